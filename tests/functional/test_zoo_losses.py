"""The 2025 estimators and losses of textrl.functional.zoo (GSPO, CISPO, DAPO, Dr. GRPO,
REINFORCE++) against closed forms and plain loops, and the micro-batch invariance of their
gradients when the caller passes the minibatch's normaliser."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from textrl import testing
from textrl.functional import (
    aggregate_loss,
    cispo_loss,
    clipped_policy_loss,
    dr_grpo_advantage,
    dr_grpo_aggregate,
    dynamic_sampling_keep,
    grpo_advantage,
    gspo_loss,
    overlong_penalty,
    reinforce_pp_advantages,
    token_level_aggregate,
)

SETTINGS = settings(max_examples=30, deadline=None)
NAN = float("nan")


@st.composite
def gapped_batch(draw, allow_empty_rows=False):
    """float64 logp/old_logp/advantages [B, T], a gapped bool mask (textrl.testing.masks, any
    pattern of Trues), NaN in the masked slots."""
    mask = draw(testing.masks(batch=(1, 6), time=(1, 9), leading_gap=True, empty_rows=allow_empty_rows))
    b, t = mask.shape
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = logp + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    logp, old, adv = (torch.where(mask, x, NAN) for x in (logp, old, adv))
    splits = sorted(set(draw(st.lists(st.integers(1, max(1, b - 1)), max_size=3)))) if b > 1 else []
    return logp, old, adv, mask, splits


def _micro(x, splits):
    bounds = [0, *splits, x.shape[0]]
    return [x[a:c] for a, c in zip(bounds[:-1], bounds[1:], strict=True) if c > a]


def _grad(fn, logp):
    leaf = logp.detach().clone().requires_grad_(True)
    loss = fn(leaf)
    (g,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), g


def _micro_grad(fn, logp, splits):
    """Sum over micro-batches of fn(micro_logp, rows): loss and gradient w.r.t. the full logp."""
    leaf = logp.detach().clone().requires_grad_(True)
    total = 0.0
    start = 0
    for part in _micro(leaf, splits):
        rows = slice(start, start + part.shape[0])
        total = total + fn(part, rows)
        start += part.shape[0]
    (g,) = torch.autograd.grad(total, leaf)
    return total.detach(), g


# ---------------------------------------------------------------------------------------- GSPO


def test_gspo_hand_case_with_gap_and_nan():
    logp = torch.tensor([[0.1, 0.3, NAN], [-0.5, NAN, -0.1]], dtype=torch.float64)
    old = torch.tensor([[0.0, 0.0, 7.0], [0.0, NAN, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, stats = gspo_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.1)
    # row 0: s = e^0.2 = 1.221 > 1.1 with A > 0 -> -1.1; row 1: s = e^-0.3 = 0.741 < 0.8, A < 0
    # -> max(2 * 0.741, 2 * 0.8) = 1.6
    assert loss.item() == pytest.approx((-1.1 + 1.6) / 2)
    assert stats["clip_fraction"].item() == 1.0
    assert stats["seq_ratio_max"].item() == pytest.approx(math.exp(0.2))
    assert stats["seq_ratio_min"].item() == pytest.approx(math.exp(-0.3))


def _gspo_loop(logp, old, adv, mask, lo, hi):
    terms = []
    for i in range(logp.shape[0]):
        idx = [t for t in range(logp.shape[1]) if mask[i, t]]
        if not idx:
            continue
        s = torch.exp(sum(logp[i, t] - old[i, t] for t in idx) / len(idx))
        terms.append(torch.minimum(s * adv[i], torch.clamp(s, 1 - lo, 1 + hi) * adv[i]))
    return -sum(terms) / len(terms)


@SETTINGS
@given(gapped_batch(allow_empty_rows=True), st.floats(0.01, 0.5), st.floats(0.01, 0.5))
def test_gspo_matches_loop_loss_and_gradient(batch, lo, hi):
    logp, old, adv_t, mask, _ = batch
    if not mask.any():
        return
    adv = torch.randn(logp.shape[0], dtype=torch.float64)
    loss, g = _grad(lambda lp: gspo_loss(lp, old, adv, mask, lo, hi)[0], logp)
    ref, g_ref = _grad(lambda lp: _gspo_loop(lp, old, adv, mask, lo, hi), torch.nan_to_num(logp))
    assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
    torch.testing.assert_close(g, torch.where(mask, g_ref, 0.0))
    assert (g[~mask] == 0).all()


@SETTINGS
@given(gapped_batch())
def test_gspo_gradient_independent_of_micro_batch_split(batch):
    logp, old, _, mask, splits = batch
    adv = torch.randn(logp.shape[0], dtype=torch.float64)
    n = int(mask.any(1).sum())
    full, g_full = _grad(lambda lp: gspo_loss(lp, old, adv, mask, 0.1, 0.2)[0], logp)
    micro, g_micro = _micro_grad(
        lambda lp, r: gspo_loss(lp, old[r], adv[r], mask[r], 0.1, 0.2, num_seqs=n)[0], logp, splits
    )
    assert micro.item() == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(g_micro, g_full)


# --------------------------------------------------------------------------------------- CISPO


@SETTINGS
@given(gapped_batch(), st.one_of(st.none(), st.floats(0.05, 0.5)), st.floats(0.05, 0.5))
def test_cispo_gradient_is_clipped_weight_times_advantage(batch, lo, hi):
    logp, old, adv, mask, splits = batch
    n = int(mask.sum())
    ratio = torch.exp(torch.nan_to_num(logp) - torch.nan_to_num(old))
    w = torch.clamp(ratio, min=None if lo is None else 1 - lo, max=1 + hi)
    expected = torch.where(mask, -w * torch.nan_to_num(adv) / n, 0.0)
    loss, g = _grad(lambda lp: cispo_loss(lp, old, adv, mask, lo, hi)[0], logp)
    torch.testing.assert_close(g, expected)
    ref = -(torch.where(mask, w * torch.nan_to_num(adv) * torch.nan_to_num(logp), 0.0)).sum() / n
    assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
    micro, g_micro = _micro_grad(
        lambda lp, r: cispo_loss(lp, old[r], adv[r], mask[r], lo, hi, num_tokens=n)[0], logp, splits
    )
    assert micro.item() == pytest.approx(loss.item(), abs=1e-12)
    torch.testing.assert_close(g_micro, g)


def test_cispo_keeps_gradient_of_clipped_tokens_where_ppo_drops_it():
    logp = torch.tensor([[0.5, 0.0]], dtype=torch.float64)  # ratio e^0.5 = 1.65 on token 0
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = torch.ones(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, g_ppo = _grad(lambda lp: clipped_policy_loss(lp, old, adv, mask, clip_eps=0.2)[0], logp)
    _, g_cispo = _grad(lambda lp: cispo_loss(lp, old, adv, mask, clip_eps_high=0.2)[0], logp)
    assert g_ppo[0, 0] == 0
    assert g_cispo[0, 0].item() == pytest.approx(-1.2 / 2)


# ------------------------------------------------------------------- finiteness and validation


@pytest.mark.parametrize("delta", [-1e4, 1e4])
def test_extreme_log_ratios_give_finite_loss_and_gradient(delta):
    old = torch.zeros(2, 3)
    logp = torch.full((2, 3), delta)
    mask = torch.tensor([[True, False, True], [True, True, False]])
    adv = torch.tensor([[1.0, -1.0, -1.0], [-1.0, 1.0, 1.0]])
    for fn in (
        lambda lp: gspo_loss(lp, old, adv[:, 0], mask),
        lambda lp: cispo_loss(lp, old, adv, mask, clip_eps_low=0.2),
    ):
        leaf = logp.clone().requires_grad_(True)
        loss, stats = fn(leaf)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(leaf.grad).all()
        assert all(torch.isfinite(v) for v in stats.values())


def test_bad_inputs_raise_naming_the_argument():
    x = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="advantages must be \\[B\\]"):
        gspo_loss(x, x, x, mask)
    with pytest.raises(ValueError, match="advantages must be \\[B\\] with B=2"):
        gspo_loss(x, x, torch.zeros(3), mask)
    with pytest.raises(ValueError, match="mask must be a bool"):
        gspo_loss(x, x, torch.zeros(2), mask.float())
    with pytest.raises(ValueError, match="old_logp must have the shape"):
        cispo_loss(x, x[:, :, None], x, mask)
    with pytest.raises(ValueError, match="num_tokens=0: must be None or a number > 0"):
        cispo_loss(x, x, x, mask, num_tokens=0)
    with pytest.raises(ValueError, match="num_seqs must be a number or a 1-element tensor"):
        gspo_loss(x, x, torch.zeros(2), mask, num_seqs=torch.ones(2))
    with pytest.raises(ValueError, match="normaliser=-1"):
        aggregate_loss(x, mask, normaliser=-1)
    with pytest.raises(ValueError, match="clip_eps_high"):
        clipped_policy_loss(x, x, x, mask, clip_eps_high=-0.1)
    with pytest.raises(ValueError, match="cache_len=5 must be <= max_len=4"):
        overlong_penalty(torch.tensor([1, 2]), max_len=4, cache_len=5)
    with pytest.raises(ValueError, match="group_rewards has NaN"):
        dynamic_sampling_keep(torch.tensor([[1.0, NAN]]))
    with pytest.raises(ValueError, match="group_size=3"):
        dr_grpo_advantage(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="mask must be \\[B, T\\] with B=3"):
        reinforce_pp_advantages(torch.zeros(3), mask)
    with pytest.raises(ValueError, match="max_len=0"):
        dr_grpo_aggregate(x, mask, max_len=0)


# ----------------------------------------------------------------------- DAPO and aggregation


def test_clip_higher_asymmetric_range_by_hand():
    old = torch.zeros(1, 2, dtype=torch.float64)
    logp = torch.log(torch.tensor([[1.25, 0.75]], dtype=torch.float64))
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    sym, _ = clipped_policy_loss(logp, old, adv, mask, clip_eps=0.2)
    high, stats = clipped_policy_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    assert sym.item() == pytest.approx((-1.2 + 0.8) / 2)  # both clipped
    assert high.item() == pytest.approx((-1.25 + 0.8) / 2)  # 1.25 < 1.28 is not clipped
    assert stats["clip_fraction"].item() == 0.5
    same, _ = clipped_policy_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.2)
    assert same.item() == sym.item()


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "seq_mean_token_sum"])
@SETTINGS
@given(batch=gapped_batch())
def test_ppo_loss_with_normaliser_is_independent_of_micro_batch_split(aggregation, batch):
    logp, old, adv, mask, splits = batch
    n = int(mask.sum()) if aggregation == "token_mean" else int(mask.any(1).sum())
    full, g_full = _grad(
        lambda lp: clipped_policy_loss(lp, old, adv, mask, 0.2, None, aggregation, 0.28)[0], logp
    )
    micro, g_micro = _micro_grad(
        lambda lp, r: clipped_policy_loss(
            lp, old[r], adv[r], mask[r], 0.2, None, aggregation, 0.28, normaliser=n
        )[0],
        logp,
        splits,
    )
    assert micro.item() == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(g_micro, g_full)


def test_token_mean_per_micro_batch_differs_without_the_normaliser():
    """The bug the normaliser prevents: averaging per-micro-batch token means weighs the tokens of
    a short micro-batch more than the minibatch's token mean does."""
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    full = aggregate_loss(loss_mat, mask)  # 16 / 4
    naive = (aggregate_loss(loss_mat[:1], mask[:1]) + aggregate_loss(loss_mat[1:], mask[1:])) / 2
    right = token_level_aggregate(loss_mat[:1], mask[:1], 4) + token_level_aggregate(
        loss_mat[1:], mask[1:], 4
    )
    assert full.item() == 4.0 and naive.item() == 6.0 and right.item() == 4.0


def test_overlong_penalty_closed_form():
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10, 11, 100])
    got = overlong_penalty(lengths, max_len=10, cache_len=4)
    want = [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(want)


def test_dynamic_sampling_keep():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.50001]])
    assert dynamic_sampling_keep(rewards).tolist() == [False, True, False, True]
    # the kept groups are exactly those whose GRPO advantages are not all zero
    adv = grpo_advantage(rewards.flatten(), 3).view(4, 3)
    assert dynamic_sampling_keep(rewards).tolist() == (adv != 0).any(1).tolist()


# -------------------------------------------------------------------------------- Dr. GRPO


def test_dr_grpo_advantage_closed_form():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0])
    got = dr_grpo_advantage(scores, 4)
    assert got.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    g = torch.Generator().manual_seed(0)
    s = torch.randn(12, generator=g, dtype=torch.float64)
    std = s.view(3, 4).std(1, keepdim=True)
    torch.testing.assert_close(
        dr_grpo_advantage(s, 4), (grpo_advantage(s, 4, eps=1e-6).view(3, 4) * (std + 1e-6)).flatten()
    )


@SETTINGS
@given(gapped_batch())
def test_dr_grpo_aggregate_constant_denominator_and_micro_batches(batch):
    loss_mat, _, _, mask, splits = batch
    b, t = mask.shape
    full = dr_grpo_aggregate(loss_mat, mask)
    assert full.item() == pytest.approx(torch.nan_to_num(loss_mat)[mask].sum().item() / (b * t))
    # micro-batches padded to their own length: pass the budget and the minibatch rows
    total = 0.0
    for lm, mk in zip(_micro(loss_mat, splits), _micro(mask, splits), strict=True):
        width = int(torch.where(mk, torch.arange(t), -1).amax()) + 1
        total += dr_grpo_aggregate(lm[:, :width], mk[:, :width], max_len=t, num_seqs=b).item()
    assert total == pytest.approx(full.item(), abs=1e-12)


# ----------------------------------------------------------------------------- REINFORCE++


def _reinforce_pp_loop(scores, mask, kl, kl_coef, group_size):
    s = scores.tolist()
    if group_size is not None:
        for g0 in range(0, len(s), group_size):
            mean = sum(s[g0 : g0 + group_size]) / group_size
            s[g0 : g0 + group_size] = [x - mean for x in s[g0 : g0 + group_size]]
    returns = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        idx = [t for t in range(mask.shape[1]) if mask[i, t]]
        running = 0.0
        for k, t in enumerate(reversed(idx)):
            r = -kl_coef * kl[i, t].item() + (s[i] if k == 0 else 0.0)
            running += r
            returns[i, t] = running
    vals = returns[mask]
    mean = vals.mean()
    var = vals.var(unbiased=True) if vals.numel() >= 2 else torch.tensor(0.0, dtype=torch.float64)
    adv = torch.where(mask, (returns - mean) / torch.sqrt(var + 1e-8), 0.0)
    return adv, returns


@SETTINGS
@given(gapped_batch(allow_empty_rows=True), st.floats(0.0, 0.5), st.booleans())
def test_reinforce_pp_matches_loop(batch, kl_coef, grouped):
    _, kl, _, mask, _ = batch
    b = mask.shape[0]
    group_size = None
    if grouped:
        group_size = next(k for k in (3, 2, 1) if b % k == 0)
    scores = torch.randn(b, dtype=torch.float64)
    adv, ret = reinforce_pp_advantages(scores, mask, kl, kl_coef, group_size)
    adv_ref, ret_ref = _reinforce_pp_loop(scores, mask, torch.nan_to_num(kl), kl_coef, group_size)
    torch.testing.assert_close(ret, ret_ref)
    torch.testing.assert_close(adv, adv_ref)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_reinforce_pp_gap_does_not_change_returns():
    """Observation tokens between two turns neither add reward nor discount (gamma = 1)."""
    kl = torch.tensor([[0.1, 9.0, 0.2, 0.3]], dtype=torch.float64)
    gapped = torch.tensor([[True, False, True, True]])
    _, ret = reinforce_pp_advantages(torch.tensor([1.0], dtype=torch.float64), gapped, kl, 1.0)
    assert ret[0].tolist() == pytest.approx([1.0 - 0.6, 0.0, 1.0 - 0.5, 1.0 - 0.3])
