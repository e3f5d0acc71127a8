"""Whether tensors changed since a moment: the one test the rollout caches, the carried KV cache,
the weight casts and the rollback copy make.

A tensor written in place (an optimiser step, ``load_state_dict``, ``copy_``) bumps its
``_version``; a tensor replaced by another has another ``data_ptr``. So ``(data_ptr, _version)``
of each tensor, compared with the pair taken before, says "changed since". A write through
``.data`` bumps neither: code that writes that way says so itself (each user's docstring names
how).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import Tensor


def tensor_versions(tensors: Iterable[Tensor]) -> tuple[tuple[int, int], ...]:
    """``(data_ptr, _version)`` of each tensor, in order: equal to an earlier call's result exactly
    when no tensor was written in place or replaced in between."""
    return tuple((t.data_ptr(), t._version) for t in tensors)


class VersionCounter:
    """A weights' version number: an int that moves by one each time it is read after one of the
    tensors ``tensors()`` gives was written in place or replaced (:func:`tensor_versions`).

    Read once after each optimiser step (the learner does), it counts the steps; a weight edited
    by hand between two reads moves it too. Everything that caches a computation of the weights
    (a kept forward, the behaviour log-probs, a rollout's provenance) keeps the number it saw and
    compares it with :meth:`now`.
    """

    def __init__(self, tensors: Callable[[], Iterable[Tensor]]) -> None:
        self._tensors = tensors
        self._seen: tuple[tuple[int, int], ...] | None = None
        self._value = 0

    def now(self) -> int:
        """The version of the weights as they are now."""
        seen = tensor_versions(self._tensors())
        if seen != self._seen:
            if self._seen is not None:
                self._value += 1
            self._seen = seen
        return self._value


__all__ = ["VersionCounter", "tensor_versions"]
