"""Tolerances of the suite's comparisons between two computations of one float32 result (two
kernels, two orders, two shapes of batch), from the arithmetic (:mod:`textrl.testing.tolerance`),
not from the numbers one CPU gave.

Two paths to the same result (a kept forward and a fresh one, micro-batches and the whole batch,
a fused log-softmax and the logits', a padded batch and a row alone, ZeRO-3's partitioned linear
layers and torch's) sum the same terms in another order, over buffers each CPU's kernels block by
their own SIMD width. A float32 sum of ``n`` terms in two orders differs by up to ``2 gamma(n - 1)``
times the sum of the terms' magnitudes, not of the result: where the terms cancel (a gradient
element, a score, a loss at ratio 1, an advantage whose values telescope) a tolerance relative to
the result, or an absolute one read off one machine, does not bound the difference. So:

- a model's outputs and gradients are compared by each tensor's norm (:func:`model_rtol`,
  :func:`textrl.testing.assert_close_normwise`, :func:`assert_gradients_close`);
- a small computation whose terms are at hand, element by element against the sum of its terms'
  magnitudes (:func:`log_softmax_bounds`, :func:`head_tolerance`, :func:`gae_tolerance`, checked by
  :func:`assert_within`).

A wrong scale, a missing micro-batch or a gradient on the wrong shard is off by 1e-3 (a scale of
1.001) to 1e-1 or more, against the 6e-5 of the tiny models' :func:`model_rtol`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from textrl.keys import KEYS
from textrl.testing import gamma, sum_tolerance, unit_roundoff


def model_rtol(config, tokens: int = 0) -> float:
    """The normwise relative tolerance between two computations, in two orders, of a model's
    outputs or gradients: ``2 gamma(n - 1)``, ``n`` the longest sum of a forward and backward (the
    batch's ``tokens``, the vocabulary's softmax, the hidden or the MLP width). 6.1e-5 for the tiny
    Llama (vocabulary 512) over a few hundred tokens; observed: 1e-7 to 1e-6 relative (a kept
    forward, micro-batches, the fused head, padded batches), 5e-7 after six ZeRO-3 steps."""
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    inner = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    return 2 * gamma(max(tokens, config.vocab_size, hidden, inner) - 1)


def rollout_rtol(config, td) -> float:
    """:func:`model_rtol` over a rollout's tokens (its prompts' and its actions' positions)."""
    return model_rtol(config, td.get(KEYS.prompt_tokens).numel() + td.get(KEYS.action).numel())


def log_softmax_bounds(logits: Tensor, temperature: float = 1.0, logit_error: Tensor | float = 0.0):
    """How far apart two float32 computations of ``log_softmax(logits / T)`` over the last dimension
    (``V`` terms, another order or chunking, another kernel) and of its entropy may be, position by
    position: ``(eps_p, entropy_tol)``, float64 ``[..., 1]``. ``logit_error``: how far apart the
    two sides' ``logits / T`` themselves may be (0 where both read the same logits).

    ``eps_p`` bounds a log-prob's difference, and a probability's relative one: the logits' error
    (it moves ``z_i`` and the log-sum-exp), plus, on each side, the log-sum-exp's sum of ``V``
    positive terms (``gamma(V - 1)`` relatively, so absolutely in its log) and the roundings of
    ``z / T``, of the shift by the row's max (up to ``2 max |z| / T``), of ``log`` and of the final
    subtraction (``u`` times ``6 max |z| / T + 2 log V``, and ``3 u`` for ``exp`` and the rest: a
    probability far in the tail, ``exp(-90)``, is off by ``u`` times its exponent relatively).
    ``entropy_tol`` bounds ``-sum p log p``: ``eps_p`` relatively in each ``p`` and absolutely in
    each ``log p`` (twice, for the margin), plus its own sum of ``V`` terms of up to
    ``max |z| / T + 1`` each (computed as ``lse - sum p z / T`` it cancels that far)."""
    u = unit_roundoff()
    z = logits.detach().double() / temperature
    v = z.shape[-1]
    zmax = torch.where(torch.isfinite(z), z.abs(), 0.0).amax(-1, keepdim=True)
    eps_p = 2 * logit_error + 2 * (gamma(max(v - 1, 0)) + u * (6 * zmax + 2 * math.log(v) + 3))
    p = torch.softmax(z, -1)
    entropy = -(p * torch.where(p > 0, torch.log_softmax(z, -1), 0.0)).sum(-1, keepdim=True)
    return eps_p, 2 * eps_p * (entropy + 1) + sum_tolerance(v, 1.0) * (zmax + 1)


def assert_within(got: Tensor, want: Tensor, tol: Tensor | float, name: str) -> None:
    """``|got - want| <= tol`` elementwise (equal infinities pass), else an AssertionError naming
    ``name``, the worst element and its tolerance. Below float32's normal range relative bounds do
    not hold (gradual underflow): values there may be up to the smallest normal number apart."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} where {tuple(want.shape)} was expected"
    tol = torch.as_tensor(tol, dtype=torch.float64).expand(got.shape) + torch.finfo(torch.float32).tiny
    a, b = got.detach().double(), want.detach().double()
    excess = torch.where(a == b, -1.0, (a - b).abs() - tol)  # a == b: the same infinity, exact zeros
    if bool((excess > 0).any()):
        i = int(excess.argmax())
        raise AssertionError(f"{name}: {a.reshape(-1)[i].item():.9g} against {b.reshape(-1)[i].item():.9g} at "
                             f"{i} (flat) differs by more than its tolerance {tol.reshape(-1)[i].item():.3e}")


def head_tolerance(hidden: Tensor, weight: Tensor, rtol: float) -> Tensor:
    """How far apart two computations of ``hidden @ weight.T`` (a score or value head, ``[..., H]``
    by ``[K, H]``) may be when the hidden states carry the model's relative error ``rtol`` (each
    component, relative to its size) and the dot product sums its ``H`` products in another order:
    ``(rtol + 2 gamma(H)) |hidden| @ |weight|.T``. A score is a sum that cancels (terms of 0.8 for a
    score of 0.02): a tolerance relative to the score itself does not bound it, this one does."""
    h = hidden.detach().double()
    return (rtol + sum_tolerance(h.shape[-1] + 1, 1.0)) * (h.abs() @ weight.detach().double().abs().T)


def gae_tolerance(rewards: Tensor, values: Tensor, mask: Tensor, discount: float, lam: float,
                  dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """``(advantage tol, return tol)``, float64 ``[B, T]``: how far apart two computations of GAE
    in ``dtype`` (a loop, a blocked scan, TorchRL's) may be, over each row's valid tokens (gaps
    skipped, as :func:`textrl.functional.gae` does), ``discount`` the GAE's gamma.
    ``A_t = sum_k (gamma lam)^k delta_{t+k}``, with
    ``delta = r + gamma V' - V``: a sum of up to ``T`` such terms, each a few roundings (and the
    discount's powers, up to ``T`` products), so two orders differ by at most ``2 gamma(4 T)``
    times ``M_t = sum_k (gamma lam)^k (|r| + gamma |V'| + |V|)_{t+k}``. With ``gamma = lam = 1`` the
    values telescope: ``M`` grows with the row while ``A`` does not (``A_0 = score - V_0``), which
    no tolerance relative to ``A`` bounds. The return ``A + V`` adds ``|V|`` to ``M``."""
    r, v = rewards.detach().double().abs(), values.detach().double().abs()
    adv_m = torch.zeros_like(r)
    for i in range(r.shape[0]):
        idx = torch.nonzero(mask[i]).flatten().tolist()
        running, v_next = 0.0, 0.0
        for t in reversed(idx):
            running = float(r[i, t]) + discount * v_next + float(v[i, t]) + discount * lam * running
            adv_m[i, t], v_next = running, float(v[i, t])
    n = 4 * max(int(mask.shape[-1]), 1)
    adv_tol = sum_tolerance(n, 1.0, dtype) * adv_m
    return adv_tol, sum_tolerance(n, 1.0, dtype) * (adv_m + torch.where(mask, v, 0.0))


def assert_gradients_close(got: dict[str, Tensor], want: dict[str, Tensor], rtol: float, what: str = "") -> None:
    """Each gradient of ``got`` within ``rtol`` of ``want``'s by norm (tensor by tensor, as
    :func:`textrl.testing.assert_close_normwise` compares), against the larger of the tensor's
    norm and what the model's average gradient element gives a tensor of its size. A tensor whose
    gradient cancels as a whole (a query projection's over a single attended key: 0, computed as
    float noise of 1e-9) is float noise relative to itself: the noise is bounded by its terms, which
    are no larger than the model's, not by the result. Same keys, ``None`` where ``want`` is."""
    assert got.keys() == want.keys(), f"{what}: other tensors {sorted(set(got) ^ set(want))}"
    present = [w.detach().double() for w in want.values() if w is not None]
    count = sum(w.numel() for w in present)
    total = math.sqrt(sum(float(w.square().sum()) for w in present))
    for name, w in want.items():
        g = got[name]
        if w is None:
            assert g is None, f"{what}{name}: a gradient where none was expected"
            continue
        scale = max(float(w.double().norm()), total * math.sqrt(w.numel() / count))
        diff = float((g.detach().double() - w.detach().double()).norm())
        assert torch.isfinite(g).all() and diff <= rtol * scale, (
            f"{what}{name}: ||actual - expected|| = {diff:.3e} > rtol * scale = {rtol:.3e} * {scale:.3e} "
            f"(||expected|| = {float(w.double().norm()):.3e})")
