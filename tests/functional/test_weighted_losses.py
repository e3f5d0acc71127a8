"""The policy losses' rollout-correction ``weights`` (clipped PPO, CISPO, GSPO): ``None`` and all-ones
leave the loss as it was, a weight scales its token's loss (against plain loops), a token of
weight 0 is a token off the mask, and micro-batches still add up, on hypothesis-drawn gapped
batches with NaN in the masked slots."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from textrl import testing
from textrl.functional import (
    LOSS_AGGREGATIONS,
    cispo_loss,
    clipped_policy_loss,
    gspo_loss,
    kept_mask,
    mismatch_bounds,
)

SETTINGS = settings(max_examples=30, deadline=None)
NAN = float("nan")
CLIP = 0.2


@st.composite
def weighted_batch(draw, zeros: bool = True):
    """float64 logp / old_logp / advantages ``[B, T]`` and row advantages ``[B]``, a gapped bool mask
    with empty rows, weights ``[B, T]`` in (0.1, 3) with some 0 (rejected) tokens when ``zeros``;
    NaN in every masked slot, the weights' included; row splits for micro-batches."""
    mask = draw(testing.masks(batch=(1, 6), time=(1, 9), leading_gap=True, empty_rows=True))
    b, t = mask.shape
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    weights = 0.1 + 2.9 * torch.rand(b, t, generator=g, dtype=torch.float64)
    if zeros:
        weights = torch.where(torch.rand(b, t, generator=g) < 0.3, 0.0, weights)
    logp, old, adv, weights = (torch.where(mask, x, NAN) for x in (logp, old, adv, weights))
    row_adv = torch.randn(b, generator=g, dtype=torch.float64)
    splits = sorted(set(draw(st.lists(st.integers(1, max(1, b - 1)), max_size=3)))) if b > 1 else []
    return logp, old, adv, row_adv, mask, weights, splits


def ppo(aggregation: str, dual_clip: float | None = None):
    def loss(logp, old, adv, row_adv, mask, weights=None, n=None):
        return clipped_policy_loss(logp, old, adv, mask, clip_eps=CLIP, dual_clip=dual_clip, aggregation=aggregation,
                                   normaliser=n, weights=weights)
    return loss


def cispo(logp, old, adv, row_adv, mask, weights=None, n=None):
    return cispo_loss(logp, old, adv, mask, clip_eps_low=CLIP, clip_eps_high=CLIP, num_tokens=n, weights=weights)


def gspo(logp, old, adv, row_adv, mask, weights=None, n=None):
    return gspo_loss(logp, old, row_adv, mask, clip_eps_low=CLIP, clip_eps_high=CLIP, num_seqs=n, weights=weights)


LOSSES = {
    **{f"ppo-{agg}": ppo(agg) for agg in LOSS_AGGREGATIONS},
    "ppo-dual-clip": ppo("token_mean", dual_clip=1.5),
    "cispo": cispo,
    "gspo": gspo,
}
EXACT = [name for name in LOSSES if name != "gspo"]
"""The losses whose weighted form is their unweighted one times w_t (GSPO's weighted form is its
token-level one: the same value and gradient in another order of operations)."""


def _grad(fn, logp):
    leaf = logp.detach().clone().requires_grad_(True)
    loss, stats = fn(leaf)
    (g,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), g, stats


def _micro(x, splits):
    bounds = [0, *splits, x.shape[0]]
    return [slice(a, c) for a, c in zip(bounds[:-1], bounds[1:], strict=True) if c > a]


# 1. None and all-ones weights: the loss as it was ---------------------------------------------------
@SETTINGS
@given(weighted_batch(), st.sampled_from(sorted(LOSSES)))
def test_weights_none_is_the_loss_without_weights_bit_for_bit(batch, name):
    logp, old, adv, row_adv, mask, _, _ = batch
    fn = LOSSES[name]
    got = _grad(lambda lp: fn(lp, old, adv, row_adv, mask, weights=None), logp)
    if name == "gspo":
        want = _grad(lambda lp: gspo_loss(lp, old, row_adv, mask, clip_eps_low=CLIP, clip_eps_high=CLIP), logp)
    elif name == "cispo":
        want = _grad(lambda lp: cispo_loss(lp, old, adv, mask, clip_eps_low=CLIP, clip_eps_high=CLIP), logp)
    else:
        agg, dual = ("token_mean", 1.5) if name == "ppo-dual-clip" else (name.removeprefix("ppo-"), None)
        want = _grad(lambda lp: clipped_policy_loss(lp, old, adv, mask, clip_eps=CLIP, dual_clip=dual,
                                                    aggregation=agg), logp)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys() and all(torch.equal(got[2][k], want[2][k]) for k in got[2])


@SETTINGS
@given(weighted_batch(), st.sampled_from(sorted(LOSSES)))
def test_weights_of_ones_are_the_unweighted_loss(batch, name):
    logp, old, adv, row_adv, mask, _, _ = batch
    fn, ones = LOSSES[name], torch.where(mask, 1.0, NAN).double()
    loss, g, stats = _grad(lambda lp: fn(lp, old, adv, row_adv, mask, weights=ones), logp)
    loss0, g0, stats0 = _grad(lambda lp: fn(lp, old, adv, row_adv, mask), logp)
    if name in EXACT:  # pg_loss * 1.0 is pg_loss
        assert torch.equal(loss, loss0) and torch.equal(g, g0)
    else:
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g, g0, rtol=1e-12, atol=1e-12)
    assert all(torch.equal(stats[k], stats0[k]) for k in stats0)


# 2. a weight scales its token's loss (plain loops) -----------------------------------------------------
def _kept_rows(mask, weights):
    """Per row, the (t, w_t) of its kept tokens (on the mask, weight != 0)."""
    return [[(t, float(weights[i, t])) for t in range(mask.shape[1]) if mask[i, t] and weights[i, t] != 0]
            for i in range(mask.shape[0])]


def _aggregate_loop(token_loss, rows, aggregation):
    """Reduce {(i, t): loss} over the kept tokens as the aggregation says (empty rows left out)."""
    per_row = [[token_loss[i, t] for t, _ in row] for i, row in enumerate(rows)]
    full = [r for r in per_row if r]
    if not full:
        return 0.0
    if aggregation == "token_mean":
        return sum(sum(r) for r in full) / sum(len(r) for r in full)
    if aggregation == "seq_mean":
        return sum(sum(r) / len(r) for r in full) / len(full)
    return sum(sum(r) for r in full) / len(full)


@SETTINGS
@given(weighted_batch(), st.sampled_from(LOSS_AGGREGATIONS))
def test_clipped_policy_loss_weighs_each_token_as_the_loop(batch, aggregation):
    logp, old, adv, _, mask, weights, _ = batch
    loss, _ = clipped_policy_loss(logp, old, adv, mask, clip_eps=CLIP, aggregation=aggregation, weights=weights)
    rows, token_loss = _kept_rows(mask, weights), {}
    for i, row in enumerate(rows):
        for t, w in row:
            r, a = float(torch.exp(logp[i, t] - old[i, t])), float(adv[i, t])
            token_loss[i, t] = w * max(-a * r, -a * min(max(r, 1 - CLIP), 1 + CLIP))
    assert loss.item() == pytest.approx(_aggregate_loop(token_loss, rows, aggregation), rel=1e-12, abs=1e-12)


@SETTINGS
@given(weighted_batch())
def test_cispo_weighs_each_token_loss_and_gradient_as_the_loop(batch):
    logp, old, adv, _, mask, weights, _ = batch
    loss, g, _ = _grad(lambda lp: cispo(lp, old, adv, None, mask, weights=weights), logp)
    rows = _kept_rows(mask, weights)
    n = sum(map(len, rows))
    want_loss, want_g = 0.0, torch.zeros_like(g)
    for i, row in enumerate(rows):
        for t, w in row:
            r = min(max(float(torch.exp(logp[i, t] - old[i, t])), 1 - CLIP), 1 + CLIP)
            want_loss += -w * r * float(adv[i, t]) * float(logp[i, t]) / n
            want_g[i, t] = -w * r * float(adv[i, t]) / n
    assert loss.item() == pytest.approx(want_loss, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(g, want_g)


@SETTINGS
@given(weighted_batch())
def test_gspo_weighs_each_token_gradient_as_verl_token_level_form(batch):
    """``loss_i = mean_t w_t l_i`` over the row's kept tokens, ``s_i`` over them too; the gradient
    at a kept token is ``w_t / (n_i N) * (-A_i s_i)`` where the unclipped term is the larger, else 0."""
    logp, old, _, row_adv, mask, weights, _ = batch
    loss, g, _ = _grad(lambda lp: gspo(lp, old, None, row_adv, mask, weights=weights), logp)
    rows = _kept_rows(mask, weights)
    full = [i for i, row in enumerate(rows) if row]
    want_loss, want_g = 0.0, torch.zeros_like(g)
    for i in full:
        ts = [t for t, _ in rows[i]]
        s = float(torch.exp(sum(logp[i, t] - old[i, t] for t in ts) / len(ts)))
        a = float(row_adv[i])
        unclipped, clipped = -a * s, -a * min(max(s, 1 - CLIP), 1 + CLIP)
        mean_w = sum(w for _, w in rows[i]) / len(ts)
        want_loss += mean_w * max(unclipped, clipped) / len(full)
        for t, w in rows[i]:
            want_g[i, t] = w / (len(ts) * len(full)) * -a * s if unclipped >= clipped else 0.0
    assert loss.item() == pytest.approx(want_loss, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(g, want_g)


# 3. a rejected token (weight 0) is a token off the mask ----------------------------------------------------
@SETTINGS
@given(weighted_batch(), st.sampled_from(sorted(LOSSES)))
def test_a_rejected_token_is_a_token_off_the_mask(batch, name):
    logp, old, adv, row_adv, mask, weights, _ = batch
    fn, keep = LOSSES[name], mask & (weights != 0)
    rejecting = torch.where(keep, 1.0, torch.where(mask, 0.0, NAN)).double()  # 1 kept, 0 rejected
    loss, g, stats = _grad(lambda lp: fn(lp, old, adv, row_adv, mask, weights=rejecting), logp)
    loss0, g0, stats0 = _grad(lambda lp: fn(lp, old, adv, row_adv, keep), logp)
    if name in EXACT:
        assert torch.equal(loss, loss0) and torch.equal(g, g0)
    else:
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g, g0, rtol=1e-12, atol=1e-12)
    assert all(torch.equal(stats[k], stats0[k]) for k in stats0)  # the stats count the kept tokens only
    assert (g[~keep] == 0).all()
    weighted = _grad(lambda lp: fn(lp, old, adv, row_adv, mask, weights=weights), logp)
    reduced = _grad(lambda lp: fn(lp, old, adv, row_adv, keep, weights=weights), logp)
    assert torch.equal(weighted[0], reduced[0]) and torch.equal(weighted[1], reduced[1])


# 4. micro-batches add up, rejected tokens out of the normaliser ----------------------------------------------
@SETTINGS
@given(weighted_batch(), st.sampled_from(["ppo-token_mean", "ppo-seq_mean", "cispo", "gspo"]))
def test_micro_batches_with_the_minibatch_count_add_up_to_the_minibatch(batch, name):
    logp, old, adv, row_adv, mask, weights, splits = batch
    keep = mask & (weights != 0)
    n = int(keep.any(1).sum()) if name in ("gspo", "ppo-seq_mean") else int(keep.sum())
    if n == 0:
        return
    fn = LOSSES[name]
    full, g_full, _ = _grad(lambda lp: fn(lp, old, adv, row_adv, mask, weights=weights), logp)
    leaf = logp.detach().clone().requires_grad_(True)
    total = sum(fn(leaf[r], old[r], adv[r], row_adv[r], mask[r], weights=weights[r], n=n)[0] for r in _micro(leaf, splits))
    (g_micro,) = torch.autograd.grad(total, leaf)
    assert total.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(g_micro, g_full)


# 5. validation ------------------------------------------------------------------------------------------------
def test_bad_weights_are_refused_naming_them():
    x = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    for fn in (lambda w: clipped_policy_loss(x, x, x, mask, weights=w), lambda w: cispo_loss(x, x, x, mask, weights=w),
               lambda w: gspo_loss(x, x, torch.zeros(2), mask, weights=w)):
        with pytest.raises(ValueError, match=r"weights must have the shape of logp \[2, 3\], got \[2, 3, 1\] .*squeeze"):
            fn(torch.ones(2, 3, 1))
        with pytest.raises(ValueError, match="weights must be a float tensor, got dtype torch.int64"):
            fn(torch.ones(2, 3, dtype=torch.long))
        with pytest.raises(ValueError, match=r"weights must be >= 0 on the mask"):
            fn(torch.tensor([[1.0, -0.5, 1.0], [1.0, 1.0, 1.0]]))
        fn(torch.tensor([[1.0, 1.0, -5.0], [1.0, NAN, NAN]]))  # off the mask: anything


def test_kept_mask_drops_the_rejected_tokens():
    mask = torch.tensor([[True, True, False], [True, False, True]])
    weights = torch.tensor([[0.0, 2.0, 0.0], [1.0, NAN, 0.0]])
    assert torch.equal(kept_mask(mask, weights), torch.tensor([[False, True, False], [True, False, False]]))
    assert kept_mask(mask, None) is mask


def test_the_bounds_of_each_kind_are_its_functions_defaults():
    assert mismatch_bounds("none") == {}
    assert mismatch_bounds("tis") == {"cap": 2.0}
    assert mismatch_bounds("mis") == {"upper": 2.0, "lower": None}
    assert mismatch_bounds("geo_mean") == {"upper": 1.001, "lower": None}
    assert mismatch_bounds("icepop") == {"lower": 0.5, "upper": 5.0}
    with pytest.raises(ValueError, match="kind='is': must be one of none, tis, mis, geo_mean, icepop"):
        mismatch_bounds("is")
