"""textrl.parallel: the backend interface, and one meaning of the ratio threshold and the NaN skip.

In one process (SingleProcess) and over two gloo processes (Replicated); DeepSpeed's engine is in
tests/agents/test_zero.py, FSDP and ZeRO runs of ``textrl train`` in tests/test_multiprocess.py.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.agents.conftest import collect, make_agent
from textrl.config import TrainConfig
from textrl.parallel import FSDP, Replicated, SingleProcess, setup_backend
from textrl.parallel.distributed import Distributed


def weights(agent) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in agent.state_dict().items() if torch.is_tensor(v)}


def judged(agent, ratio_of) -> list[str]:
    """Wrap ``agent.loss``: micro-batch ``i`` reports ``ratio/mean = ratio_of(i)`` (``nan``: a NaN
    loss as well); returns the list of backward calls, by micro-batch index."""
    loss, calls, backwards = agent.loss, [], []

    def fake(mb):
        value, stats = loss(mb)
        ratio = ratio_of(len(calls))
        calls.append(len(calls))
        if math.isnan(ratio):
            return value * math.nan, {**stats, "ratio/mean": torch.tensor(100.0)}
        return value, {**stats, "ratio/mean": torch.tensor(ratio)}

    backward = agent.backend.backward

    def spy(value):
        backwards.append(calls[-1])
        backward(value)

    agent.loss, agent.backend.backward = fake, spy
    return backwards


def test_every_agent_starts_single_process_and_its_state_is_the_modules():
    from textrl.models import build_tiny_tokenizer

    agent = make_agent(build_tiny_tokenizer())
    assert isinstance(agent.backend, SingleProcess) and agent.backend.dist.world_size == 1
    assert not agent.backend.partitions_weights and not agent.backend.gathers_state
    state = agent.state_dict()
    assert set(state) - {"agent_state"} == set(torch.nn.Module.state_dict(agent))


def test_setup_backend_in_one_process_is_single_and_refuses_sharding(tmp_path):
    backend = setup_backend(TrainConfig(), torch.device("cpu"))
    assert isinstance(backend, SingleProcess) and backend.is_main
    with pytest.raises(ValueError, match="fsdp=True shards over several processes; launch with"):
        setup_backend(TrainConfig(fsdp=True), torch.device("cpu"))


def test_a_micro_batch_over_the_ratio_threshold_is_left_out_actor_and_critic(tok):
    # micro-batch 0 over the threshold, micro-batch 1 not: only 1 is back-propagated, and the step
    # is the one micro-batch 1 alone gives (its usual weight in the minibatch)
    agent = make_agent(tok, gradient_accumulation_steps=2, ratio_threshold=5.0, actor_lr=1e-2)
    td = collect(agent, tok)
    backwards = judged(agent, lambda i: 50.0 if i == 0 else 1.0)
    torch.manual_seed(0)
    metrics = agent.update(td.clone())
    assert backwards == [1] and metrics["ppo/ratio_threshold_skips"] == 1.0
    assert metrics["nonfinite/skipped_updates"] == 0 and "grad_norm/critic" in metrics

    alone = make_agent(tok, gradient_accumulation_steps=2, ratio_threshold=5.0, actor_lr=1e-2)
    loss = alone.loss
    alone.loss = lambda mb, calls=[]: (calls.append(1) or loss(mb)[0] * (len(calls) > 1), loss(mb)[1])
    torch.manual_seed(0)
    alone.update(td.clone())
    a, b = weights(agent), weights(alone)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_when_every_micro_batch_is_over_the_threshold_nothing_steps(tok):
    agent = make_agent(tok, gradient_accumulation_steps=2, ratio_threshold=1e-3)
    before = weights(agent)
    metrics = agent.update(collect(agent, tok))
    assert metrics["ppo/ratio_threshold_skips"] == 1.0 and metrics["nonfinite/skipped_updates"] == 0
    assert all(torch.equal(weights(agent)[k], v) for k, v in before.items())  # critic untouched too
    assert all(not o.state for o in agent.optimizers) and all(s.last_epoch == 0 for s in agent.schedulers)


def test_a_nan_loss_is_never_left_out_by_the_threshold_and_skips_the_step(tok):
    agent = make_agent(tok, gradient_accumulation_steps=2, ratio_threshold=5.0)
    before = weights(agent)
    backwards = judged(agent, lambda i: math.nan if i == 0 else 1.0)
    metrics = agent.update(collect(agent, tok))
    assert backwards == [0, 1] and metrics["ppo/ratio_threshold_skips"] == 0.0
    assert metrics["nonfinite/skipped_updates"] == 1 == agent.nonfinite_streak
    assert all(torch.equal(weights(agent)[k], v) for k, v in before.items())
    assert all(not o.state for o in agent.optimizers) and all(s.last_epoch == 0 for s in agent.schedulers)


def test_multi_adapter_ppo_refuses_a_sharding_backend_by_name(tok):
    agent = make_agent(tok, "multi_adapter_ppo")
    with pytest.raises(ValueError, match="multi_adapter_ppo does not shard .*--load-in-4bit instead"):
        FSDP(Distributed(), "cpu").prepare(agent)
    assert isinstance(agent.backend, SingleProcess)


# -- two gloo processes: every process decides alike ------------------------------------------------


FAULTS = ("none", "nan", "ratio")


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    from tests.agents.conftest import collect, make_agent
    from textrl.models import build_tiny_tokenizer

    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        tok = build_tiny_tokenizer()
        for fault in FAULTS:  # each case a fresh agent in the same two processes (their start is most of the time)
            agent = make_agent(tok, "gae_ppo", seed=rank, gradient_accumulation_steps=2, ratio_threshold=5.0,
                               actor_lr=1e-2)  # different initial weights: prepare() broadcasts rank 0's
            Replicated(Distributed("cpu"), "cpu").prepare(agent)
            td = collect(agent, tok, seed=rank)
            before = weights(agent)
            # rank 1 alone trips: a NaN loss, or a ratio whose average over both processes is over 5
            ratio = {"nan": math.nan, "ratio": 20.0, "none": 1.0}[fault]
            backwards = judged(agent, lambda i, ratio=ratio: ratio if (rank == 1 and i == 0) else 1.0)
            metrics = agent.update(td)
            torch.save({"before": before, "after": weights(agent), "metrics": metrics, "backwards": backwards},
                       os.path.join(out_dir, f"{fault}-rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_replicated_processes_skip_alike_and_stay_identical(tmp_path):
    """No fault, a NaN loss, a ratio over the threshold, each on rank 1 alone: both processes skip
    alike and end with the same weights. One spawn for the three cases (one test, so that xdist does
    not start the processes on several workers)."""
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for fault in FAULTS:
        r0, r1 = (torch.load(tmp_path / f"{fault}-rank{r}.pt", weights_only=False) for r in (0, 1))
        assert all(torch.equal(r0["before"][k], v) for k, v in r1["before"].items()), fault  # rank 0's weights everywhere
        assert all(torch.equal(r0["after"][k], v) for k, v in r1["after"].items()), fault  # and the same step
        moved = any(not torch.equal(r0["after"][k], v) for k, v in r0["before"].items())
        for r in (r0, r1):
            skipped = r["metrics"]["nonfinite/skipped_updates"]
            dropped = r["metrics"]["ppo/ratio_threshold_skips"]
            want = {"none": (0, 0, True), "nan": (1, 0, False), "ratio": (0, 1, True)}[fault]
            assert (skipped, dropped, moved) == want, fault
            assert r["backwards"] == {"none": [0, 1], "nan": [0, 1], "ratio": [1]}[fault], fault


@pytest.mark.parametrize("name", ["gae_ppo", "rloo"])
def test_an_update_frees_its_gradients_before_the_next_rollout(tok, name):
    """The last step's gradients are not needed until the next update's first backward: kept, they
    sat through the next rollout's generation (6 GB of a 1.5B policy's float32 gradients on a GPU)."""
    agent = make_agent(tok, name)
    agent.update(collect(agent, tok))
    trained = [p for opt in agent.optimizers for g in opt.param_groups for p in g["params"]]
    assert trained and all(p.grad is None for p in trained)
