"""Per-token log-probabilities and entropies from ``[B, T, V]`` logits, chunked over time.

A float32 log-softmax of ``[B, T, V]`` logits is the largest tensor of an RLHF step (B=8,
T=1024, V=150k is 4.9 GB). Both functions walk the sequence in chunks of ``[B, chunk, V]``
and keep only ``[B, T]`` results; their backward passes are written out (custom autograd
functions) and recompute each chunk, so autograd does not hold a float32 copy either.

Computation dtype: float32 for half/bfloat16/float32 logits, float64 for float64 logits (so
``torch.autograd.gradcheck`` applies). Gradients are returned in the dtype of ``logits``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from textrl.functional._validate import check_float, check_positive, check_tensor

DEFAULT_CHUNK_ELEMENTS = 1 << 24
"""Default bound on the elements of one ``[B, chunk, V]`` temporary (64 MiB in float32)."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _check_logits(logits: Tensor, temperature: float, chunk_size: int | None) -> None:
    check_tensor("logits", logits)
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {list(logits.shape)}")
    check_float("logits", logits)
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension V")
    check_positive("temperature", temperature)
    if chunk_size is not None and (
        not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size={chunk_size!r}: must be a positive int or None")


def _chunk(logits: Tensor, chunk_size: int | None) -> int:
    """Time steps per chunk: ``chunk_size`` or as many as fit in ``DEFAULT_CHUNK_ELEMENTS``."""
    b, _, v = logits.shape
    if chunk_size is not None:
        return chunk_size
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(1, b * v))


class _TokenLogProb(torch.autograd.Function):
    """log p(token) = z[token] - logsumexp(z), z = logits / t; d/dlogits = (onehot - p) / t."""

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, chunk: int) -> Tensor:  # type: ignore[override]
        b, t, _ = logits.shape
        cdt = _compute_dtype(logits.dtype)
        out = torch.empty(b, t, dtype=cdt, device=logits.device)
        lse = torch.empty(b, t, dtype=cdt, device=logits.device)
        for s in range(0, t, chunk):
            z = logits[:, s : s + chunk].to(cdt) / temperature  # [B, c, V]
            lse_c = torch.logsumexp(z, dim=-1)  # [B, c]
            picked = z.gather(-1, tokens[:, s : s + chunk].unsqueeze(-1)).squeeze(-1)  # [B, c]
            out[:, s : s + chunk] = picked - lse_c
            lse[:, s : s + chunk] = lse_c
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature = temperature
        ctx.chunk = chunk
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        logits, tokens, lse = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        cdt = lse.dtype
        grad_logits = torch.empty_like(logits)
        for s in range(0, logits.shape[1], chunk):
            z = logits[:, s : s + chunk].to(cdt) / temperature  # [B, c, V]
            g = -torch.exp(z - lse[:, s : s + chunk].unsqueeze(-1))  # -softmax, [B, c, V]
            g.scatter_add_(-1, tokens[:, s : s + chunk].unsqueeze(-1), torch.ones_like(g[..., :1]))
            g.mul_(grad_out[:, s : s + chunk].to(cdt).unsqueeze(-1) / temperature)
            grad_logits[:, s : s + chunk] = g.to(logits.dtype)
        return grad_logits, None, None, None


class _Entropy(torch.autograd.Function):
    """H = logsumexp(z) - sum(p * z) = -sum(p * log p), z = logits / t; dH/dlogits = -p (log p + H) / t."""

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk: int) -> Tensor:  # type: ignore[override]
        b, t, _ = logits.shape
        cdt = _compute_dtype(logits.dtype)
        ent = torch.empty(b, t, dtype=cdt, device=logits.device)
        lse = torch.empty(b, t, dtype=cdt, device=logits.device)
        for s in range(0, t, chunk):
            z = logits[:, s : s + chunk].to(cdt) / temperature  # [B, c, V]
            lse_c = torch.logsumexp(z, dim=-1)  # [B, c]
            logp = z - lse_c.unsqueeze(-1)
            p = torch.exp(logp)
            # -sum(p * log p) equals lse - sum(p * z) without its cancellation when one token
            # dominates; p == 0 where z == -inf (banned tokens): 0 * -inf is NaN, the limit 0.
            plogp = torch.where(p > 0, p * logp, torch.zeros((), dtype=cdt, device=z.device))
            ent[:, s : s + chunk] = -plogp.sum(-1)
            lse[:, s : s + chunk] = lse_c
        ctx.save_for_backward(logits, lse, ent)
        ctx.temperature = temperature
        ctx.chunk = chunk
        return ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        logits, lse, ent = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        cdt = lse.dtype
        grad_logits = torch.empty_like(logits)
        for s in range(0, logits.shape[1], chunk):
            z = logits[:, s : s + chunk].to(cdt) / temperature  # [B, c, V]
            logp = z - lse[:, s : s + chunk].unsqueeze(-1)
            p = torch.exp(logp)
            g = -p * (logp + ent[:, s : s + chunk].unsqueeze(-1))
            g = torch.where(p > 0, g, torch.zeros((), dtype=cdt, device=z.device))
            g.mul_(grad_out[:, s : s + chunk].to(cdt).unsqueeze(-1) / temperature)
            grad_logits[:, s : s + chunk] = g.to(logits.dtype)
        return grad_logits, None, None


def logprobs_from_logits(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> Tensor:
    """Log-probability of each token under ``softmax(logits / temperature)``.

    logits: float ``[B, T, V]`` (any float dtype), where ``logits[:, i]`` scores ``tokens[:, i]``
    (already shifted); tokens: int64 ``[B, T]`` in ``[0, V)``; temperature > 0 (use the sampling
    temperature so log-probs match the behaviour policy).
    Returns float32 ``[B, T]`` (float64 for float64 logits):
    ``logits.gather(tokens) / t - logsumexp(logits / t)``, equal to
    ``log_softmax(logits / t).gather(-1, tokens)``.
    Computed over ``[B, chunk_size, V]`` slices of time; ``chunk_size=None`` picks the largest
    chunk whose temporary holds at most ``DEFAULT_CHUNK_ELEMENTS`` elements. Differentiable
    w.r.t. ``logits`` (first order), with the same gradient as the naive path.
    Source: TRL ``selective_log_softmax`` / verl ``logprobs_from_logits`` (logsumexp form).
    """
    _check_logits(logits, temperature, chunk_size)
    check_tensor("tokens", tokens)
    b, t, v = logits.shape
    if tokens.shape != (b, t):
        raise ValueError(
            f"tokens must be [B, T] = {[b, t]} matching logits [B, T, V] = {[b, t, v]}, "
            f"got shape {list(tokens.shape)}"
        )
    if tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be an int64 tensor of token ids, got dtype {tokens.dtype}")
    if tokens.numel() > 0:
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= v:
            raise ValueError(f"tokens must lie in [0, V={v}), got values in [{lo}, {hi}]")
    return _TokenLogProb.apply(logits, tokens, float(temperature), _chunk(logits, chunk_size))


def entropy_from_logits(
    logits: Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` at each position.

    logits: float ``[B, T, V]`` (any float dtype); temperature > 0.
    Returns float32 ``[B, T]`` (float64 for float64 logits):
    ``H = logsumexp(z) - sum(softmax(z) * z)`` with ``z = logits / t``, evaluated as
    ``-sum(p * (z - logsumexp(z)))`` (same value, no cancellation when one token dominates;
    tokens with ``z = -inf`` contribute 0). Chunked over time like ``logprobs_from_logits``; differentiable
    w.r.t. ``logits`` (first order).
    Source: verl ``entropy_from_logits``; TRL ``entropy_from_logits``.
    """
    _check_logits(logits, temperature, chunk_size)
    return _Entropy.apply(logits, float(temperature), _chunk(logits, chunk_size))
