"""Token-level MDP environments (Gymnasium and TorchRL), task environments, the generate fast path,
prompt sources.

Importing ``textrl.envs`` registers ``textrl/TokenMDP-v0`` and ``textrl/<Id>-v0`` for every
registered environment with Gymnasium::

    import gymnasium as gym, textrl.envs
    env = gym.make("textrl/TokenMDP-v0")        # tiny offline tokenizer, built-in digits prompts

Gymnasium >= 1.0 has no plugin entry points; without the import, name the module in the id:
``gym.make("textrl.envs:textrl/TokenMDP-v0")``.

``TextGenEnv`` and ``to_rollout`` (TorchRL) are imported on first use, so ``import textrl.envs``
does not import TorchRL (see :mod:`textrl.envs.torchrl_env` about its start method).
"""

from __future__ import annotations

from typing import Any

from textrl.envs.collector import EpisodeRunner, collect_episodes
from textrl.envs.environment import EnvError, Environment, Episode, PromptTask, Turn
from textrl.envs.fast_path import (
    Scores,
    place_score,
    rollout_from_responses,
    score_completions,
)
from textrl.envs.gym_ids import TimeLimitCap, register
from textrl.envs.observations import observation_ids
from textrl.envs.policies import KVCachePolicy
from textrl.envs.prompts import (
    PromptDataset,
    PromptSampler,
    check_prompts_fit,
    encode_prompts,
    load_prompts,
)
from textrl.envs.prompts.table import PromptTable
from textrl.envs.registry import env_ids, make_env, register_env
from textrl.envs.tasks import make_digits_task
from textrl.envs.token_mdp import ENV_ID, TokenMDPEnv

_TORCHRL = {"TextGenEnv": "textrl.envs.torchrl_env", "to_rollout": "textrl.envs.torchrl_rollout"}
"""Names of the TorchRL modules -> the module of each, imported on first use."""


def __getattr__(name: str) -> Any:
    if name in _TORCHRL:
        import importlib

        return getattr(importlib.import_module(_TORCHRL[name]), name)
    raise AttributeError(f"module 'textrl.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_TORCHRL))


register()

__all__ = [
    "ENV_ID",
    "EnvError",
    "Environment",
    "Episode",
    "EpisodeRunner",
    "KVCachePolicy",
    "PromptDataset",
    "PromptSampler",
    "PromptTable",
    "PromptTask",
    "Scores",
    "TextGenEnv",
    "TimeLimitCap",
    "TokenMDPEnv",
    "Turn",
    "check_prompts_fit",
    "collect_episodes",
    "encode_prompts",
    "env_ids",
    "load_prompts",
    "make_digits_task",
    "make_env",
    "observation_ids",
    "place_score",
    "register_env",
    "rollout_from_responses",
    "score_completions",
    "to_rollout",
]
