"""Token-level MDP environments (Gymnasium and TorchRL), the generate fast path, prompt sources.

Importing ``textrl.envs`` registers ``textrl/TokenMDP-v0`` with Gymnasium::

    import gymnasium as gym, textrl.envs
    env = gym.make("textrl/TokenMDP-v0")        # tiny offline tokenizer, built-in digits prompts
"""

from __future__ import annotations

from textrl.envs.collector import EpisodeRunner, collect_episodes
from textrl.envs.environment import EnvError, Environment, Episode, PromptTask, Turn
from textrl.envs.fast_path import (
    Scores,
    place_score,
    rollout_from_responses,
    score_completions,
)
from textrl.envs.policies import KVCachePolicy
from textrl.envs.prompt_table import PromptTable
from textrl.envs.prompts import (
    PromptDataset,
    PromptSampler,
    check_prompts_fit,
    encode_prompts,
    load_prompts,
)
from textrl.envs.registry import env_ids, make_env, register_env
from textrl.envs.tasks import make_digits_task
from textrl.envs.token_mdp import ENV_ID, TokenMDPEnv, register
from textrl.envs.torchrl_env import TextGenEnv

register()

__all__ = [
    "ENV_ID",
    "EnvError",
    "Environment",
    "Episode",
    "EpisodeRunner",
    "PromptTask",
    "Turn",
    "collect_episodes",
    "encode_prompts",
    "env_ids",
    "make_env",
    "register_env",
    "KVCachePolicy",
    "PromptDataset",
    "PromptSampler",
    "PromptTable",
    "Scores",
    "TextGenEnv",
    "TokenMDPEnv",
    "check_prompts_fit",
    "load_prompts",
    "make_digits_task",
    "place_score",
    "rollout_from_responses",
    "score_completions",
]
