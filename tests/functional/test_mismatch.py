"""textrl.functional.mismatch (TIS, MIS, geometric-mean rejection, IcePop, the gap statistics)
against the peers' arithmetic (tests/functional/peers.py: verl, OpenRLHF, with their commits) and
plain loops, on hypothesis-drawn ragged batches with NaN in the masked slots."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.functional import peers
from textrl import testing
from textrl.functional import (
    MISMATCH_KINDS,
    geo_mean_weights,
    icepop_weights,
    mis_weights,
    mismatch_stats,
    mismatch_weights,
    none_weights,
    tis_weights,
)
from textrl.functional.mismatch import (
    REJECTION_WARNING_ITERATIONS,
    REJECTION_WARNING_SHARE,
    rejected_share,
    rejection_warning,
    resolved_bounds,
)
from textrl.testing import unit_roundoff

SETTINGS = settings(max_examples=40, deadline=None)
NAN = float("nan")


@st.composite
def mismatch_batch(draw, scale=None):
    """(learner, engine) float64 [B, T] with NaN in the masked slots, the same two with finite
    masked slots (for the peers, which multiply by the mask), a gapped bool mask with empty rows."""
    mask = draw(testing.masks(batch=(1, 6), time=(1, 12), leading_gap=True, empty_rows=True))
    b, t = mask.shape
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([1e-3, 0.05, 0.3, 1.5])) if scale is None else scale
    engine = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    learner = engine + scale * torch.randn(b, t, generator=g, dtype=torch.float64)
    nan_learner, nan_engine = (torch.where(mask, x, NAN) for x in (learner, engine))
    return nan_learner, nan_engine, learner, engine, mask


def _rows(mask):
    return [[t for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]


# ------------------------------------------------------------------------------- reference loops


def loop_weights(kind, learner, engine, mask, **bounds):
    """Each kind's weights as the papers state them, one token at a time in Python floats."""
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i, ts in enumerate(_rows(mask)):
        d = [float(learner[i, t] - engine[i, t]) for t in ts]
        if kind == "none":
            ws = [1.0] * len(ts)
        elif kind == "tis":
            ws = [min(math.exp(x), bounds.get("cap", 2.0)) for x in d]
        elif kind == "icepop":
            lo, hi = bounds.get("lower", 0.5), bounds.get("upper", 5.0)
            ws = [math.exp(x) if lo <= math.exp(x) <= hi else 0.0 for x in d]
        else:
            hi = bounds.get("upper", 2.0 if kind == "mis" else 1.001)
            lo = bounds.get("lower") or 1.0 / hi
            rho = math.exp(sum(d)) if kind == "mis" else math.exp(sum(d) / max(len(d), 1))
            keep = lo <= rho <= hi
            ws = [(rho if kind == "mis" else 1.0) if keep else 0.0] * len(ts)
        for t, w in zip(ts, ws, strict=True):
            out[i, t] = w
    return out


@given(batch=mismatch_batch(), kind=st.sampled_from(MISMATCH_KINDS))
@SETTINGS
def test_every_kind_matches_its_loop_and_rejects_off_the_mask(batch, kind):
    nan_learner, nan_engine, learner, engine, mask = batch
    got = mismatch_weights(kind, nan_learner, nan_engine, mask)
    want = loop_weights(kind, learner, engine, mask)
    assert got.shape == mask.shape and got.dtype == torch.float64
    assert torch.isfinite(got).all() and (got >= 0).all()
    assert (got[~mask] == 0).all()
    # the loop sums in another order and takes math.exp: a few ulps of a ratio, except right at a
    # bound, where either side may round; those rows are left out (the peers' tests are exact)
    near = torch.zeros_like(mask)
    if kind in ("mis", "geo_mean"):
        lr = torch.where(mask, learner - engine, 0.0)
        stat = lr.sum(1) if kind == "mis" else lr.sum(1) / mask.sum(1).clamp(min=1)
        hi = 2.0 if kind == "mis" else 1.001
        bounds = torch.tensor([math.log(hi), -math.log(hi)], dtype=torch.float64)
        near = ((stat[:, None] - bounds).abs() < 1e-12).any(1)[:, None].expand_as(mask)
    torch.testing.assert_close(got[~near], want[~near], rtol=1e-13, atol=0.0)


# ------------------------------------------------------------------------------------- the peers


@given(batch=mismatch_batch(), cap=st.sampled_from([1.0, 1.5, 2.0, 5.0]))
@SETTINGS
def test_tis_equals_verl_token_is(batch, cap):
    nan_learner, nan_engine, learner, engine, mask = batch
    got = tis_weights(nan_learner, nan_engine, mask, cap=cap)
    want = peers.verl_token_tis(learner - engine, mask.double(), cap)
    assert torch.equal(got, want)


@given(batch=mismatch_batch(), upper=st.sampled_from([1.05, 1.5, 2.0, 5.0]),
       lower=st.sampled_from([None, 0.1, 0.8]))
@SETTINGS
def test_mis_equals_verl_sequence_mask_mode(batch, upper, lower):
    nan_learner, nan_engine, learner, engine, mask = batch
    got = mis_weights(nan_learner, nan_engine, mask, upper=upper, lower=lower)
    want = peers.verl_sequence_mis(learner, engine, mask.double(), upper, lower)
    assert torch.equal(got, want)


@given(batch=mismatch_batch(scale=1e-3), upper=st.sampled_from([1.0001, 1.001, 1.01]),
       lower=st.sampled_from([None, 0.99, 0.9995]))
@SETTINGS
def test_geo_mean_equals_verl_geometric_rejection(batch, upper, lower):
    nan_learner, nan_engine, learner, engine, mask = batch
    got = geo_mean_weights(nan_learner, nan_engine, mask, upper=upper, lower=lower)
    log_ratio = learner - engine
    want = peers.verl_geometric_rs(log_ratio, mask.double(), upper, lower)
    # verl divides the row's sum by count + 1e-8, we by count: the means differ by a relative
    # 1e-8 / count plus one rounding each; the decisions agree unless a row's statistic is within
    # that of a bound (then either side is right)
    ours = torch.where(mask, log_ratio, 0.0).sum(1) / mask.sum(1).clamp(min=1)
    theirs = peers.verl_masked_mean(log_ratio, mask.double(), axis=-1)
    u = unit_roundoff(torch.float64)
    rel = 1e-8 + 2 * u
    assert ((ours - theirs).abs() <= rel * ours.abs()).all()
    # exp and the comparison with a bound round once more each: 4u in log space
    lo = 1.0 / upper if lower is None else lower
    bound_logs = torch.tensor([math.log(lo), math.log(upper)], dtype=torch.float64)
    near = ((ours[:, None] - bound_logs).abs() <= rel * ours.abs()[:, None] + 4 * u).any(1)
    rows = ~near
    assert torch.equal(got[rows], want[rows])
    assert ((got == 0) | (got == 1)).all()


@given(batch=mismatch_batch(), lower=st.sampled_from([0.5, 0.8, 1.0]),
       upper=st.sampled_from([1.0, 1.25, 5.0]))
@SETTINGS
def test_icepop_equals_openrlhf(batch, lower, upper):
    nan_learner, nan_engine, learner, engine, mask = batch
    got = icepop_weights(nan_learner, nan_engine, mask, lower=lower, upper=upper)
    want = peers.openrlhf_icepop(learner, engine, lower, upper)
    assert torch.equal(got[mask], want[mask])  # OpenRLHF leaves the mask to the loss's aggregation
    assert (got[~mask] == 0).all()


@given(batch=mismatch_batch())
@SETTINGS
def test_kl_k3_stat_matches_verl_k3_kl(batch):
    nan_learner, nan_engine, learner, engine, mask = batch
    got = mismatch_stats(nan_learner, nan_engine, mask)["kl_k3"]
    want = peers.verl_k3_kl(learner, engine, mask.double())
    # the same terms summed in the same order; verl divides by count + 1e-8, we by count
    rel = 1e-8 + 2 * unit_roundoff(torch.float64)
    assert (got - want).abs() <= rel * got.abs()


# ----------------------------------------------------------------------------------- statistics


@given(batch=mismatch_batch(), threshold=st.sampled_from([0.0, 0.01, math.log(2.0), 3.0]))
@SETTINGS
def test_stats_match_a_loop(batch, threshold):
    nan_learner, nan_engine, learner, engine, mask = batch
    got = mismatch_stats(nan_learner, nan_engine, mask, threshold=threshold)
    d = [float(learner[i, t] - engine[i, t]) for i, ts in enumerate(_rows(mask)) for t in ts]
    n = max(len(d), 1)
    want = {
        "abs_gap_mean": sum(abs(x) for x in d) / n,
        "abs_gap_max": max((abs(x) for x in d), default=0.0),
        "kl_k3": sum(math.exp(x) - x - 1 for x in d) / n,
        "gap_fraction": sum(abs(x) > threshold for x in d) / n,
    }
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].shape == () and not got[key].requires_grad
        assert float(got[key]) == pytest.approx(value, rel=1e-12, abs=1e-15), key
    assert float(got["kl_k3"]) >= 0.0


def test_stats_of_an_empty_mask_are_zero():
    x = torch.full((2, 3), NAN)
    stats = mismatch_stats(x, x, torch.zeros(2, 3, dtype=torch.bool))
    assert all(float(v) == 0.0 for v in stats.values())


def test_identical_log_probs_need_no_correction():
    logp = -torch.rand(3, 5, dtype=torch.float64)
    mask = torch.rand(3, 5) > 0.3
    for kind in MISMATCH_KINDS:
        assert torch.equal(mismatch_weights(kind, logp, logp, mask), mask.double()), kind
    stats = mismatch_stats(logp, logp, mask)
    assert all(float(v) == 0.0 for v in stats.values())


# ----------------------------------------------------------------------------------- hand cases


def test_hand_case_each_kind():
    d = torch.tensor([[math.log(3.0), 0.0, math.log(0.25)], [0.1, 0.1, NAN]], dtype=torch.float64)
    engine = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    tis = tis_weights(d, engine, mask)
    torch.testing.assert_close(tis, torch.tensor([[2.0, 1.0, 0.25], [math.exp(0.1)] * 2 + [0.0]],
                                                 dtype=torch.float64))
    ice = icepop_weights(d, engine, mask)  # [0.5, 5]: 3 kept, 1 kept, 0.25 rejected
    torch.testing.assert_close(ice, torch.tensor([[3.0, 1.0, 0.0], [math.exp(0.1)] * 2 + [0.0]],
                                                 dtype=torch.float64))
    mis = mis_weights(d, engine, mask)  # row 0: 3 * 0.25 = 0.75 in [0.5, 2]; row 1: e^0.2
    torch.testing.assert_close(mis, torch.tensor([[0.75] * 3, [math.exp(0.2)] * 2 + [0.0]],
                                                 dtype=torch.float64))
    assert torch.equal(mis_weights(d, engine, mask, upper=1.25), torch.tensor(  # 0.75 < 0.8
        [[0.0] * 3, [math.exp(0.2)] * 2 + [0.0]], dtype=torch.float64))
    geo = geo_mean_weights(d, engine, mask, upper=1.2)  # row 0: 0.75 ** (1/3) = 0.909; row 1: e^0.1
    assert torch.equal(geo, torch.tensor([[1.0] * 3, [1.0, 1.0, 0.0]], dtype=torch.float64))
    assert torch.equal(geo_mean_weights(d, engine, mask), torch.zeros(2, 3, dtype=torch.float64))


# ------------------------------------------------------------------ the defaults and the warning


def test_the_default_bounds_follow_one_rule():
    """The peer's defaults, an unset lower bound 1 / upper (symmetric in log space) except icepop's,
    which OpenRLHF fixes at 0.5 under an upper bound of 5 (docs/training.md, "Rollout corrections")."""
    assert {kind: resolved_bounds(kind) for kind in MISMATCH_KINDS} == {
        "none": {}, "tis": {"cap": 2.0}, "mis": {"upper": 2.0, "lower": 0.5},
        "geo_mean": {"upper": 1.001, "lower": 1 / 1.001}, "icepop": {"lower": 0.5, "upper": 5.0}}
    assert resolved_bounds("mis", upper=4.0) == {"upper": 4.0, "lower": 0.25}
    assert resolved_bounds("icepop", upper=4.0) == {"lower": 0.5, "upper": 4.0}
    assert resolved_bounds("geo_mean", upper=None, lower=0.9) == {"upper": 1.001, "lower": 0.9}


@SETTINGS
@given(batch=mismatch_batch(), kind=st.sampled_from(MISMATCH_KINDS))
def test_the_rejected_share_counts_the_zero_weights_of_the_agents_tokens(batch, kind):
    learner, engine, _, _, mask = batch
    w = mismatch_weights(kind, learner, engine, mask)
    tokens = [(i, t) for i, ts in enumerate(_rows(mask)) for t in ts]
    want = sum(float(w[i, t]) == 0.0 for i, t in tokens) / len(tokens) if tokens else 0.0
    assert float(rejected_share(w, mask)) == pytest.approx(want, abs=1e-7)


def test_rejecting_nearly_everything_for_several_iterations_is_said_once_in_one_line():
    n, high = REJECTION_WARNING_ITERATIONS, REJECTION_WARNING_SHARE + 0.05
    assert n >= 2 and 0.5 < REJECTION_WARNING_SHARE < 1
    assert rejection_warning("icepop", {}, [high] * (n - 1)) is None  # not yet several iterations
    assert rejection_warning("icepop", {}, [high] * (n - 1) + [REJECTION_WARNING_SHARE]) is None  # not above
    assert rejection_warning("icepop", {}, [high, REJECTION_WARNING_SHARE] + [high] * (n - 1)) is None  # interrupted
    message = rejection_warning("icepop", {}, [0.1] + [0.97] + [high] * (n - 1))
    assert message is not None and "\n" not in message
    assert message.startswith("rollout_correction='icepop' rejected 95% or more of the agent's tokens in each of "
                              f"the last {n} iterations")
    assert "[0.5, 5]" in message and "widen the bounds" in message and "weights" in message and "precision" in message
    mis = rejection_warning("mis", {"upper": 4.0, "lower": None}, [1.0] * n)
    assert "product" in mis and "[0.25, 4]" in mis and "100%" in mis
    assert "geometric mean" in rejection_warning("geo_mean", {"upper": 1.01}, [1.0] * n)
    assert rejection_warning("mis", {}, [0.99] * n, share=0.995) is None  # the threshold is the argument
    assert rejection_warning("mis", {}, [0.99] * 2, iterations=2) is not None


def test_bounds_are_inclusive():
    z = torch.zeros(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    for kind in ("mis", "geo_mean", "icepop"):  # ratio exactly 1 with lower = upper = 1
        assert torch.equal(mismatch_weights(kind, z, z, mask, lower=1.0, upper=1.0), torch.ones(1, 2,
                           dtype=torch.float64)), kind
    assert torch.equal(tis_weights(z, z, mask, cap=1.0), torch.ones(1, 2, dtype=torch.float64))


def test_weights_are_detached_and_extreme_ratios_finite():
    learner = torch.tensor([[500.0, -500.0, 0.0]], requires_grad=True)
    engine = torch.zeros(1, 3)
    mask = torch.ones(1, 3, dtype=torch.bool)
    for kind in MISMATCH_KINDS:
        w = mismatch_weights(kind, learner, engine, mask)
        assert not w.requires_grad and torch.isfinite(w).all() and w.dtype == torch.float32, kind
    assert icepop_weights(learner, engine, mask).tolist() == [[0.0, 0.0, 1.0]]
    assert tis_weights(learner, engine, mask)[0, 0] == 2.0
    stats = mismatch_stats(learner, engine, mask)
    assert all(torch.isfinite(v) and not v.requires_grad for v in stats.values())
    assert float(stats["abs_gap_max"]) == 500.0


def test_bf16_inputs_compute_in_float32():
    learner = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16)
    engine = torch.tensor([[-1.5, -2.0]], dtype=torch.bfloat16)
    w = none_weights(learner, engine, torch.ones(1, 2, dtype=torch.bool))
    assert w.dtype == torch.float32
    assert tis_weights(learner, engine, torch.ones(1, 2, dtype=torch.bool)).dtype == torch.float32


# ----------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("call, match", [
    (lambda x, m: tis_weights(x[:, :, None], x, m), r"logp_learner must be \[B, T\]"),
    (lambda x, m: tis_weights(x, x[:, :2], m), r"logp_engine must have the shape of logp_learner"),
    (lambda x, m: tis_weights(x, x, m.float()), r"mask must be a bool tensor"),
    (lambda x, m: tis_weights(x, x.long(), m), r"logp_engine must be a float tensor"),
    (lambda x, m: tis_weights(x, x, m, cap=0.0), r"cap=0.0: must be a number > 0"),
    (lambda x, m: mis_weights(x, x, m, upper=-1.0), r"upper=-1.0: must be a number > 0"),
    (lambda x, m: geo_mean_weights(x, x, m, lower=0.0), r"lower=0.0: must be a number > 0"),
    (lambda x, m: icepop_weights(x, x, m, lower=2.0, upper=1.0), r"lower=2.0: must be <= upper=1.0"),
    (lambda x, m: mismatch_weights("seq_tis", x, x, m), r"kind='seq_tis': must be one of none, tis"),
    (lambda x, m: mismatch_weights("tis", x, x, m, upper=2.0), r"upper: not a bound of kind='tis' \(it takes cap\)"),
    (lambda x, m: mismatch_weights("none", x, x, m, cap=2.0), r"cap: not a bound of kind='none' \(it takes no bounds\)"),
    (lambda x, m: mismatch_stats(x, x, m, threshold=-0.1), r"threshold=-0.1: must be a number >= 0"),
])
def test_bad_arguments_name_themselves(call, match):
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=match):
        call(x, torch.ones(2, 3, dtype=torch.bool))


def test_dispatcher_passes_bounds():
    x = torch.tensor([[math.log(1.5), math.log(3.0)]])
    z = torch.zeros(1, 2)
    m = torch.ones(1, 2, dtype=torch.bool)
    assert torch.equal(mismatch_weights("tis", x, z, m, cap=1.2), tis_weights(x, z, m, cap=1.2))
    assert torch.equal(mismatch_weights("icepop", x, z, m, upper=2.0), icepop_weights(x, z, m, upper=2.0))
    assert torch.equal(mismatch_weights("mis", x, z, m, upper=10.0, lower=None), mis_weights(x, z, m, upper=10.0))
