"""``--lora-r`` for every agent that declares LoRA support: a policy LoRA on one base whose
reference is that base with adapters disabled (as TRL does with peft); only LoRA weights (and a
value head) train. An agent that cannot take LoRA refuses it by name."""

from __future__ import annotations

import json

import pytest
import torch

from tests.agents.conftest import collect
from textrl.agents import agent_class, agent_names
from textrl.config import TrainConfig
from textrl.keys import KEYS
from textrl.models import load_causal_lm

SMALL = dict(prompts_per_iteration=2, n_samples_per_prompt=2, max_new_tokens=6, ppo_epochs=1, num_minibatches=1,
             forward_batch_size=4, generation_batch_size=4, iterations=5, warmup_sft_steps=0, actor_lr=1e-2)
LORA_AGENTS = [name for name in agent_names() if agent_class(name).lora == "optional"]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path_factory.getbasetemp() / "lora_cache"))


def build(name: str, **overrides):
    torch.manual_seed(0)
    return agent_class(name).from_config(TrainConfig(agent=name, lora_r=4, **SMALL, **overrides), "cpu",
                                         log=lambda *a: None)


def split_weights(agent):
    """(base weights, LoRA weights) of the shared model, cloned."""
    base, lora = {}, {}
    for name, param in agent.stack.model.named_parameters():
        (lora if "lora_" in name else base)[name] = param.detach().clone()
    return base, lora


def test_lora_agents_are_declared():
    assert set(LORA_AGENTS) == {"cispo", "dapo", "dr_grpo", "gae_ppo", "grpo", "gspo", "reinforce_pp",
                                "reinforce_pp_baseline", "rloo", "vapo"}
    assert agent_class("multi_adapter_ppo").lora == "required" and agent_class("one_step_ppo").lora == "no"


@pytest.mark.parametrize("name", LORA_AGENTS)
def test_with_lora_only_lora_weights_change_and_the_reference_is_the_base(name):
    # vapo trains only its critic in its first iterations (critic_warmup_iterations): turned off here
    agent = build(name, **({"critic_warmup_iterations": 0} if name == "vapo" else {}))
    tok = agent.tokenizer
    base_before, lora_before = split_weights(agent)
    td = collect(agent, tok)
    metrics = agent.update(td)
    assert metrics["kl/before_update"] == 0.0  # a fresh adapter (B = 0) is the base
    base_after, lora_after = split_weights(agent)
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before)
    assert any(not torch.equal(lora_before[k], lora_after[k]) for k in lora_before)
    trained = {id(p) for p in agent.policy.parameters()}
    assert trained == {id(p) for n, p in agent.stack.model.named_parameters() if "lora_" in n and ".policy." in n}
    # the reference is the untouched base model: the same log-probs as a fresh copy of it
    fresh = load_causal_lm("tiny").float().eval()
    from textrl.agents.base import sequence_inputs

    ids, mask, p = sequence_inputs(td)
    with torch.no_grad():
        ref = agent.learner.forwards.logprobs(agent.ref_policy, ids, mask, p, td.get(KEYS.action))
        base = agent.learner.forwards.logprobs(fresh, ids, mask, p, td.get(KEYS.action))
    torch.testing.assert_close(ref, base, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", LORA_AGENTS)
def test_lora_weights_are_the_agent_state(name):
    agent = build(name)
    state = agent.state_dict()
    weights = [k for k, v in state.items() if torch.is_tensor(v)]
    assert weights and all("lora_" in k or k.startswith("critic.value_head.") for k in weights)
    if agent.needs_critic:
        assert {"critic.value_head.weight", "critic.value_head.bias"} <= set(weights)
    agent.update(collect(agent, agent.tokenizer))
    other = build(name)
    other.load_state_dict(agent.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(agent.policy.parameters(), other.policy.parameters()))


def test_gae_ppo_lora_on_a_4bit_base_trains_only_lora():
    agent = build("gae_ppo", load_in_4bit=True)
    assert getattr(agent.stack.model.base_model.model, "is_loaded_in_4bit", False)
    base_before, _ = split_weights(agent)
    agent.update(collect(agent, agent.tokenizer))
    base_after, _ = split_weights(agent)
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before)


def test_gae_ppo_with_a_critic_lora_trains_the_critic_adapter():
    agent = build("gae_ppo", critic_type="lora")
    critic_lora = [p for n, p in agent.stack.model.named_parameters() if ".critic." in n and "lora_" in n]
    assert critic_lora and {id(p) for p in critic_lora} <= {id(p) for p in agent.critic.parameters()}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"agent": "one_step_ppo", "lora_r": 4}, "one_step_ppo does not read lora_r=4 .* drop --lora-r"),
    ({"load_in_4bit": True}, "load_in_4bit=True freezes the base model.*add --lora-r 8"),
    ({"lora_alpha": 32}, "lora_alpha=32 is read only with a LoRA policy"),
    ({"lora_r": 4, "ref_refresh_every": 2}, "cannot be refreshed"),
    ({"agent": "gae_ppo", "lora_r": 4, "critic_init": "reward_model", "reward_model": "tiny"},
     "leave critic_init='policy'"),
])
def test_combinations_that_make_no_sense_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**overrides).validate()


def test_textrl_train_with_lora_writes_an_adapter_checkpoint(tmp_path):
    from textrl.cli import main
    from textrl.run import latest_checkpoint

    out = tmp_path / "run"
    assert main(["train", "--agent", "grpo", "--lora-r", "4", "--iterations", "2", "--warmup-sft-steps", "0",
                 "--output-dir", str(out), "--prompts-per-iteration", "2", "--n-samples-per-prompt", "2",
                 "--max-new-tokens", "4", "--eval-size", "2", "--eval-every", "0", "--progress", "false",
                 "--ppo-epochs", "1", "--num-minibatches", "1"]) == 0
    assert (latest_checkpoint(out) / "policy" / "adapter_config.json").is_file()
    assert [json.loads(r)["iteration"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_resumed_lora_run_is_bit_identical_to_an_uninterrupted_one(tmp_path):
    from textrl.cli import main

    args = ["train", "--agent", "gae_ppo", "--lora-r", "4", "--warmup-sft-steps", "0", "--prompts-per-iteration",
            "2", "--n-samples-per-prompt", "2", "--max-new-tokens", "4", "--eval-size", "2", "--eval-every", "0",
            "--progress", "false", "--ppo-epochs", "1", "--num-minibatches", "1", "--checkpoint-every", "1"]
    assert main([*args, "--iterations", "3", "--output-dir", str(tmp_path / "whole")]) == 0
    assert main([*args, "--iterations", "1", "--output-dir", str(tmp_path / "parts")]) == 0
    assert main([*args, "--iterations", "3", "--output-dir", str(tmp_path / "parts"), "--resume", "true"]) == 0

    def rows(run):
        keep = ("reward/mean", "loss/total", "kl/collection", "grad_norm/actor", "grad_norm/critic")
        return [{k: r[k] for k in keep} for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())]

    assert rows("whole") == rows("parts")
