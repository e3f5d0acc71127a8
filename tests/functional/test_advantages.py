from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrl.objectives.value.functional import generalized_advantage_estimate

from tests.arithmetic import assert_within, gae_tolerance
from textrl import testing
from textrl.functional.advantages import (
    gae,
    grpo_advantage,
    last_valid,
    one_step_advantage,
    rloo_advantage,
)

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def ragged_batch(draw):
    """rewards, values [B, T] float64, a single-turn (prefix) mask drawn by textrl.testing, gamma, lam."""
    mask = draw(testing.masks(batch=(1, 5), time=(1, 70), multi_turn=False))  # T > 32: several scan blocks
    rewards = draw(testing.float_tensors(mask.shape))
    values = draw(testing.float_tensors(mask.shape))
    gamma = draw(st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]))
    lam = draw(st.sampled_from([0.0, 0.5, 0.95, 1.0]))
    return rewards, values, mask, gamma, lam


@SETTINGS
@given(ragged_batch())
def test_gae_matches_python_loop(batch):
    rewards, values, mask, gamma, lam = batch
    testing.check_agrees_with_reference(gae, testing.reference_gae, rewards, values, mask, gamma, lam)


@SETTINGS
@given(ragged_batch())
def test_gae_matches_torchrl(batch):
    rewards, values, mask, gamma, lam = batch
    # float32: TorchRL forms gamma * (~done).int() in the default dtype even for float64 inputs.
    rewards, values = rewards.float(), values.float()
    b, t = rewards.shape
    zero = torch.zeros(())
    v = torch.where(mask, values, zero)
    next_v = torch.where(mask, torch.cat([v[:, 1:], torch.zeros(b, 1)], dim=1), zero)
    done = torch.zeros(b, t, dtype=torch.bool)
    done[torch.arange(b), mask.sum(1) - 1] = True
    ref_adv, ref_ret = generalized_advantage_estimate(
        gamma,
        lam,
        v.unsqueeze(-1),
        next_v.unsqueeze(-1),
        torch.where(mask, rewards, zero).unsqueeze(-1),
        done.unsqueeze(-1),
        done.unsqueeze(-1),
        time_dim=-2,
    )
    adv, ret = gae(rewards, values, mask, gamma, lam)
    # a blocked scan against TorchRL's loop, in float32: within the sums' bound (tests/arithmetic.py)
    adv_tol, ret_tol = gae_tolerance(rewards, values, mask, gamma, lam)
    assert_within(adv[mask], ref_adv.squeeze(-1)[mask], adv_tol[mask], "advantages")
    assert_within(ret[mask], ref_ret.squeeze(-1)[mask], ret_tol[mask], "returns")


@SETTINGS
@given(ragged_batch(), st.floats(-3, 3), st.floats(-3, 3))
def test_gae_closed_form_terminal_score(batch, score, v0):
    """gamma = lam = 1, reward only on the last valid token, constant V: A = score - V."""
    _, _, mask, _, _ = batch
    b, t = mask.shape
    rewards = torch.zeros(b, t, dtype=torch.float64)
    rewards[torch.arange(b), mask.sum(1) - 1] = score
    values = torch.full((b, t), v0, dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv[mask], torch.full_like(adv[mask], score - v0))
    torch.testing.assert_close(ret[mask], torch.full_like(ret[mask], score))


@SETTINGS
@given(ragged_batch(), st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30]))
def test_gae_padding_garbage_does_not_leak(batch, garbage):
    rewards, values, mask, gamma, lam = batch
    adv, ret = gae(rewards, values, mask, gamma, lam)
    dirty_r = torch.where(mask, rewards, garbage)
    dirty_v = torch.where(mask, values, -garbage)
    adv2, ret2 = gae(dirty_r, dirty_v, mask, gamma, lam)
    torch.testing.assert_close(adv2, adv)
    torch.testing.assert_close(ret2, ret)
    assert (adv2[~mask] == 0).all() and (ret2[~mask] == 0).all()


@SETTINGS
@given(ragged_batch(), st.integers(1, 5))
def test_gae_extra_trailing_padding_changes_nothing(batch, extra):
    rewards, values, mask, gamma, lam = batch
    b = rewards.shape[0]
    adv, ret = gae(rewards, values, mask, gamma, lam)
    pad = torch.full((b, extra), float("nan"), dtype=torch.float64)
    adv2, ret2 = gae(
        torch.cat([rewards, pad], 1),
        torch.cat([values, pad], 1),
        torch.cat([mask, torch.zeros(b, extra, dtype=torch.bool)], 1),
        gamma,
        lam,
    )
    torch.testing.assert_close(adv2[:, : rewards.shape[1]], adv)
    torch.testing.assert_close(ret2[:, : rewards.shape[1]], ret)
    assert (adv2[:, rewards.shape[1] :] == 0).all()


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (2, 31), (2, 32), (2, 33), (1, 97)])
def test_gae_edge_shapes(shape):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(*shape, generator=g, dtype=torch.float64)
    values = torch.randn(*shape, generator=g, dtype=torch.float64)
    mask = torch.ones(shape, dtype=torch.bool)
    if shape[0] > 0 and shape[1] > 2:
        mask[0, shape[1] - 2 :] = False
    adv, ret = gae(rewards, values, mask, 0.9, 0.8)
    ref_adv, ref_ret = testing.reference_gae(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)


def test_gae_computes_bf16_in_float32():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.bfloat16)
    values = torch.zeros(1, 3, dtype=torch.bfloat16)
    adv, ret = gae(rewards, values, torch.ones(1, 3, dtype=torch.bool), gamma=1.0, lam=0.5)
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([[0.25, 0.5, 1.0]]))


def test_gae_hand_example():
    rewards = torch.tensor([[1.0, 2.0, 99.0]])
    values = torch.tensor([[0.5, 1.0, 99.0]])
    mask = torch.tensor([[True, True, False]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # delta_1 = 2 - 1 = 1; delta_0 = 1 + 0.5 * 1 - 0.5 = 1; A_0 = 1 + 0.25 * 1.
    torch.testing.assert_close(adv, torch.tensor([[1.25, 1.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.75, 2.0, 0.0]]))


def _bt(b=2, t=3):
    return torch.zeros(b, t), torch.ones(b, t, dtype=torch.bool)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"values": torch.zeros(2, 3, 1)}, r"values .*squeeze"),
        ({"rewards": torch.zeros(2, 3, 1)}, r"rewards .*squeeze"),
        ({"values": torch.zeros(2, 4)}, r"values"),
        ({"rewards": torch.zeros(2, 3, dtype=torch.long)}, r"rewards .*float"),
        ({"mask": torch.ones(2, 3)}, r"mask .*bool"),
        ({"mask": torch.ones(2, 3, 1, dtype=torch.bool)}, r"mask .*\[2, 3\]"),
        ({"gamma": 1.5}, r"gamma"),
        ({"lam": -0.1}, r"lam"),
    ],
)
def test_gae_rejects_bad_input(kwargs, match):
    x, mask = _bt()
    args = {"rewards": x, "values": x.clone(), "mask": mask} | kwargs
    with pytest.raises(ValueError, match=match):
        gae(**args)


def test_last_valid_and_one_step_advantage():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, float("nan")]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    v_last = last_valid(values, mask)
    torch.testing.assert_close(v_last, torch.tensor([3.0, 5.0]))
    score = torch.tensor([1.0, 1.0])
    torch.testing.assert_close(one_step_advantage(score, v_last), torch.tensor([-2.0, -4.0]))
    with pytest.raises(ValueError, match="values_last"):
        one_step_advantage(score, v_last.unsqueeze(-1))
    with pytest.raises(ValueError, match="score"):
        one_step_advantage(score.unsqueeze(-1), v_last)
    with pytest.raises(ValueError, match="empty rows"):
        last_valid(values, torch.zeros(2, 3, dtype=torch.bool))


def test_grpo_hand_example():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0])
    adv = grpo_advantage(scores, group_size=3, eps=1e-6)
    g1 = torch.tensor([1.0, 0.0, 0.0])
    g2 = torch.tensor([1.0, 2.0, 4.0])
    expected = torch.cat(
        [(g1 - g1.mean()) / (g1.std() + 1e-6), (g2 - g2.mean()) / (g2.std() + 1e-6)]
    )
    torch.testing.assert_close(adv, expected)
    # group 1: mean 1/3, std sqrt(1/3): first row (2/3) / sqrt(1/3) = 2/sqrt(3).
    torch.testing.assert_close(adv[0], torch.tensor(2 / 3**0.5), rtol=1e-5, atol=1e-5)


def test_grpo_constant_group_is_zero_and_finite():
    scores = torch.tensor([0.7, 0.7, 0.7, 0.7, 1.0, 0.0, 1.0, 0.0])
    adv = grpo_advantage(scores, group_size=4)
    assert torch.isfinite(adv).all()
    assert (adv[:4] == 0).all()
    assert (adv[4:] != 0).all()


def test_rloo_hand_example():
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0, 6.0])
    adv = rloo_advantage(scores, group_size=3)
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5, -3.0, 0.0, 3.0]))
    assert (rloo_advantage(torch.full((4,), 3.0), group_size=2) == 0).all()


@SETTINGS
@given(st.integers(1, 4), st.integers(2, 6), st.integers(0, 2**31 - 1))
def test_rloo_closed_form(n_groups, k, seed):
    """s_i - mean_{j != i} s_j = k / (k - 1) * (s_i - mean_g), and each group sums to 0."""
    scores = torch.randn(n_groups * k, generator=torch.Generator().manual_seed(seed)).double()
    adv = rloo_advantage(scores, group_size=k)
    g = scores.view(n_groups, k)
    torch.testing.assert_close(adv, (k / (k - 1) * (g - g.mean(1, keepdim=True))).view(-1))
    torch.testing.assert_close(adv.view(n_groups, k).sum(1), torch.zeros(n_groups).double())


def test_group_advantages_reject_bad_input():
    scores = torch.zeros(5)
    with pytest.raises(ValueError, match=r"scores .*group_size=2"):
        grpo_advantage(scores, group_size=2)
    with pytest.raises(ValueError, match=r"scores .*group_size=3"):
        rloo_advantage(torch.zeros(7), group_size=3)
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantage(scores, group_size=1)
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantage(scores, group_size=0)
    with pytest.raises(ValueError, match=r"scores .*\[B\]"):
        grpo_advantage(torch.zeros(4, 1), group_size=2)
    with pytest.raises(ValueError, match="scores .*float"):
        rloo_advantage(torch.zeros(4, dtype=torch.long), group_size=2)


@SETTINGS
@given(testing.groups(group_size=(1, 8)))
def test_grpo_matches_reference_loop(case):
    scores, k = case
    testing.check_agrees_with_reference(grpo_advantage, testing.reference_grpo_advantages, scores, k)


@SETTINGS
@given(testing.groups(group_size=(2, 8)))
def test_rloo_matches_reference_loop(case):
    scores, k = case
    testing.check_agrees_with_reference(rloo_advantage, testing.reference_rloo_advantages, scores, k)
