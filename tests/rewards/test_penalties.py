from __future__ import annotations

import pytest
import torch

from textrl.rewards import length_penalty, missing_eos_penalty, repetition_penalty

LENGTH_CASES = [
    # (n_tokens, target, per_token, cap, expected)
    (3, 5, 0.1, None, 0.0),  # under the target: no penalty
    (5, 5, 0.1, None, 0.0),  # exactly at the target
    (8, 5, 0.5, None, -1.5),  # 3 tokens over
    (105, 5, 0.5, 2.0, -2.0),  # capped at max_penalty
    (0, 0, 1.0, None, 0.0),  # empty completion
]


@pytest.mark.parametrize(("n", "target", "per_token", "cap", "expected"), LENGTH_CASES)
def test_length_penalty_table(n, target, per_token, cap, expected):
    out = length_penalty(
        ["q"],
        ["x"],
        completion_ids=[[1] * n],
        target_tokens=target,
        penalty_per_token=per_token,
        max_penalty=cap,
    )
    assert out.dtype == torch.float32
    assert out.item() == pytest.approx(expected)


def test_length_penalty_is_never_negative_zero():
    out = length_penalty(["q"], ["x"], completion_ids=[[1]], target_tokens=5)
    assert torch.signbit(out).tolist() == [False]


def test_length_penalty_padded_tensor_with_mask():
    ids = torch.tensor([[5, 6, 7, 0], [5, 0, 0, 0]])
    mask = ids != 0
    out = length_penalty(
        ["q"] * 2,
        ["a", "b"],
        completion_ids=ids,
        completion_mask=mask,
        target_tokens=1,
        penalty_per_token=1.0,
    )
    assert out.tolist() == [-2.0, 0.0]


def test_length_penalty_padded_tensor_without_mask_says_what_to_pass():
    with pytest.raises(ValueError, match=r"length_penalty: .*pass completion_mask"):
        length_penalty(["q"], ["a"], completion_ids=torch.ones(1, 4, dtype=torch.long))


def test_length_penalty_needs_completion_ids():
    with pytest.raises(ValueError, match=r"length_penalty needs the batch field 'completion_ids'"):
        length_penalty(["q"], ["a"])


def test_length_penalty_rejects_negative_setting():
    with pytest.raises(ValueError, match=r"penalty_per_token=-1"):
        length_penalty(["q"], ["a"], completion_ids=[[1]], penalty_per_token=-1)


REPETITION_CASES = [
    # (completion, ngram_size, expected)
    ("the cat sat on the mat", 3, 0.0),  # no repeated trigram
    ("a b a b a b", 2, -0.6),  # bigrams ab ba ab ba ab: 2 unique of 5
    ("go go go go go", 1, -0.8),  # 1 unique word of 5
    ("go go go go go", 3, -2 / 3),  # ggg x3: 1 unique of 3
    ("too short", 3, 0.0),  # fewer words than n: nothing to repeat
    ("", 3, 0.0),  # empty completion
]


@pytest.mark.parametrize(("completion", "n", "expected"), REPETITION_CASES)
def test_repetition_penalty_table(completion, n, expected):
    out = repetition_penalty(["q"], [completion], ngram_size=n)
    assert out.item() == pytest.approx(expected, abs=1e-6)


def test_repetition_penalty_tokens_and_scale():
    out = repetition_penalty(
        ["q"],
        ["ignored"],
        unit="tokens",
        ngram_size=1,
        max_penalty=2.0,
        completion_ids=[[3, 3, 3, 3]],
    )
    assert out.item() == pytest.approx(-1.5)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"ngram_size": 0}, r"ngram_size=0 must be >= 1"),
        ({"unit": "chars"}, r"unit='chars'; use 'words' or 'tokens'"),
        ({"max_penalty": -1.0}, r"max_penalty=-1.0 must be >= 0"),
    ],
)
def test_repetition_penalty_bad_settings(settings, match):
    with pytest.raises(ValueError, match=match):
        repetition_penalty(["q"], ["a"], **settings)


@pytest.mark.parametrize(
    "truncated",
    [
        [False, True, True],  # list
        torch.tensor([False, True, True]),  # bool [B]
        torch.tensor([[0], [1], [1]]),  # [B, 1], ints
    ],
)
def test_missing_eos_penalty(truncated):
    out = missing_eos_penalty(["q"] * 3, ["a.", "b", "c"], truncated=truncated, penalty=0.5)
    assert out.tolist() == [0.0, -0.5, -0.5]
    assert out.dtype == torch.float32


def test_missing_eos_penalty_needs_truncated():
    with pytest.raises(ValueError, match=r"missing_eos_penalty needs the batch field 'truncated'"):
        missing_eos_penalty(["q"], ["a"])


def test_missing_eos_penalty_wrong_length():
    with pytest.raises(ValueError, match=r"truncated has 1 entries for 2"):
        missing_eos_penalty(["q"] * 2, ["a", "b"], truncated=[True])
