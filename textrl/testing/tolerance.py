"""Tolerances from the arithmetic: how far apart two float evaluations of the same quantity may be.

Two computations of the same float32 sum in two orders (another SIMD width, another GEMM blocking,
a reduce-scatter instead of a local sum, one CPU's kernels against another's) round differently.
A sum of ``n`` terms computed in any order is within ``gamma(n - 1) * sum(|x_i|)`` of the exact sum
(``gamma(k) = k u / (1 - k u)``, ``u`` the unit roundoff, half of ``torch.finfo(dtype).eps``), so
two orders are within twice that of each other. The bound is on the *terms'* magnitudes, not the
result's: where the terms cancel (a gradient element near zero) the result's relative error is
unbounded, and a relative tolerance taken from one machine's numbers fails on another's. Where the
terms' magnitudes are not at hand, :func:`assert_close_normwise` compares whole tensors by their norms
(the normwise form of the same bound), which a wrong scale, a missing term or a misplaced block
still fails by orders of magnitude.
"""

from __future__ import annotations

import torch
from torch import Tensor

from textrl.testing.checks import InvariantError


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """``u``: half the gap between 1 and the next float of ``dtype`` (2**-24 for float32)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """``gamma(n) = n u / (1 - n u)``: the relative error bound of ``n`` rounded operations in a row
    (a sum of ``n + 1`` terms, a dot product of length ``n``), in ``dtype``. Raises ``ValueError``
    where ``n u >= 1`` (no bound: use a wider dtype)."""
    if n < 0:
        raise ValueError(f"gamma: n={n} is negative; it counts rounded operations")
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"gamma: n={n} operations in {dtype} give no error bound (n*u >= 1); compute in a wider dtype")
    return nu / (1 - nu)


def sum_tolerance(terms: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """The largest difference between two evaluations, in any two orders, of a sum of ``terms``
    values whose absolute values add up to ``magnitude``: ``2 gamma(terms - 1) magnitude``."""
    if terms < 1:
        raise ValueError(f"sum_tolerance: terms={terms}; a sum has at least one term")
    return 2 * gamma(terms - 1, dtype) * magnitude


def assert_close_normwise(actual: Tensor, expected: Tensor, rtol: float, name: str = "tensor") -> None:
    """``||actual - expected|| <= rtol * ||expected||`` (Frobenius norms, computed in float64), else
    :class:`~textrl.testing.InvariantError` naming ``name``, both norms and the worst element. Shapes
    must match exactly (no broadcasting). An all-zero ``expected`` needs an all-zero ``actual``."""
    if actual.shape != expected.shape:
        raise InvariantError(f"{name}: shape {tuple(actual.shape)} where {tuple(expected.shape)} was expected")
    a, e = actual.detach().double(), expected.detach().double()
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        raise InvariantError(f"{name}: non-finite values (actual {int((~torch.isfinite(a)).sum())}, "
                             f"expected {int((~torch.isfinite(e)).sum())})")
    diff, scale = (a - e).norm().item(), e.norm().item()
    if diff <= rtol * scale:
        return
    worst = int((a - e).abs().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), tuple(e.shape))) if e.dim() else ()
    raise InvariantError(
        f"{name}: ||actual - expected|| = {diff:.3e} > rtol * ||expected|| = {rtol:.3e} * {scale:.3e} "
        f"(relative {diff / scale if scale else float('inf'):.3e}); the largest difference is at {index}: "
        f"{a.reshape(-1)[worst].item():.6e} against {e.reshape(-1)[worst].item():.6e}"
    )
