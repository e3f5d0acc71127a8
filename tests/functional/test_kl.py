"""KL estimators: closed forms, unbiasedness on a categorical, stability; KL-shaped rewards."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.arithmetic import assert_within
from textrl.functional.kl import (
    KL_KINDS,
    kl_abs,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
    kl_shaped_rewards,
)
from textrl.testing import sum_tolerance

SETTINGS = settings(max_examples=30, deadline=None)


@st.composite
def logp_pairs(draw):
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 9))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logp = -torch.rand(b, t, generator=g) * 5
    ref = -torch.rand(b, t, generator=g) * 5
    return logp, ref


@SETTINGS
@given(logp_pairs(), st.sampled_from(KL_KINDS))
def test_zero_when_equal_and_nonnegative(pair, kind):
    logp, ref = pair
    assert torch.equal(kl_penalty(logp, logp, kind), torch.zeros_like(logp))
    out = kl_penalty(logp, ref, kind)
    assert out.dtype == torch.float32 and out.shape == logp.shape
    if kind != "k1":
        assert (out >= 0).all()


@SETTINGS
@given(logp_pairs())
def test_closed_forms(pair):
    logp, ref = pair
    d = logp - ref
    torch.testing.assert_close(kl_k1(logp, ref), d)
    torch.testing.assert_close(kl_k2(logp, ref), 0.5 * d**2)
    torch.testing.assert_close(kl_k3(logp, ref), torch.exp(-d) - 1 + d)
    torch.testing.assert_close(kl_abs(logp, ref), d.abs())
    for kind, fn in zip(KL_KINDS, (kl_k1, kl_k2, kl_k3, kl_abs)):
        assert torch.equal(kl_penalty(logp, ref, kind), fn(logp, ref))


@pytest.mark.parametrize("estimator", [kl_k1, kl_k3])
def test_unbiased_on_categorical(estimator):
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.9, 0.1], dtype=torch.float64)
    q = torch.tensor([0.5, 0.5], dtype=torch.float64)
    kl_pq = float((p * (p / q).log()).sum())  # forward KL, the target (0.368)
    kl_qp = float((q * (q / p).log()).sum())  # reverse KL (0.511), a wrong answer
    n = 50_000
    a = torch.multinomial(p, n, replacement=True, generator=g)
    est = estimator(p.log()[a], q.log()[a])
    mean, se = float(est.mean()), float(est.std()) / math.sqrt(n)
    assert abs(mean - kl_pq) < 5 * se
    # the test has power: the wrong answers are many standard errors away
    assert abs(kl_pq - kl_qp) > 20 * se and kl_pq > 20 * se
    assert abs(mean - kl_qp) > 10 * se and mean > 10 * se


def test_k2_is_biased_on_categorical():
    # guards the unbiasedness test above: a biased estimator does fail it
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.9, 0.1], dtype=torch.float64)
    q = torch.tensor([0.5, 0.5], dtype=torch.float64)
    kl_pq = float((p * (p / q).log()).sum())
    a = torch.multinomial(p, 50_000, replacement=True, generator=g)
    est = kl_k2(p.log()[a], q.log()[a])
    assert abs(float(est.mean()) - kl_pq) > 5 * float(est.std()) / math.sqrt(50_000)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
def test_k3_finite_at_extreme_log_ratio(dtype, log_ratio):
    logp = torch.full((2, 3), -1.0, dtype=dtype)
    ref = (logp.float() - log_ratio).to(dtype)
    out = kl_k3(logp, ref)
    assert out.dtype == torch.float32 and torch.isfinite(out).all() and (out >= 0).all()
    # clamped to |log r| <= 20: exp(20) - 1 - 20 for log r = +20 (logp far below ref)
    bound = math.expm1(20.0) - 20.0 if log_ratio < 0 else math.expm1(-20.0) + 20.0
    torch.testing.assert_close(out, torch.full((2, 3), bound))
    for kind in KL_KINDS:
        assert torch.isfinite(kl_penalty(logp, ref, kind)).all()


# ---- kl_shaped_rewards ---------------------------------------------------------------------


@st.composite
def shaped(draw):
    b, t = draw(st.integers(1, 5)), draw(st.integers(1, 9))
    lengths = draw(st.lists(st.integers(1, t), min_size=b, max_size=b))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    score = torch.randn(b, generator=g)
    kl = torch.randn(b, t, generator=g)
    mask = torch.arange(t).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    coef = draw(st.sampled_from([0.0, 0.05, 1.0]))
    return score, kl, mask, coef, lengths


@SETTINGS
@given(shaped())
def test_shaped_rewards_closed_form(case):
    score, kl, mask, coef, lengths = case
    kl_poisoned = torch.where(mask, kl, torch.nan)
    last = kl_shaped_rewards(score, kl_poisoned, mask, coef, placement="last")
    uni = kl_shaped_rewards(score, kl_poisoned, mask, coef, placement="uniform")
    # a row's sum of up to t terms (coef * kl, the score or its share) against another sum of them:
    # within 2 gamma of the operations of the terms' magnitudes, not of the sum, which cancels
    magnitude = score.double().abs() + coef * torch.where(mask, kl, 0).double().abs().sum(1)
    tol = sum_tolerance(3 * mask.shape[1] + 2, 1.0) * magnitude
    for out in (last, uni):
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        assert (out[~mask] == 0).all()
        assert_within(out.sum(1), score - coef * torch.where(mask, kl, 0).sum(1), tol, "row sums")
    for i, n in enumerate(lengths):
        expected_last = -coef * kl[i, :n]
        expected_last[n - 1] += score[i]
        torch.testing.assert_close(last[i, :n], expected_last)
        torch.testing.assert_close(uni[i, :n], -coef * kl[i, :n] + score[i] / n)


def test_shaped_rewards_small_example():
    score = torch.tensor([1.0, 2.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, float("inf"), float("nan")]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    out = kl_shaped_rewards(score, kl, mask, kl_coef=0.5)
    torch.testing.assert_close(out, torch.tensor([[-0.05, -0.1, 0.85], [1.8, 0.0, 0.0]]))
    out = kl_shaped_rewards(score, kl, mask, kl_coef=0.5, placement="uniform")
    third = 1 / 3
    expected = torch.tensor([[third - 0.05, third - 0.1, third - 0.15], [1.8, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)


# ---- bad inputs --------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [kl_k1, kl_k2, kl_k3, kl_abs])
def test_estimators_reject_trailing_one(fn):
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"ref_logp.*\[2, 3, 1\].*squeeze"):
        fn(logp, torch.zeros(2, 3, 1))
    with pytest.raises(ValueError, match=r"ref_logp.*squeeze"):
        fn(torch.zeros(2, 3, 1), logp)
    with pytest.raises(ValueError, match="logp must be a float"):
        fn(logp.long(), logp)


def test_kl_penalty_unknown_kind():
    with pytest.raises(ValueError, match=r"kind='k4'.*\('k1', 'k2', 'k3', 'abs'\)"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), "k4")


def test_shaped_rewards_bad_inputs():
    score, kl = torch.zeros(2), torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="mask must be a bool"):
        kl_shaped_rewards(score, kl, mask.float(), 0.1)
    with pytest.raises(ValueError, match=r"mask .*bool"):
        kl_shaped_rewards(score, kl, torch.tensor([[1, 0, 1], [1] * 3]), 0.1)
    with pytest.raises(ValueError, match=r"kl must be \[B, T\].*squeeze"):
        kl_shaped_rewards(score, kl.unsqueeze(-1), mask, 0.1)
    with pytest.raises(ValueError, match=r"mask .*\[2, 3, 1\]"):
        kl_shaped_rewards(score, kl, mask.unsqueeze(-1), 0.1)
    with pytest.raises(ValueError, match=r"score must be \[B\].*squeeze"):
        kl_shaped_rewards(score.unsqueeze(-1), kl, mask, 0.1)
    with pytest.raises(ValueError, match="no valid token"):
        kl_shaped_rewards(score, kl, torch.tensor([[True] * 3, [False] * 3]), 0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        kl_shaped_rewards(score, kl, mask, -0.1)
    with pytest.raises(ValueError, match="placement"):
        kl_shaped_rewards(score, kl, mask, 0.1, placement="first")
