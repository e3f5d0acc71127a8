"""Masked reductions against references on the selected elements; response_mask cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from textrl.functional.masking import (
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    response_mask,
)

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def batches(draw, min_valid: int = 0):
    """x float64 [B, T], a bool mask (arbitrary pattern) with at least ``min_valid`` Trues."""
    b = draw(st.integers(1, 5))
    t = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, generator=g, dtype=torch.float64) * 3 + 1
    bits = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    mask = torch.tensor(bits, dtype=torch.bool).reshape(b, t)
    flat = mask.flatten()
    need = max(0, min_valid - int(flat.sum()))
    flat[torch.nonzero(~flat).flatten()[:need]] = True
    return x, flat.reshape(b, t)


def poison(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x with NaN, +inf, -inf cycling through its masked positions."""
    junk = torch.tensor([math.nan, math.inf, -math.inf], dtype=x.dtype)
    idx = torch.arange(x.numel()).reshape(x.shape) % 3
    return torch.where(mask, x, junk[idx])


@SETTINGS
@given(batches())
def test_masked_sum_mean_match_reference(data):
    x, mask = data
    assert torch.allclose(masked_sum(x, mask), x[mask].sum())
    expected_mean = x[mask].mean() if mask.any() else torch.tensor(0.0, dtype=x.dtype)
    assert torch.allclose(masked_mean(x, mask), expected_mean)
    row_sum = masked_sum(x, mask, dim=1)
    row_mean = masked_mean(x, mask, dim=1)
    assert row_sum.shape == row_mean.shape == (x.shape[0],)
    for i in range(x.shape[0]):
        sel = x[i][mask[i]]
        assert torch.allclose(row_sum[i], sel.sum())
        assert torch.allclose(row_mean[i], sel.mean() if sel.numel() else torch.zeros(()).double())


@SETTINGS
@given(batches(), st.booleans())
def test_masked_var_matches_reference(data, unbiased):
    x, mask = data
    sel = x[mask]
    expected = sel.var(unbiased=unbiased) if sel.numel() >= 2 else torch.zeros((), dtype=x.dtype)
    assert torch.allclose(masked_var(x, mask, unbiased=unbiased), expected)


@SETTINGS
@given(batches())
def test_padding_invariance(data):
    x, mask = data
    bad = poison(x, mask)
    assert torch.equal(masked_sum(bad, mask), masked_sum(x, mask))
    assert torch.equal(masked_mean(bad, mask, dim=1), masked_mean(x, mask, dim=1))
    assert torch.equal(masked_var(bad, mask), masked_var(x, mask))
    for shift in (True, False):
        out = masked_whiten(bad, mask, shift_mean=shift)
        assert torch.equal(out, masked_whiten(x, mask, shift_mean=shift))
        assert torch.isfinite(out).all()
        assert (out[~mask] == 0).all()


@SETTINGS
@given(batches(min_valid=2))
def test_masked_whiten_mean0_std1(data):
    x, mask = data
    assume(int(mask.sum()) >= 2)
    out = masked_whiten(x, mask)
    sel = out[mask]
    assert abs(float(sel.mean())) < 1e-6
    var = float(x[mask].double().var())  # the eps=1e-8 under the root leaves std sqrt(var / (var + eps))
    assert abs(float(sel.std()) - (var / (var + 1e-8)) ** 0.5) < 1e-6
    kept = masked_whiten(x, mask, shift_mean=False)[mask]
    assert torch.allclose(kept, sel + x[mask].mean())


def test_masked_whiten_one_or_no_valid_token_is_finite():
    x = torch.tensor([[5.0, math.nan, math.inf]])
    one = torch.tensor([[True, False, False]])
    assert torch.equal(masked_whiten(x, one), torch.zeros(1, 3))
    assert torch.equal(masked_whiten(x, one, shift_mean=False), torch.tensor([[5.0, 0.0, 0.0]]))
    none = torch.zeros(1, 3, dtype=torch.bool)
    assert torch.equal(masked_whiten(x, none), torch.zeros(1, 3))
    assert masked_mean(x, none) == 0 and masked_var(x, none) == 0
    assert torch.equal(masked_mean(x, none, dim=1), torch.zeros(1))
    assert masked_var(x, one) == 0


def test_masked_float32_dim1_and_3d():
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    mask = x % 2 == 0
    assert masked_sum(x, mask) == x[mask].sum()
    assert torch.allclose(masked_mean(x, mask, dim=-1), x[..., ::2].mean(-1))


@pytest.mark.parametrize("fn", [masked_sum, masked_mean, masked_var, masked_whiten])
def test_bad_inputs(fn):
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="mask.*bool"):
        fn(x, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"mask.*\[2, 3, 1\].*squeeze"):
        fn(x, torch.ones(2, 3, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="x must be a float"):
        fn(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool))


# ---- response_mask ------------------------------------------------------------------------

EOS, PAD = 2, 0


def rm(rows, eos=EOS, pad=None):
    return response_mask(torch.tensor(rows), eos, pad).int().tolist()


@pytest.mark.parametrize(
    ("row", "pad", "expected"),
    [
        ([5, 6, EOS, 7, 8], None, [1, 1, 1, 0, 0]),  # EOS mid-row, kept
        ([EOS, 6, 7], None, [1, 0, 0]),  # EOS first
        ([5, 6, EOS], None, [1, 1, 1]),  # EOS last
        ([5, 6, 7], None, [1, 1, 1]),  # truncated, no pad id
        ([5, 6, 7], PAD, [1, 1, 1]),  # truncated, no padding in it
        ([5, 6, EOS, EOS, EOS], None, [1, 1, 1, 0, 0]),  # several EOS in a row
        ([5, EOS, PAD, PAD], PAD, [1, 1, 0, 0]),  # EOS then pads
        ([5, PAD, 6, PAD, PAD], PAD, [1, 1, 1, 0, 0]),  # no EOS: up to last non-pad
        ([PAD, PAD, PAD], PAD, [0, 0, 0]),  # only pads, no EOS
        ([5, PAD, EOS, PAD], PAD, [1, 1, 1, 0]),  # pad before EOS stays inside (prefix)
    ],
)
def test_response_mask_cases(row, pad, expected):
    assert rm([row], pad=pad) == [expected]


def test_response_mask_pad_equals_eos_keeps_first_eos():
    assert rm([[5, 6, EOS, EOS, EOS], [EOS, EOS, EOS, EOS, EOS], [5, 6, 7, 8, 9]], pad=EOS) == [
        [1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1],
    ]


def test_response_mask_list_of_eos_ids():
    rows = [[5, 9, 2, 7], [5, 2, 9, 7], [5, 6, 7, 8]]
    assert rm(rows, eos=[2, 9]) == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert rm(rows, eos=(9,)) == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    # a pad id that is one of several EOS ids behaves like pad == eos
    assert rm([[5, 9, 9, 9]], eos=[2, 9], pad=9) == [[1, 1, 0, 0]]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 4), min_size=6, max_size=6), min_size=1, max_size=5),
    st.sampled_from([None, 0, 2]),
)
def test_response_mask_is_prefix_and_matches_loop(rows, pad):
    tokens = torch.tensor(rows)
    mask = response_mask(tokens, EOS, pad)
    assert mask.dtype == torch.bool and mask.shape == tokens.shape
    for row, m in zip(rows, mask.tolist()):
        n = sum(m)
        assert m == [True] * n + [False] * (len(row) - n)
        if EOS in row:
            assert n == row.index(EOS) + 1
        elif pad is not None and pad != EOS:
            assert n == max((i + 1 for i, tok in enumerate(row) if tok != pad), default=0)
        else:
            assert n == len(row)


def test_response_mask_bad_inputs():
    with pytest.raises(ValueError, match=r"tokens must be \[B, T\]"):
        response_mask(torch.zeros(3, dtype=torch.long), EOS)
    with pytest.raises(ValueError, match="tokens must be an integer"):
        response_mask(torch.zeros(2, 3), EOS)
    with pytest.raises(ValueError, match="eos_token_id"):
        response_mask(torch.zeros(2, 3, dtype=torch.long), [])
    with pytest.raises(ValueError, match="pad_token_id"):
        response_mask(torch.zeros(2, 3, dtype=torch.long), EOS, 1.5)
