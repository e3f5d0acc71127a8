"""Wall-clock seconds per phase of a training iteration (``time/<phase>_s`` in metrics.jsonl)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def timed(timings: dict[str, float] | None, phase: str, device: torch.device | str = "cpu") -> Iterator[None]:
    """Add the wall-clock seconds of the block to ``timings[phase]`` (no-op when ``None``).

    On CUDA the device is synchronised on both ends, so queued kernels count in their phase.
    """
    if timings is None:
        yield
        return
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    try:
        yield
    finally:
        if cuda:
            torch.cuda.synchronize(device)
        timings[phase] = timings.get(phase, 0.0) + time.perf_counter() - start


__all__ = ["timed"]
