"""Tiny agents and rollouts shared by the agent tests (hidden 64, B=4, T<=6)."""

from __future__ import annotations

import math

import pytest
import torch

from textrl.agents import AGENTS
from textrl.config import TrainConfig
from textrl.envs import rollout_from_responses
from textrl.models import ValueModel, build_tiny_causal_lm, build_tiny_tokenizer
from textrl.parallel.fsdp_sharding import local

PROMPTS = ["What is 1+2?", "hi", "Count to 3", "<think>"]
LOW_IDS = 128


@pytest.fixture(scope="session")
def tok():
    return build_tiny_tokenizer()


def target_reward(prompts, completions, completion_ids=None, **kwargs):
    """Share of a completion's tokens with id < LOW_IDS (a quarter of the vocab): easy to raise."""
    return torch.tensor([sum(i < LOW_IDS for i in ids) / max(1, len(ids)) for ids in completion_ids])


def make_config(**overrides) -> TrainConfig:
    base = dict(
        agent="gae_ppo", prompts_per_iteration=4, n_samples_per_prompt=1, max_new_tokens=6, ppo_epochs=1,
        num_minibatches=1, forward_batch_size=4, generation_batch_size=4, iterations=5,
    )
    if AGENTS[overrides.get("agent", "gae_ppo")].min_samples_per_prompt > 1:  # group baselines: 2 groups of 2
        base.update(prompts_per_iteration=2, n_samples_per_prompt=2)
    base.update(overrides)
    return TrainConfig(**base)


def make_agent(tok, name: str = "gae_ppo", seed: int = 0, **overrides):
    policy = build_tiny_causal_lm(tok, seed=seed)
    cls = AGENTS[name]
    if name == "multi_adapter_ppo":  # one base: builds its own reference and critic
        return cls(policy, tok, make_config(agent=name, **overrides))
    critic = ValueModel.from_causal_lm(policy) if cls.needs_critic else None
    return cls(policy, tok, make_config(agent=name, **overrides), critic=critic)


def collect(agent, tok, prompts=PROMPTS, seed: int = 0, reward_fn=target_reward):
    enc = tok(list(prompts), return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"].bool()
    torch.manual_seed(seed)
    responses = agent.act(ids, mask, greedy=False)
    td = rollout_from_responses(
        ids, mask, responses, tokenizer=tok, reward_fn=reward_fn, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, max_new_tokens=agent.config.max_new_tokens,
    )
    return agent.process_rollout(td)


def record_loss_stats(agent) -> list[dict]:
    """Wrap ``agent.loss``: every (micro-)batch's stats are appended to the returned list."""
    seen, loss = [], agent.loss

    def spy(mb):
        out = loss(mb)
        seen.append(out[1])
        return out

    agent.loss = spy
    return seen


def poison_next_step(optimizer) -> None:
    """``optimizer``'s next step fills (this process's part of) its first parameter with +inf after
    stepping: a step that overflows, from finite gradients. Under DeepSpeed that parameter is the
    float32 master partition of every policy weight, which the engine then copies into the weights."""
    step = optimizer.step

    def overflowing(*args, **kwargs):
        del optimizer.step  # once: the class's step again
        out = step(*args, **kwargs)
        with torch.no_grad():
            local(optimizer.param_groups[0]["params"][0]).fill_(math.inf)
        return out

    optimizer.step = overflowing


def same(a, b) -> bool:
    """``a`` and ``b`` (nested dicts, lists, tensors, numbers) are equal, tensors bit for bit."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
