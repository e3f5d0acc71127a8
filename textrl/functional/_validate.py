"""Input checks shared by the functional core: each raises ``ValueError`` naming the argument,
what it got and what it expected. They run before any math so a mis-shaped tensor never
broadcasts silently (``[B, T] - [B, T, 1]`` is ``[B, T, T]``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _shape(x: Tensor) -> str:
    return "[" + ", ".join(str(s) for s in x.shape) + "]"


def check_tensor(name: str, x: object) -> Tensor:
    """``x`` is a tensor; return it."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_2d(name: str, x: Tensor) -> None:
    """``x`` is ``[B, T]``; a ``[B, T, 1]`` gets a hint to squeeze."""
    check_tensor(name, x)
    if x.dim() != 2:
        hint = " (a [B, T, 1] tensor: call .squeeze(-1) first)" if x.dim() == 3 and x.shape[-1] == 1 else ""
        raise ValueError(f"{name} must be [B, T], got shape {_shape(x)}{hint}")


def check_float(name: str, x: Tensor) -> None:
    """``x`` has a floating dtype."""
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a float tensor, got dtype {x.dtype}")


def check_same_shape(name: str, x: Tensor, ref_name: str, ref: Tensor) -> None:
    """``x`` has exactly the shape of ``ref``; the ``[B,T]`` vs ``[B,T,1]`` case gets a hint."""
    check_tensor(name, x)
    if x.shape == ref.shape:
        return
    hint = ""
    if x.dim() == ref.dim() + 1 and x.shape[-1] == 1 and x.shape[:-1] == ref.shape:
        hint = f" ({name} has a trailing 1: call .squeeze(-1); [B,T] - [B,T,1] broadcasts to [B,T,T])"
    elif ref.dim() == x.dim() + 1 and ref.shape[-1] == 1 and ref.shape[:-1] == x.shape:
        hint = f" ({ref_name} has a trailing 1: squeeze it; [B,T] - [B,T,1] broadcasts to [B,T,T])"
    raise ValueError(f"{name} must have the shape of {ref_name} {_shape(ref)}, got {_shape(x)}{hint}")


def check_mask(name: str, mask: Tensor, ref_name: str, ref: Tensor) -> None:
    """``mask`` is bool with the shape of ``ref``; any pattern of Trues (gaps allowed)."""
    check_tensor(name, mask)
    if mask.dtype != torch.bool:
        raise ValueError(
            f"{name} must be a bool tensor, got dtype {mask.dtype}; pass mask.bool() "
            "(a float mask is ambiguous about NaN/inf in masked positions)"
        )
    check_same_shape(name, mask, ref_name, ref)


def check_probability(name: str, value: float) -> None:
    """``value`` is a number in [0, 1]."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value!r}: must be a number in [0, 1]")


def check_positive(name: str, value: float) -> None:
    """``value`` is a number > 0."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name}={value!r}: must be a number > 0")
