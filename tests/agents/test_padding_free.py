"""``padding_free``: every agent's rollout forwards (behaviour and reference log-probs, values), its
update's log-probs and entropies and the gradient of a minibatch of two micro-batches, on the
packed real tokens, equal the padded forwards' within tests/arithmetic.py's normwise tolerance:
ragged single-turn rows, multi-turn rows with observation gaps, a LoRA policy, the shared and LoRA
critics, the fused (chunked) log-probs and the 4-bit multi-adapter agent. Each case checks that the
packed path ran (the models' layout is ``bins``), so a fallback to the padded forwards fails it."""

from __future__ import annotations

import unittest.mock

import pytest
import torch

from tests.agents.test_zoo_agents import (
    ENV_SETTINGS,
    ScriptedGuesser,
    hand_rollout,
    uneven_responses,
)
from tests.arithmetic import assert_gradients_close, rollout_rtol
from textrl.agents import agent_class, agent_names
from textrl.agents.base import UpdateTally
from textrl.agents.forwards import attended_response, sequence_inputs
from textrl.agents.update import Objective, run_epochs
from textrl.config import TrainConfig
from textrl.envs.collector import EpisodeRunner
from textrl.envs.episodes import default_episode_tokens
from textrl.envs.prompts import PromptSampler
from textrl.envs.registry import split_rows, task_environment
from textrl.keys import KEYS
from textrl.models.packed_forward import critic_layout, packing_layout
from textrl.run.rollout import run_episodes
from textrl.testing import assert_close_normwise

SMALL = dict(max_new_tokens=6, ppo_epochs=1, num_minibatches=1, gradient_accumulation_steps=2, forward_batch_size=4,
             generation_batch_size=6, iterations=5, warmup_sft_steps=0, kl_coef=0.05)
CASES = [(name, {}) for name in agent_names()] + [
    ("gae_ppo", {"entropy_coef": 0.01}),  # the entropy with its gradient
    ("gae_ppo", {"logprob_chunk_size": 3, "entropy_coef": 0.01}),  # the fused head in chunks
    ("gae_ppo", {"critic": "shared"}),
    ("gae_ppo", {"critic": "lora"}),
    ("gae_ppo", {"lora_r": 4}),
    ("grpo", {"lora_r": 4, "kl_in": "loss"}),
    ("multi_adapter_ppo", {"critic_type": "lora"}),
]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path_factory.getbasetemp() / "padding_free_cache"))


def perturb(model, seed: int, scale: float = 0.05) -> None:
    """Move every trained weight (a LoRA's B too, a zero value head) off its start."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(scale * torch.randn(p.shape, generator=gen))


def build(name: str, padding_free: bool, rows: int, **overrides):
    cls = agent_class(name)
    n = 2 if cls.min_samples_per_prompt > 1 or name not in ("gae_ppo", "one_step_ppo", "multi_adapter_ppo") else 1
    settings = {**SMALL, "prompts_per_iteration": rows // n, "n_samples_per_prompt": n, **overrides}
    torch.manual_seed(0)
    agent = cls.from_config(TrainConfig(agent=name, padding_free=padding_free, **settings), "cpu", log=lambda *a: None)
    if agent.ref_policy is not None and agent.ref_policy is not agent.policy:
        perturb(agent.ref_policy, seed=3)
    if agent.critic is not None:
        perturb(agent.critic, seed=5)
    return agent


def forwards_and_gradient(agent, raw):
    """The rollout after the actor's forwards, the policy's log-probs and entropies now, and the
    gradient of one minibatch (rows in order, two micro-batches, not stepped)."""
    td = agent.process_rollout(raw.clone())
    perturb(agent.policy, seed=4, scale=0.02)  # ratios != 1
    input_ids, attention_mask, p = sequence_inputs(td)
    with torch.no_grad():
        logp, entropy = agent.learner.forwards.logprobs_and_entropy(agent.policy, input_ids, attention_mask, p,
                                                                     td.get(KEYS.action))
    agent.backend.step = lambda agent: {}  # record, do not step
    with unittest.mock.patch("torch.randperm", lambda n, device=None, **_: torch.arange(n, device=device)):
        run_epochs(agent.learner, td, None, UpdateTally(), Objective(agent.loss, agent.micro_weight))
    grads = {n: p.grad.clone() for n, p in agent.named_parameters() if p.grad is not None}
    return td, logp, entropy, grads


def assert_packed_path(agent, td) -> None:
    """The policy, the reference and the critic ran packed rows (not the padded fallback)."""
    assert packing_layout(agent.policy, "cpu") == "bins"
    if agent.ref_policy is not None:
        assert packing_layout(agent.ref_policy, "cpu") == "bins"
    if agent.critic is not None:
        assert critic_layout(agent.critic, "cpu") == "bins"
    input_ids, attention_mask, p = sequence_inputs(td)
    packed = agent.learner.forwards.packing(agent.policy, input_ids, attention_mask, p)
    assert packed is not None and packed.slots <= input_ids.numel()


def assert_equal_to_the_padded_forwards(name: str, raw, **overrides) -> None:
    runs = {pf: forwards_and_gradient(build(name, pf, raw.shape[0], **overrides), raw) for pf in (False, True)}
    (padded, logp, entropy, grads), (packed, p_logp, p_entropy, p_grads) = runs[False], runs[True]
    assert_packed_path(build(name, True, raw.shape[0], **overrides), packed)
    attended, mask = attended_response(padded), padded.get(KEYS.mask)
    assert not torch.equal(attended.all(1), torch.ones_like(attended.all(1)))  # ragged: some rows padded
    agent = build(name, False, raw.shape[0], **overrides)
    rtol = rollout_rtol(agent.policy.config, padded)
    assert_close_normwise(packed.get(KEYS.action_log_prob)[attended], padded.get(KEYS.action_log_prob)[attended],
                          rtol, name="action_log_prob")
    if KEYS.ref_log_prob in padded.keys():
        assert_close_normwise(packed.get(KEYS.ref_log_prob)[attended], padded.get(KEYS.ref_log_prob)[attended], rtol,
                              name="ref_log_prob")
    if KEYS.state_value in padded.keys():
        values = padded.get(KEYS.state_value).squeeze(-1)[mask]
        assert values.abs().max() > 1e-3  # a critic that says something
        assert_close_normwise(packed.get(KEYS.state_value).squeeze(-1)[mask], values, rtol, name="state_value")
    assert_close_normwise(p_logp[attended], logp[attended], rtol, name="logp")
    assert_close_normwise(p_entropy[attended], entropy[attended], rtol, name="entropy")
    assert grads and any(g.abs().max() > 0 for g in grads.values())
    assert_gradients_close(p_grads, grads, rtol, what=f"{name} padding_free: ")


@pytest.mark.parametrize("name, overrides", CASES, ids=[f"{n}{'-' + '-'.join(map(str, o.values())) if o else ''}"
                                                        for n, o in CASES])
def test_padding_free_equals_the_padded_forwards_for_every_agent(tok, name, overrides):
    raw = hand_rollout(tok, uneven_responses(tok.eos_token_id))  # responses of 2, 6, 4, 1, 5, 3 tokens
    assert_equal_to_the_padded_forwards(name, raw, **overrides)


@pytest.fixture(scope="module")
def multi_turn(tok):
    """A guess_number rollout of 4 rows whose episodes take several turns (observation gaps)."""
    from textrl.agents import make_agent
    from textrl.models import build_tiny_causal_lm

    generator = make_agent("grpo", build_tiny_causal_lm(tok), tok, TrainConfig(agent="grpo", **ENV_SETTINGS))
    env = task_environment("guess_number", None, None, None)
    rows, _ = split_rows(env, 4, 0)
    sampler = PromptSampler(rows, tok, prompts_per_batch=2, n_samples_per_prompt=2, seed=0, max_prompt_length=64)
    runner = EpisodeRunner(env, tokenizer=tok, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                           max_new_tokens=6, max_episode_tokens=default_episode_tokens(env, 6))
    torch.manual_seed(0)
    td = run_episodes(ScriptedGuesser(generator, tok), sampler.next_batch(), runner, greedy=False, timings=None)
    assert int(td.get(KEYS.turns).max()) > 1 and not torch.equal(td.get(KEYS.mask), td.get(KEYS.response_mask))
    return td


@pytest.mark.parametrize("name", ["gae_ppo", "grpo", "multi_adapter_ppo"])
def test_padding_free_equals_the_padded_forwards_on_multi_turn_rows(tok, multi_turn, name):
    assert_equal_to_the_padded_forwards(name, multi_turn, env="guess_number")


def test_padding_free_on_a_4bit_multi_adapter_base(tok):
    pytest.importorskip("bitsandbytes")
    raw = hand_rollout(tok, uneven_responses(tok.eos_token_id))
    assert_equal_to_the_padded_forwards("multi_adapter_ppo", raw, load_in_4bit=True)
