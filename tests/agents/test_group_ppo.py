"""GRPO and RLOO: critic-free, group baselines over the responses of a prompt."""

from __future__ import annotations

import math

import pytest
import torch

from tests.agents.conftest import collect, make_agent
from textrl.agents.base import SCORE
from textrl.agents.update import total_loss
from textrl.keys import KEYS


def constant_reward(prompts, completions, **kwargs):
    return torch.full((len(completions),), 0.5)


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_constant_reward_group_gives_zero_advantages_and_a_finite_loss(tok, name):
    agent = make_agent(tok, name, kl_coef=0.0)
    assert agent.critic is None and agent.critic_optimizer is None  # the critic passed in is dropped
    td = collect(agent, tok, reward_fn=constant_reward)
    adv = td.get(KEYS.advantage).squeeze(-1)
    assert torch.equal(adv, torch.zeros_like(adv))
    terms, stats = agent.loss(td)
    loss = total_loss(terms)
    assert math.isfinite(loss.item()) and loss.item() == 0.0
    assert stats["ratio/mean"].item() == 1.0


def test_advantages_are_the_group_formulas_on_every_valid_token(tok):
    scores = torch.tensor([1.0, 0.0, 0.25, 0.75])  # two groups of two
    for name, expected in (("grpo", [0.7071, -0.7071, -0.7071, 0.7071]), ("rloo", [1.0, -1.0, -0.5, 0.5])):
        agent = make_agent(tok, name, kl_coef=0.0)
        td = collect(agent, tok, reward_fn=lambda p, c, **k: scores)
        mask = td.get(KEYS.mask)
        adv = td.get(KEYS.advantage).squeeze(-1)  # [B, T]
        want = torch.tensor(expected).unsqueeze(1).expand_as(adv)
        assert torch.allclose(adv[mask], want[mask], atol=1e-4), name
        assert torch.equal(adv[~mask], torch.zeros_like(adv[~mask]))
        assert torch.equal(td.get(SCORE), scores)


def test_kl_in_the_reward_lowers_the_sequence_reward(tok):
    agent = make_agent(tok, "rloo", kl_coef=0.5)
    td = collect(agent, tok)
    td.set(KEYS.action_log_prob, td.get(KEYS.ref_log_prob) + 0.1)  # KL_t = 0.1 on every token
    agent.estimate(td)
    mask = td.get(KEYS.mask)
    sequence_reward = td.get(KEYS.value_target).squeeze(-1)[:, 0]
    assert torch.allclose(sequence_reward, td.get(SCORE) - 0.5 * 0.1 * mask.sum(1), atol=1e-5)


def test_rows_not_in_whole_groups_are_an_error(tok):
    agent = make_agent(tok, "grpo")
    td = collect(agent, tok)
    with pytest.raises(ValueError, match="not whole groups"):
        agent.estimate(td[:3])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_short_update_run_raises_the_reward(tok, name):
    """As tests/agents/test_learning.py: 4 prompts x 4 samples (4 groups), 15 iterations."""
    torch.manual_seed(0)
    agent = make_agent(tok, name, prompts_per_iteration=4, n_samples_per_prompt=4, num_minibatches=2,
                       ppo_epochs=2, actor_lr=3e-3, kl_coef=0.01, forward_batch_size=16, generation_batch_size=16)
    prompts = [p for p in ("What is 1+2?", "hi", "Count to 3", "<think>") for _ in range(4)]  # groups in a row
    rewards = []
    for it in range(15):
        td = collect(agent, tok, prompts=prompts, seed=it)
        rewards.append(td.get(SCORE).mean().item())
        metrics = agent.update(td)
        assert all(math.isfinite(v) for v in metrics.values()), metrics
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, rewards
