"""The update's micro-batches (textrl.agents.update.micro_splits): ``gradient_accumulation_steps``
near-equal row counts, or ``microbatch_tokens`` runs of rows filled up to a token budget, balanced,
as many on every process; the refusals of ``microbatch_tokens``. The gradient's independence of
the split: tests/agents/test_zoo_agents.py."""

from __future__ import annotations

import doctest
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.agents.test_zoo_agents import TOKEN_BUDGETS, hand_rollout, uneven_responses, zoo_agent
from textrl.agents import update as update_module
from textrl.agents.forwards import reuses_rollout_forward
from textrl.agents.update import balanced_runs, filled_runs, micro_splits, real_tokens
from textrl.config import TrainConfig


class TwoProcesses:
    """A ``Distributed`` stand-in: the other process needs ``theirs`` micro-batches."""

    world_size = 2

    def __init__(self, theirs: int) -> None:
        self.theirs = theirs

    def gather(self, tensor):
        return torch.cat([tensor, torch.tensor([self.theirs])])


ONE = SimpleNamespace(world_size=1)


def test_the_doctests_run():
    assert doctest.testmod(update_module).failed == 0


def test_row_counts_without_a_token_budget():
    cfg = SimpleNamespace(gradient_accumulation_steps=3, microbatch_tokens=None)
    splits = micro_splits(torch.arange(7), torch.ones(7, dtype=torch.long), cfg, ONE)
    assert [s.tolist() for s in splits] == [[0, 1, 2], [3, 4], [5, 6]]


def test_the_hand_rollouts_token_budgets(tok):
    tokens = real_tokens(hand_rollout(tok, uneven_responses(tok.eos_token_id)))
    assert tokens.tolist() == [8, 8, 10, 2, 10, 4]
    rows = {budget: [len(s) for s in micro_splits(torch.arange(6), tokens, SimpleNamespace(microbatch_tokens=budget), ONE)]
            for budget in TOKEN_BUDGETS}
    assert rows == {1: [1] * 6, 14: [1, 1, 2, 2], 30: [3, 3]}
    order = torch.tensor([5, 0, 3, 2, 1, 4])  # a shuffled minibatch keeps its order
    splits = micro_splits(order, tokens, SimpleNamespace(microbatch_tokens=14), ONE)
    assert torch.equal(torch.cat(splits), order) and all(int(tokens[s].sum()) <= 14 for s in splits)


def test_every_process_runs_as_many_micro_batches_as_the_one_that_needs_most():
    tokens = torch.tensor([4, 4, 4, 4, 4, 4])
    cfg = SimpleNamespace(microbatch_tokens=12)
    assert [len(s) for s in micro_splits(torch.arange(6), tokens, cfg, TwoProcesses(1))] == [3, 3]
    assert [len(s) for s in micro_splits(torch.arange(6), tokens, cfg, TwoProcesses(4))] == [1, 1, 2, 2]
    assert len(micro_splits(torch.arange(6), tokens, cfg, TwoProcesses(9))) == 6  # never more than the rows


@settings(max_examples=80, deadline=None)
@given(tokens=st.lists(st.integers(1, 50), min_size=1, max_size=12), budget=st.integers(1, 120))
def test_token_runs_cover_the_rows_in_order_within_the_budget(tokens, budget):
    ends = filled_runs(tokens, budget)
    runs = [tokens[a:b] for a, b in zip([0, *ends], ends)]
    assert sum(runs, []) == tokens and all(r and (sum(r) <= budget or len(r) == 1) for r in runs)
    for count in range(1, len(tokens) + 1):
        balanced = balanced_runs(tokens, count)
        parts = [tokens[a:b] for a, b in zip([0, *balanced], balanced)]
        assert len(parts) == count and sum(parts, []) == tokens and all(parts)
        if count == len(ends):  # as many runs as filling takes: none larger than filling's largest
            assert max(map(sum, parts)) <= max(map(sum, runs))


@pytest.mark.parametrize("settings, message", [
    (dict(microbatch_tokens=0), "microbatch_tokens=0: must be a number >= 1"),
    (dict(microbatch_tokens=64, gradient_accumulation_steps=2),
     "microbatch_tokens=64 splits each minibatch by tokens and gradient_accumulation_steps=2 by rows: give one of them"),
])
def test_a_token_budget_that_cannot_apply_is_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(agent="gae_ppo", num_minibatches=1, **settings).validate()


def test_a_token_budget_runs_the_updates_own_forward(tok):
    agent = zoo_agent(tok, "grpo")
    assert reuses_rollout_forward(agent)
    agent.config.microbatch_tokens = 64
    assert not reuses_rollout_forward(agent)
