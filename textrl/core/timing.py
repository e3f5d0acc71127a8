"""Wall-clock seconds per phase of a training iteration (``time/<phase>_s`` in metrics.jsonl)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def timed(timings: dict[str, float] | None, phase: str, device: torch.device | str = "cpu") -> Iterator[None]:
    """Add the wall-clock seconds of the block to ``timings[phase]`` (no-op when ``None``).

    On CUDA the calling thread's current stream is synchronised on both ends, so the kernels it
    queued count in their phase; not the whole device: the asynchronous actor's thread runs on a
    stream of its own (:class:`textrl.agents.async_actor.ActorStream`), and a device-wide wait would
    make each of its phases wait for the learner's kernels and each of the learner's for the actor's
    (and break a CUDA graph the other thread is capturing).
    """
    if timings is None:
        yield
        return
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.current_stream(device).synchronize()
    start = time.perf_counter()
    try:
        yield
    finally:
        if cuda:
            torch.cuda.current_stream(device).synchronize()
        timings[phase] = timings.get(phase, 0.0) + time.perf_counter() - start


__all__ = ["timed"]
