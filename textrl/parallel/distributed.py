"""The training loop's view of the process group: rank, world size and the few collectives PPO needs.

``textrl train`` under ``accelerate launch --num_processes N`` (or ``torchrun``) runs one copy of
the loop per process. Each process generates and scores its share of the rollout (whole prompt
groups); the run's backend (:mod:`textrl.parallel`) keeps the weights in step, e.g.
:meth:`Distributed.all_reduce_grads` averages gradients before every optimiser step in a
replicated run (data parallelism, as DDP). Decisions that change control flow (KL early stop, the
ratio threshold, skipping a non-finite update) are taken on values averaged over processes, so
every process takes the same branch and no collective is left waiting. In a single process every
method is a cheap no-op.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn


class Distributed:
    """Rank, world size and collectives over ``torch.distributed`` (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.world_size = torch.distributed.get_world_size() if initialized else 1
        self.rank = torch.distributed.get_rank() if initialized else 0
        self.device = torch.device(device)

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> Distributed:
        """This process alone, whatever process group is up (an actor that serves every process from
        one of them: no collective of its own)."""
        solo = cls.__new__(cls)
        solo.world_size, solo.rank, solo.device = 1, 0, torch.device(device)
        return solo

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- splitting work -------------------------------------------------------------------------
    def shard(self, n: int, what: str = "rows") -> slice:
        """This process's contiguous share of ``n`` items (``n`` must divide by the world size)."""
        if n % self.world_size:
            raise ValueError(
                f"{n} {what} do not split evenly over {self.world_size} processes; choose a "
                f"multiple of {self.world_size}"
            )
        size = n // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    # -- collectives ----------------------------------------------------------------------------
    def all_reduce_grads(self, parameters: Iterable[nn.Parameter]) -> None:
        """Average ``.grad`` over processes, in place (a missing grad counts as zeros).

        All gradients travel in one flat buffer per dtype, so there is one collective per step.
        """
        if not self.enabled:
            return
        from torch.distributed.tensor import DTensor

        # FSDP shards (DTensors) were reduce-scattered in the backward already
        params = [p for p in parameters if p.requires_grad and not isinstance(p, DTensor)]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for group in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in group])
            torch.distributed.all_reduce(flat)
            flat /= self.world_size
            offset = 0
            for p in group:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n

    def mean(self, values: Mapping[str, float]) -> dict[str, float]:
        """Average a dict of floats over processes (every process must pass the same keys)."""
        if not self.enabled or not values:
            return dict(values)
        keys = sorted(values)
        self._check_same_keys(keys)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self._comm_device)
        torch.distributed.all_reduce(t)
        t /= self.world_size
        return dict(zip(keys, t.tolist()))

    def any(self, flag: bool) -> bool:
        """True on every process when ``flag`` is True on at least one."""
        if not self.enabled:
            return bool(flag)
        t = torch.tensor([1.0 if flag else 0.0], device=self._comm_device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item() > 0)

    def gather(self, tensor: Tensor) -> Tensor:
        """Concatenate each process's ``[b, ...]`` tensor along dim 0 (equal ``b`` everywhere)."""
        if not self.enabled:
            return tensor
        local = tensor.to(self._comm_device)
        if local.dtype == torch.bool:
            local = local.to(torch.uint8)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, local.contiguous())
        return torch.cat(parts).to(device=tensor.device, dtype=tensor.dtype)

    def gather_object(self, obj: Any) -> list[Any]:
        """Every process's picklable ``obj``, in rank order, on every process."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Process ``src``'s picklable ``obj`` on every process (the others pass anything)."""
        if not self.enabled:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src)
        return box[0]

    def broadcast_module(self, module: nn.Module) -> None:
        """Copy rank 0's parameters and buffers into every process's ``module``, in place."""
        if not self.enabled:
            return
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                buf = tensor.data.to(self._comm_device)
                torch.distributed.broadcast(buf, src=0)
                tensor.data.copy_(buf)

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    # -- internals ------------------------------------------------------------------------------
    @property
    def _comm_device(self) -> torch.device:
        backend = torch.distributed.get_backend() if self.enabled else "gloo"
        return self.device if backend == "nccl" else torch.device("cpu")

    def _check_same_keys(self, keys: list[str]) -> None:
        seen = self.gather_object(pickle.dumps(keys))
        if len(set(seen)) > 1:
            raise RuntimeError(
                "processes report different metric keys "
                f"({[pickle.loads(s) for s in seen]}); every process must run the same agent config"
            )


__all__ = ["Distributed"]
