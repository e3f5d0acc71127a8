"""Tiny agents and rollouts shared by the agent tests (hidden 64, B=4, T<=6)."""

from __future__ import annotations

import pytest
import torch
from textrl.agents import AGENTS
from textrl.envs import rollout_from_responses

from textrl.config import TrainConfig
from textrl.models import ValueModel, build_tiny_causal_lm, build_tiny_tokenizer

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
        prompts_per_iteration=4, n_samples_per_prompt=1, max_new_tokens=6, ppo_epochs=1,
        num_minibatches=1, forward_batch_size=4, generation_batch_size=4, iterations=5,
    )
    if overrides.get("agent") in ("grpo", "rloo"):  # group baselines: the 4 rows are 2 groups of 2
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
