"""The update's rollback copy (``nonfinite_weights='rollback'``, :mod:`textrl.parallel.rollback`):
buffers reused from update to update, staged when the rollout is processed, made again when the
weights changed since, where ``rollback_copy`` puts them; the guard's metrics; the one-sync
finiteness check. Rollback semantics themselves: tests/test_nonfinite_weights.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.agents.conftest import collect, make_agent, poison_next_step, same
from tests.test_nonfinite_weights import _without_iteration, full_state, trained_agent
from textrl.agents.state import load_agent_state, take_changed_settings
from textrl.parallel.rollback import RollbackCopy


@pytest.fixture(scope="module")
def tok():
    from textrl.models import build_tiny_tokenizer

    return build_tiny_tokenizer()


def as_plain(snapshot) -> dict:
    """An :class:`UpdateSnapshot` as nested dicts and lists, for :func:`same`."""
    return {"tensors": list(snapshot.tensors), "schedulers": snapshot.schedulers,
            "optimizers": [{"groups": o.groups, "state": o.state} for o in snapshot.optimizers]}


def n_trained(agent) -> int:
    return sum(p.numel() for o in agent.optimizers for g in o.param_groups for p in g["params"])


def count_calls(monkeypatch, name: str) -> list[int]:
    """Count the calls of ``RollbackCopy.<name>`` (still calling it)."""
    calls, method = [], getattr(RollbackCopy, name)

    def spy(self, *args, **kwargs):
        calls.append(1)
        return method(self, *args, **kwargs)

    monkeypatch.setattr(RollbackCopy, name, spy)
    return calls


# -- buffers reused, copies staged ----------------------------------------------------------------------


def test_the_buffers_are_allocated_once_and_reused_update_after_update(tok, monkeypatch):
    agent = trained_agent(tok)  # AdamW's state exists: what the copy holds no longer changes shape
    agent.update(collect(agent, tok, seed=1))
    guard = agent.backend.rollback_copy
    buffers, pointers = list(guard.buffers), [b.data_ptr() for b in guard.buffers]
    allocations = count_calls(monkeypatch, "_allocate")
    for seed in (2, 3, 4):
        agent.update(collect(agent, tok, seed=seed))
        assert all(a is b for a, b in zip(guard.buffers, buffers)) and len(guard.buffers) == len(buffers)
        assert [b.data_ptr() for b in guard.buffers] == pointers
    assert not allocations


def test_the_staged_copy_is_taken_as_it_is_and_equals_a_synchronous_snapshot_bit_for_bit(tok, monkeypatch):
    agent = trained_agent(tok)
    collect(agent, tok, seed=1)  # process_rollout stages the copy
    fills = count_calls(monkeypatch, "_fill")
    expected = agent.backend.snapshot(agent)
    taken = agent.backend.take_rollback(agent)
    assert not fills  # the staged copy, not a new one
    assert same(as_plain(taken), as_plain(expected))
    assert [t.data_ptr() for t in taken.tensors] == [b.data_ptr() for b in agent.backend.rollback_copy.buffers[:len(taken.tensors)]]


def test_without_a_staged_copy_the_update_copies_at_once(tok, monkeypatch):
    agent = trained_agent(tok)
    td = collect(agent, tok, seed=1)
    agent.backend.invalidate_rollback()
    fills = count_calls(monkeypatch, "_fill")
    before = full_state(agent)
    poison_next_step(agent.actor_optimizer)
    assert agent.update(td)["nonfinite/rolled_back"] == 1.0
    assert len(fills) == 1
    assert same(_without_iteration(full_state(agent)), _without_iteration(before))


def test_a_rollback_at_the_first_update_drops_the_optimiser_state_created_since(tok):
    agent = make_agent(tok, actor_lr=1e-2)
    before = full_state(agent)
    td = collect(agent, tok)  # staged before AdamW has any state
    poison_next_step(agent.actor_optimizer)
    assert agent.update(td)["nonfinite/rolled_back"] == 1.0
    assert all(not o.state for o in agent.optimizers) and all(s.last_epoch == 0 for s in agent.schedulers)
    assert same(_without_iteration(full_state(agent)), _without_iteration(before))


# -- a staged copy made stale -----------------------------------------------------------------------------


def test_weights_loaded_between_staging_and_update_are_the_ones_rolled_back_to(tok):
    agent, other = trained_agent(tok), trained_agent(tok, seed=1)
    td = collect(agent, tok, seed=1)  # staged: the agent's own weights
    loaded = full_state(other)
    agent.load_state_dict(loaded)
    poison_next_step(agent.actor_optimizer)
    assert agent.update(td)["nonfinite/rolled_back"] == 1.0
    assert same(_without_iteration(full_state(agent)), _without_iteration(loaded))


@pytest.mark.parametrize("how", ["in place", "through .data, then invalidated"])
def test_a_weight_edited_by_hand_between_staging_and_update_is_the_one_rolled_back_to(tok, how):
    agent = trained_agent(tok)
    td = collect(agent, tok, seed=1)
    weight = agent.policy.get_input_embeddings().weight
    with torch.no_grad():
        if how == "in place":
            weight.add_(1.0)  # bumps the weight's version: the staged copy is seen to be stale
        else:
            weight.data.add_(1.0)  # invisible to the version check: the editor says so
            agent.backend.invalidate_rollback()
    edited = full_state(agent)
    poison_next_step(agent.actor_optimizer)
    assert agent.update(td)["nonfinite/rolled_back"] == 1.0
    assert same(_without_iteration(full_state(agent)), _without_iteration(edited))


@pytest.mark.parametrize("load", ["load_state_dict", "load_weights_state", "load_agent_state_dict",
                                  "take_changed_settings"])
def test_every_load_path_makes_the_staged_copy_stale(tok, load):
    agent = trained_agent(tok)
    state = agent.state_dict()
    collect(agent, tok, seed=1)
    assert agent.backend.rollback_copy._staged is not None
    argument = {"load_state_dict": state, "load_weights_state": {k: v for k, v in state.items() if k != "agent_state"},
                "load_agent_state_dict": state["agent_state"], "take_changed_settings": {"actor_lr"}}[load]
    call = {"load_agent_state_dict": load_agent_state, "take_changed_settings": take_changed_settings}.get(load)
    if call is None:
        getattr(agent, load)(argument)
    else:
        call(agent, argument)
    assert agent.backend.rollback_copy._staged is None


def test_a_restore_makes_the_staged_copy_stale(tok):
    agent = trained_agent(tok)
    snapshot = agent.backend.snapshot(agent)
    collect(agent, tok, seed=1)
    agent.backend.restore(agent, snapshot)
    assert agent.backend.rollback_copy._staged is None


# -- placement, several updates, metrics ---------------------------------------------------------------


@pytest.mark.parametrize("where", ["host", "device", "auto"])
def test_every_placement_rolls_back_weights_adamw_and_schedule_bit_for_bit_after_several_updates(tok, where):
    agent = make_agent(tok, actor_lr=1e-2, num_minibatches=2, ppo_epochs=2, lr_schedule="cosine", iterations=8,
                       rollback_copy=where)
    for seed in range(3):
        agent.update(collect(agent, tok, seed=seed))
    before = full_state(agent)
    assert all(s.last_epoch == 12 for s in agent.schedulers)
    poison_next_step(agent.actor_optimizer)
    metrics = agent.update(collect(agent, tok, seed=3))
    assert metrics["nonfinite/rolled_back"] == 1.0
    assert same(_without_iteration(full_state(agent)), _without_iteration(before))
    guard = agent.backend.rollback_copy
    assert guard.placement == ("host" if where == "auto" else where)  # on the CPU both are CPU memory
    assert all(b.device.type == "cpu" and not b.is_pinned() for b in guard.buffers)
    metrics = agent.update(collect(agent, tok, seed=4))  # and the next update trains from there
    assert metrics["nonfinite/rolled_back"] == 0.0 and agent.backend.weights_finite(agent)


@pytest.mark.parametrize("name", ["gae_ppo", "grpo"])
def test_the_metrics_give_the_bytes_copied_and_the_backend_the_guards_seconds(tok, name):
    agent = trained_agent(tok, name)
    agent.backend.rollback_seconds()
    metrics = agent.update(collect(agent, tok, seed=1))
    # float32 weights and AdamW's two moments (and a step count per weight tensor)
    assert 3 * 4 * n_trained(agent) <= metrics["guard/bytes"] <= 1.02 * 3 * 4 * n_trained(agent)
    assert metrics["guard/bytes"] == agent.backend.rollback_copy.nbytes
    assert not any("guard" in k and k != "guard/bytes" for k in metrics)  # the seconds are no metric
    assert 0.0 < agent.backend.rollback_seconds() < math.inf
    assert agent.backend.rollback_seconds() == 0.0  # read, and set back to 0


def test_with_nonfinite_weights_stop_the_guard_stages_nothing_and_costs_nothing(tok, monkeypatch):
    agent = trained_agent(tok, nonfinite_weights="stop")
    for name in ("stage", "take", "_fill"):
        monkeypatch.setattr(RollbackCopy, name, lambda *a, **k: pytest.fail("the rollback copy was used"))
    agent.backend.rollback_seconds()
    metrics = agent.update(collect(agent, tok, seed=1))
    assert metrics["guard/bytes"] == 0.0 and agent.backend.rollback_seconds() == 0.0


# -- weights_finite: one inf in one tensor, one host sync ------------------------------------------------


@pytest.fixture(scope="module")
def checked_agent(tok):
    return make_agent(tok)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), value=st.sampled_from([math.inf, -math.inf, math.nan]))
def test_weights_finite_finds_one_nonfinite_value_in_any_trained_tensor(checked_agent, data, value):
    agent = checked_agent
    params = [p for o in agent.optimizers for g in o.param_groups for p in g["params"]]
    param = params[data.draw(st.integers(0, len(params) - 1), label="tensor")]
    flat = param.detach().view(-1)
    at = data.draw(st.integers(0, flat.numel() - 1), label="element")
    kept = flat[at].item()
    assert agent.backend.weights_finite(agent)
    flat[at] = value
    try:
        assert not agent.backend.weights_finite(agent)
    finally:
        flat[at] = kept
    assert agent.backend.weights_finite(agent)


def test_weights_finite_reads_one_value_back_from_the_device(tok, monkeypatch):
    agent = make_agent(tok)
    reads = []
    for name in ("__bool__", "item"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, _m=method: reads.append(1) or _m(self))
    assert agent.backend.weights_finite(agent)
    assert len(reads) == 1


@pytest.mark.parametrize("values, finite", [
    ([3e38] * 8, True),  # finite, though their float32 sum overflows: looked at value by value
    ([3e38, -math.inf], False),
    ([math.inf, -math.inf], False),  # sums to NaN
    ([1.0, math.nan], False),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_is_exact_when_the_sum_overflows(values, finite, dtype):
    from textrl.parallel.base import all_finite

    if dtype == torch.float16:  # its largest finite value is 65504
        values = [6e4 if abs(v) == 3e38 else v for v in values]
    assert all_finite([torch.ones(3), torch.tensor(values, dtype=dtype)]) is finite
    assert all_finite([])


# -- CUDA: the copy on the device and in pinned host memory ------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("where", ["device", "host"])
def test_the_rollback_copy_on_cuda_restores_bit_for_bit(tok, where):
    agent = make_agent(tok, actor_lr=1e-2, num_minibatches=2, rollback_copy=where).to("cuda")
    for seed in range(2):
        agent.update(collect(agent, tok, seed=seed))
    td = collect(agent, tok, seed=2)  # stages the copy on the side stream
    torch.cuda.synchronize()
    expected = agent.backend.snapshot(agent)
    taken = agent.backend.take_rollback(agent)
    torch.cuda.synchronize()  # the host buffers are read here
    assert same(as_plain(taken), as_plain(expected))
    guard = agent.backend.rollback_copy
    assert guard.placement == where
    weights = guard.buffers[:len(taken.tensors)]
    if where == "host":
        assert all(b.device.type == "cpu" and b.is_pinned() for b in weights)
    else:
        assert all(b.device.type == "cuda" for b in weights)
    agent.backend.invalidate_rollback()  # the update takes its own copy again

    before = {k: v.detach().clone() for k, v in agent.state_dict().items() if torch.is_tensor(v)}
    before_optimizers = _without_iteration(full_state(agent))["agent_state"]
    poison_next_step(agent.actor_optimizer)
    metrics = agent.update(td)
    assert metrics["nonfinite/rolled_back"] == 1.0
    assert 3 * 4 * n_trained(agent) <= metrics["guard/bytes"] <= 1.02 * 3 * 4 * n_trained(agent)
    after = {k: v for k, v in agent.state_dict().items() if torch.is_tensor(v)}
    assert all(v.device.type == "cuda" for v in after.values()) and same(after, before)
    assert same(_without_iteration(full_state(agent))["agent_state"], before_optimizers)
    assert agent.update(collect(agent, tok, seed=3))["nonfinite/rolled_back"] == 0.0  # staged, taken, not needed


@pytest.mark.cuda
def test_auto_keeps_a_small_copy_on_the_cuda_device(tok):
    agent = make_agent(tok).to("cuda")
    agent.update(collect(agent, tok))
    assert agent.backend.rollback_copy.placement == "device"
