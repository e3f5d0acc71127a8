"""Masked reductions over ``[B, T]`` tensors, the response mask, and gapped masks.

Masks are bool and masked positions may hold anything, NaN and inf included: every function
selects with ``torch.where(mask, x, 0)`` instead of multiplying, so garbage never leaks
(``nan * 0`` is ``nan``).

A mask may have gaps: in a multi-turn episode the agent's tokens are interrupted by the
environment's observation tokens (docs/design.md, "Multi-turn episodes"). :func:`compaction_index`,
:func:`compact` and :func:`uncompact` move each row's True positions to the left (in order) and
back, so that math over "the agent's tokens in order" runs on a prefix mask; for a prefix mask
they are the identity.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from textrl.functional._validate import check_2d, check_float, check_mask, check_tensor


def _check_x_mask(x: Tensor, mask: Tensor) -> None:
    check_tensor("x", x)
    check_float("x", x)
    check_mask("mask", mask, "x", x)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over the True positions of ``mask``.

    x: float, any shape (usually ``[B, T]``); mask: bool, same shape.
    Returns ``[]`` for ``dim=None``, else ``x`` with ``dim`` reduced (``[B]`` for ``dim=1``).
    An empty mask sums to 0. Masked positions are selected away, never multiplied.
    Source: TRL ``trl/core.py::masked_mean`` numerator, with select instead of multiply.
    """
    _check_x_mask(x, mask)
    selected = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the True positions of ``mask``.

    x: float, any shape (usually ``[B, T]``); mask: bool, same shape.
    Returns ``[]`` for ``dim=None``, else ``x`` with ``dim`` reduced (``[B]`` for ``dim=1``).
    The mean over an empty mask (or an empty row with ``dim``) is defined as 0, not NaN, so a
    fully padded row contributes a finite 0 instead of poisoning a loss.
    Source: TRL ``trl/core.py::masked_mean`` (sum(x * mask) / sum(mask)), selecting instead.
    """
    _check_x_mask(x, mask)
    total = masked_sum(x, mask, dim=dim)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all True positions of ``mask`` -> ``[]``.

    x: float, any shape; mask: bool, same shape. ``unbiased`` divides by ``n - 1`` (Bessel),
    else by ``n``. With fewer than 2 valid elements the result is 0 (TRL raises or warns there;
    a 0 keeps whitening finite).
    Source: TRL ``trl/core.py::masked_var``.
    """
    _check_x_mask(x, mask)
    n = mask.sum()
    mean = masked_mean(x, mask)
    centered = torch.where(mask, x - mean, torch.zeros((), dtype=x.dtype, device=x.device))
    sq = (centered * centered).sum()
    denom = (n - 1) if unbiased else n
    var = sq / denom.clamp(min=1).to(sq.dtype)
    return torch.where(n >= 2, var, torch.zeros_like(var))


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``x`` to mean 0 and std 1 over the True positions of ``mask``.

    x: float, any shape (usually ``[B, T]``); mask: bool, same shape -> same shape as ``x``.
    Output ``(x - mean) / sqrt(var + eps)`` with the (unbiased) mean and variance taken over the
    whole mask; with ``shift_mean=False`` the mean is added back, as TRL does for rewards.
    Masked positions are exactly 0. One valid token or an empty mask gives a finite output
    (variance 0, so every valid value becomes 0, or the mean when ``shift_mean=False``).
    Source: TRL ``trl/core.py::masked_whiten``.
    """
    _check_x_mask(x, mask)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros((), dtype=whitened.dtype, device=x.device))


def _check_bool_2d(name: str, mask: Tensor) -> None:
    check_2d(name, mask)
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor, got dtype {mask.dtype}; pass {name}.bool()")


def compaction_index(mask: Tensor) -> Tensor:
    """Where each position goes when each row's True positions move left: int64 ``[B, T]``.

    mask: bool ``[B, T]``, gaps allowed. Row ``b`` of the result is a permutation of
    ``range(T)``: the k-th True of the row goes to ``k``, the k-th False to ``n_b + k`` with
    ``n_b = mask[b].sum()``. For a prefix mask it is ``arange(T)`` in every row.
    """
    _check_bool_2d("mask", mask)
    m = mask.long()
    n = m.sum(dim=1, keepdim=True)  # (B, 1)
    true_rank = m.cumsum(dim=1) - 1  # (B, T)
    false_rank = (1 - m).cumsum(dim=1) - 1  # (B, T)
    return torch.where(mask, true_rank, n + false_rank)


def compact(x: Tensor, index: Tensor) -> Tensor:
    """``x`` ``[B, T]`` with each row permuted by ``index`` (:func:`compaction_index`) -> ``[B, T]``.

    ``out[b, index[b, t]] = x[b, t]``: a row's True positions come first, in order, then its
    False positions (whatever they hold). The prefix mask of the result is
    ``arange(T) < mask.sum(1, keepdim=True)``.
    """
    check_2d("x", x)
    return torch.empty_like(x).scatter_(1, index, x)


def uncompact(y: Tensor, index: Tensor) -> Tensor:
    """The inverse of :func:`compact`: ``out[b, t] = y[b, index[b, t]]``. ``[B, T] -> [B, T]``."""
    check_2d("y", y)
    return y.gather(1, index)


def last_true_index(mask: Tensor) -> Tensor:
    """Position of each row's last True: int64 ``[B]``, -1 for a row without one.

    mask: bool ``[B, T]``, gaps allowed; for a prefix mask this is ``mask.sum(1) - 1``.
    """
    _check_bool_2d("mask", mask)
    b, t = mask.shape
    if t == 0:
        return torch.full((b,), -1, dtype=torch.long, device=mask.device)
    positions = torch.arange(t, device=mask.device)
    return torch.where(mask, positions, -1).amax(dim=1)


def response_mask(
    tokens: Tensor, eos_token_id: int | Sequence[int], pad_token_id: int | None = None
) -> Tensor:
    """Bool ``[B, T]`` mask of the valid tokens of right-padded generated responses.

    tokens: int ``[B, T]``; eos_token_id: one id or a non-empty list of ids (any of them ends
    a response); pad_token_id: optional. The result is always a prefix mask (Trues then Falses):

    * a row containing an EOS is valid up to and **including** its first EOS, padding after;
      this also holds when ``pad_token_id`` is one of the EOS ids (the first EOS is kept,
      later EOS/pad tokens are padding);
    * a row with no EOS (truncated at ``T``) is valid up to and including its last token that
      is not ``pad_token_id`` when ``pad_token_id`` is given and is not an EOS id (so a row of
      only pads is all False); otherwise it is all True.

    Source: docs/design.md, "The rollout TensorDict" (EOS is an action, inside the mask); TRL ``PPOTrainer`` truncation
    (``first_true_indices(tokens == eos) + 1``).
    """
    check_2d("tokens", tokens)
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be an integer tensor of token ids, got dtype {tokens.dtype}")
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not eos_ids or not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_ids):
        raise ValueError(
            f"eos_token_id={eos_token_id!r}: must be an int or a non-empty list of ints"
        )
    if pad_token_id is not None and (
        not isinstance(pad_token_id, int) or isinstance(pad_token_id, bool)
    ):
        raise ValueError(f"pad_token_id={pad_token_id!r}: must be an int or None")

    _, t = tokens.shape
    positions = torch.arange(t, device=tokens.device)
    is_eos = torch.isin(tokens, torch.tensor(eos_ids, dtype=tokens.dtype, device=tokens.device))
    has_eos = is_eos.any(dim=1)
    first_eos = is_eos.int().argmax(dim=1)  # [B]; 0 for rows without EOS, masked below

    if pad_token_id is not None and pad_token_id not in eos_ids:
        not_pad = tokens != pad_token_id  # [B, T]
        last_not_pad = torch.where(not_pad, positions, -1).amax(dim=1) if t > 0 else first_eos
        no_eos_length = last_not_pad + 1
    else:
        no_eos_length = torch.full_like(first_eos, t)
    length = torch.where(has_eos, first_eos + 1, no_eos_length)  # [B]
    return positions.unsqueeze(0) < length.unsqueeze(1)
