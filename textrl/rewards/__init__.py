"""Reward functions: rule-based, neural (a reward model, in this process or served), an LLM judge, composite,
and a registry by name.

A reward function is ``fn(prompts, completions, **kwargs) -> Tensor`` (float32 ``[B]``, or a
list with None where it does not apply), called as TRL's ``GRPOTrainer`` calls its
``reward_funcs``: strings for plain prompts, message lists for conversational rows; see
:mod:`textrl.rewards.base` for the two forms and the batch fields in ``kwargs``.

>>> from textrl.rewards import parse_reward_spec
>>> reward = parse_reward_spec("think_format:0.5,tag_count,accuracy:2")
>>> total, raw = reward.components(["q"], ["<answer>4</answer>"], answer=["4"])
>>> total.tolist(), {k: v.tolist() for k, v in raw.items()}
([2.5], {'think_format': [0.0], 'tag_count': [0.5], 'accuracy': [1.0]})
"""

from textrl.rewards.background import DEFAULT_CONCURRENCY, RewardPool
from textrl.rewards.base import (
    RewardError,
    RewardFn,
    call_reward,
    completion_text,
    does_io,
    evaluate_reward,
    is_async_reward,
    named,
    overlapped,
    reward_name,
)
from textrl.rewards.composite import (
    CompositeReward,
    NoApplicableRewardWarning,
    RewardBreakdown,
    combine_scores,
)
from textrl.rewards.judge import JudgeReward
from textrl.rewards.neural import NeuralReward
from textrl.rewards.penalties import length_penalty, missing_eos_penalty, repetition_penalty
from textrl.rewards.registry import (
    REWARD_LOADERS,
    REWARDS,
    check_reward_spec,
    get_reward,
    parse_reward_spec,
    register_reward,
)
from textrl.rewards.rules import accuracy_reward, tag_count_reward, think_format_reward
from textrl.rewards.served import ServedReward

__all__ = [
    "DEFAULT_CONCURRENCY",
    "REWARDS",
    "REWARD_LOADERS",
    "CompositeReward",
    "JudgeReward",
    "NeuralReward",
    "NoApplicableRewardWarning",
    "RewardBreakdown",
    "RewardError",
    "RewardFn",
    "RewardPool",
    "ServedReward",
    "accuracy_reward",
    "call_reward",
    "check_reward_spec",
    "combine_scores",
    "completion_text",
    "does_io",
    "evaluate_reward",
    "get_reward",
    "is_async_reward",
    "length_penalty",
    "missing_eos_penalty",
    "named",
    "overlapped",
    "parse_reward_spec",
    "register_reward",
    "repetition_penalty",
    "reward_name",
    "tag_count_reward",
    "think_format_reward",
]
