"""An update whose steps leave NaN/inf weights is rolled back in place (``nonfinite_weights``).

``Backend.snapshot`` / ``Backend.restore`` in one process and over two replicated gloo processes,
and ``PPOAgent.update`` around them. The same under DeepSpeed ZeRO: tests/agents/test_zero.py;
under FSDP: tests/test_sharding.py; whole `textrl train` runs: tests/test_reliability.py.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.agents.conftest import collect, make_agent, poison_next_step, same
from textrl.models import build_tiny_tokenizer
from textrl.parallel import Replicated
from textrl.parallel.distributed import Distributed


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def full_state(agent) -> dict:
    """Every weight, the optimisers, schedulers, KL controller and counters, copied."""
    state = agent.state_dict()
    weights = {k: v.detach().clone() for k, v in state.items() if torch.is_tensor(v)}
    return {**weights, "agent_state": _cloned(state["agent_state"])}


def _cloned(value):
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cloned(v) for v in value]
    return value


def _without_iteration(state: dict) -> dict:
    return {**state, "agent_state": {k: v for k, v in state["agent_state"].items() if k != "iteration"}}


def trained_agent(tok, name: str = "gae_ppo", **overrides):
    """An agent after one update (so AdamW has moments and the schedulers have stepped)."""
    agent = make_agent(tok, name, actor_lr=1e-2, num_minibatches=2, ppo_epochs=2, **overrides)
    agent.update(collect(agent, tok, seed=0))
    return agent


# -- Backend.snapshot / restore ----------------------------------------------------------------------


def test_snapshot_and_restore_give_back_weights_optimisers_and_schedulers_bit_for_bit(tok):
    agent = trained_agent(tok)
    before = full_state(agent)
    snapshot = agent.backend.snapshot(agent)
    assert all(t.device.type == "cpu" for t in snapshot.tensors)
    # weights, AdamW's two moments and its step count: a little more than 3 copies of the weights
    n_trained = sum(p.numel() for o in agent.optimizers for g in o.param_groups for p in g["params"])
    assert 3 * 4 * n_trained <= snapshot.nbytes < 3.1 * 4 * n_trained
    agent.update(collect(agent, tok, seed=1))
    assert not same(_without_iteration(full_state(agent)), _without_iteration(before))  # it trained
    agent.backend.restore(agent, snapshot)
    assert same(_without_iteration(full_state(agent)), _without_iteration(before))
    assert [o.param_groups[0]["lr"] for o in agent.optimizers] == [1e-2, agent.config.critic_lr]


def test_a_snapshot_before_the_first_step_restores_optimisers_without_state(tok):
    agent = make_agent(tok, actor_lr=1e-2)
    before = full_state(agent)
    snapshot = agent.backend.snapshot(agent)
    agent.update(collect(agent, tok))
    assert all(o.state for o in agent.optimizers)
    agent.backend.restore(agent, snapshot)
    assert all(not o.state for o in agent.optimizers) and all(s.last_epoch == 0 for s in agent.schedulers)
    assert same(_without_iteration(full_state(agent)), _without_iteration(before))


def test_a_snapshot_restores_only_into_the_agent_it_was_taken_from(tok):
    agent, other = make_agent(tok), make_agent(tok, "grpo")
    with pytest.raises(ValueError, match="restore a snapshot into the agent it was taken from"):
        other.backend.restore(other, agent.backend.snapshot(agent))


# -- PPOAgent.update rolls back ----------------------------------------------------------------------


def test_an_update_that_leaves_nonfinite_weights_is_rolled_back_and_counts_as_one_skip(tok):
    # the first step of the update writes inf into a weight; the later steps may be skipped for the
    # NaN losses that follows: the whole update is undone and counts once, whatever its steps did
    agent = trained_agent(tok, ref_refresh_every=1, kl_after_update=True)
    before = full_state(agent)
    poison_next_step(agent.actor_optimizer)
    metrics = agent.update(collect(agent, tok, seed=1))
    assert metrics["nonfinite/rolled_back"] == 1.0 and metrics["nonfinite/skipped_updates"] == 1.0
    assert metrics["nonfinite/consecutive"] == 1.0 == agent.nonfinite_streak
    assert same(_without_iteration(full_state(agent)), _without_iteration(before))
    assert agent.backend.weights_finite(agent)
    # the reference refresh after the update copied the restored policy, not the NaN/inf one
    assert all(torch.equal(v, agent.ref_policy.state_dict()[k]) for k, v in agent.policy.state_dict().items())
    assert metrics["kl/after_update"] == metrics["kl/before_update"]  # the forward sees the restored weights
    assert metrics["lr/actor"] == 1e-2

    metrics = agent.update(collect(agent, tok, seed=2))  # a clean update steps and resets the streak
    assert metrics["nonfinite/rolled_back"] == 0.0 and agent.nonfinite_streak == 0
    assert agent.backend.weights_finite(agent)
    assert not torch.equal(agent.policy.state_dict()["model.norm.weight"], before["policy.model.norm.weight"])


@pytest.mark.parametrize("name", ["gae_ppo", "one_step_ppo", "grpo", "rloo", "multi_adapter_ppo"])
def test_every_agent_rolls_back_and_refreshes_its_copies_from_the_restored_policy(tok, name):
    # one_step_ppo refreshes its old-policy snapshot after every update; the LoRA agent's trained
    # weights are its adapters and value head
    agent = trained_agent(tok, name) if name == "multi_adapter_ppo" else trained_agent(tok, name, ref_refresh_every=1)
    before = full_state(agent)
    poison_next_step(agent.actor_optimizer)
    metrics = agent.update(collect(agent, tok, seed=1))
    assert metrics["nonfinite/rolled_back"] == 1.0 and agent.nonfinite_streak == 1
    assert same(_without_iteration(full_state(agent)), _without_iteration(before))
    for copy in (getattr(agent, "old_policy", None), agent.ref_policy if name != "multi_adapter_ppo" else None):
        if copy is not None:
            assert all(torch.equal(v, copy.state_dict()[k]) for k, v in agent.policy.state_dict().items())


def test_rolled_back_updates_add_to_the_streak_of_skipped_ones(tok):
    agent = trained_agent(tok, max_nonfinite_updates=10)
    agent.nonfinite_streak = 5  # five skipped updates before
    poison_next_step(agent.actor_optimizer)
    agent.update(collect(agent, tok, seed=1))
    assert agent.nonfinite_streak == 6


def test_with_nonfinite_weights_stop_nothing_is_copied_nor_rolled_back(tok, monkeypatch):
    agent = trained_agent(tok, nonfinite_weights="stop")
    monkeypatch.setattr(type(agent.backend), "snapshot", lambda *a, **k: pytest.fail("a snapshot was taken"))
    poison_next_step(agent.actor_optimizer)
    metrics = agent.update(collect(agent, tok, seed=1))
    assert metrics["nonfinite/rolled_back"] == 0.0 and not agent.backend.weights_finite(agent)


def test_an_update_without_a_step_is_not_checked(tok, monkeypatch):
    # every micro-batch over the ratio threshold: nothing stepped, so no look at the weights
    agent = make_agent(tok, ratio_threshold=1e-3)
    monkeypatch.setattr(type(agent.backend), "weights_finite", lambda *a: pytest.fail("weights checked"))
    assert agent.update(collect(agent, tok))["nonfinite/rolled_back"] == 0.0


def test_the_option_is_checked():
    from textrl.config import TrainConfig

    with pytest.raises(ValueError, match="nonfinite_weights='skip': must be one of rollback, stop"):
        TrainConfig(nonfinite_weights="skip").validate()


# -- two gloo processes: one process's NaN weights roll back every process ------------------------------


def _backend(kind: str):
    from textrl.parallel import FSDP, DeepSpeedZero

    dist = Distributed("cpu")
    return {"replicated": lambda: Replicated(dist, "cpu"), "fsdp": lambda: FSDP(dist, "cpu"),
            "zero3": lambda: DeepSpeedZero(dist, "cpu", 3)}[kind]()


def _seeded_update(agent, td, seed: int) -> dict[str, float]:
    torch.manual_seed(seed)
    return agent.update(td.clone())


def rollback_worker(rank: int, init_file: str, out_dir: str, kind: str) -> None:
    """Agents ``a`` and ``b`` (same weights) under backend ``kind``: one update each; then ``a`` alone
    an update whose step fills this process's part of a weight with inf on rank 1 only; then the
    same update for both. Saves the full states (gathered on rank 0) and ``a``'s metrics."""
    os.environ["LOCAL_RANK"] = str(rank)  # DeepSpeed reads it
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        tok = build_tiny_tokenizer()
        options = dict(actor_lr=1e-2, critic_lr=1e-2, max_grad_norm=0.0)  # one step: the poisoned one is the last
        a, b = make_agent(tok, **options), make_agent(tok, **options)
        _backend(kind).prepare(a), _backend(kind).prepare(b)
        td = collect(a, tok, seed=rank)
        _seeded_update(a, td, 0), _seeded_update(b, td, 0)
        before = full_state(a)  # a collective where the backend gathers
        if rank == 1:
            poison_next_step(a.actor_optimizer)
        metrics = _seeded_update(a, collect(a, tok, seed=10 + rank), 1)
        after = full_state(a)
        td = collect(a, tok, seed=20 + rank)
        _seeded_update(a, td, 2), _seeded_update(b, td, 2)
        torch.save({"before": before, "after": after, "a": full_state(a), "b": full_state(b), "metrics": metrics},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def check_rolled_back_together(tmp_path, kind: str) -> None:
    """Run :func:`rollback_worker` on two processes: both rolled back; the state after the rollback
    is the state before, bit for bit; the next update equals the one of an agent that never saw it."""
    mp.spawn(rollback_worker, args=(str(tmp_path / "init"), str(tmp_path), kind), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for r in (r0, r1):
        assert r["metrics"]["nonfinite/rolled_back"] == 1.0 and r["metrics"]["nonfinite/consecutive"] == 1.0
    assert same(_without_iteration(r0["after"]), _without_iteration(r0["before"]))
    assert same(_without_iteration(r0["a"]), _without_iteration(r0["b"]))
    assert all(bool(torch.isfinite(v).all()) for v in r0["a"].values() if torch.is_tensor(v))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["replicated", pytest.param("zero3", marks=pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed"))])
def test_processes_roll_back_together(tmp_path, kind):
    check_rolled_back_together(tmp_path, kind)


def test_weights_too_large_for_the_forward_stop_sampling_with_one_line(tok, monkeypatch):
    """Finite weights so large that the forward overflows (AdamW with actor_lr=1e30 moves each
    weight by about 1e30; tried by hand): torch.multinomial's error is said as what it means."""
    agent = make_agent(tok, generation_engine="hf")  # its generate stands in

    def overflowing_generate(*args, **kwargs):
        torch.multinomial(torch.tensor([[float("nan"), 1.0]]), 1)  # the error sampling raises then

    monkeypatch.setattr(agent.policy, "generate", overflowing_generate)
    ids = torch.randint(3, 50, (2, 4))
    with pytest.raises(ValueError, match=r"^generation drew from NaN/inf probabilities: the policy's forward "
                                         r"overflows \(its largest weight is .*, actor_lr=.*\); lower --actor-lr"):
        agent.act(ids, torch.ones_like(ids))


@pytest.mark.parametrize("engine", ["hf", "textrl"])
def test_an_overflowing_forward_stops_sampling_with_one_line_with_either_engine(tok, engine):
    """A real overflow (the LM head's weights at 3e38: inf logits). ``hf`` raises from
    ``torch.multinomial``; the textrl engine checks the logits on the device and raises the same
    error at the end of the call: the same one line either way."""
    agent = make_agent(tok, generation_engine=engine)
    with torch.no_grad():
        agent.policy.lm_head.weight.fill_(3e38)  # finite; the forward overflows
    ids = torch.randint(3, 50, (2, 4))
    with pytest.raises(ValueError, match=r"^generation drew from NaN/inf probabilities: the policy's forward "
                                         r"overflows \(its largest weight is 3e\+38, actor_lr=.*\); lower --actor-lr"):
        agent.act(ids, torch.ones_like(ids))
