"""The reward-function interface, its error type and the safety wrapper :func:`call_reward`.

A reward function is any callable

    fn(prompts: list[str], completions: list[str], **kwargs) -> Tensor  # float32 [B]

``kwargs`` carry optional per-row batch fields; a function reads the ones it needs and ignores
the rest, so every reward function must accept ``**kwargs``. As TRL does, a function with a
parameter named ``completions`` gets ``prompts`` and ``completions`` by keyword, so TRL's
``def reward(completions, **kwargs)`` works as it is (:func:`invoke`); others get them by position. The fields the built-in rewards
read are

- ``completion_ids``: per-row token id lists, or an int64 ``[B, T]`` tensor (then with
  ``completion_mask`` bool ``[B, T]``, True on valid tokens);
- ``answer``: one reference answer per row (the prompt dataset's ``answer`` field);
- ``truncated``: bool ``[B]``, the completion hit the length cap without EOS.

A reward function has a ``name`` attribute (set with :func:`named`); :func:`reward_name` falls
back to ``__name__`` for user callables. Rewards are scores, not losses: they are detached.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

_MAX_ROWS_SHOWN = 10
_MAX_ROWS_RETRIED = 64


class RewardFn(Protocol):
    """``fn(prompts, completions, **kwargs) -> Tensor`` float32 ``[B]``."""

    def __call__(self, prompts: list[str], completions: list[str], **kwargs: Any) -> Tensor: ...


class RewardError(ValueError):
    """A reward function that raised or returned something other than finite float ``[B]``."""


F = TypeVar("F", bound=Callable[..., Any])


def named(name: str) -> Callable[[F], F]:
    """Decorator: set ``fn.name``, the name the registry and the reward logs use."""

    def set_name(fn: F) -> F:
        fn.name = name  # type: ignore[attr-defined]
        return fn

    return set_name


def reward_name(fn: Callable[..., Any]) -> str:
    """``fn.name``, else ``fn.__name__``, else the class name (for callable objects)."""
    name = getattr(fn, "name", None)
    if isinstance(name, str) and name:
        return name
    inner = getattr(fn, "func", None)  # functools.partial
    if inner is not None and inner is not fn:
        return reward_name(inner)
    return getattr(fn, "__name__", None) or type(fn).__name__


def _rows(indices: Sequence[int]) -> str:
    shown = list(indices[:_MAX_ROWS_SHOWN])
    more = f" and {len(indices) - len(shown)} more" if len(indices) > len(shown) else ""
    return f"{shown}{more}"


def check_batch(prompts: Sequence[str], completions: Sequence[str]) -> int:
    """Batch size ``B``; raises when prompts and completions are not equally long lists."""
    for what, x in (("prompts", prompts), ("completions", completions)):
        if isinstance(x, str):
            raise ValueError(f"{what} is a single str; pass a list of str (one per row)")
    if len(prompts) != len(completions):
        raise ValueError(
            f"len(prompts)={len(prompts)} != len(completions)={len(completions)}: "
            "pass one prompt per completion (repeat a prompt for each of its samples)"
        )
    return len(completions)


def batch_field(value: Any, field: str, n: int, fn_name: str) -> Sequence[Any]:
    """A required per-row kwarg: raises when it is missing or not ``n`` long."""
    if value is None:
        raise ValueError(
            f"{fn_name} needs the batch field {field!r}: pass {field}=[...] (one entry per "
            f"completion), i.e. give the prompt dataset a {field!r} column"
        )
    if len(value) != n:
        raise ValueError(f"{fn_name}: {field} has {len(value)} entries for {n} completions")
    return value


def token_lists(completion_ids: Any, completion_mask: Any, n: int, fn_name: str) -> list[list[int]]:
    """Per-row token id lists from ``completion_ids`` (lists, or a ``[B, T]`` tensor + mask)."""
    ids = batch_field(completion_ids, "completion_ids", n, fn_name)
    if not isinstance(ids, Tensor):
        return [list(map(int, row)) for row in ids]
    if ids.dim() != 2:
        raise ValueError(f"{fn_name}: completion_ids has shape {tuple(ids.shape)}, expected [B, T]")
    if completion_mask is None:
        raise ValueError(
            f"{fn_name}: completion_ids is a padded [B, T] tensor, so the row lengths are unknown; "
            "pass completion_mask (bool [B, T], True on valid tokens) or a list of per-row id lists"
        )
    mask = torch.as_tensor(completion_mask, dtype=torch.bool)
    if mask.shape != ids.shape:
        raise ValueError(
            f"{fn_name}: completion_mask has shape {tuple(mask.shape)}, "
            f"completion_ids has {tuple(ids.shape)}"
        )
    return [row[m].tolist() for row, m in zip(ids, mask)]


def bool_rows(value: Any, field: str, n: int, fn_name: str) -> Tensor:
    """A required per-row bool kwarg (list, ``[B]`` or ``[B, 1]`` tensor) as bool ``[B]``."""
    x = torch.as_tensor(batch_field(value, field, n, fn_name)).to(torch.bool)
    if x.dim() == 2 and x.shape[1] == 1:
        x = x.squeeze(1)
    if tuple(x.shape) != (n,):
        raise ValueError(f"{fn_name}: {field} has shape {tuple(x.shape)}, expected [{n}]")
    return x


def _slice_kwargs(kwargs: dict[str, Any], i: int, n: int) -> dict[str, Any]:
    out = {}
    for k, v in kwargs.items():
        sized = isinstance(v, (list, tuple)) or getattr(v, "ndim", 0) > 0  # tensors, arrays
        out[k] = v[i : i + 1] if sized and len(v) == n else v
    return out


def invoke(fn: RewardFn, prompts: list[str], completions: list[str], kwargs: dict[str, Any]) -> Any:
    """``fn`` called as TRL calls a reward function (``prompts=``, ``completions=`` and the batch
    fields by keyword) when it names a ``completions`` parameter, else ``fn(prompts, completions,
    **kwargs)``."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        params = {}
    completions_param = params.get("completions")
    if completions_param is not None and completions_param.kind is not inspect.Parameter.POSITIONAL_ONLY:
        return fn(prompts=prompts, completions=completions, **kwargs)
    return fn(prompts, completions, **kwargs)


def _rows_that_raise(fn: RewardFn, prompts, completions, kwargs) -> list[int] | None:
    """Rows whose one-row call raises, or None when the batch is too large to retry."""
    n = len(completions)
    if n > _MAX_ROWS_RETRIED:
        return None
    bad = []
    for i in range(n):
        try:
            invoke(fn, prompts[i : i + 1], completions[i : i + 1], _slice_kwargs(kwargs, i, n))
        except Exception:
            bad.append(i)
    return bad


def _raised(fn: RewardFn, name: str, err: Exception, prompts, completions, kwargs) -> RewardError:
    hint = "fix the function or the batch field it needs"
    if isinstance(err, TypeError) and "unexpected keyword argument" in str(err):
        hint = "reward functions must accept **kwargs (the trainer passes every batch field)"
    rows = _rows_that_raise(fn, prompts, completions, kwargs)
    if rows is None:
        where = f"rows: not searched (batch of {len(completions)} is too large to retry row by row)"
    elif rows and len(rows) == len(completions):
        where = "rows: every row raises on its own"
    elif rows:
        where = f"rows that raise on their own: {_rows(rows)}"
    else:
        where = "rows: no single row raises on its own (the failure needs the whole batch)"
    return RewardError(f"reward {name!r} raised {type(err).__name__}: {err}; {where}; {hint}")


def call_reward(
    fn: RewardFn,
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    allow_nonfinite: bool = False,
    **kwargs: Any,
) -> Tensor:
    """Call ``fn`` and return its scores as a finite, detached float32 ``[B]`` tensor.

    Raises :class:`RewardError` naming the function, the offending rows and what to do when it
    raises, returns NaN/inf, the wrong shape, or something that is not a tensor, list or array
    of ``B`` numbers. Lists and arrays of shape ``[B]`` are converted. ``allow_nonfinite=True``
    lets NaN/inf scores through (the caller applies a ``reward_nonfinite`` policy to them).

    >>> call_reward(lambda p, c, **kw: [1, 2], ["p", "p"], ["a", "b"]).tolist()
    [1.0, 2.0]
    """
    n = check_batch(prompts, completions)
    name = reward_name(fn)
    try:
        out = invoke(fn, list(prompts), list(completions), kwargs)
    except Exception as err:
        raise _raised(fn, name, err, list(prompts), list(completions), kwargs) from err

    if not isinstance(out, Tensor):
        if isinstance(out, (list, tuple)) or hasattr(out, "__array__"):
            try:
                out = torch.as_tensor(out, dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError) as err:
                raise RewardError(
                    f"reward {name!r} returned a {type(out).__name__} that is not {n} numbers "
                    f"({err}); return a float tensor of shape [{n}]"
                ) from err
        else:
            raise RewardError(
                f"reward {name!r} returned {type(out).__name__}, expected a float tensor of shape "
                f"[{n}] (one score per completion)"
            )
    if out.is_complex() or not (out.is_floating_point() or out.dtype in _REAL_DTYPES):
        raise RewardError(f"reward {name!r} returned dtype {out.dtype}; return float scores")
    if tuple(out.shape) != (n,):
        hint = (
            " (a [B, 1] tensor: use .squeeze(-1))"
            if tuple(out.shape) == (n, 1)
            else f" ({out.shape[0]} scores for {n} completions: return exactly one per row)"
            if out.dim() == 1
            else ""
        )
        raise RewardError(
            f"reward {name!r} returned shape {tuple(out.shape)}, expected [{n}]{hint}"
        )
    out = out.detach().to(torch.float32)
    bad = [] if allow_nonfinite else torch.nonzero(~torch.isfinite(out)).flatten().tolist()
    if bad:
        values = [out[i].item() for i in bad[:_MAX_ROWS_SHOWN]]
        raise RewardError(
            f"reward {name!r} returned non-finite scores {values} in rows {_rows(bad)}; "
            "return a finite score for every row (e.g. 0.0 for a completion it cannot parse)"
        )
    return out


_REAL_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def check_finite_weight(weight: float, what: str) -> float:
    """``weight`` as a finite float; raises naming ``what`` otherwise."""
    try:
        w = float(weight)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what}: weight {weight!r} is not a number") from err
    if not math.isfinite(w):
        raise ValueError(f"{what}: weight {weight!r} is not finite")
    return w


__all__ = [
    "RewardError",
    "RewardFn",
    "batch_field",
    "bool_rows",
    "call_reward",
    "check_batch",
    "check_finite_weight",
    "named",
    "reward_name",
    "token_lists",
]
