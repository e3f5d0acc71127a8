"""MultiAdapterPPO: one tiny base with policy / critic / reward adapters (hidden 64, B=4, T<=6).

Reference = base with adapters disabled (exact base log-probs, before and after training), reward
adapter = merged reward model, frozen weights bit-identical, ratio 1 / KL 0 at step 0, 4-bit and
full precision, resume state, the trainer end to end.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import PeftModel, get_peft_model

from tests.agents.conftest import collect, make_config, record_loss_stats
from tests.arithmetic import assert_within, head_tolerance, model_rtol
from textrl.agents import AGENTS, MultiAdapterPPO, make_agent
from textrl.config import TrainConfig
from textrl.core.checks import check_rollout
from textrl.keys import KEYS
from textrl.models import build_tiny_causal_lm, tiny_model_path
from textrl.models.adapters import (
    last_token_hidden,
    load_base_model,
    load_reward_adapter,
    lora_config,
    merge_adapter,
    save_reward_adapter,
)

NAME = "multi_adapter_ppo"


@pytest.fixture(scope="module")
def reward_dir(tok, tmp_path_factory):
    """A reward adapter on the tiny base (seed 0): a random LoRA (B != 0) and a random score head."""
    model = get_peft_model(build_tiny_causal_lm(tok, seed=0), lora_config(), adapter_name="default")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
        head = torch.nn.Linear(64, 1)
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * 0.1)
        head.bias.fill_(0.3)
    path = tmp_path_factory.mktemp("rm") / "reward"
    save_reward_adapter(model, head, path, base_model="tiny")
    return path


def build(tok, reward_dir, base=None, **overrides) -> MultiAdapterPPO:
    config = make_config(agent=NAME, reward_adapter=str(reward_dir), **overrides)
    return MultiAdapterPPO(base if base is not None else build_tiny_causal_lm(tok, seed=0), tok, config)


def frozen_state(agent: MultiAdapterPPO) -> dict[str, torch.Tensor]:
    """Every weight that must not train: the base, the reward adapter and the score head."""
    trainable = {id(p) for p in [*agent.policy.parameters(), *agent.critic.parameters()]}
    state = {n: p.detach().clone() for n, p in agent.stack.model.named_parameters() if id(p) not in trainable}
    state.update({f"head.{n}": p.detach().clone() for n, p in agent.reward_model.score_head.named_parameters()})
    return state


def test_registered_and_built_by_name(tok, reward_dir):
    assert AGENTS[NAME] is MultiAdapterPPO
    agent = make_agent(NAME, build_tiny_causal_lm(tok, seed=0), tok, make_config(agent=NAME, reward_adapter=str(reward_dir)))
    assert isinstance(agent, MultiAdapterPPO) and set(agent.stack.model.peft_config) == {"policy", "reward"}
    with pytest.raises(ValueError, match="builds its own reference"):
        MultiAdapterPPO(build_tiny_causal_lm(tok), tok, make_config(agent=NAME), critic=torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="plain base model"):
        MultiAdapterPPO(get_peft_model(build_tiny_causal_lm(tok), lora_config()), tok, make_config(agent=NAME))


@pytest.mark.parametrize("critic_type", ["value_head", "lora"])
def test_optimisers_hold_only_the_trainable_adapters(tok, reward_dir, critic_type):
    agent = build(tok, reward_dir, critic_type=critic_type)
    actor = [p for g in agent.actor_optimizer.param_groups for p in g["params"]]
    critic = [p for g in agent.critic_optimizer.param_groups for p in g["params"]]
    names = {id(p): n for n, p in agent.stack.model.named_parameters()}
    assert actor and all(".policy." in names[id(p)] for p in actor)
    assert len(actor) == 2 * 2 * 2  # 2 layers x q,v (peft's Llama targets, lora_target_modules='auto') x (A, B)
    head = list(agent.critic.value_head.parameters())
    critic_lora = [p for p in critic if id(p) in names]
    assert all(any(p is h for p in critic) for h in head)
    assert all(".critic." in names[id(p)] for p in critic_lora)
    assert len(critic_lora) == (8 if critic_type == "lora" else 0)
    assert sum(p.requires_grad for p in agent.stack.model.parameters()) == len(actor) + len(critic_lora)


def test_adapter_switching_scores_like_the_merged_reward_model(tok, reward_dir):
    agent = build(tok, reward_dir, actor_lr=1e-2)
    merged, head = load_reward_adapter(build_tiny_causal_lm(tok, seed=0), reward_dir)
    merged = merge_adapter(merged, "reward")
    td = collect(agent, tok)
    ids, mask = td.get(KEYS.prompt_tokens), td.get(KEYS.prompt_mask)
    seq_ids = torch.cat([ids, td.get(KEYS.action)], 1)
    seq_mask = torch.cat([mask, td.get(KEYS.mask)], 1)
    with torch.no_grad():
        hidden = last_token_hidden(merged, seq_ids, seq_mask)
        expected = head(hidden).squeeze(-1)
    scores = agent.reward_model(input_ids=seq_ids, attention_mask=seq_mask).logits.squeeze(-1)
    # a switched adapter against merged weights (W + s B A rounded once): other sums in the body, and
    # a score head's dot product that cancels: tests/arithmetic.py
    tol = head_tolerance(hidden, head.weight, model_rtol(merged.config, seq_ids.numel())).squeeze(-1)
    assert_within(scores, expected, tol, "scores")
    agent.update(td)  # training the policy adapter does not move the reward model
    again = agent.reward_model(input_ids=seq_ids, attention_mask=seq_mask).logits.squeeze(-1)
    assert torch.equal(again, scores)
    assert agent.stack.model.active_adapter == "policy"


def test_disabled_adapters_reproduce_the_base_log_probs_exactly(tok, reward_dir):
    agent = build(tok, reward_dir, actor_lr=1e-2)
    base = build_tiny_causal_lm(tok, seed=0)
    td = collect(agent, tok)
    from textrl.agents.base import sequence_inputs

    args = (*sequence_inputs(td), td.get(KEYS.action))
    with torch.no_grad():
        expected = agent.learner.forwards.logprobs(base, *args)
    assert torch.equal(td.get(KEYS.ref_log_prob), expected)
    agent.update(td)
    with torch.no_grad():
        assert torch.equal(agent.learner.forwards.logprobs(agent.ref_policy, *args), expected)
        assert not torch.equal(agent.learner.forwards.logprobs(agent.policy, *args), expected)


@pytest.mark.parametrize("critic_type", ["value_head", "lora"])
def test_frozen_weights_are_bit_identical_after_an_update(tok, reward_dir, critic_type):
    agent = build(tok, reward_dir, critic_type=critic_type, actor_lr=1e-2, critic_lr=1e-2, ppo_epochs=2)
    before = frozen_state(agent)
    trainable_before = {k: v.clone() for k, v in agent.state_dict().items() if torch.is_tensor(v)}
    td = collect(agent, tok)
    agent.update(td)
    after = frozen_state(agent)
    assert before.keys() == after.keys() and len(before) > 30
    assert all(torch.equal(before[k], after[k]) for k in before)
    state = agent.state_dict()
    moved = {k.split(".")[0] for k, v in trainable_before.items() if not torch.equal(v, state[k])}
    assert moved == {"policy", "critic"}
    if critic_type == "lora":
        assert any(".critic." in k and not torch.equal(v, state[k]) for k, v in trainable_before.items())


def test_first_minibatch_ratio_is_one_and_kl_is_zero(tok, reward_dir):
    agent = build(tok, reward_dir, ppo_epochs=2, kl_after_update=True)
    td = collect(agent, tok)
    check_rollout(td)
    assert torch.equal(td.get(KEYS.action_log_prob), td.get(KEYS.ref_log_prob))
    seen = record_loss_stats(agent)
    metrics = agent.update(td)
    assert metrics["kl/collection"] == 0.0 and metrics["kl/before_update"] == 0.0
    assert seen[0]["ratio/mean"].item() == 1.0 and seen[0]["ratio/max"].item() == 1.0
    assert seen[0]["kl/policy_old"].item() == 0.0 and seen[0]["clip_fraction"].item() == 0.0
    assert metrics["kl/after_update"] != 0.0


def test_start_up_and_update_checks_raise_with_a_reason(tok, reward_dir):
    agent = build(tok, reward_dir)
    name, param = next((n, p) for n, p in agent.stack.lora["policy"] if "lora_B" in n)
    with torch.no_grad():
        param.fill_(0.1)
    with pytest.raises(RuntimeError, match="policy LoRA starts non-zero"):
        agent.check_start()
    _, reward_param = agent.stack.lora["reward"][0]
    with torch.no_grad():
        reward_param.add_(1e-3)
    with pytest.raises(RuntimeError, match="changed during the update"):
        agent.check_frozen()


def test_a_merged_base_warns_that_the_reference_is_the_merged_model(tok, reward_dir):
    base = build_tiny_causal_lm(tok, seed=0)
    base.config.textrl_merged = {"base_model": "tiny", "adapter": "runs/sft/adapter"}
    with pytest.warns(UserWarning, match="reference policy is this merged model"):
        build(tok, reward_dir, base=copy.deepcopy(base))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        MultiAdapterPPO(base, tok, make_config(agent=NAME), merged=False)


def test_state_dict_is_trainable_weights_only_and_resumes(tok, reward_dir, tmp_path):
    agent = build(tok, reward_dir, actor_lr=1e-2, critic_type="lora")
    td = collect(agent, tok)
    agent.update(td)
    state = agent.state_dict()
    tensors = {k for k, v in state.items() if torch.is_tensor(v)}
    assert all(".lora_" in k or k.startswith("critic.value_head.") for k in tensors)
    assert not any(".reward." in k for k in tensors)
    torch.save(state, tmp_path / "s.pt")
    other = build(tok, reward_dir, actor_lr=1e-2, critic_type="lora")
    other.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=False))
    assert other.iteration == agent.iteration == 1
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in state.items() if torch.is_tensor(v))
    with pytest.raises(RuntimeError, match="critic_type"):
        build(tok, reward_dir).load_state_dict(state)


def test_policy_checkpoint_is_a_peft_adapter(tok, reward_dir, tmp_path):
    agent = build(tok, reward_dir, actor_lr=1e-2)
    agent.update(collect(agent, tok))
    agent.policy.save_pretrained(tmp_path / "policy")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "policy").iterdir()}
    loaded = PeftModel.from_pretrained(build_tiny_causal_lm(tok, seed=0), tmp_path / "policy")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, agent.policy(input_ids=ids).logits)


def test_runs_through_rollout_collect(tok, reward_dir):
    from textrl.envs.prompts import encode_prompts
    from textrl.envs.tasks import make_digits_task
    from textrl.rewards import CompositeReward, NeuralReward, parse_reward_spec
    from textrl.run.rollout import collect as rollout_collect

    agent = build(tok, reward_dir, prompts_per_iteration=4)
    rules = parse_reward_spec("think_format,tag_count")
    reward = CompositeReward({**{n: (f, rules.weights[n]) for n, f in rules.functions.items()},
                              "reward_model": NeuralReward(agent.reward_model, tok, batch_size=4)})
    batch = encode_prompts(make_digits_task(4, seed=1), tok)[0]
    torch.manual_seed(0)
    td = rollout_collect(agent, batch, reward)
    scores = td.get(KEYS.reward_components)["reward_model"]
    assert scores.shape == (4,) and scores.abs().sum() > 0
    metrics = agent.update(td)
    assert metrics["kl/collection"] == 0.0


def test_4bit_and_full_precision_bases_both_update(tok, reward_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))
    for load_in_4bit in (False, True):
        base = load_base_model("tiny", load_in_4bit=load_in_4bit)
        agent = build(tok, reward_dir, base=base, actor_lr=1e-2, load_in_4bit=load_in_4bit,
                      kl_after_update=True)
        before = frozen_state(agent)
        td = collect(agent, tok)
        metrics = agent.update(td)
        assert metrics["kl/before_update"] == 0.0 and metrics["kl/after_update"] > 0.0
        after = frozen_state(agent)
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_trainer_runs_multi_adapter_ppo_from_the_command_line(tok, tmp_path, monkeypatch):
    from textrl.cli import main
    from textrl.run import latest_checkpoint

    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))
    base = load_base_model("tiny")
    assert base.config._name_or_path == str(tiny_model_path())
    model = get_peft_model(base, lora_config(), adapter_name="default")
    save_reward_adapter(model, torch.nn.Linear(64, 1), tmp_path / "rm", base_model="tiny")
    out = tmp_path / "run"
    args = ["train", "--agent", NAME, "--reward-adapter", str(tmp_path / "rm"), "--iterations", "2",
            "--output-dir", str(out), "--prompts-per-iteration", "4", "--n-samples-per-prompt", "2",
            "--max-new-tokens", "8", "--eval-size", "4", "--eval-every", "0", "--progress", "false",
            "--ppo-epochs", "1", "--num-minibatches", "2", "--reward", "think_format"]
    assert main([*args, "--load-in-4bit", "true"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert "reward_components/reward_model/mean" in rows[0] and rows[0]["kl/collection"] == 0.0
    ckpt = latest_checkpoint(out)
    assert (ckpt / "policy" / "adapter_config.json").is_file()
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)["agent"]
    assert all(".lora_" in k or "value_head" in k for k, v in state.items() if torch.is_tensor(v))
    assert main([*args, "--iterations", "3", "--resume", "true"]) == 0  # full precision resumes too
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"ref_refresh_every": 2}, "cannot be refreshed"),
        ({"reward_model": "tiny"}, "drop --reward-model"),
        ({"critic_init": "reward_model", "reward_model": "tiny"}, "reward_model"),
        ({"reward_adapter": "/no/such/folder"}, "not a folder"),
        ({"agent": "gae_ppo", "reward_adapter": "x"}, "read only by agent=multi_adapter_ppo"),
    ],
)
def test_config_checks_name_the_problem(overrides, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{"agent": NAME, **overrides}).validate()


def test_padding_free_scores_the_reward_adapter_on_packed_rows_as_on_padded_ones(tok, reward_dir):
    from textrl.agents.build import task_reward
    from textrl.models.packed_forward import scorer_layout

    prompts = ["Add 2 and 3. " * 16, "Hi", "Name a colour, any colour you like.", "x"]
    completions = ["<answer>5</answer>", "hello there, friend", "", "blue " * 6]
    scorers = {pf: task_reward(build(tok, reward_dir, padding_free=pf, forward_batch_size=8), "")
               .functions["reward_model"] for pf in (False, True)}
    padded, packed = scorers[False], scorers[True]
    assert packed.padding_free and not padded.padding_free  # the run's config reaches the agent's reward model
    assert scorer_layout(packed.model, "cpu") == "bins"
    rows = padded.encode(prompts, completions)
    assert len(set(map(len, rows))) == len(rows)
    calls: list[dict] = []
    hook = packed.model.register_forward_pre_hook(lambda _m, _a, kw: calls.append(kw), with_kwargs=True)
    try:
        got = packed.score_raw(prompts, completions)
    finally:
        hook.remove()
    assert len(calls) == 1 and calls[0]["attention_mask"] is None and calls[0]["input_ids"].shape[0] < len(rows)
    model = packed.model
    with torch.no_grad(), model.stack.use("reward"):
        hidden = torch.cat([last_token_hidden(model.stack.model, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long))
                            for r in rows])
    tol = head_tolerance(hidden, model.score_head.weight,
                         model_rtol(model.config, len(rows) * max(map(len, rows)))).squeeze(-1)
    assert_within(got, padded.score_raw(prompts, completions), tol, "reward adapter scores")
    assert len(set(got.tolist())) == len(rows)
