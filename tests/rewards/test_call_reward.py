from __future__ import annotations

import numpy as np
import pytest
import torch

from textrl.rewards import RewardError, call_reward, named

PROMPTS = ["p"] * 3
COMPLETIONS = ["ok", "bad", "ok"]


@named("fine")
def fine(prompts, completions, **kwargs):
    return torch.tensor([1.0, 2.0, 3.0])


@pytest.mark.parametrize(
    "output",
    [
        [1.0, 2.0, 3.0],  # list
        (1, 2, 3),  # tuple of ints
        np.array([1.0, 2.0, 3.0]),  # ndarray float64
        torch.tensor([1, 2, 3]),  # int64 tensor
        torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64),  # float64 tensor
        torch.tensor([1.0, 2.0, 3.0], requires_grad=True),  # needs detaching
    ],
)
def test_valid_outputs_become_float32_b(output):
    out = call_reward(lambda p, c, **kw: output, PROMPTS, COMPLETIONS)
    assert out.dtype == torch.float32 and not out.requires_grad
    assert out.tolist() == [1.0, 2.0, 3.0]


def test_kwargs_are_forwarded():
    out = call_reward(
        lambda p, c, *, scale=0, **kw: torch.full((len(c),), float(scale)),
        PROMPTS,
        COMPLETIONS,
        scale=4,
    )
    assert out.tolist() == [4.0] * 3


def test_raising_reward_names_function_and_rows():
    @named("picky")
    def picky(prompts, completions, **kwargs):
        if "bad" in completions:
            raise KeyError("bad")
        return torch.zeros(len(completions))

    with pytest.raises(
        RewardError,
        match=r"reward 'picky' raised KeyError: 'bad'; rows that raise on their own: \[1\]; fix",
    ):
        call_reward(picky, PROMPTS, COMPLETIONS)


def test_raising_on_every_row():
    def always(prompts, completions, **kwargs):
        raise RuntimeError("no")

    with pytest.raises(
        RewardError, match=r"reward 'always' raised RuntimeError: no; rows: every row raises"
    ):
        call_reward(always, PROMPTS, COMPLETIONS)


def test_raising_only_on_the_whole_batch():
    def needs_one(prompts, completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("batch too big")
        return torch.zeros(len(completions))

    with pytest.raises(RewardError, match=r"no single row raises on its own"):
        call_reward(needs_one, PROMPTS, COMPLETIONS)


def test_per_row_retry_slices_batch_fields():
    def by_answer(prompts, completions, *, answer, **kwargs):
        if any(a is None for a in answer):
            raise ValueError("missing answer")
        return torch.zeros(len(completions))

    with pytest.raises(RewardError, match=r"rows that raise on their own: \[2\]"):
        call_reward(
            by_answer,
            PROMPTS,
            COMPLETIONS,
            answer=["1", "2", None],
            truncated=torch.zeros(3),
            scale=torch.tensor(2.0),
        )


def test_missing_kwargs_in_signature_gets_a_hint():
    def strict(prompts, completions):
        return torch.zeros(len(completions))

    with pytest.raises(
        RewardError, match=r"reward 'strict' raised TypeError.*must accept \*\*kwargs"
    ):
        call_reward(strict, PROMPTS, COMPLETIONS, answer=["1"] * 3)


@pytest.mark.parametrize(
    ("value", "row", "shown"),
    [(float("nan"), 1, "nan"), (float("inf"), 2, "inf"), (float("-inf"), 0, "-inf")],
)
def test_non_finite_scores_name_rows(value, row, shown):
    @named("wild")
    def wild(prompts, completions, **kwargs):
        out = torch.zeros(len(completions))
        out[row] = value
        return out

    with pytest.raises(
        RewardError,
        match=rf"reward 'wild' returned non-finite scores \[{shown}\] in rows \[{row}\]; return a finite score",
    ):
        call_reward(wild, PROMPTS, COMPLETIONS)


@pytest.mark.parametrize(
    ("output", "match"),
    [
        (
            torch.zeros(3, 1),
            r"returned shape \(3, 1\), expected \[3\] \(a \[B, 1\] tensor: use \.squeeze\(-1\)\)",
        ),
        (torch.zeros(4), r"returned shape \(4,\), expected \[3\] \(4 scores for 3 completions"),
        (torch.zeros(2), r"returned shape \(2,\), expected \[3\]"),
        (torch.tensor(1.0), r"returned shape \(\), expected \[3\]"),
        (np.zeros((3, 2)), r"returned shape \(3, 2\), expected \[3\]"),
        ([[1.0], [2.0], [3.0]], r"returned shape \(3, 1\)"),
        (1.0, r"returned float, expected a float tensor of shape \[3\]"),
        (None, r"returned NoneType"),
        ({"a": 1}, r"returned dict"),
        (["a", "b", "c"], r"returned a list that is not 3 numbers"),
        (torch.zeros(3, dtype=torch.complex64), r"returned dtype torch.complex64"),
    ],
)
def test_bad_outputs(output, match):
    @named("shaky")
    def shaky(prompts, completions, **kwargs):
        return output

    with pytest.raises(RewardError, match=r"reward 'shaky' " + match):
        call_reward(shaky, PROMPTS, COMPLETIONS)


def test_reward_error_is_a_value_error():
    assert issubclass(RewardError, ValueError)


def test_length_mismatch_names_both():
    with pytest.raises(ValueError, match=r"len\(prompts\)=2 != len\(completions\)=3"):
        call_reward(fine, ["p", "p"], COMPLETIONS)


@pytest.mark.parametrize("which", ["prompts", "completions"])
def test_single_string_instead_of_list(which):
    args = {"prompts": ["p"], "completions": ["c"]}
    args[which] = "oops"
    with pytest.raises(ValueError, match=rf"{which} is a single str"):
        call_reward(fine, args["prompts"], args["completions"])


def test_name_falls_back_to_dunder_name_and_class():
    def plain(prompts, completions, **kwargs):
        return [float("nan")] * len(completions)

    class Scorer:
        def __call__(self, prompts, completions, **kwargs):
            return None

    with pytest.raises(RewardError, match=r"reward 'plain'"):
        call_reward(plain, ["p"], ["c"])
    with pytest.raises(RewardError, match=r"reward 'Scorer'"):
        call_reward(Scorer(), ["p"], ["c"])


def test_a_trl_style_function_gets_prompts_and_completions_by_keyword():
    """TRL calls ``reward_func(prompts=..., completions=..., **fields)``: its documented
    ``def reward_len(completions, **kwargs)`` must work unchanged."""

    def reward_len(completions, **kwargs):
        assert kwargs["prompts"] == ["p", "q"] and kwargs["answer"] == ["1", "2"]
        return [-abs(20 - len(c)) for c in completions]

    out = call_reward(reward_len, ["p", "q"], ["a" * 20, "b"], answer=["1", "2"])
    assert out.tolist() == [0.0, -19.0]
    positional = call_reward(lambda p, c, **kw: [len(x) for x in c], ["p"], ["abc"])  # other names: by position
    assert positional.tolist() == [3.0]
