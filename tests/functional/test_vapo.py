"""VAPO's pieces (Yue et al. 2025, arXiv:2504.05118): the length-adaptive lambda in closed form,
GAE with a lambda per row against a reference loop (and against ``gae`` row by row)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from textrl import testing
from textrl.functional import gae, gae_row_lambda, length_adaptive_lambda

SETTINGS = settings(max_examples=40, deadline=None)


def reference_row_lambda_gae(rewards, values, mask, gamma, lam):
    """GAE as a loop over rows and, backwards, over the row's True positions, row ``i`` with ``lam[i]``."""
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    ret = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        next_value, next_adv = 0.0, 0.0
        for j in reversed(range(mask.shape[1])):
            if not mask[i, j]:
                continue
            delta = float(rewards[i, j]) + gamma * next_value - float(values[i, j])
            next_adv = delta + gamma * float(lam[i]) * next_adv
            next_value = float(values[i, j])
            adv[i, j], ret[i, j] = next_adv, next_adv + float(values[i, j])
    return adv, ret


@st.composite
def row_lambda_batch(draw, multi_turn: bool):
    mask = draw(testing.masks(batch=(1, 5), time=(1, 40), multi_turn=multi_turn))
    rewards = draw(testing.float_tensors(mask.shape))
    values = draw(testing.float_tensors(mask.shape))
    lam = torch.tensor(draw(st.lists(st.sampled_from([0.0, 0.3, 0.95, 1.0]), min_size=mask.shape[0],
                                     max_size=mask.shape[0])), dtype=torch.float64)
    gamma = draw(st.sampled_from([0.0, 0.9, 1.0]))
    return rewards, values, mask, gamma, lam


@SETTINGS
@given(row_lambda_batch(multi_turn=True))
def test_gae_row_lambda_matches_the_reference_loop_on_gapped_masks(batch):
    rewards, values, mask, gamma, lam = batch
    testing.check_agrees_with_reference(gae_row_lambda, reference_row_lambda_gae, rewards, values, mask, gamma, lam,
                                        mask=mask)
    adv, ret = gae_row_lambda(rewards, values, mask, gamma, lam)
    assert not adv[~mask].any() and not ret[~mask].any()


@SETTINGS
@given(row_lambda_batch(multi_turn=False))
def test_gae_row_lambda_is_gae_row_by_row(batch):
    rewards, values, mask, gamma, lam = batch
    adv, ret = gae_row_lambda(rewards, values, mask, gamma, lam)
    for i in range(mask.shape[0]):
        row = slice(i, i + 1)
        ref_adv, ref_ret = gae(rewards[row], values[row], mask[row], gamma, float(lam[i]))
        torch.testing.assert_close(adv[row], ref_adv)
        torch.testing.assert_close(ret[row], ref_ret)


def test_a_constant_row_lambda_is_gae():
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 9, generator=gen), torch.randn(4, 9, generator=gen)
    mask = torch.arange(9)[None, :] < torch.tensor([[9], [3], [1], [6]])
    got = gae_row_lambda(rewards, values, mask, 0.99, torch.full((4,), 0.95))
    for g, want in zip(got, gae(rewards, values, mask, 0.99, 0.95)):
        torch.testing.assert_close(g, want)


def test_gamma_lambda_one_gives_the_return_minus_the_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 2.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv, ret = gae_row_lambda(rewards, values, mask, 1.0, torch.ones(2))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [2.5, 2.0, 0.0]]))
    torch.testing.assert_close(adv, ret - torch.where(mask, values, 0.0))


def test_length_adaptive_lambda_closed_form():
    lengths = torch.tensor([0, 5, 20, 40, 100, 1000])
    got = length_adaptive_lambda(lengths, 0.05)  # 1 - 1 / (0.05 l), clamped to [0, 1]
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, 0.0, 0.5, 0.8, 0.98]))
    assert got.dtype == torch.float32
    assert length_adaptive_lambda(lengths.double(), 0.05).dtype == torch.float64


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=20), st.floats(1e-3, 1.0))
def test_length_adaptive_lambda_lies_in_0_1_and_grows_with_length(lengths, alpha):
    lam = length_adaptive_lambda(torch.tensor(lengths), alpha)
    assert bool(((lam >= 0) & (lam <= 1)).all())
    order = torch.argsort(torch.tensor(lengths))
    assert bool((lam[order].diff() >= 0).all())


@pytest.mark.parametrize("lengths, alpha, message", [
    (torch.ones(2, 2), 0.05, r"lengths must be 1-D|\[B\]"),
    (torch.ones(3, dtype=torch.bool), 0.05, r"lengths must be an int or float tensor"),
    (torch.ones(3), 0.0, r"alpha=0.0: must be a number > 0"),
    (torch.ones(3), True, r"alpha=True: must be a number > 0"),
])
def test_length_adaptive_lambda_refuses_bad_inputs(lengths, alpha, message):
    with pytest.raises(ValueError, match=message):
        length_adaptive_lambda(lengths, alpha)


def test_gae_row_lambda_refuses_a_bad_lambda():
    rewards = values = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"lam must be \[B\] with B=2"):
        gae_row_lambda(rewards, values, mask, 1.0, torch.ones(3))
    with pytest.raises(ValueError, match=r"lam must lie in \[0, 1\]"):
        gae_row_lambda(rewards, values, mask, 1.0, torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match=r"lam"):
        gae_row_lambda(rewards, values, mask, 1.0, torch.ones(2, dtype=torch.long))
