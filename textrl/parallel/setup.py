"""Choosing and starting a run's backend: :func:`setup_backend`.

What accelerate does here: :class:`accelerate.PartialState` joins the process group that
``accelerate launch`` (or ``torchrun``) describes in environment variables and picks this
process's device; ``accelerate launch`` FSDP / DeepSpeed configs reach us as its environment
variables (``ACCELERATE_USE_FSDP``, ``ACCELERATE_USE_DEEPSPEED``, ...), read by
:func:`check_sharding`. Everything else (sharding, engines, gradient sync, checkpoints) is
textrl's own (:mod:`textrl.parallel`).
"""

from __future__ import annotations

from typing import Any

import torch

from textrl.config import TrainConfig
from textrl.parallel.base import Backend
from textrl.parallel.distributed import Distributed


def check_sharding(config: TrainConfig) -> dict[str, Any] | None:
    """Fold an accelerate FSDP / DeepSpeed config into ``config`` (``fsdp``, ``zero_stage``) and
    resolve ``deepspeed_config``; return the ZeRO section to use (None without DeepSpeed).

    ``ValueError`` for what cannot run: offload, an unreadable DeepSpeed config, DeepSpeed not
    installed, FSDP and DeepSpeed together.
    """
    from textrl.parallel import deepspeed_engine
    from textrl.parallel.fsdp_sharding import accelerate_fsdp_options, accelerate_wants_fsdp

    if deepspeed_engine.accelerate_wants_deepspeed():
        for name, value in deepspeed_engine.accelerate_deepspeed_options().items():
            setattr(config, name, value)
    if accelerate_wants_fsdp():
        for name, value in {"fsdp": True, **accelerate_fsdp_options()}.items():
            setattr(config, name, value)
    section = deepspeed_engine.read_zero_section(config.deepspeed_config) if config.deepspeed_config else {}
    if not config.zero_stage and "stage" in section:  # --deepspeed-config alone: its stage
        config.zero_stage = section["stage"]
    if config.deepspeed_config and not config.zero_stage:
        raise ValueError(f"deepspeed_config={config.deepspeed_config!r} names no zero_optimization.stage; "
                         "add one or pass --zero-stage 1, 2 or 3")
    config.validate()
    if not config.zero_stage:
        return None
    deepspeed_engine.require_deepspeed()
    return section


def check_process_split(config: TrainConfig, dist: Distributed) -> None:
    """Each process takes whole prompt groups and splits its rows into the minibatches."""
    if config.prompts_per_iteration % dist.world_size:
        raise ValueError(
            f"prompts_per_iteration={config.prompts_per_iteration} does not split over "
            f"{dist.world_size} processes; choose a multiple of {dist.world_size}"
        )
    local = config.rollout_batch_size // dist.world_size
    parts = config.num_minibatches * config.gradient_accumulation_steps
    if local % parts:
        raise ValueError(
            f"each of the {dist.world_size} processes gets {local} rows, which do not divide into "
            f"num_minibatches={config.num_minibatches} x gradient_accumulation_steps="
            f"{config.gradient_accumulation_steps}; lower either or raise prompts_per_iteration"
        )


def process_group(device: torch.device) -> Distributed:
    """This process's view of the run's processes: accelerate's ``PartialState`` joins the group
    that ``accelerate launch`` / ``torchrun`` set up (a group of one otherwise)."""
    from accelerate import PartialState

    state = PartialState(cpu=device.type == "cpu")
    dist = Distributed(state.device)
    return dist if dist.enabled else Distributed(device)


def setup_backend(config: TrainConfig, device: torch.device) -> Backend:
    """The backend ``config`` asks for (``fsdp``, ``zero_stage``, or the processes it was launched
    with), its process group joined; ``device`` is used in a single process.

    ``ValueError`` saying what to fix: sharding in one process, rows that do not split over the
    processes, and everything :func:`check_sharding` refuses.
    """
    from textrl.parallel.fsdp import FSDP
    from textrl.parallel.replicated import Replicated
    from textrl.parallel.single import SingleProcess
    from textrl.parallel.zero import DeepSpeedZero

    zero_section = check_sharding(config)
    dist = process_group(device)
    if (config.fsdp or config.zero_stage) and not dist.enabled:
        flag = "--fsdp" if config.fsdp else "--zero-stage"
        what = "fsdp=True" if config.fsdp else f"zero_stage={config.zero_stage}"
        raise ValueError(f"{what} shards over several processes; launch with `accelerate launch "
                         f"--num_processes N -m textrl.cli train ...` or torchrun, or drop {flag}")
    if not dist.enabled:
        return SingleProcess(dist, device)
    check_process_split(config, dist)
    if config.fsdp:  # each process keeps 1/N of every weight, gradient and optimiser state
        return FSDP(dist, dist.device, config.fsdp_reshard_after_forward)
    if config.zero_stage:  # AdamW states (1), + gradients (2), + weights (3) partitioned
        return DeepSpeedZero(dist, dist.device, config.zero_stage, zero_section)
    return Replicated(dist, dist.device)


__all__ = ["check_process_split", "check_sharding", "process_group", "setup_backend"]
