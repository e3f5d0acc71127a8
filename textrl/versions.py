"""Whether tensors changed since a moment: the one test the rollout caches, the carried KV cache,
the weight casts and the rollback copy make.

A tensor written in place (an optimiser step, ``load_state_dict``, ``copy_``) bumps its
``_version``; a tensor replaced by another has another ``data_ptr``. So ``(data_ptr, _version)``
of each tensor, compared with the pair taken before, says "changed since". A write through
``.data`` bumps neither: code that writes that way says so itself (each user's docstring names
how).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor


def tensor_versions(tensors: Iterable[Tensor]) -> tuple[tuple[int, int], ...]:
    """``(data_ptr, _version)`` of each tensor, in order: equal to an earlier call's result exactly
    when no tensor was written in place or replaced in between."""
    return tuple((t.data_ptr(), t._version) for t in tensors)


__all__ = ["tensor_versions"]
