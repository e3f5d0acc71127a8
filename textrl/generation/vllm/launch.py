"""The training processes a colocated vLLM starts among: one, or every process of a torchrun /
accelerate launch on the launcher's process group (:class:`Launch`, :func:`launch_of`), what that
cannot run (:func:`check_processes`), and the launcher's group kept through vLLM's shutdown
(:func:`launcher_group_kept`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from textrl.generation.vllm.options import EngineOptions


@dataclass(frozen=True)
class Launch:
    """The training processes vLLM starts among: one (vLLM's own single-process executor), or
    ``world`` of them under torchrun / accelerate launch, this one ``rank``: then every process starts
    its own engine on the launcher's process group (vLLM's ``external_launcher`` executor), which
    generates that process's share of each rollout."""

    world: int = 1
    rank: int = 0

    def llm_options(self, seed: int) -> dict[str, Any]:
        """The ``vllm.LLM(...)`` keywords of the launch: vLLM's seed (``seed + rank``: each process its
        own, the same on every run), and under several processes the external launcher."""
        if self.world == 1:
            return {"seed": int(seed)}
        return {"seed": int(seed) + self.rank, "distributed_executor_backend": "external_launcher"}


def launch_of(dist: Any, options: EngineOptions, environ: Any = os.environ) -> Launch:
    """The :class:`Launch` of ``torch.distributed`` as it is now (its default process group, if any).
    ``ValueError`` in one line for what vLLM's external launcher cannot run: a process group not
    started by a launcher (no ``RANK`` / ``LOCAL_RANK``), tensor parallel over processes, the
    asynchronous loop."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Launch()
    missing = [name for name in ("RANK", "LOCAL_RANK") if name not in environ]
    if missing:
        raise ValueError(f"--generation-engine vllm under several processes starts vLLM on the launcher's process "
                         f"group, which needs {' and '.join(missing)} set; launch with torchrun or accelerate launch")
    check_processes(options, dist.get_world_size())
    return Launch(world=dist.get_world_size(), rank=dist.get_rank())


def check_processes(options: EngineOptions, processes: int) -> None:
    """``ValueError`` in one line for what a vLLM of each of ``processes`` training processes cannot run
    (none for one): tensor parallel over processes (each process draws its own share)."""
    if processes <= 1:
        return
    if options.tensor_parallel_size > 1:
        raise ValueError(f"vllm_tensor_parallel_size={options.tensor_parallel_size} under several processes: each "
                         "process's vLLM draws its own share (tensor parallel 1); to split a model over GPUs, serve "
                         "it: textrl vllm-serve MODEL --tensor-parallel-size N and --vllm-server URL (docs/vllm.md)")


@contextmanager
def launcher_group_kept() -> Iterator[None]:
    """vLLM's shutdown destroys ``torch.distributed``'s default process group; under several processes
    that group is the launcher's, the run's own: inside this block vLLM destroys its groups alone."""
    dist = torch.distributed
    destroy = dist.destroy_process_group

    def own_groups_only(group: Any = None) -> None:
        if group is not None and group is not dist.GroupMember.WORLD:
            destroy(group)

    dist.destroy_process_group = own_groups_only
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


__all__ = ["Launch", "check_processes", "launch_of", "launcher_group_kept"]
