"""Every random generator a run draws from: seeding at start, capture and restore for exact resume."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch (CPU and CUDA) RNGs."""
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002 - the global NumPy RNG that user reward code may use
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy, torch CPU (and every CUDA device's) RNG state."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002 - saved for exact resume
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore a :func:`rng_state` capture (its CUDA part only where CUDA is available)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])  # noqa: NPY002 - restored for exact resume
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextmanager
def keeping_rng() -> Iterator[None]:
    """Every generator :func:`rng_state` captures as it was on entry, whatever the body draws from or
    reseeds them with: a library's own seeding and draws (vLLM seeds Python, NumPy and torch with its
    own seed when it starts, and may draw from torch's for a row without a seed) leave the run's
    random stream where they found it. Unlike ``torch.random.fork_rng``, Python's and NumPy's too."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def draw_start(sampler: Any) -> dict[str, Any]:
    """What a rollout's draw depends on besides the weights: this process's RNGs and the prompt
    sampler's position (``{"rng", "sampler"}``; ``sampler`` has ``state_dict`` / ``load_state_dict``).
    The synchronous step rewinds to it after an engine failed; the asynchronous actor keeps the one
    of the rollout in flight (a checkpoint draws it again from there)."""
    return {"rng": rng_state(), "sampler": sampler.state_dict()}


def put_back(sampler: Any, start: dict[str, Any]) -> None:
    """The RNGs and the prompt sampler as :func:`draw_start` found them."""
    sampler.load_state_dict(start["sampler"])
    set_rng_state(start["rng"])


__all__ = ["draw_start", "keeping_rng", "put_back", "rng_state", "seed_everything", "set_rng_state"]
