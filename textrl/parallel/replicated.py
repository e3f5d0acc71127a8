"""Replicated data parallelism: every process holds the whole agent and averages its gradients.

Each process generates and scores its share of the rollout (whole prompt groups) and computes
gradients on it; :meth:`Replicated.sync_gradients` all-reduces them (one flat buffer per dtype)
before every optimiser step, so the weights stay bit-identical everywhere, as with DDP
(:meth:`Replicated.end_of_run` checks it with a checksum).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from textrl.core.versions import mark_written
from textrl.parallel.base import Backend, trained_parameters


def parameter_checksum(module: nn.Module) -> str:
    """sha256 of every parameter's bytes, in order: equal across processes iff the weights are."""
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class Replicated(Backend):
    """Data parallelism over the process group of ``dist`` (gloo on CPU, NCCL on CUDA)."""

    name = "replicated"

    def prepare(self, agent: Any) -> None:
        """Rank 0's weights everywhere, then this process's own sampling seed ``seed + 1_000_003 x rank``."""
        super().prepare(agent)
        if self.dist.enabled:
            self.dist.broadcast_module(agent)  # through .data: marked, as every such write
            mark_written([*agent.parameters(), *agent.buffers()])
            torch.manual_seed(agent.config.seed + 1_000_003 * self.dist.rank)

    def sync_gradients(self, agent: Any) -> None:
        """Average every gradient over the processes (a missing one counts as zeros)."""
        self.dist.all_reduce_grads(p for _, p in trained_parameters(agent) if p.grad is not None)

    def end_of_run(self, agent: Any) -> dict[str, Any]:
        """``parameter_checksum``, after checking every process ended with the same weights."""
        checksums = self.dist.gather_object(parameter_checksum(agent))
        if len(set(checksums)) > 1:
            raise RuntimeError(f"the {self.dist.world_size} processes ended with different weights "
                               f"({checksums}); this is a bug in gradient synchronisation, please report it")
        return {"parameter_checksum": checksums[0]}


__all__ = ["Replicated", "parameter_checksum"]
