"""A short run on an easy reward raises it (fixed seeds, tiny model)."""

from __future__ import annotations

import pytest
import torch

from tests.agents.conftest import collect
from tests.agents.conftest import make_agent as build

PROMPTS = ["What is 1+2?", "hi", "Count to 3", "<think>"] * 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gae_ppo", "one_step_ppo"])
def test_short_run_raises_the_reward(tok, name):
    torch.manual_seed(0)
    agent = build(
        tok, name, prompts_per_iteration=16, num_minibatches=2, ppo_epochs=2, actor_lr=3e-3,
        kl_coef=0.01, forward_batch_size=16, generation_batch_size=16,
    )
    rewards = []
    for it in range(15):
        td = collect(agent, tok, prompts=PROMPTS, seed=it)
        rewards.append(td.get("score").mean().item())
        agent.update(td)
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.15, rewards
