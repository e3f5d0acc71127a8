from __future__ import annotations

import pytest
import torch

from textrl.rewards import (
    CompositeReward,
    RewardError,
    accuracy_reward,
    tag_count_reward,
    think_format_reward,
)

GOOD = "<think>\nr\n</think>\n<answer>\n42\n</answer>"
BATCH = (["q"] * 3, [GOOD, "<answer>42</answer>", "nope"])
ANSWERS = ["42", "42", "42"]


def test_total_is_weighted_sum_of_raw_components():
    reward = CompositeReward(
        {
            "format": (think_format_reward, 2.0),
            "tags": (tag_count_reward, 0.5),
            "accuracy": accuracy_reward,  # bare function: weight 1.0
        }
    )
    total, raw = reward.components(*BATCH, answer=ANSWERS)
    assert list(raw) == ["format", "tags", "accuracy"]
    assert raw["format"].tolist() == [0.5, 0.0, 0.0]  # raw, not weighted
    assert raw["tags"].tolist() == [1.0, 0.5, 0.0]
    assert raw["accuracy"].tolist() == [1.0, 1.0, 0.0]
    expected = 2.0 * raw["format"] + 0.5 * raw["tags"] + raw["accuracy"]
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(reward(*BATCH, answer=ANSWERS), total)
    assert total.dtype == torch.float32 and total.shape == (3,)


def test_no_hidden_state_between_calls():
    reward = CompositeReward({"tags": tag_count_reward})
    first = reward(*BATCH)
    reward(["q"], ["other"])
    torch.testing.assert_close(reward(*BATCH), first)
    assert reward.weights == {"tags": 1.0}


def test_weights_copy_cannot_mutate_reward():
    reward = CompositeReward({"tags": (tag_count_reward, 3.0)})
    reward.weights["tags"] = 0.0
    assert reward.weights == {"tags": 3.0}


def test_negative_and_zero_weights_allowed():
    reward = CompositeReward({"tags": (tag_count_reward, -1.0), "format": (think_format_reward, 0)})
    total, raw = reward.components(*BATCH)
    torch.testing.assert_close(total, -raw["tags"])


def test_failing_component_is_named():
    def broken(prompts, completions, **kwargs):
        return torch.ones(len(completions) + 1)

    reward = CompositeReward({"tags": tag_count_reward, "broken": broken})
    with pytest.raises(RewardError, match=r"reward 'broken' returned shape \(4,\), expected \[3\]"):
        reward(*BATCH)


def test_missing_field_of_a_component_is_reported():
    reward = CompositeReward({"accuracy": accuracy_reward})
    with pytest.raises(RewardError, match=r"reward 'accuracy' raised ValueError: .*'answer'"):
        reward(*BATCH)


@pytest.mark.parametrize(
    ("components", "match"),
    [
        ({}, r"at least one component"),
        ({"x": (tag_count_reward, float("nan"))}, r"component 'x'.*not finite"),
        ({"x": (tag_count_reward, "heavy")}, r"component 'x'.*not a number"),
        ({"x": 3.0}, r"component 'x' is not callable"),
        ({"x": (tag_count_reward, 1.0, 2.0)}, r"give \(fn, weight\) or fn"),
        ({"": tag_count_reward}, r"not a non-empty str"),
    ],
)
def test_bad_construction(components, match):
    with pytest.raises(ValueError, match=match):
        CompositeReward(components)


def test_prompt_completion_length_mismatch_names_both():
    reward = CompositeReward({"tags": tag_count_reward})
    with pytest.raises(ValueError, match=r"len\(prompts\)=1 != len\(completions\)=2"):
        reward(["q"], ["a", "b"])


def test_repr_lists_weights():
    reward = CompositeReward({"a": (tag_count_reward, 0.5), "b": tag_count_reward})
    assert repr(reward) == "CompositeReward(a:0.5, b:1)"
