"""The update's micro-batches (textrl.agents.splits.micro_splits): ``gradient_accumulation_steps``
near-equal row counts, or ``microbatch_tokens`` runs of rows filled up to a token budget, balanced,
as many on every process; the refusals of ``microbatch_tokens``. The gradient's independence of
the split: tests/agents/test_zoo_agents.py. The prefill forwards' micro-batches
(textrl.agents.splits.prefill_batches): ``forward_batch_size`` rows, or the same token runs, the
rollout's log-probs and values those of the row split."""

from __future__ import annotations

import doctest
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.agents.test_zoo_agents import TOKEN_BUDGETS, hand_rollout, uneven_responses, zoo_agent
from tests.arithmetic import rollout_rtol
from textrl.agents import update as update_module
from textrl.agents.forwards import own_behaviour_logprobs, reuses_rollout_forward
from textrl.agents.splits import (
    balanced_runs,
    filled_runs,
    micro_splits,
    prefill_batches,
    real_tokens,
)
from textrl.config import TrainConfig
from textrl.keys import KEYS
from textrl.testing import assert_close_normwise


def reuses(agent) -> bool:
    """Whether ``agent``'s update reuses the behaviour forward (:func:`reuses_rollout_forward` of its parts)."""
    return reuses_rollout_forward(agent.config, agent.reuse_rollout_forward, own_behaviour_logprobs(type(agent)))


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
    assert reuses(agent)
    agent.config.microbatch_tokens = 64
    assert not reuses(agent)


# -- two gloo processes: as many micro-batches on each, the gradient of the whole minibatch ----------


def _split_worker(rank: int, init_file: str, out_dir: str) -> None:
    import os
    import unittest.mock

    from tests.agents.conftest import PROMPTS, collect, make_agent
    from tests.arithmetic import rollout_rtol
    from textrl.agents.base import UpdateTally
    from textrl.agents.update import Objective, run_epochs
    from textrl.models import build_tiny_tokenizer
    from textrl.parallel import Replicated
    from textrl.parallel.distributed import Distributed

    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        tok = build_tiny_tokenizer()
        prompts = PROMPTS if rank == 0 else [f"{p} and a few more words, then some more" for p in PROMPTS]
        out = {}
        for split, settings in (("whole", {}), ("tokens", {"microbatch_tokens": BUDGET})):
            torch.manual_seed(0)
            agent = make_agent(tok, "gae_ppo", **settings)
            Replicated(Distributed("cpu"), "cpu").prepare(agent)
            td = collect(agent, tok, prompts=prompts, seed=rank)
            grads, loss, calls = {}, agent.loss, []

            def step(agent, grads=grads):  # the synchronised gradient, not stepped
                agent.backend.sync_gradients(agent)
                grads.update({n: p.grad.clone() for n, p in agent.named_parameters() if p.grad is not None})
                return {}

            def counted(mb, loss=loss, calls=calls):
                calls.append(mb.shape[0])
                return loss(mb)

            agent.backend.step = step
            with unittest.mock.patch("torch.randperm", lambda n, device=None, **_: torch.arange(n, device=device)):
                run_epochs(agent.learner, td, None, UpdateTally(), Objective(counted, agent.micro_weight))
            out[split] = {"grads": grads, "rows": calls, "rtol": rollout_rtol(agent.policy.config, td),
                          "filled": len(filled_runs(real_tokens(td).tolist(), BUDGET)),
                          "prefills": len(agent.actor.prefill_batches(td))}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


BUDGET = 30
"""Two or three of the short rows a micro-batch on process 0, one or two of the long ones on process 1."""


@pytest.mark.slow
def test_two_processes_run_as_many_token_micro_batches_and_the_gradient_of_the_whole_minibatch(tmp_path):
    import torch.multiprocessing as mp

    from tests.arithmetic import assert_gradients_close

    mp.spawn(_split_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    filled = [r["tokens"]["filled"] for r in ranks]
    assert filled[0] != filled[1]  # each process alone would split otherwise
    for r in ranks:
        assert len(r["tokens"]["rows"]) == max(filled) and len(r["whole"]["rows"]) == 1
        assert r["tokens"]["prefills"] == max(filled)  # the rollout's forwards: as many on each process too
        assert_gradients_close(r["tokens"]["grads"], r["whole"]["grads"], r["whole"]["rtol"], what="token split: ")
    assert all(torch.equal(ranks[0]["tokens"]["grads"][k], g) for k, g in ranks[1]["tokens"]["grads"].items())


# -- the prefill forwards ---------------------------------------------------------------------------
def test_prefill_batches_are_rows_without_a_budget_and_filled_token_runs_with_one():
    tokens = torch.tensor([3, 4, 2, 9, 1, 5, 5])
    rows = SimpleNamespace(forward_batch_size=3, microbatch_tokens=None)
    assert prefill_batches(tokens, rows, ONE) == [slice(0, 3), slice(3, 6), slice(6, 7)]
    budget = SimpleNamespace(forward_batch_size=3, microbatch_tokens=7)
    runs = prefill_batches(tokens, budget, ONE)
    # filling takes 5 runs (7, 2, 9 alone, 6, 5 tokens); balanced into 5, the largest 9: 3, 6, 9, 6, 5
    assert [(s.start, s.stop) for s in runs] == [(0, 1), (1, 3), (3, 4), (4, 6), (6, 7)]
    assert len(prefill_batches(tokens, budget, TwoProcesses(6))) == 6  # as many as the other process
    assert prefill_batches(tokens[:0], budget, ONE) == []


@pytest.mark.parametrize("budget", TOKEN_BUDGETS)
def test_the_prefill_forwards_run_the_token_runs_and_give_the_row_splits_numbers(tok, budget):
    """``microbatch_tokens``: the actor's behaviour, reference and value forwards run each token run
    once, in order (the balanced runs of :func:`micro_splits`, not ``forward_batch_size`` rows), and the
    rollout's numbers are the row split's within tests/arithmetic.py's normwise tolerance."""
    agent = zoo_agent(tok, "gae_ppo", forward_batch_size=6)
    with torch.no_grad():
        for param in agent.critic.value_head.parameters():  # a critic that says something
            param.add_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    raw = hand_rollout(tok, uneven_responses(tok.eos_token_id))
    whole = agent.actor.evaluate(raw)
    tokens = real_tokens(raw).tolist()
    agent.actor.config = TrainConfig(**{**vars(agent.config), "microbatch_tokens": budget})
    rows: list[int] = []
    hook = agent.policy.register_forward_pre_hook(lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]),
                                                  with_kwargs=True)
    try:
        split = agent.actor.evaluate(raw)
    finally:
        hook.remove()
    ends = balanced_runs(tokens, len(filled_runs(tokens, budget)))
    assert rows == [b - a for a, b in zip([0, *ends], ends)] and sum(rows) == len(tokens)
    assert len(rows) > 1  # not the one forward of forward_batch_size=6
    rtol = rollout_rtol(agent.policy.config, raw)
    mask = raw.get(KEYS.mask)
    for key in (KEYS.action_log_prob, KEYS.ref_log_prob, KEYS.state_value):
        want = whole.get(key).reshape(mask.shape)[mask]
        assert want.abs().max() > 1e-3
        assert_close_normwise(split.get(key).reshape(mask.shape)[mask], want, rtol, name=str(key))
