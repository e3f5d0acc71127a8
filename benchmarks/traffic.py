"""What a decode step moves: the aten ops it dispatches and the bytes of their tensors.

A decode step is memory-bound: its floor is the bytes of the weights (and the KV cache) over the
card's bandwidth (``benchmarks/bench_generation.py``). Whether a step reads only those bytes is a
property of the ops it dispatches, the same on every device: :class:`OpLog` records them (below
autograd and autocast, so autocast's casts are seen as ops) and :func:`step_bytes` sorts the bytes
of an eager step into

- ``casts``: floating-point ``_to_copy`` / ``copy_`` between dtypes (read + written);
- ``matmul``: the operands of the matrix products (the weights are most of them) and their
  outputs;
- ``attention``: the query, keys, values and mask the attention kernels read, and their output;
- ``other``: every other op's tensor inputs and outputs; an in-place op counts its
  target as read and written, except where it only writes (``copy_``, ``fill_``) or writes a slice
  (``index_copy_``: one cache column, not the cache). Views move nothing and are not counted.

An eager count is an upper bound of what a compiled step moves (fusion removes the elementwise
ops' round trips, never a matmul's operands), so a step whose ``casts`` grow with the cache or
the weights is caught here, on the CPU, before any GPU is timed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_int_mm"})
"""aten ops (by their packet name) counted as matrix products."""

NO_MOVE = frozenset({"_unsafe_view", "alias", "detach", "lift_fresh", "_reshape_alias", "set_"})
"""aten ops that return their input's storage without the schema saying so: they move nothing."""

PURE_WRITES = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_", "exponential_", "random_"})
"""In-place aten ops that write their target without reading it."""


@dataclass(frozen=True)
class Op:
    """One dispatched aten op: its packet name (``mm``), the (dtype, bytes) of each tensor it reads
    and of each it writes."""

    name: str
    reads: tuple[tuple[torch.dtype, int], ...]
    writes: tuple[tuple[torch.dtype, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(b for _, b in self.reads) + sum(b for _, b in self.writes)


class OpLog(TorchDispatchMode):
    """Inside ``with OpLog() as log:``, each aten op run is appended to ``log.ops`` as an :class:`Op`
    (views and :data:`NO_MOVE` ops left out; module docstring for what an in-place op counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name in NO_MOVE:
            return out
        schema = func._schema.arguments
        mutated = {a.name for a in schema if a.alias_info is not None and a.alias_info.is_write}
        named = dict(zip((a.name for a in schema), args))
        named.update(kwargs)
        inputs = [(k, t) for k, v in named.items() for t in tree_flatten(v)[0] if isinstance(t, Tensor)]
        reads = [(t.dtype, t.nbytes) for k, t in inputs if k not in mutated]
        if mutated:
            writes = []
            for k, t in inputs:
                if k not in mutated:
                    continue
                if name == "index_fill_":  # one slice per index
                    n = t.numel() // max(1, t.shape[named["dim"]]) * named["index"].numel()
                elif name.startswith(("index_", "scatter")):  # the source's elements
                    n = max(s.numel() for j, s in inputs if j not in mutated and j not in ("index", "indices"))
                else:
                    n = t.numel()
                    if name not in PURE_WRITES:
                        reads.append((t.dtype, t.nbytes))  # an in-place update reads what it writes
                writes.append((t.dtype, n * t.element_size()))
        else:
            writes = [(t.dtype, t.nbytes) for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        self.ops.append(Op(name, tuple(reads), tuple(writes)))
        return out


class OpCount(TorchDispatchMode):
    """Inside ``with OpCount() as count:``, ``count.n`` counts every aten op dispatched (views too),
    except while ``count.paused``: the host's work of a call, each op a launch or a copy on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.n, self.paused = 0, False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.n += not self.paused
        return func(*args, **(kwargs or {}))


@contextmanager
def uncounted(count: OpCount, owner: type, *methods: str) -> Iterator[None]:
    """Inside the block, ``count`` leaves out the ops dispatched inside ``owner``'s ``methods`` (for
    example a decoder's ``run`` and ``feed``: captured graphs on CUDA, a single launch each)."""
    originals = {name: getattr(owner, name) for name in methods}

    def pausing(method: Any) -> Any:
        def paused(self: Any, *args: Any, **kwargs: Any) -> Any:
            count.paused = True
            try:
                return method(self, *args, **kwargs)
            finally:
                count.paused = False
        return paused

    for name, method in originals.items():
        setattr(owner, name, pausing(method))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(owner, name, method)


def _is_cast(op: Op) -> bool:
    if op.name not in ("_to_copy", "copy_") or not op.reads or not op.writes:
        return False
    (src, _), (dst, _) = op.reads[0], op.writes[0]
    return src.is_floating_point and dst.is_floating_point and src != dst


def _is_attention(op: Op) -> bool:
    return "scaled_dot_product" in op.name or "attention" in op.name


def step_bytes(ops: Iterable[Op]) -> dict[str, int]:
    """Bytes of ``ops`` by kind (module docstring): ``casts``, ``matmul``, ``attention``, ``other``, ``total``."""
    out = {"casts": 0, "matmul": 0, "attention": 0, "other": 0}
    for op in ops:
        kind = ("casts" if _is_cast(op) else "matmul" if op.name in MATMULS
                else "attention" if _is_attention(op) else "other")
        out[kind] += op.nbytes
    out["total"] = sum(out.values())
    return out


def read_dtypes(ops: Iterable[Op], kind: str) -> set[torch.dtype]:
    """The floating dtypes the ``kind`` ops (``matmul`` or ``attention``) read."""
    test = (lambda op: op.name in MATMULS) if kind == "matmul" else _is_attention
    return {d for op in ops if test(op) for d, _ in op.reads if d.is_floating_point}


__all__ = ["MATMULS", "NO_MOVE", "PURE_WRITES", "Op", "OpCount", "OpLog", "read_dtypes", "step_bytes", "uncounted"]
