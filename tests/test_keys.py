from __future__ import annotations

import dataclasses

import pytest

from textrl.keys import KEYS, RolloutKeys


def test_keys_match_design_table():
    assert KEYS.action == "action"
    assert KEYS.mask == ("collector", "mask")
    assert KEYS.action_log_prob == "action_log_prob"
    assert KEYS.reward == ("next", "reward")
    assert KEYS.done == ("next", "done")
    assert KEYS.prompt_tokens == ("tokens", "prompt")
    assert KEYS.reward_component("think_format") == ("reward_components", "think_format")


def test_keys_are_frozen_and_unique():
    with pytest.raises(dataclasses.FrozenInstanceError):
        KEYS.action = "other"  # type: ignore[misc]
    values = list(KEYS.all().values())
    assert len(values) == len(set(values))


def test_keys_can_be_renamed():
    keys = RolloutKeys(action="tokens_out")
    assert keys.action == "tokens_out" and KEYS.action == "action"
