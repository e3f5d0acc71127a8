"""textrl.parallel.distributed: collectives over two real gloo processes, and no-ops in one process."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from textrl.parallel.distributed import Distributed


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    try:
        dist = Distributed("cpu")
        torch.manual_seed(rank)  # different initial weights per process
        model = nn.Linear(3, 2)
        dist.broadcast_module(model)
        x = torch.full((4, 3), float(rank + 1))
        model(x).sum().backward()
        model.bias.grad = None if rank == 1 else model.bias.grad  # a missing grad counts as zeros
        dist.all_reduce_grads(model.parameters())
        result = {
            "weight": model.weight.detach().clone(),
            "weight_grad": model.weight.grad.clone(),
            "bias_grad": model.bias.grad.clone(),
            "mean": dist.mean({"a": float(rank), "b": 2.0 * rank}),
            "any": dist.any(rank == 1),
            "gather": dist.gather(torch.tensor([[rank, rank]]) == 1),
            "objects": dist.gather_object({"rank": rank}),
            "shard": dist.shard(8),
        }
        try:
            dist.mean({f"k{rank}": 1.0})
        except RuntimeError as err:
            result["keys_error"] = str(err)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_collectives_over_two_gloo_processes(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    torch.manual_seed(0)
    reference = nn.Linear(3, 2)  # rank 0's weights, broadcast to rank 1
    assert torch.equal(r0["weight"], reference.weight) and torch.equal(r1["weight"], reference.weight)
    # d(sum(Wx+b))/dW = sum over rows of x: 4 * (rank + 1) per entry, averaged over ranks = 6
    for r in (r0, r1):
        assert torch.allclose(r["weight_grad"], torch.full((2, 3), 6.0))
        assert torch.allclose(r["bias_grad"], torch.full((2,), 2.0))  # (4 + 0) / 2
        assert r["mean"] == {"a": 0.5, "b": 1.0}
        assert r["any"] is True
        assert r["gather"].tolist() == [[False, False], [True, True]]
        assert r["objects"] == [{"rank": 0}, {"rank": 1}]
        assert "different metric keys" in r["keys_error"]
    assert (r0["shard"], r1["shard"]) == (slice(0, 4), slice(4, 8))


def test_single_process_is_a_no_op():
    dist = Distributed()
    assert (dist.rank, dist.world_size, dist.enabled, dist.is_main) == (0, 1, False, True)
    model = nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    grad = model.weight.grad.clone()
    dist.all_reduce_grads(model.parameters())
    assert torch.equal(model.weight.grad, grad)
    assert dist.mean({"a": 1.5}) == {"a": 1.5} and dist.any(False) is False
    assert dist.shard(6) == slice(0, 6) and dist.gather_object(3) == [3]


def test_uneven_shard_names_the_fix():
    dist = Distributed()
    dist.world_size, dist.rank = 4, 1
    assert dist.shard(8) == slice(2, 4)
    with pytest.raises(ValueError, match="multiple of 4"):
        dist.shard(6, "prompts")
