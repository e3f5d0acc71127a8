"""Agents under a real DeepSpeed ZeRO engine, in this process (a gloo group of one process).

The DeepSpeedZero backend against the single-process one: the same step without clipping, the
joint clipping norm, a NaN loss skipped by DeepSpeed's overflow check, the ratio threshold judged
before the backward, and the full-tensor state round trip. Runs over two processes (partitioned
weights, resume) are in tests/test_multiprocess.py.
"""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch

pytest.importorskip("deepspeed")

from tests.agents.conftest import collect, poison_next_step, record_loss_stats, same  # noqa: E402
from tests.agents.conftest import make_agent as build  # noqa: E402
from tests.arithmetic import rollout_rtol  # noqa: E402
from textrl.parallel import DeepSpeedZero  # noqa: E402
from textrl.parallel.base import trained_parameters  # noqa: E402
from textrl.parallel.distributed import Distributed  # noqa: E402
from textrl.testing import assert_close_normwise  # noqa: E402


def forget_deepspeed_groups() -> None:
    """DeepSpeed keeps the groups it made (and its communication backend) in module globals; after the
    process group is destroyed they name a dead group, which the next module's new group would meet."""
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups

    ds_comm.cdb = None
    for name in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP",
                 "_ALL_TO_ALL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP"):
        if getattr(groups, name, None) is not None:
            setattr(groups, name, None)
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP"):
        if isinstance(getattr(groups, name, None), dict):
            getattr(groups, name).clear()


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """DeepSpeed needs a process group: one gloo process, torn down after this module."""
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    local_rank = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"  # DeepSpeed reads it (torchrun and accelerate set it)
    yield
    torch.distributed.destroy_process_group()
    forget_deepspeed_groups()
    if local_rank is None:
        del os.environ["LOCAL_RANK"]
    else:
        os.environ["LOCAL_RANK"] = local_rank


def weights(agent) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in agent.state_dict().items() if torch.is_tensor(v)}


def seeded_update(agent, td, seed: int = 0) -> dict[str, float]:
    """``agent.update`` on a copy of ``td`` with the minibatch shuffle seeded."""
    torch.manual_seed(seed)
    return agent.update(td.clone())


def pair(tok, stage: int, agent: str = "gae_ppo", **overrides):
    """A plain agent and the same agent (same initial weights) under ZeRO ``stage``."""
    plain, zero = build(tok, agent, **overrides), build(tok, agent, **overrides)
    DeepSpeedZero(Distributed(), "cpu", stage).prepare(zero)
    return plain, zero


def first_moments(agent) -> dict[str, torch.Tensor]:
    """AdamW's ``exp_avg`` of every trained weight, by name: ``(1 - beta1) x`` the first step's gradient."""
    if isinstance(agent.backend, DeepSpeedZero):
        return {k: v["exp_avg"] for k, v in agent.state_dict()["agent_state"]["optimizers"][0]["state"].items()}
    state = {**agent.actor_optimizer.state, **(agent.critic_optimizer.state if agent.critic_optimizer else {})}
    return {name: state[p]["exp_avg"] for name, p in trained_parameters(agent)}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("agent", ["gae_ppo", "one_step_ppo", "grpo"])
def test_a_zero_step_equals_the_plain_one(tok, stage, agent):
    # one step over two accumulated micro-batches (DeepSpeed accumulates, textrl steps), no clipping
    plain, zero = pair(tok, stage, agent, max_grad_norm=0.0, gradient_accumulation_steps=2)
    td = collect(plain, tok)
    m_plain, m_zero = seeded_update(plain, td), seeded_update(zero, td)
    assert m_zero["nonfinite/skipped_updates"] == 0 and "grad_norm/total" in m_zero
    assert m_zero["loss/policy"] == pytest.approx(m_plain["loss/policy"], abs=1e-6)
    assert (m_zero["lr/actor"], m_zero.get("lr/critic")) == (m_plain["lr/actor"], m_plain.get("lr/critic"))
    # the gradients, through AdamW's first moments (the weights themselves differ where a gradient
    # cancels to ~0: Adam turns float noise of 1e-9 there into a step of ~lr)
    a, b = first_moments(plain), first_moments(zero)
    assert a.keys() == b.keys() and len(a) > 20
    assert sum(float(v.abs().sum()) for v in a.values()) > 0
    for key in a:
        assert_close_normwise(b[key], a[key], rtol=zero_step_rtol(plain, td), name=key)


def zero_step_rtol(agent, td) -> float:
    """How far ZeRO's gradients may be from the plain loop's, relative to a tensor's norm.

    Stage 3 gathers its partitioned weights and reduce-scatters its gradients: the same sums in
    another order, over buffers the CPU's kernels block by their own SIMD width (an AVX-512 Xeon
    and an AVX-512 EPYC round the same step differently). A float32 sum of ``n`` terms in two orders
    differs by up to ``2 gamma(n - 1)`` times the sum of the terms' magnitudes; the longest sum of a
    step is over the batch's tokens or the model's widest dimension (the vocabulary's softmax).
    Near an element that cancels to ~0 that bound is far above the element itself (a relative
    1e-4 failed at 6e-6 on one CPU), so each tensor is compared by its norm: observed 2.5e-7 to
    3.9e-7 relative, against 6e-5 here; a wrong scale, a missing micro-batch or a gradient on the
    wrong shard is off by 1e-1 or more."""
    return rollout_rtol(agent.policy.config, td)  # tests/arithmetic.py


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_updates_keep_equal_to_plain_ones_over_minibatches_and_iterations(tok, stage):
    # stages 1 and 2 reduce in the same order as the plain loop: equal weights over several steps
    plain, zero = pair(tok, stage, max_grad_norm=0.0, num_minibatches=2, gradient_accumulation_steps=2,
                       actor_lr=1e-2, critic_lr=1e-2)
    initial = weights(plain)
    for it in range(2):
        td = collect(plain, tok, seed=it)
        m_plain, m_zero = seeded_update(plain, td, seed=it), seeded_update(zero, td, seed=it)
        assert m_zero["loss/policy"] == pytest.approx(m_plain["loss/policy"], abs=1e-6)
    a, b = weights(plain), weights(zero)
    assert sum(not torch.equal(v, initial[k]) for k, v in a.items() if k.startswith("policy.")) > 10
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)


def test_deepspeed_clips_the_joint_actor_and_critic_norm(tok):
    plain, zero = pair(tok, 2, max_grad_norm=1e-3)
    td = collect(plain, tok)
    m_plain, m_zero = seeded_update(plain, td), seeded_update(zero, td)
    joint = math.hypot(m_plain["grad_norm/actor"], m_plain["grad_norm/critic"])
    assert m_zero["grad_norm/total"] == pytest.approx(joint, rel=1e-4)
    # one step, clipped jointly to norm 1e-3: AdamW's first moment is (1 - beta1) x the clipped gradient
    assert joint > 1e-2
    state = zero.backend.engine.optimizer.optimizer.state.values()
    first_moment = math.sqrt(sum(float(s["exp_avg"].norm()) ** 2 for s in state))
    assert first_moment == pytest.approx(0.1 * 1e-3, rel=1e-3)


def test_a_nan_loss_makes_deepspeed_skip_the_step(tok, monkeypatch):
    _, zero = pair(tok, 2)
    td = collect(zero, tok)
    before = weights(zero)
    loss = type(zero).loss

    def nan_loss(self, mb):
        value, stats = loss(self, mb)
        return value * math.nan, stats

    monkeypatch.setattr(type(zero), "loss", nan_loss)
    metrics = zero.update(td.clone())
    assert metrics["nonfinite/skipped_updates"] == 1 and zero.nonfinite_streak == 1
    after = weights(zero)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    monkeypatch.undo()
    metrics = zero.update(collect(zero, tok, seed=1))  # DeepSpeed dropped the NaN gradients: a clean step
    assert metrics["nonfinite/skipped_updates"] == 0 and zero.nonfinite_streak == 0
    assert math.isfinite(metrics["grad_norm/total"])
    assert any(not torch.equal(weights(zero)[k], v) for k, v in before.items() if k.startswith("policy."))


def test_over_the_ratio_threshold_a_micro_batch_is_left_out_of_the_step(tok):
    # a threshold below 1 trips on every micro-batch: nothing is back-propagated, nothing steps
    _, zero = pair(tok, 2, ratio_threshold=1e-3, gradient_accumulation_steps=2)
    seen = record_loss_stats(zero)
    before = weights(zero)
    metrics = zero.update(collect(zero, tok))
    assert len(seen) == 2 and metrics["ppo/ratio_threshold_skips"] == 1.0
    assert metrics["nonfinite/skipped_updates"] == 0 and "grad_norm/total" not in metrics
    assert all(torch.equal(weights(zero)[k], v) for k, v in before.items())  # critic untouched too
    assert not zero.backend.engine.optimizer.optimizer.state  # AdamW never stepped


@pytest.mark.parametrize("stage", [2, 3])
def test_the_full_state_round_trips_into_a_fresh_engine(tok, stage):
    _, zero = pair(tok, stage, actor_lr=1e-2)
    td = collect(zero, tok)
    zero.update(td.clone())
    state = zero.state_dict()
    saved = state["agent_state"]["optimizers"][0]
    assert saved["format"] == "deepspeed_zero_full" and saved["step"] == 1.0
    assert set(saved["state"]) == {k for k, _ in trained_parameters(zero)}

    _, fresh = pair(tok, stage, seed=1, actor_lr=1e-2)  # other initial weights, no AdamW state yet
    fresh.load_state_dict(state)
    assert all(torch.equal(weights(fresh)[k], v) for k, v in weights(zero).items())
    again = fresh.state_dict()["agent_state"]["optimizers"][0]
    for name, entry in saved["state"].items():
        for key, value in entry.items():
            assert torch.equal(again["state"][name][key], value), (name, key)
    # the master weights were restored too: the next update is the same from both
    m_a, m_b = zero.update(collect(zero, tok, seed=3)), fresh.update(collect(fresh, tok, seed=3))
    assert m_a["loss/total"] == pytest.approx(m_b["loss/total"], abs=1e-6)
    for key, value in weights(zero).items():
        torch.testing.assert_close(weights(fresh)[key], value, rtol=0, atol=1e-6, msg=key)


def test_a_plain_checkpoint_is_refused_by_a_deepspeed_agent(tok):
    plain, zero = pair(tok, 1)
    plain.update(collect(plain, tok))
    with pytest.raises(ValueError, match="was not written under DeepSpeed"):
        zero.load_state_dict(plain.state_dict())


def _zero_agent(tok, stage: int, **overrides):
    agent = build(tok, **overrides)
    DeepSpeedZero(Distributed(), "cpu", stage).prepare(agent)
    return agent


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_rolled_back_update_leaves_the_engine_as_if_it_never_ran(tok, stage):
    # the AdamW step writes inf into its float32 master partition, which DeepSpeed copies into the
    # weights: the rollback restores weights, masters (and stage 3's gathered small weights) and
    # AdamW state, so the next update equals that of an engine that never saw the poisoned one
    options = dict(actor_lr=1e-2, critic_lr=1e-2, max_grad_norm=0.0)
    a, b = _zero_agent(tok, stage, **options), _zero_agent(tok, stage, **options)
    td = collect(a, tok)
    seeded_update(a, td), seeded_update(b, td)
    before = a.state_dict()
    poison_next_step(a.actor_optimizer)
    metrics = seeded_update(a, collect(a, tok, seed=1))
    assert metrics["nonfinite/rolled_back"] == 1.0 and a.nonfinite_streak == 1
    after = a.state_dict()
    after["agent_state"]["iteration"] = before["agent_state"]["iteration"]
    assert same(after, before)
    td = collect(a, tok, seed=2)
    seeded_update(a, td), seeded_update(b, td)
    assert same(weights(a), weights(b)) and a.backend.weights_finite(a)
