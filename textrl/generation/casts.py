"""The weights autocast would cast at every matmul, cast once a call instead (:class:`WeightCasts`),
and the autocast open here and now (:func:`ambient_autocast`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from textrl.core.versions import tensor_versions

MATMUL_LAYERS: tuple[type[nn.Module], ...] = (nn.Linear, Conv1D)
"""The layers whose ``weight`` and ``bias`` a matmul reads, which autocast casts at every call:
``nn.Linear`` and transformers' ``Conv1D`` (GPT-2's attention and MLP)."""


def ambient_autocast(device: torch.device | str) -> torch.dtype | None:
    """The dtype of the autocast open for ``device``'s type here and now (CUDA or the CPU), else None."""
    kind = torch.device(device).type
    if kind not in ("cuda", "cpu") or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


class WeightCasts:
    """The weights and biases of ``model``'s :data:`MATMUL_LAYERS` autocast would cast to ``dtype`` (floating,
    another dtype, plain ``nn.Parameter``: not a quantised one), each with a copy in ``dtype``.
    :meth:`refresh` copies the current values in; inside :meth:`swapped` the modules read the copies."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.entries: list[tuple[nn.Module, str, Tensor, Tensor]] = []
        for module in model.modules():
            if not isinstance(module, MATMUL_LAYERS):
                continue
            for name in ("weight", "bias"):
                p = module._parameters.get(name)
                if p is not None and type(p) is nn.Parameter and p.is_floating_point() and p.dtype != dtype:
                    self.entries.append((module, name, p, torch.empty_like(p, dtype=dtype)))
        self.versions: tuple[tuple[int, int], ...] | None = None
        """The weights' :func:`~textrl.core.versions.tensor_versions` at the last :meth:`refresh` (None: never)."""

    def refresh(self) -> None:
        with torch.no_grad():
            for _, _, p, copy in self.entries:
                copy.copy_(p)
        self.versions = tensor_versions(p for _, _, p, _ in self.entries)

    def changed(self) -> bool:
        """Whether a weight was changed in place (an optimiser step, a load) or marked written
        (:func:`textrl.core.versions.mark_written`: a step or a load through ``.data``, as DeepSpeed's) since
        the last :meth:`refresh`. The engine refreshes at the start of every rollout anyway."""
        return tensor_versions(p for _, _, p, _ in self.entries) != self.versions

    @contextmanager
    def swapped(self) -> Iterator[None]:
        for module, name, _, copy in self.entries:
            module._parameters[name] = copy  # type: ignore[assignment]
        try:
            yield
        finally:
            for module, name, p, _ in self.entries:
                module._parameters[name] = p

    @property
    def nbytes(self) -> int:
        return sum(copy.nbytes for *_, copy in self.entries)


__all__ = ["MATMUL_LAYERS", "WeightCasts", "ambient_autocast"]
