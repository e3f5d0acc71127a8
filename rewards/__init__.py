"""Reward functions: rule-based, neural (a reward model), composite, and a registry by name.

A reward function is ``fn(prompts: list[str], completions: list[str], **kwargs) -> Tensor``
(float32 ``[B]``); see :mod:`rewards.base` for the batch fields in ``kwargs``.

>>> from rewards import parse_reward_spec
>>> reward = parse_reward_spec("think_format:0.5,tag_count,accuracy:2")
>>> total, raw = reward.components(["q"], ["<answer>4</answer>"], answer=["4"])
>>> total.tolist(), {k: v.tolist() for k, v in raw.items()}
([2.5], {'think_format': [0.0], 'tag_count': [0.5], 'accuracy': [1.0]})
"""

from rewards.base import RewardError, RewardFn, call_reward, named, reward_name
from rewards.composite import CompositeReward
from rewards.neural import NeuralReward
from rewards.penalties import length_penalty, missing_eos_penalty, repetition_penalty
from rewards.registry import (
    REWARD_LOADERS,
    REWARDS,
    check_reward_spec,
    get_reward,
    parse_reward_spec,
    register_reward,
)
from rewards.rules import accuracy_reward, tag_count_reward, think_format_reward

__all__ = [
    "REWARDS",
    "REWARD_LOADERS",
    "CompositeReward",
    "NeuralReward",
    "RewardError",
    "RewardFn",
    "accuracy_reward",
    "call_reward",
    "check_reward_spec",
    "get_reward",
    "length_penalty",
    "missing_eos_penalty",
    "named",
    "parse_reward_spec",
    "register_reward",
    "repetition_penalty",
    "reward_name",
    "tag_count_reward",
    "think_format_reward",
]
