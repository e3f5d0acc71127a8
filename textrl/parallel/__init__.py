"""Parallelism behind one interface: a run's :class:`Backend` (docs/parallelism.md).

- :class:`SingleProcess`: one process (every agent starts under it);
- :class:`Replicated`: data parallel, gradients all-reduced before each step;
- :class:`FSDP`: FSDP2, every weight, gradient and optimiser state split over the processes;
- :class:`DeepSpeedZero`: DeepSpeed ZeRO stages 1-3, one engine over the agent's models.

``backend = setup_backend(config, device)`` joins the process group and picks one;
``backend.prepare(agent)`` makes the agent train under it.
"""

from __future__ import annotations

from textrl.parallel.base import Backend
from textrl.parallel.fsdp import FSDP
from textrl.parallel.replicated import Replicated, parameter_checksum
from textrl.parallel.setup import check_process_split, check_sharding, setup_backend
from textrl.parallel.single import SingleProcess
from textrl.parallel.zero import DeepSpeedZero

__all__ = [
    "FSDP",
    "Backend",
    "DeepSpeedZero",
    "Replicated",
    "SingleProcess",
    "check_process_split",
    "check_sharding",
    "parameter_checksum",
    "setup_backend",
]
