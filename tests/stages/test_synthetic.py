"""The built-in ``case`` task: splits, balance, and the rule behind its preferences."""

from __future__ import annotations

import doctest

import pytest

from textrl.envs import synthetic
from textrl.envs.synthetic import (
    case_follow_reward,
    case_preferences,
    case_prompts,
    case_sft_pairs,
    case_style,
    follows_case,
)
from textrl.stages import dpo, preferences


@pytest.mark.parametrize("module", [synthetic, preferences, dpo])
def test_doctests_pass(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_heldout_prompts_are_unseen_by_sft_and_reward_model():
    train = {r["prompt"] for r in case_prompts("train")}
    held = {r["prompt"] for r in case_prompts("heldout")}
    assert len(train) == 256 and len(held) == 128 and not train & held
    assert {r["prompt"] for r in case_sft_pairs(1024)} <= train
    assert {r["prompt"] for r in case_preferences()} == train


def test_styles_are_balanced_and_sft_follows_at_the_given_rate():
    rows = case_prompts("heldout")
    assert 0.4 < sum(r["style"] == "capital" for r in rows) / len(rows) < 0.6
    pairs = case_sft_pairs(2000, follow_rate=0.5, seed=3)
    rate = sum(follows_case(r["response"], case_style(r["prompt"])) for r in pairs) / len(pairs)
    assert 0.45 < rate < 0.55
    assert case_sft_pairs(8, seed=1) == case_sft_pairs(8, seed=1) != case_sft_pairs(8, seed=2)


def test_chosen_follows_the_rule_and_rejected_does_not():
    rows = case_preferences(split="heldout")
    chosen = case_follow_reward([r["prompt"] for r in rows], [r["chosen"] for r in rows])
    rejected = case_follow_reward([r["prompt"] for r in rows], [r["rejected"] for r in rows])
    assert chosen.tolist() == [1.0] * len(rows) and rejected.tolist() == [0.0] * len(rows)


def test_rule_loads_as_a_reward_file_with_weight_zero():
    from textrl.rewards import parse_reward_spec

    reward = parse_reward_spec(f"{synthetic.__file__}:case_follow_reward:0,tag_count")
    total, parts = reward.components(["Describe the sky. Use capital letters."], ["THE SKY."])
    assert parts["case_follow_reward"].tolist() == [1.0] and total.tolist() == [0.0]
