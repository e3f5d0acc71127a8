"""Chunked log-probs and entropy against the naive log_softmax path, values and gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.arithmetic import assert_within, log_softmax_bounds
from textrl.functional import logprobs as lp_mod
from textrl.functional.logprobs import entropy_from_logits, logprobs_from_logits
from textrl.testing import unit_roundoff

SETTINGS = settings(max_examples=30, deadline=None)


def naive_logprobs(logits, tokens, t):
    return torch.log_softmax(logits.float() / t, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def naive_entropy(logits, t):
    logp = torch.log_softmax(logits.float() / t, -1)
    return -(logp.exp() * logp).sum(-1)


@st.composite
def problems(draw):
    b, t, v = draw(st.integers(1, 4)), draw(st.integers(1, 11)), draw(st.integers(1, 17))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(b, t, v, generator=g) * draw(st.sampled_from([0.1, 1.0, 5.0]))
    tokens = torch.randint(0, v, (b, t), generator=g)
    temperature = draw(st.sampled_from([0.3, 0.7, 1.0, 1.5]))
    chunk = draw(st.one_of(st.none(), st.integers(1, 13)))
    return logits, tokens, temperature, chunk


@SETTINGS
@given(problems())
def test_logprobs_match_naive(problem):
    logits, tokens, t, chunk = problem
    out = logprobs_from_logits(logits, tokens, temperature=t, chunk_size=chunk)
    assert out.dtype == torch.float32 and out.shape == tokens.shape
    torch.testing.assert_close(out, naive_logprobs(logits, tokens, t), rtol=1e-5, atol=1e-5)


@SETTINGS
@given(problems())
def test_entropy_matches_naive(problem):
    logits, _, t, chunk = problem
    out = entropy_from_logits(logits, temperature=t, chunk_size=chunk)
    assert out.dtype == torch.float32 and out.shape == logits.shape[:2]
    torch.testing.assert_close(out, naive_entropy(logits, t), rtol=1e-5, atol=1e-5)


@SETTINGS
@given(problems())
def test_gradients_match_naive(problem):
    logits, tokens, t, chunk = problem
    w = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(0))
    a = logits.clone().requires_grad_()
    (logprobs_from_logits(a, tokens, t, chunk) * w).sum().backward()
    b = logits.clone().requires_grad_()
    (naive_logprobs(b, tokens, t) * w).sum().backward()
    # d/dz of w log p = w (onehot - p) / T and of w H = -w p (log p + H) / T: each within the
    # softmax's and the entropy's bounds (tests/arithmetic.py) and its own few roundings (8 u for
    # both sides), relatively, of its terms' magnitudes; both cancel (p -> 1, log p -> -H), where a
    # relative tolerance does not hold
    eps_p, ent_tol = log_softmax_bounds(logits, t)
    eps_p = eps_p + 8 * unit_roundoff()
    p = torch.softmax(logits.double() / t, -1)
    log_p = torch.log_softmax(logits.double() / t, -1)
    entropy = -(p * log_p).sum(-1, keepdim=True)
    scale = w.double().abs()[..., None] / t
    onehot = torch.nn.functional.one_hot(tokens, logits.shape[-1]).double()
    assert_within(a.grad, b.grad, eps_p * scale * (onehot + p), "the log-probs' gradient")

    a.grad = b.grad = None
    (entropy_from_logits(a, t, chunk) * w).sum().backward()
    (naive_entropy(b, t) * w).sum().backward()
    assert_within(a.grad, b.grad, (eps_p + ent_tol) * scale * p * (log_p.abs() + entropy + 1), "the entropy's gradient")


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 4, (2, 5), generator=g)
    assert logprobs_from_logits(logits, tokens).dtype == torch.float64
    assert torch.autograd.gradcheck(lambda x: logprobs_from_logits(x, tokens, 0.7, 2), (logits,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, 1.3, 3), (logits,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits(dtype):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 7, 50, generator=g) * 4).to(dtype).requires_grad_()
    tokens = torch.randint(0, 50, (3, 7), generator=g)
    out = logprobs_from_logits(logits, tokens, 0.9, 3)
    ent = entropy_from_logits(logits, 0.9, 3)
    assert out.dtype == ent.dtype == torch.float32
    # same math on the exactly representable upcast: only reduction order differs (V = 50 terms,
    # logits / T up to ~20: tests/arithmetic.py)
    eps_p, ent_tol = log_softmax_bounds(logits.float(), 0.9)
    assert_within(out, naive_logprobs(logits.detach(), tokens, 0.9), eps_p.squeeze(-1), "logp")
    assert_within(ent, naive_entropy(logits.detach(), 0.9), ent_tol.squeeze(-1), "entropy")
    (out.sum() + ent.sum()).backward()
    assert logits.grad.dtype == dtype and torch.isfinite(logits.grad).all()


def test_default_chunk_is_bounded(monkeypatch):
    calls = []
    real = torch.logsumexp

    def spy(z, dim):
        calls.append(z.numel())
        return real(z, dim=dim)

    monkeypatch.setattr(lp_mod, "DEFAULT_CHUNK_ELEMENTS", 2 * 3 * 10)
    monkeypatch.setattr(lp_mod.torch, "logsumexp", spy)
    logits = torch.randn(2, 7, 10)
    tokens = torch.randint(0, 10, (2, 7))
    out = logprobs_from_logits(logits, tokens)
    assert max(calls) <= 60 and len(calls) == 3  # chunks of 3, 3, 1 time steps
    monkeypatch.setattr(lp_mod.torch, "logsumexp", real)
    torch.testing.assert_close(out, naive_logprobs(logits, tokens, 1.0))


def test_entropy_ignores_minus_inf_logits():
    logits = torch.tensor([[[0.0, 0.0, -float("inf")]]], requires_grad=True)
    ent = entropy_from_logits(logits)
    torch.testing.assert_close(ent, torch.tensor([[torch.log(torch.tensor(2.0)).item()]]))
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_bad_inputs():
    logits = torch.zeros(2, 3, 5)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"logits must be \[B, T, V\]"):
        logprobs_from_logits(torch.zeros(2, 3), tokens)
    with pytest.raises(ValueError, match="logits must be a float"):
        logprobs_from_logits(logits.long(), tokens)
    with pytest.raises(ValueError, match=r"tokens must be \[B, T\]"):
        logprobs_from_logits(logits, tokens.unsqueeze(-1))
    with pytest.raises(ValueError, match="tokens must be an int64"):
        logprobs_from_logits(logits, tokens.int())
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, V=5\)"):
        logprobs_from_logits(logits, tokens + 5)
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, V=5\)"):
        logprobs_from_logits(logits, tokens - 1)
    for bad_t in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature"):
            logprobs_from_logits(logits, tokens, temperature=bad_t)
        with pytest.raises(ValueError, match="temperature"):
            entropy_from_logits(logits, temperature=bad_t)
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(logits, chunk_size=0)


@pytest.mark.parametrize("fn", ["logprobs", "entropy"])
def test_autograd_saves_no_float32_vocab_copy(fn):
    logits = torch.randn(2, 6, 32).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, 32, (2, 6))
    saved = []

    def pack(x):
        saved.append((x.dtype, x.numel()))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        if fn == "logprobs":
            logprobs_from_logits(logits, tokens, chunk_size=2)
        else:
            entropy_from_logits(logits, chunk_size=2)
    big_float32 = [n for dtype, n in saved if dtype == torch.float32 and n >= 2 * 2 * 32]
    assert not big_float32, saved
