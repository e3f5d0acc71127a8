"""``logprobs_from_hidden`` (the fused linear log-softmax) against the unfused path the agents take:
``F.linear`` to ``[N, V]`` logits, ``warp_logits``, ``logprobs_from_logits`` /
``entropy_from_logits``. Values and gradients w.r.t. hidden, weight and bias; float64 gradcheck;
bf16 autocast; and the memory it was written for: no tensor of positions x vocabulary, in forward
or backward (a CPU check that fails on the unfused path; the CUDA one at Qwen2.5's vocabulary is
tests/cuda/test_fused_logprobs.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from tests.arithmetic import assert_within, log_softmax_bounds
from textrl.agents.forwards import warp_logits
from textrl.functional import (
    ENTROPY_MODES,
    entropy_from_logits,
    logprobs_from_hidden,
    logprobs_from_logits,
)
from textrl.functional import logprobs as lp_mod
from textrl.testing import sum_tolerance, unit_roundoff

SETTINGS = settings(max_examples=40, deadline=None)


def unfused(hidden, weight, tokens, bias=None, temperature=1.0, top_k=0, top_p=1.0):
    """What the agents compute today: ``(logp, entropy)`` from the whole logits, shaped like ``tokens``."""
    logits = F.linear(hidden, weight, bias).reshape(1, -1, weight.shape[0])  # [1, N, V]
    warped = warp_logits(logits, temperature, top_k, top_p)
    t = temperature if warped is logits else 1.0  # warp_logits divided already when it filtered
    logp = logprobs_from_logits(warped, tokens.reshape(1, -1), temperature=t)
    ent = entropy_from_logits(logits, temperature=temperature)
    return logp.view(tokens.shape), ent.view(tokens.shape)


@st.composite
def problems(draw, dtype=torch.float32):
    """A small problem: hidden ``[N, H]`` or ``[B, T, H]``, weight ``[V, H]``, maybe a bias, tokens
    (some the argmax, which no filter drops, some at random, which top-k / top-p may drop), the
    sampling settings and a chunk size."""
    lead = draw(st.sampled_from([(draw(st.integers(0, 12)),), (draw(st.integers(1, 3)), draw(st.integers(1, 6)))]))
    h, v = draw(st.integers(1, 8)), draw(st.integers(1, 20))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([0.3, 1.0, 3.0]))
    hidden = torch.randn(*lead, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype) * scale
    bias = torch.randn(v, generator=g, dtype=dtype) if draw(st.booleans()) else None
    logits = F.linear(hidden, weight, bias)
    tokens = torch.where(torch.rand(lead, generator=g) < 0.5, logits.argmax(-1), torch.randint(0, v, lead, generator=g))
    sampling = dict(temperature=draw(st.sampled_from([0.3, 0.7, 1.0, 1.6])),
                    top_k=draw(st.sampled_from([0, 1, 3, 50])), top_p=draw(st.sampled_from([1.0, 0.95, 0.6, 0.2])))
    chunk = draw(st.one_of(st.none(), st.integers(1, 7)))
    return hidden, weight, bias, tokens, sampling, chunk


def fused_tolerances(hidden, weight, bias, tokens, sampling, w_lp, w_ent, entropy_grad: bool):
    """How far apart, from the float32 arithmetic, the fused and the unfused paths' results may be:
    ``(log-prob tol, entropy tol, [the hidden's, the weight's, the bias's gradient tol])``, shaped
    like their tensors. The two sum the same terms in other orders (chunks, matmul blockings), and a
    relative tolerance fails where a value cancels (a hidden's gradient element of terms up to 40
    summing to 0.32 was 9e-6 off in 1,500 draws: 22% of the old atol), so each bound is its sums'
    error times the magnitude of their terms:

    - a logit ``x . w + b`` (``H + 1`` terms) by ``2 gamma(H + 1) (|x| . |w| + |b|)``, over ``T``;
      the log-softmax and entropy on top by ``tests.arithmetic.log_softmax_bounds``;
    - the gradient w.r.t. the logits, ``(w_lp (onehot - p~) - w_ent p (log p + H)) / T`` (``p~``
      the filtered distribution), relatively by those two bounds and its own few roundings, on
      the magnitude ``M`` of its terms; a parameter's gradient sums that times ``|W|`` over the
      vocabulary (hidden), times ``|x|`` or 1 over the positions (weight, bias): that error plus
      the dot product's own ``2 gamma(n)``, times the sum of the terms' magnitudes.
    """
    t = sampling["temperature"]
    x = hidden.detach().double().reshape(-1, hidden.shape[-1])  # [N, H]
    w = weight.detach().double()
    b = bias.detach().double() if bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    n, v = x.shape[0], w.shape[0]
    z = x @ w.T + b  # [N, V]
    dz = sum_tolerance(x.shape[1] + 2, 1.0) * (x.abs() @ w.abs().T + b.abs()).amax(-1, keepdim=True) / t
    eps_p, ent_tol = log_softmax_bounds(z, t, logit_error=dz)  # [N, 1]
    p = torch.softmax(z / t, -1)
    log_p = torch.where(p > 0, torch.log_softmax(z / t, -1), 0.0)
    entropy = -(p * log_p).sum(-1, keepdim=True)
    warped = warp_logits(F.linear(hidden.detach(), weight.detach(), bias), t, sampling["top_k"], sampling["top_p"])
    p_kept = torch.softmax((z / t).masked_fill(~torch.isfinite(warped.reshape(n, v)), -math.inf), -1)
    magnitude = w_lp.reshape(-1, 1).double().abs() * (F.one_hot(tokens.reshape(-1), v).double() + p_kept) / t
    if entropy_grad:
        magnitude = magnitude + w_ent.reshape(-1, 1).double().abs() * p * (log_p.abs() + entropy + 1) / t
    eps_d = eps_p + ent_tol + 8 * unit_roundoff()  # [N, 1]: row n's logits' gradient, relatively
    st_v, st_n = sum_tolerance(v + 1, 1.0), sum_tolerance(n + 1, 1.0)  # dot products: a product each
    grads = [
        ((eps_d + st_v) * (magnitude @ w.abs())).reshape(hidden.shape),  # [N, H]: sums over V
        (eps_d * magnitude).T @ x.abs() + st_n * (magnitude.T @ x.abs()),  # [V, H]: sums over N
        (eps_d * magnitude).sum(0) + st_n * magnitude.sum(0),  # [V]: sums over N
    ]
    return eps_p.reshape(tokens.shape), ent_tol.reshape(tokens.shape), grads


def leaves(*xs):
    return [None if x is None else x.detach().clone().requires_grad_() for x in xs]


def grads(*xs):
    return [None if x is None else x.grad for x in xs]


@SETTINGS
@given(problems(), st.sampled_from(ENTROPY_MODES))
def test_values_and_gradients_equal_the_unfused_path(problem, entropy):
    hidden, weight, bias, tokens, sampling, chunk = problem
    h1, w1, b1 = leaves(hidden, weight, bias)
    logp, ent = logprobs_from_hidden(h1, w1, tokens, bias=b1, chunk_size=chunk, entropy=entropy, **sampling)
    h2, w2, b2 = leaves(hidden, weight, bias)
    ref_logp, ref_ent = unfused(h2, w2, tokens, b2, **sampling)

    g = torch.Generator().manual_seed(0)
    w_lp, w_ent = torch.randn(tokens.shape, generator=g), torch.randn(tokens.shape, generator=g)
    logp_tol, ent_tol, grad_tols = fused_tolerances(hidden, weight, bias, tokens, sampling, w_lp, w_ent,
                                                    entropy_grad=entropy == "grad")

    assert logp.dtype == torch.float32 and logp.shape == tokens.shape
    assert torch.equal(torch.isfinite(logp), torch.isfinite(ref_logp))  # the same tokens filtered out
    assert_within(logp, ref_logp, logp_tol, "logp")
    if entropy == "none":
        assert ent is None
    else:
        assert ent.dtype == torch.float32 and ent.shape == tokens.shape
        assert ent.requires_grad == (entropy == "grad")
        assert_within(ent, ref_ent.detach(), ent_tol, "entropy")


    def loss(lp, en):  # -inf where a filter dropped the token, yet finite gradients: no +1 there
        total = lp.mul(w_lp).sum()
        return total + en.mul(w_ent).sum() if entropy == "grad" else total

    if tokens.numel() == 0:
        return
    loss(logp, ent).backward()
    loss(ref_logp, ref_ent).backward()
    for name, got, want, tol in zip(("hidden", "weight", "bias"), grads(h1, w1, b1), grads(h2, w2, b2), grad_tols):
        if want is None:
            assert got is None
        else:
            assert_within(got, want, tol, f"the {name}'s gradient")


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = F.linear(hidden, weight, bias).argmax(-1)  # kept by every filter: a finite log-prob
    for sampling in (dict(temperature=0.7), dict(temperature=1.3, top_k=3), dict(temperature=0.9, top_k=4, top_p=0.7)):

        def both(h, w, b, sampling=sampling):
            return logprobs_from_hidden(h, w, tokens, bias=b, chunk_size=3, entropy="grad", **sampling)

        logp, ent = both(hidden, weight, bias)
        assert logp.dtype == ent.dtype == torch.float64
        assert torch.autograd.gradcheck(both, (hidden, weight, bias))


def test_float64_values_equal_a_float64_log_softmax():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    weight = torch.randn(9, 4, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 9, (2, 5), generator=g)
    logp, ent = logprobs_from_hidden(hidden, weight, tokens, temperature=0.8, chunk_size=3, entropy="detached")
    want = torch.log_softmax(hidden @ weight.T / 0.8, -1)
    torch.testing.assert_close(logp, want.gather(-1, tokens[..., None]).squeeze(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, -(want.exp() * want).sum(-1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.7)], ids=["plain", "tempered"])
def test_bf16_autocast_matches_the_unfused_path_under_the_same_autocast(sampling):
    """The matmul in bf16 as the LM head's would be, the softmax in float32. No top-k / top-p here:
    bf16 logits tie often, and a 1-ulp difference between two matmul blockings moves a top-k /
    top-p boundary, and with it every log-prob of the row (CI's processes saw it even with one
    chunk: 0.03 in a log-prob, 0.04 in a scaled gradient); the filters are tested in float32."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 24, 16, generator=g)
    weight = torch.randn(300, 16, generator=g) * 0.5
    bias = torch.randn(300, generator=g)
    tokens = F.linear(hidden, weight, bias).argmax(-1)
    tokens[:, ::2] = torch.randint(0, 300, (2, 12), generator=g)
    chunk = None if not sampling else 7
    h1, w1, b1 = leaves(hidden, weight, bias)
    h2, w2, b2 = leaves(hidden, weight, bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent = logprobs_from_hidden(h1, w1, tokens, bias=b1, chunk_size=chunk or 5, entropy="grad", **sampling)
        ref_logp, ref_ent = unfused(h2, w2, tokens, b2, **sampling)
        assert F.linear(h2, w2, b2).dtype == torch.bfloat16  # the unfused head's logits are bf16
    assert logp.dtype == ent.dtype == torch.float32
    assert torch.equal(torch.isfinite(logp), torch.isfinite(ref_logp))
    finite = torch.isfinite(ref_logp)
    torch.testing.assert_close(logp[finite], ref_logp[finite], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ent, ref_ent, rtol=2e-2, atol=2e-2)
    w = torch.randn(tokens.shape, generator=g)
    (torch.where(finite, logp, 0.0) * w + ent).sum().backward()
    (torch.where(finite, ref_logp, 0.0) * w + ref_ent).sum().backward()
    for got, want in zip(grads(h1, w1, b1), grads(h2, w2, b2)):
        assert got.dtype == want.dtype == torch.float32
        scale = want.abs().max()
        torch.testing.assert_close(got / scale, want / scale, rtol=0, atol=2e-2)


def test_under_no_grad_and_with_some_inputs_frozen():
    g = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(6, 4, generator=g), torch.randn(11, 4, generator=g)
    tokens = torch.randint(0, 11, (6,), generator=g)
    with torch.no_grad():
        logp, ent = logprobs_from_hidden(hidden.requires_grad_(), weight, tokens, entropy="grad")
    assert not logp.requires_grad and not ent.requires_grad
    w = weight.clone().requires_grad_()  # the head trains, the body is frozen
    logp, _ = logprobs_from_hidden(hidden.detach(), w, tokens, chunk_size=4)
    logp.sum().backward()
    w2 = weight.clone().requires_grad_()
    unfused(hidden.detach(), w2, tokens)[0].sum().backward()
    torch.testing.assert_close(w.grad, w2.grad)


def test_the_default_chunk_is_bounded_by_elements(monkeypatch):
    shapes = []
    real = lp_mod._linear

    def spy(x, weight, bias):
        out = real(x, weight, bias)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(lp_mod, "DEFAULT_CHUNK_ELEMENTS", 3 * 10)
    monkeypatch.setattr(lp_mod, "_linear", spy)
    hidden = torch.randn(2, 4, 5, requires_grad=True)
    weight = torch.randn(10, 5)
    tokens = torch.randint(0, 10, (2, 4))
    logp, _ = logprobs_from_hidden(hidden, weight, tokens)
    assert shapes == [(3, 10), (3, 10), (2, 10)]  # 8 positions in chunks of 3, 3, 2
    logp.sum().backward()
    assert shapes[3:] == [(3, 10), (3, 10), (2, 10)]  # the backward recomputes chunk by chunk


def test_bad_inputs():
    hidden, weight = torch.zeros(2, 3, 4), torch.zeros(5, 4)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    cases = [
        ((torch.zeros(4), weight, tokens), {}, r"hidden must be \[N, H\] or \[B, T, H\]"),
        ((hidden.long(), weight, tokens), {}, "hidden must be a float"),
        ((hidden, torch.zeros(5, 4, 1), tokens), {}, r"weight must be \[V, H\]"),
        ((hidden, torch.zeros(0, 4), tokens), {}, "non-empty vocabulary"),
        ((hidden, torch.zeros(5, 3), tokens), {}, "H=4 must equal weight"),
        ((hidden, weight, tokens), dict(bias=torch.zeros(4)), r"bias must be \[V\]"),
        ((hidden, weight, tokens[:, :2]), {}, r"tokens must be \[B, T\] = \[2, 3\]"),
        ((hidden[0], weight, tokens), {}, r"tokens must be \[N\] = \[3\]"),
        ((hidden, weight, tokens.int()), {}, "tokens must be an int64"),
        ((hidden, weight, tokens + 5), {}, r"tokens must lie in \[0, V=5\)"),
        ((hidden, weight, tokens), dict(temperature=0.0), "temperature"),
        ((hidden, weight, tokens), dict(top_k=-1), "top_k"),
        ((hidden, weight, tokens), dict(top_p=1.5), "top_p"),
        ((hidden, weight, tokens), dict(chunk_size=0), "chunk_size"),
        ((hidden, weight, tokens), dict(entropy=True), "entropy=True"),
        ((hidden, weight.double(), tokens), {}, "share one dtype outside autocast"),
    ]
    for args, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            logprobs_from_hidden(*args, **kwargs)


# -- memory ---------------------------------------------------------------------------------------


class LargestTensor(TorchDispatchMode):
    """The bytes of the largest storage any op returned while active (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def largest_and_saved(fn):
    """``(largest tensor any op made, bytes autograd saved for the backward)`` of ``fn()``'s
    forward + backward; ``fn`` returns the loss."""
    saved = []

    def pack(x):
        saved.append(x.untyped_storage().nbytes())
        return x

    with LargestTensor() as spy:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            loss = fn()
        loss.backward()
    return spy.largest, max(saved)


@pytest.mark.slow
def test_no_tensor_holds_positions_times_vocabulary():
    """V=50,000, N=2,048, chunk=64: the fused forward + backward makes no tensor beyond a few
    ``[chunk, V]``; the unfused path makes (and saves) ``[N, V]`` logits, which this check catches."""
    n, h, v, chunk = 2048, 16, 50_000, 64
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = (torch.randn(v, h, generator=g) * 0.1).requires_grad_()
    tokens = torch.randint(0, v, (n,), generator=g)

    def fused():
        logp, ent = logprobs_from_hidden(hidden, weight, tokens, chunk_size=chunk, entropy="grad")
        return logp.sum() + ent.sum()

    def reference():
        logp, ent = unfused(hidden, weight, tokens)
        return logp.sum() + ent.sum()

    chunk_bytes, full_bytes = chunk * v * 4, n * v * 4  # float32 [chunk, V] and [N, V]
    largest, saved = largest_and_saved(fused)
    assert largest <= 2 * chunk_bytes, (largest, chunk_bytes)  # [chunk, V]: a float32 z or a grad block
    assert saved <= max(n * h, v * h) * 4  # hidden and the weight themselves, [N] vectors
    largest, saved = largest_and_saved(reference)
    assert largest >= full_bytes and saved >= full_bytes  # what the check is for: it sees [N, V]
