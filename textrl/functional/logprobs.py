"""Per-token log-probabilities and entropies from ``[B, T, V]`` logits, chunked over time.

A float32 log-softmax of ``[B, T, V]`` logits is the largest tensor of an RLHF step (B=8,
T=1024, V=150k is 4.9 GB). Both functions walk the sequence in chunks of ``[B, chunk, V]``
and keep only ``[B, T]`` results; their backward passes are written out (custom autograd
functions) and recompute each chunk, so autograd does not hold a float32 copy either.

Computation dtype: float32 for half/bfloat16/float32 logits, float64 for float64 logits (so
``torch.autograd.gradcheck`` applies). Gradients are returned in the dtype of ``logits``.

Even chunked, the ``[B, T, V]`` logits themselves (and their gradient) stay whole.
:func:`logprobs_from_hidden` starts one step earlier, from the final hidden states and the LM
head's weight: it computes each chunk's logits itself, in forward and again in backward, so no
tensor the size of positions x vocabulary exists at any time (a fused linear log-softmax).
"""

from __future__ import annotations

import torch
from torch import Tensor

from textrl.functional._validate import check_float, check_positive, check_probability, check_tensor

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


# -- from hidden states: the LM head fused in, chunked over positions -----------------------------

ENTROPY_MODES = ("none", "detached", "grad")
"""``entropy=`` of :func:`logprobs_from_hidden`: not computed, computed without grad, with grad."""


def _check_hidden_inputs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, temperature: float,
    top_k: int, top_p: float, chunk_size: int | None, entropy: str,
) -> None:
    check_tensor("hidden", hidden)
    check_tensor("weight", weight)
    check_tensor("tokens", tokens)
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [N, H] or [B, T, H], got shape {list(hidden.shape)}")
    check_float("hidden", hidden)
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H] (an nn.Linear's weight), got shape {list(weight.shape)}")
    check_float("weight", weight)
    v, h = weight.shape
    if v == 0:
        raise ValueError("weight must have a non-empty vocabulary dimension V (weight is [V, H])")
    if hidden.shape[-1] != h:
        raise ValueError(f"hidden's last dimension H={hidden.shape[-1]} must equal weight [V, H] = {[v, h]}'s H")
    if bias is not None:
        check_tensor("bias", bias)
        check_float("bias", bias)
        if bias.shape != (v,):
            raise ValueError(f"bias must be [V] = {[v]} matching weight [V, H] = {[v, h]}, got shape "
                             f"{list(bias.shape)}")
    if tokens.shape != hidden.shape[:-1]:
        lead = "[N]" if hidden.dim() == 2 else "[B, T]"
        raise ValueError(f"tokens must be {lead} = {list(hidden.shape[:-1])} matching hidden "
                         f"{lead[:-1]}, H] = {list(hidden.shape)}, got shape {list(tokens.shape)}")
    if tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be an int64 tensor of token ids, got dtype {tokens.dtype}")
    for name, x in (("weight", weight), ("bias", bias), ("tokens", tokens)):
        if x is not None and x.device != hidden.device:
            raise ValueError(f"{name} is on {x.device} but hidden on {hidden.device}: put them on one device")
    if tokens.numel() > 0:
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= v:
            raise ValueError(f"tokens must lie in [0, V={v}), got values in [{lo}, {hi}]")
    check_positive("temperature", temperature)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k={top_k!r}: must be an int >= 0 (0 keeps every token)")
    check_probability("top_p", top_p)
    if chunk_size is not None and (
        not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size={chunk_size!r}: must be a positive int or None")
    if entropy not in ENTROPY_MODES:
        raise ValueError(f"entropy={entropy!r}: must be one of {ENTROPY_MODES}")


def _matmul_dtype(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight, bias)`` computes in here and now: the autocast dtype under
    an autocast of ``hidden``'s device (which leaves float64 alone), else the inputs' one dtype."""
    inputs = [x for x in (hidden, weight, bias) if x is not None]
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind) and all(x.dtype != torch.float64 for x in inputs):
        return torch.get_autocast_dtype(kind)
    dtypes = {x.dtype for x in inputs}
    if len(dtypes) != 1:
        raise ValueError(f"hidden, weight and bias must share one dtype outside autocast (as nn.Linear needs), "
                         f"got {', '.join(str(x.dtype) for x in inputs)}")
    return hidden.dtype


def sampling_filter(z: Tensor, top_k: int, top_p: float) -> Tensor:
    """The sampling distribution's logits from tempered ones (generation engines draw from it, the
    log-probs are of it). ``z`` ``[..., V]`` (logits already divided by the temperature) with the entries top-k, then
    top-p drop set to ``-inf``: HF generate's order and rule (ties with the k-th value stay; top-p
    keeps the smallest set of largest entries whose mass exceeds ``top_p``, at least one)."""
    if top_k > 0:
        kth = torch.topk(z, min(top_k, z.shape[-1]), dim=-1).values[..., -1:]  # [c, 1]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, descending=False, dim=-1)
        remove_sorted = sorted_z.softmax(-1).cumsum(-1) <= (1 - top_p)
        remove_sorted[..., -1:] = False
        z = z.masked_fill(remove_sorted.scatter(-1, order, remove_sorted), float("-inf"))
    return z


def _filters(top_k: int, top_p: float) -> bool:
    return top_k > 0 or top_p < 1.0


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight.T + bias`` with autocast off (the caller cast to the matmul dtype)."""
    with torch.autocast(x.device.type, enabled=False):
        return torch.nn.functional.linear(x, weight, bias)


def _scaled_logits(h: Tensor, w: Tensor, b: Tensor | None, cdt: torch.dtype, temperature: float) -> Tensor:
    """``z = (h @ w.T + b) / t`` ``[c, V]`` in the compute dtype: a new tensor, free to modify in place."""
    z = _linear(h, w, b)
    return (z if z.dtype == cdt else z.to(cdt)).div_(temperature)


class _LinearLogProb(torch.autograd.Function):
    """``(log p(token), H)`` of ``warp(z)``, ``z = (hidden @ weight.T + bias) / t``, over chunks of positions.

    The forward keeps per position only the log-normaliser of the sampling distribution (warped)
    and of the plain one and ``H``; the backward recomputes each chunk's logits and turns
    ``d/dz`` (``onehot - q`` for the log-prob, ``q`` the warped softmax; ``-p (log p + H)`` for the
    entropy) times ``1 / t`` into the gradients of hidden, weight and bias. The ``[c, V]``
    temporaries are updated in place: about three live at a time (more while top-p sorts).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor,  # type: ignore[override]
                temperature: float, top_k: int, top_p: float, chunk: int, entropy: str, mm_dtype: torch.dtype):
        n, device = hidden.shape[0], hidden.device
        cdt = _compute_dtype(mm_dtype)
        w, b = weight.to(mm_dtype), None if bias is None else bias.to(mm_dtype)  # cast once, not per chunk
        want_entropy, filtered = entropy != "none", _filters(top_k, top_p)
        logp = torch.empty(n, dtype=cdt, device=device)
        lse_sampled = torch.empty(n, dtype=cdt, device=device)  # [N] of the warped distribution
        lse = torch.empty(n if want_entropy else 0, dtype=cdt, device=device)  # [N] of the plain one
        ent = torch.empty(n if want_entropy else 0, dtype=cdt, device=device)
        for s in range(0, n, chunk):
            z = _scaled_logits(hidden[s : s + chunk].to(mm_dtype), w, b, cdt, temperature)  # [c, V]
            tok = tokens[s : s + chunk, None]  # [c, 1]
            zs = sampling_filter(z, top_k, top_p) if filtered else z
            lse_s = torch.logsumexp(zs, dim=-1)  # [c]
            logp[s : s + chunk] = zs.gather(-1, tok).squeeze(-1) - lse_s
            lse_sampled[s : s + chunk] = lse_s
            del zs
            if want_entropy:
                lse_c = torch.logsumexp(z, dim=-1) if filtered else lse_s
                logp_all = z.sub_(lse_c[:, None])  # z's memory from here on
                p = torch.exp(logp_all)
                plogp = logp_all.mul_(p).masked_fill_(p == 0, 0.0)  # p == 0 where z == -inf: 0, not NaN
                ent[s : s + chunk] = -plogp.sum(-1)
                lse[s : s + chunk] = lse_c
                del p, plogp, logp_all
            del z
        ctx.save_for_backward(hidden, weight, bias, tokens, lse_sampled, lse, ent)
        ctx.config = (temperature, top_k, top_p, chunk, mm_dtype)
        ctx.set_materialize_grads(False)
        if entropy == "detached":
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp: Tensor | None, grad_ent: Tensor | None):  # type: ignore[override]
        hidden, weight, bias, tokens, lse_sampled, lse, ent = ctx.saved_tensors
        temperature, top_k, top_p, chunk, mm_dtype = ctx.config
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        rest = (None,) * 7  # tokens and the settings
        if grad_ent is not None and ent.numel() == 0:
            grad_ent = None
        if grad_logp is None and grad_ent is None:
            return (None, None, None, *rest)
        cdt, filtered, device = lse_sampled.dtype, _filters(top_k, top_p), hidden.device
        w, b = weight.to(mm_dtype), None if bias is None else bias.to(mm_dtype)
        acc = _compute_dtype(weight.dtype)  # float32 accumulators of the weight's and bias's grads
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=device) if need_b else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk].to(mm_dtype)  # [c, H]
            z = _scaled_logits(h, w, b, cdt, temperature)  # [c, V]
            g = None  # d loss / d z, [c, V]
            if grad_logp is not None:
                g_lp = grad_logp[s : s + chunk].to(cdt)[:, None]  # [c, 1]
                tok = tokens[s : s + chunk, None]  # [c, 1]
                zs = sampling_filter(z, top_k, top_p) if filtered else z
                g = torch.sub(zs, lse_sampled[s : s + chunk, None]).exp_().mul_(-g_lp)  # -q g: 0 where filtered
                # +g at the token, unless the filters dropped it (its -inf has no gradient)
                plus = torch.where(torch.isfinite(zs.gather(-1, tok)), g_lp, 0.0) if filtered else g_lp
                g.scatter_add_(-1, tok, plus)
                del zs
            if grad_ent is not None:
                logp_all = z.sub_(lse[s : s + chunk, None])  # z's memory from here on
                p = torch.exp(logp_all)
                dh = logp_all.add_(ent[s : s + chunk, None]).mul_(p).masked_fill_(p == 0, 0.0)  # -dH/dz
                del p
                g_ent = -grad_ent[s : s + chunk].to(cdt)[:, None]
                g = dh.mul_(g_ent) if g is None else g.addcmul_(dh, g_ent)
                del dh, logp_all
            del z
            g.div_(temperature)  # d z / d logits
            if need_b:
                grad_b.add_(g.sum(0))
            g = g.to(mm_dtype)
            if need_h:
                grad_h[s : s + chunk] = (g @ w).to(hidden.dtype)
            if need_w:
                if grad_w.dtype == mm_dtype:
                    grad_w.addmm_(g.T, h)
                else:  # a half-precision matmul, accumulated in float32
                    grad_w.add_(g.T @ h)
            del g
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return (grad_h, grad_w, grad_b, *rest)


def logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk_size: int | None = None,
    entropy: str = "none",
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of ``tokens`` from the final hidden states and the LM head, never
    holding more than one chunk of the logits: a fused (chunked) linear log-softmax.

    hidden: float ``[N, H]`` or ``[B, T, H]``, where position ``i``'s output scores ``tokens[i]``
    (already shifted); weight: ``[V, H]`` (the LM head's ``nn.Linear.weight``); bias: ``[V]`` or
    None; tokens: int64 ``[N]`` or ``[B, T]`` in ``[0, V)``.
    Returns ``(logp, entropy)``, each float32 ``[N]`` / ``[B, T]`` (float64 for float64 inputs):

    - ``logp``: the log-probability of each token under the sampling distribution: the logits
      ``hidden @ weight.T + bias`` divided by ``temperature``, then top-k (``top_k=0``: off), then
      top-p (``top_p=1``: off) set the entries they drop to ``-inf`` (HF generate's order), then a
      log-softmax; a token the filters drop gets ``-inf`` (and no gradient of its own).
    - ``entropy``: ``"detached"`` (no grad) or ``"grad"``: the entropy of
      ``softmax(logits / temperature)``, without top-k / top-p (as :func:`entropy_from_logits`);
      ``"none"``: not computed, None.

    Values and gradients (w.r.t. hidden, weight and bias; first order) are those of
    ``logits = F.linear(hidden, weight, bias)`` followed by :func:`logprobs_from_logits` (after
    the warping) and :func:`entropy_from_logits`, up to rounding, under ``torch.autocast`` too:
    the matmul runs in the autocast dtype as the LM head's would, the softmax in float32.
    Positions are walked in chunks of ``chunk_size`` (None: as many as keep ``[chunk, V]`` within
    ``DEFAULT_CHUNK_ELEMENTS``). Forward and backward each hold one chunk's logits and their
    temporaries at a time; autograd keeps ``hidden`` and a few ``[N]`` tensors. The backward
    recomputes each chunk's logits (one more matmul than the unfused path) and accumulates the
    weight's and bias's gradients in float32.
    Source: Liger-Kernel's fused linear cross-entropy; verl's ``FusedLinearForPPO``.
    """
    _check_hidden_inputs(hidden, weight, bias, tokens, temperature, top_k, top_p, chunk_size, entropy)
    mm_dtype = _matmul_dtype(hidden, weight, bias)
    chunk = chunk_size if chunk_size is not None else max(1, DEFAULT_CHUNK_ELEMENTS // weight.shape[0])
    flat = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    logp, ent = _LinearLogProb.apply(flat, weight, bias, tokens.reshape(-1), float(temperature), int(top_k),
                                     float(top_p), chunk, entropy, mm_dtype)
    lead = hidden.shape[:-1]
    return logp.view(lead), (None if entropy == "none" else ent.view(lead))
