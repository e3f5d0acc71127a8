"""Whether tensors changed since a moment: the one test the rollout caches, the carried KV cache,
the weight casts, the rollback copy and the engines that hold their own copy of the weights (the
``vllm`` engines) make.

A tensor written in place (an optimiser step, ``load_state_dict``, ``copy_``) bumps its
``_version`` (autograd's counter); a tensor replaced by another has another ``data_ptr``. So
``(data_ptr, _version)`` of each tensor, compared with the pair taken before, says "changed
since". A write that autograd does not count (through ``.data``, as DeepSpeed ZeRO's step and its
loads write the weights; a kernel writing through the tensor's pointer, as bitsandbytes' 8-bit
AdamW does) is stated by its writer instead: :func:`mark_written` bumps the same counter, so
every reader sees it through the one test, whatever object it holds. textrl marks every such write
of its own (:meth:`textrl.parallel.Backend.step` after every optimiser step it applied, whatever
the optimiser or the engine did inside; DeepSpeed's loads and copies); a user's own write through
``.data`` is marked by calling :func:`mark_written`, or else shows as a gap between the engine's
log-probs and the learner's (docs/design.md, "Actor and learner").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import Tensor
from torch.autograd.graph import increment_version


def tensor_versions(tensors: Iterable[Tensor]) -> tuple[tuple[int, int], ...]:
    """``(data_ptr, _version)`` of each tensor, in order: equal to an earlier call's result exactly
    when no tensor was written in place (or marked written: :func:`mark_written`) or replaced in
    between."""
    return tuple((t.data_ptr(), t._version) for t in tensors)


def mark_written(tensors: Iterable[Tensor]) -> None:
    """State that ``tensors`` were written where autograd's counter does not see it (through
    ``.data``, or by a kernel through their memory): bumps each one's ``_version``, as an in-place
    write would, so that :func:`tensor_versions` and every :class:`VersionCounter` over them move.
    Harmless after a write autograd counted too (the counter moves once more; readers compare it
    for equality). Tensors made under ``torch.inference_mode`` have no counter and are skipped."""
    counted = [t for t in tensors if not t.is_inference()]
    if counted:
        increment_version(counted)


class VersionCounter:
    """A weights' version number: an int that moves by one each time it is read after one of the
    tensors ``tensors()`` gives was written in place (or marked written: :func:`mark_written`) or
    replaced (:func:`tensor_versions`).

    Read once after each optimiser step (the learner does; every backend's step marks the weights
    it wrote), it counts the steps; a weight edited by hand between two reads moves it too.
    Everything that caches a computation of the weights (a kept forward, the behaviour log-probs,
    a rollout's provenance, an engine's own copy of them) keeps the number it saw and compares it
    with :meth:`now`.
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


__all__ = ["VersionCounter", "mark_written", "tensor_versions"]
