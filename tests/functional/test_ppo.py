from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from textrl.functional.ppo import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    clipped_policy_loss,
    clipped_value_loss,
    explained_variance,
)

SETTINGS = settings(max_examples=40, deadline=None)
NAN = float("nan")


@st.composite
def ragged(draw):
    """Three random float64 [B, T] tensors and a prefix mask with per-row lengths 1..T."""
    b = draw(st.integers(1, 5))
    t = draw(st.integers(1, 10))
    lengths = draw(st.lists(st.integers(1, t), min_size=b, max_size=b))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x, y, z = (torch.randn(b, t, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    return x, y, z, mask


# A small ragged example: row 0 has 3 valid tokens, row 1 has 1; NaN in the padding.
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, NAN]])
MASK = torch.tensor([[True, True, True], [True, False, False]])


def test_aggregations_by_hand():
    assert LOSS_AGGREGATIONS == ("token_mean", "seq_mean", "seq_mean_token_sum")
    torch.testing.assert_close(aggregate_loss(LOSS, MASK), torch.tensor(10.0 / 4))
    torch.testing.assert_close(aggregate_loss(LOSS, MASK, "seq_mean"), torch.tensor(3.0))
    torch.testing.assert_close(aggregate_loss(LOSS, MASK, "seq_mean_token_sum"), torch.tensor(5.0))


def test_aggregations_skip_empty_rows_and_empty_mask_is_zero():
    loss = torch.cat([LOSS, torch.full((1, 3), NAN)])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=torch.bool)])
    torch.testing.assert_close(aggregate_loss(loss, mask, "seq_mean"), torch.tensor(3.0))
    torch.testing.assert_close(aggregate_loss(loss, mask, "seq_mean_token_sum"), torch.tensor(5.0))
    for agg in LOSS_AGGREGATIONS:
        assert aggregate_loss(loss, torch.zeros_like(mask), agg) == 0


@SETTINGS
@given(ragged(), st.sampled_from(LOSS_AGGREGATIONS))
def test_policy_loss_at_ratio_one_is_minus_mean_advantage(batch, aggregation):
    logp, _, adv, mask = batch
    logp = logp.clone().requires_grad_(True)
    old = torch.where(mask, logp.detach(), NAN)
    loss, stats = clipped_policy_loss(logp, old, adv, mask, aggregation=aggregation)
    torch.testing.assert_close(loss, aggregate_loss(-adv, mask, aggregation))
    if aggregation == "token_mean":
        torch.testing.assert_close(loss, -adv[mask].mean())
    assert stats["clip_fraction"] == 0
    assert stats["approx_kl"] == 0
    for k in ("ratio_mean", "ratio_max", "ratio_min"):
        assert stats[k] == 1
        assert not stats[k].requires_grad
    loss.backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad[~mask] == 0).all()


@SETTINGS
@given(ragged(), st.sampled_from([NAN, float("inf"), -float("inf")]))
def test_policy_loss_padding_garbage_does_not_leak(batch, garbage):
    logp, old, adv, mask = batch
    clean = logp.clone().requires_grad_(True)
    dirty = torch.where(mask, logp, garbage).requires_grad_(True)
    loss, stats = clipped_policy_loss(clean, old, adv, mask, dual_clip=3.0)
    loss2, stats2 = clipped_policy_loss(
        dirty,
        torch.where(mask, old, garbage),
        torch.where(mask, adv, garbage),
        mask,
        dual_clip=3.0,
    )
    torch.testing.assert_close(loss2, loss)
    for k in stats:
        torch.testing.assert_close(stats2[k], stats[k])
    loss.backward()
    loss2.backward()
    torch.testing.assert_close(dirty.grad, clean.grad)


def test_policy_loss_zero_gradient_where_clipped():
    # Token 0: A > 0 and ratio 1.5 > 1 + eps -> clipped, no gradient.
    # Token 1: A < 0 and ratio 0.5 < 1 - eps -> clipped, no gradient.
    # Token 2: ratio 1 -> unclipped, gradient -A / 3.
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]])).requires_grad_(True)
    old = torch.zeros(1, 3)
    adv = torch.tensor([[2.0, -1.0, 3.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = clipped_policy_loss(logp, old, adv, mask, clip_eps=0.2)
    torch.testing.assert_close(loss, torch.tensor(-(2.0 * 1.2 - 1.0 * 0.8 + 3.0) / 3))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, -1.0]]))
    torch.testing.assert_close(stats["clip_fraction"], torch.tensor(2 / 3))
    torch.testing.assert_close(stats["ratio_max"], torch.tensor(1.5))
    torch.testing.assert_close(stats["ratio_min"], torch.tensor(0.5))
    torch.testing.assert_close(stats["ratio_mean"], torch.tensor(1.0))
    # k3: (r - 1) - log r
    k3 = ((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))) / 3
    torch.testing.assert_close(stats["approx_kl"], torch.tensor(k3))


def test_policy_loss_unclipped_side_keeps_gradient():
    # A > 0 with ratio < 1 - eps: the unclipped term is the max, gradient flows.
    logp = torch.log(torch.tensor([[0.5]])).requires_grad_(True)
    loss, stats = clipped_policy_loss(
        logp, torch.zeros(1, 1), torch.tensor([[2.0]]), torch.ones(1, 1, dtype=torch.bool)
    )
    torch.testing.assert_close(loss, torch.tensor(-1.0))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0]]))  # d(-A r)/dlogp = -A r
    assert stats["clip_fraction"] == 0


def test_dual_clip_by_hand():
    # ratio 10, A = -1: pg_loss1 = 10, pg_loss2 = 1.2, max = 10; dual bound -A * 3 = 3 -> 3.
    # ratio 10, A = +1: dual clip does not apply; pg_loss = max(-10, -1.2) = -1.2.
    # ratio 2,  A = -1: max(2, 1.2) = 2 < 3 -> stays 2.
    logp = torch.log(torch.tensor([[10.0, 10.0, 2.0]])).requires_grad_(True)
    old = torch.zeros(1, 3)
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = clipped_policy_loss(logp, old, adv, mask, clip_eps=0.2, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor((3.0 - 1.2 + 2.0) / 3))
    torch.testing.assert_close(stats["dual_clip_fraction"], torch.tensor(1 / 3))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 2.0 / 3]]))
    no_dual, stats_nd = clipped_policy_loss(logp, old, adv, mask, clip_eps=0.2)
    torch.testing.assert_close(no_dual, torch.tensor((10.0 - 1.2 + 2.0) / 3))
    assert "dual_clip_fraction" not in stats_nd


def test_value_loss_clipped_and_unclipped_by_hand():
    values = torch.tensor([[1.0, 0.0, 2.0], [0.5, NAN, NAN]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 1.9], [0.0, NAN, NAN]])
    returns = torch.tensor([[0.0, 1.0, 3.0], [2.0, NAN, NAN]])
    # Unclipped: 0.5 * (V - R)^2 = [0.5, 0.5, 0.5 | 1.125]
    loss_u, stats_u = clipped_value_loss(values, old, returns, MASK, clip_eps=None)
    torch.testing.assert_close(loss_u, torch.tensor((0.5 + 0.5 + 0.5 + 1.125) / 4))
    assert stats_u["value_clip_fraction"] == 0
    # Clipped, eps 0.2: V_clip = [0.2, 0.0, 2.0 | 0.2]
    # (V_clip - R)^2 = [0.04, 1, 1 | 3.24] vs (V - R)^2 = [1, 1, 1 | 2.25]
    # 0.5 * max = [0.5, 0.5, 0.5 | 1.62]; clipped term larger only at the last valid token.
    loss_c, stats_c = clipped_value_loss(values, old, returns, MASK, clip_eps=0.2)
    torch.testing.assert_close(loss_c, torch.tensor((0.5 + 0.5 + 0.5 + 1.62) / 4))
    torch.testing.assert_close(stats_c["value_clip_fraction"], torch.tensor(0.25))
    torch.testing.assert_close(stats_c["value_mean"], torch.tensor(3.5 / 4))
    torch.testing.assert_close(stats_c["return_mean"], torch.tensor(6.0 / 4))
    loss_c.backward()
    # Row 1 is clipped (V - V_old = 0.5 > 0.2): no gradient; the rest (V - R) / 4.
    torch.testing.assert_close(values.grad, torch.tensor([[0.25, -0.25, -0.25], [0.0, 0.0, 0.0]]))
    assert not stats_c["explained_variance"].requires_grad


def test_explained_variance():
    r = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, NAN]])
    assert explained_variance(r, r, MASK) == 1
    v = torch.where(MASK, torch.full_like(r, 2.5), NAN)
    torch.testing.assert_close(explained_variance(v, r, MASK), torch.tensor(0.0))
    # 1 - Var[R - V] / Var[R] with V = R + 1 on two tokens and R - 1 on the others.
    v2 = torch.tensor([[2.0, 1.0, 4.0], [3.0, 0.0, 0.0]])
    res = torch.tensor([-1.0, 1.0, -1.0, 1.0])
    expected = 1 - res.var(unbiased=False) / torch.tensor([1.0, 2, 3, 4]).var(unbiased=False)
    torch.testing.assert_close(explained_variance(v2, r, MASK), expected)
    assert torch.isnan(explained_variance(r, torch.ones(2, 3), MASK))
    assert torch.isnan(explained_variance(r, r, torch.zeros(2, 3, dtype=torch.bool)))


@SETTINGS
@given(ragged())
def test_value_loss_is_at_least_unclipped_and_matches_mse_at_old(batch):
    values, old, returns, mask = batch
    unclipped, _ = clipped_value_loss(values, old, returns, mask, clip_eps=None)
    clipped, _ = clipped_value_loss(values, old, returns, mask, clip_eps=0.2)
    assert clipped >= unclipped - 1e-12
    at_old, stats = clipped_value_loss(old, old, returns, mask, clip_eps=0.2)
    torch.testing.assert_close(at_old, 0.5 * ((old - returns)[mask] ** 2).mean())
    assert stats["value_clip_fraction"] == 0


def _args():
    x = torch.zeros(2, 3)
    return x, x.clone(), x.clone(), torch.ones(2, 3, dtype=torch.bool)


@pytest.mark.parametrize(
    ("index", "bad", "match"),
    [
        (0, torch.zeros(2, 3, 1), r"logp .*squeeze"),
        (1, torch.zeros(2, 3, 1), r"old_logp .*squeeze"),
        (2, torch.zeros(2, 3, 1), r"advantages .*squeeze"),
        (2, torch.zeros(2, 3, dtype=torch.long), r"advantages .*float"),
        (3, torch.ones(2, 3), r"mask .*bool"),
        (3, torch.ones(2, 4, dtype=torch.bool), r"mask"),
    ],
)
def test_policy_loss_rejects_bad_tensors(index, bad, match):
    args = list(_args())
    args[index] = bad
    with pytest.raises(ValueError, match=match):
        clipped_policy_loss(*args)


@pytest.mark.parametrize(
    ("index", "match"), [(0, r"values .*squeeze"), (1, r"old_values .*squeeze"), (2, r"returns")]
)
def test_value_loss_rejects_bad_tensors(index, match):
    args = list(_args())
    args[index] = torch.zeros(2, 3, 1)
    with pytest.raises(ValueError, match=match):
        clipped_value_loss(*args)


@pytest.mark.parametrize(
    ("fn", "kwargs", "match"),
    [
        (clipped_policy_loss, {"clip_eps": 0.0}, "clip_eps"),
        (clipped_policy_loss, {"dual_clip": 1.0}, "dual_clip"),
        (clipped_policy_loss, {"dual_clip": 0.5}, "dual_clip"),
        (clipped_policy_loss, {"aggregation": "sum"}, "aggregation"),
        (clipped_value_loss, {"clip_eps": -0.1}, "clip_eps"),
        (clipped_value_loss, {"aggregation": "seq-mean"}, "aggregation"),
    ],
)
def test_losses_reject_bad_options(fn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(*_args(), **kwargs)


def test_aggregate_and_explained_variance_reject_bad_input():
    with pytest.raises(ValueError, match=r"loss_mat .*squeeze"):
        aggregate_loss(torch.zeros(2, 3, 1), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="aggregation"):
        aggregate_loss(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), "mean")
    with pytest.raises(ValueError, match=r"returns .*squeeze"):
        explained_variance(torch.zeros(2, 3), torch.zeros(2, 3, 1), torch.ones(2, 3).bool())
