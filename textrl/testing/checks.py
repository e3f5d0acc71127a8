"""Invariant checks that raise :class:`InvariantError` (an ``AssertionError``) naming the output,
the position and the values: masked positions ignored, agreement with a reference, finite under
extreme log-ratios."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor


class InvariantError(AssertionError):
    """An invariant of an estimator or loss does not hold; the message says where and how."""


def _flatten(out: Any, name: str = "output") -> list[tuple[str, Tensor]]:
    """Named tensors of a function's output: a tensor, or (nested) tuples, lists and dicts of them."""
    if isinstance(out, Tensor):
        return [(name, out)]
    if isinstance(out, (tuple, list)):
        return [p for i, o in enumerate(out) for p in _flatten(o, f"{name}[{i}]")]
    if isinstance(out, dict):
        return [p for k, o in out.items() for p in _flatten(o, f"{name}[{k!r}]")]
    return []


def _per_token(x: Tensor, mask: Tensor) -> bool:
    return tuple(x.shape) in (tuple(mask.shape), (*mask.shape, 1))


def _where_valid(x: Tensor, mask: Tensor) -> Tensor:
    """``mask`` shaped like ``x`` (``[B, T]`` or ``[B, T, 1]``)."""
    return mask if x.dim() == mask.dim() else mask.unsqueeze(-1)


def _row_mask(mask: Tensor, row: int) -> str:
    return "".join("1" if v else "0" for v in mask[row].tolist())


def _where(index: tuple[int, ...], mask: Tensor | None) -> str:
    """`` at row r, position t (row mask 1101)``, `` at index [i]``, or nothing for a scalar."""
    if not index:
        return ""
    if mask is None or len(index) < 2:
        return f" at index {list(index)}"
    return f" at row {index[0]}, position {index[1]} (row mask {_row_mask(mask, index[0])})"


def _compare(name: str, got: Tensor, want: Tensor, mask: Tensor | None, rtol: float, atol: float,
             what: str) -> None:
    """Raise InvariantError where ``got`` and ``want`` differ (at ``mask`` for per-token tensors)."""
    if tuple(got.shape) != tuple(want.shape):
        raise InvariantError(f"{name}: shape {tuple(got.shape)} but {what} has {tuple(want.shape)}")
    g, w = got.detach().to(torch.float64), want.detach().to(torch.float64)
    both_nan = g.isnan() & w.isnan()
    same_inf = torch.isinf(g) & (g == w)
    bad = ~((g - w).abs() <= atol + rtol * w.abs()) & ~both_nan & ~same_inf
    if mask is not None and _per_token(g, mask):
        bad &= _where_valid(g, mask)
    if bad.any():
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise InvariantError(
            f"{name} disagrees with {what} at {int(bad.sum())} of {bad.numel()} entries; first"
            f"{_where(idx, mask)}: got {g[idx].item()!r}, {what} {w[idx].item()!r} "
            f"(rtol={rtol}, atol={atol})"
        )


def check_agrees_with_reference(
    fn: Callable[..., Any],
    ref: Callable[..., Any],
    *args: Any,
    mask: Tensor | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **kwargs: Any,
) -> None:
    """``fn(*args, **kwargs)`` equals ``ref(*args, **kwargs)`` up to ``rtol`` / ``atol`` (in float64).

    Outputs may be a tensor or tuples / lists / dicts of tensors, matched in order. With ``mask``
    (bool ``[B, T]``), per-token outputs (``[B, T]`` or ``[B, T, 1]``) are compared only at its
    True positions; other outputs everywhere. NaN matches NaN, inf matches the same inf.

    Raises :class:`InvariantError` naming the output, the first differing row and position, that
    row's mask as 0/1 and both values.
    """
    got, want = _flatten(fn(*args, **kwargs)), _flatten(ref(*args, **kwargs))
    if len(got) != len(want):
        raise InvariantError(f"fn returned {len(got)} tensors, the reference {len(want)}")
    shown = {k: v for k, v in kwargs.items() if not isinstance(v, Tensor)}
    call = f" (called with {shown})" if shown else ""
    for (name, g), (_, w) in zip(got, want):
        _compare(name + call, g, w, mask, rtol, atol, "the reference")


DEFAULT_FILLS = (float("nan"), float("inf"), -float("inf"), 1e30, -12345.0)
"""What :func:`check_masked_positions_ignored` writes into masked positions, one pass each."""


def check_masked_positions_ignored(
    fn: Callable[..., Any],
    *args: Any,
    mask: Tensor,
    zero_outside: bool = False,
    fills: Sequence[float] = DEFAULT_FILLS,
    grad: bool = False,
) -> None:
    """Values at masked positions never change an output at a valid position.

    ``fn(*args)`` is called once as given, then once per value of ``fills`` with the False
    positions of ``mask`` (bool ``[B, T]``) overwritten in every float argument of shape
    ``[B, T]`` or ``[B, T, 1]`` (other arguments, the mask included, pass unchanged). Per-token
    outputs must keep their bits at True positions and other outputs (losses, ``[B]`` scores)
    everywhere. ``zero_outside=True``: per-token outputs must also be exactly 0 at False
    positions (the function promises it). ``grad=True``: the float arguments require grad, the
    outputs' valid entries are summed and back-propagated, and every gradient must be finite and
    0 at False positions (catches ``torch.where`` applied after ``exp`` of garbage).

    Raises :class:`InvariantError` naming the output, the position, the fill and both values.
    """
    if mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(f"mask must be a bool [B, T] tensor, got {mask.dtype} {list(mask.shape)}")
    clean = _flatten(fn(*args))
    if zero_outside:
        _check_zero_outside(clean, mask, "as given")
    for fill in fills:
        dirty_args = [
            torch.where(_where_valid(a, mask), a, torch.tensor(fill, dtype=a.dtype))
            if isinstance(a, Tensor) and a.is_floating_point() and _per_token(a, mask) else a
            for a in args
        ]
        if grad:
            dirty_args = [a.detach().requires_grad_(True) if isinstance(a, Tensor) and a.is_floating_point()
                          else a for a in dirty_args]
        dirty = _flatten(fn(*dirty_args))
        for (name, c), (_, d) in zip(clean, dirty):
            c64, d64 = c.detach().to(torch.float64), d.detach().to(torch.float64)
            same = (c64 == d64) | (c64.isnan() & d64.isnan())
            if _per_token(c, mask):
                same |= ~_where_valid(c, mask)
            if not same.all():
                idx = tuple(int(i) for i in torch.nonzero(~same)[0])
                raise InvariantError(
                    f"{name} changed{_where(idx, mask)} when the masked positions of the inputs "
                    f"were set to {fill}: {c64[idx].item()!r} before, {d64[idx].item()!r} after; the "
                    "function reads masked positions (select with torch.where(mask, x, 0) before any "
                    "arithmetic instead of multiplying by the mask)"
                )
        if zero_outside:
            _check_zero_outside(dirty, mask, f"with masked inputs set to {fill}")
        if grad:
            _check_grad(dirty, dirty_args, mask, fill)


def _check_zero_outside(outputs: list[tuple[str, Tensor]], mask: Tensor, when: str) -> None:
    for name, x in outputs:
        if _per_token(x, mask) and x.is_floating_point():
            bad = ~_where_valid(x, mask) & (x.detach() != 0)
            if bad.any():
                idx = tuple(int(i) for i in torch.nonzero(bad)[0])
                raise InvariantError(
                    f"{name} is {x[idx].item()!r} off the mask{_where(idx, mask)} {when}; "
                    "it must be exactly 0 at masked positions"
                )


def _check_grad(outputs: list[tuple[str, Tensor]], args: list[Any], mask: Tensor, fill: float) -> None:
    total = None
    for _, x in outputs:
        if x.requires_grad:
            part = torch.where(_where_valid(x, mask), x, 0.0).sum() if _per_token(x, mask) else x.sum()
            total = part if total is None else total + part
    if total is None:
        raise ValueError("grad=True but no output of fn requires grad: pass grad=False")
    leaves = [(i, a) for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad]
    grads = torch.autograd.grad(total, [a for _, a in leaves], allow_unused=True)
    for (i, a), g in zip(leaves, grads):
        if g is None:
            continue
        bad = ~torch.isfinite(g) | (~_where_valid(a, mask) & (g != 0)) if _per_token(a, mask) else ~torch.isfinite(g)
        if bad.any():
            idx = tuple(int(k) for k in torch.nonzero(bad)[0])
            raise InvariantError(
                f"the gradient of args[{i}] is {g[idx].item()!r}{_where(idx, mask)} with masked "
                f"inputs set to {fill}; it must be finite, and 0 at masked positions (select before "
                "exp/log: torch.where after them still back-propagates NaN)"
            )


EXTREME_LOG_RATIOS = (-1e4, -1000.0, -100.0, -50.0, -20.0, -1e-6, 0.0, 1e-6, 20.0, 50.0, 100.0, 1000.0, 1e4)
"""``logp - old_logp`` values :func:`check_finite_under_extreme_log_ratios` tries (exp overflows
float32 beyond 88.7 and float64 beyond 709.8)."""


def extreme_log_ratio_inputs(
    log_ratios: Sequence[float] = EXTREME_LOG_RATIOS,
    advantages: Sequence[float] = (-1.0, 0.0, 1.0),
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(logp, old_logp, advantages, mask)`` ``[A, R + 2]``: row ``a`` holds advantage
    ``advantages[a]``, column ``r < R`` log-ratio ``logp - old_logp = log_ratios[r]`` (both
    log-probs <= 0); a masked column in the middle and one at the end hold NaN."""
    a, r = len(advantages), len(log_ratios)
    d = torch.tensor(log_ratios, dtype=torch.float64)
    logp = torch.where(d < 0, -0.5 + d, torch.full_like(d, -0.5))
    old = torch.where(d < 0, torch.full_like(d, -0.5), -0.5 - d)
    half = r // 2
    nan = torch.full((1,), float("nan"), dtype=torch.float64)

    def layout(x: Tensor) -> Tensor:
        return torch.cat([x[:half], nan, x[half:], nan]).expand(a, r + 2).to(dtype).clone()

    mask = torch.ones(a, r + 2, dtype=torch.bool)
    mask[:, half] = False
    mask[:, -1] = False
    adv = torch.tensor(advantages, dtype=dtype).reshape(a, 1).expand(a, r + 2)
    adv = torch.where(mask, adv, torch.tensor(float("nan"), dtype=dtype))
    return layout(logp), layout(old), adv, mask


def check_finite_under_extreme_log_ratios(
    fn: Callable[[Tensor, Tensor, Tensor, Tensor], Any],
    log_ratios: Sequence[float] = EXTREME_LOG_RATIOS,
    advantages: Sequence[float] = (-1.0, 0.0, 1.0),
    dtype: torch.dtype = torch.float32,
    grad: bool = True,
) -> None:
    """``fn(logp, old_logp, advantages, mask)`` stays finite for every log-ratio in ``log_ratios``
    and advantage in ``advantages`` (inputs from :func:`extreme_log_ratio_inputs`, ``[A, R + 2]``
    with NaN at masked positions; a function that needs no advantages ignores them).

    Per-token outputs must be finite at valid positions, other outputs everywhere; with ``grad``
    (``logp`` requires grad), the gradient of the outputs' valid entries with respect to ``logp``
    must be finite everywhere. On failure the check reruns ``fn`` with one valid position at a time
    and names the first (log-ratio, advantage) that breaks it.
    """
    logp, old, adv, mask = extreme_log_ratio_inputs(log_ratios, advantages, dtype)
    problem = _nonfinite(fn, logp, old, adv, mask, grad)
    if problem is None:
        return
    culprit = ""
    for i, j in torch.nonzero(mask).tolist():
        one = torch.zeros_like(mask)
        one[i, j] = True
        alone = _nonfinite(fn, logp, old, adv, one, grad)
        if alone is not None:
            culprit = (f"; with only the position of log-ratio {float(logp[i, j] - old[i, j])!r} and advantage "
                       f"{float(adv[i, j])!r} valid: {alone}")
            break
    raise InvariantError(f"{problem}{culprit}")


def _nonfinite(fn: Callable[..., Any], logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor,
               grad: bool) -> str | None:
    """What is non-finite in ``fn``'s outputs (or the gradient wrt ``logp``), or None."""
    lp = logp.detach().clone().requires_grad_(grad)
    outputs = _flatten(fn(lp, old, adv, mask))
    total = None
    for name, x in outputs:
        if not x.is_floating_point():
            continue
        valid = _where_valid(x, mask) if _per_token(x, mask) else torch.ones_like(x, dtype=torch.bool)
        bad = valid & ~torch.isfinite(x.detach())
        if bad.any():
            idx = tuple(int(i) for i in torch.nonzero(bad)[0])
            return f"{name} is {x.detach()[idx].item()!r}{_where(idx, mask)}"
        if grad and x.requires_grad:
            part = torch.where(valid, x, 0.0).sum()
            total = part if total is None else total + part
    if grad and total is not None:
        (g,) = torch.autograd.grad(total, [lp], allow_unused=True)
        if g is not None and not torch.isfinite(g).all():
            idx = tuple(int(i) for i in torch.nonzero(~torch.isfinite(g))[0])
            return f"the gradient wrt logp is {g[idx].item()!r}{_where(idx, mask)}"
    return None


__all__ = ["DEFAULT_FILLS", "EXTREME_LOG_RATIOS", "InvariantError", "check_agrees_with_reference",
           "check_finite_under_extreme_log_ratios", "check_masked_positions_ignored", "extreme_log_ratio_inputs"]
