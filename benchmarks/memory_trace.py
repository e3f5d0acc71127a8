"""What was live when CUDA memory peaked: a replay of torch's allocator trace (``--trace``).

``bench_gpu_memory.py --trace`` records the CUDA caching allocator's history over the update of
one extra iteration (:func:`recording`: every allocation with the Python stack that made it), then
:func:`peak_breakdown` replays the trace: the running sum of the blocks allocated since the
recording began and not yet freed, its peak, and the blocks live at that peak grouped by where
they were made (:func:`where`: the innermost frame outside torch, and the innermost textrl frame
when that one is elsewhere). Blocks allocated before the recording (the models' weights, state that
lives across iterations, the rollout) are not in the trace: the breakdown is of what the update
adds.

The replay is plain Python over the trace's entries (``{"action", "addr", "size", "frames"}``), so
tests check it on the CPU with made-up entries.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

MAX_ENTRIES = 2_000_000
"""Trace entries kept (a ring buffer: a longer iteration loses its oldest, and the replay says so)."""


NO_STACK = "no Python stack (autograd's backward: gradients)"
"""Where a block made without Python frames was made: on CUDA, autograd runs the backward in a C++
thread, so the gradients (and the backward's temporaries) come without a stack."""


def _package_path(frame: dict[str, Any]) -> str:
    """The frame's file as its package names it (``torch/nn/functional.py``, ``textrl/agents/update.py``):
    after the last ``site-packages/`` (or ``/textrl/``); else the file's name."""
    path = str(frame.get("filename", "?")).replace("\\", "/")
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    if "/textrl/" in path:
        return "textrl/" + path.rsplit("/textrl/", 1)[1]
    return path.rsplit("/", 1)[-1]


def _short(frame: dict[str, Any]) -> str:
    return f"{_package_path(frame)}:{frame.get('line', '?')} {frame.get('name', '?')}"


def where(frames: list[dict[str, Any]]) -> str:
    """Where a block was made: the innermost frame (``frames[0]``) outside torch's own Python, then
    `` < `` the innermost textrl frame when that is another one; :data:`NO_STACK` without frames."""
    if not frames:
        return NO_STACK
    outside = [f for f in frames if not _package_path(f).startswith("torch/")]
    if not outside:
        return _short(frames[0])
    ours = next((f for f in outside if _package_path(f).startswith("textrl/")), None)
    text = _short(outside[0])
    return text if ours is None or ours is outside[0] else f"{text} < {_short(ours)}"


def _replay(entries: list[dict[str, Any]], stop: int | None = None) -> tuple[int, int, dict[int, tuple[int, int]]]:
    """Replay ``entries[:stop]``: ``(peak bytes, index of the entry that reached it, live blocks at the
    end)``, the blocks as ``addr -> (size, index of their allocation)``."""
    live: dict[int, tuple[int, int]] = {}
    total = peak = 0
    peak_at = -1
    for i, entry in enumerate(entries[:stop]):
        action = entry.get("action")
        if action == "alloc":
            live[entry["addr"]] = (int(entry["size"]), i)
            total += int(entry["size"])
            if total > peak:
                peak, peak_at = total, i
        elif action == "free_completed" and entry.get("addr") in live:
            total -= live.pop(entry["addr"])[0]
    return peak, peak_at, live


def peak_breakdown(entries: Iterable[dict[str, Any]], top: int = 12, max_entries: int = MAX_ENTRIES) -> dict[str, Any]:
    """The replay of ``entries`` (module docstring): ``peak_mb`` (MiB live at the peak, of the blocks
    allocated in the trace), ``at_peak`` (``[{"where", "mb", "blocks"}]``, the ``top`` largest
    groups of the blocks live then, largest first; ``rest_mb`` the other groups together),
    ``entries`` and ``complete`` (False when the trace holds ``max_entries``: the recording's ring
    buffer was full and its oldest entries are lost). Frees of blocks allocated before the
    recording are not in the sum."""
    entries = list(entries)
    peak, peak_at, _ = _replay(entries)
    live = _replay(entries, peak_at + 1)[2]  # the blocks live right after the peak's allocation
    sizes: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for size, index in live.values():
        key = where(entries[index].get("frames") or [])
        sizes[key] += size
        counts[key] += 1
    groups = sizes.most_common()
    complete = len(entries) < max_entries
    mib = 2**20
    return {
        "peak_mb": round(peak / mib),
        "at_peak": [{"where": k, "mb": round(v / mib, 1), "blocks": counts[k]} for k, v in groups[:top]],
        "rest_mb": round(sum(v for _, v in groups[top:]) / mib, 1),
        "entries": len(entries),
        "complete": complete,
    }


@contextmanager
def recording(device: torch.device, max_entries: int = MAX_ENTRIES) -> Iterator[dict[str, Any]]:
    """Record ``device``'s allocator history inside the block; the yielded dict gets ``entries``
    (the trace of ``device``) at the end. CUDA only."""
    out: dict[str, Any] = {}
    torch.cuda.synchronize(device)
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                              max_entries=max_entries, device=device)
    try:
        yield out
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
        traces = snapshot.get("device_traces") or [[]]
        index = device.index if device.index is not None else torch.cuda.current_device()
        out["entries"] = traces[index] if index < len(traces) else []
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)


__all__ = ["MAX_ENTRIES", "peak_breakdown", "recording", "where"]
