"""Token-level MDP environments (Gymnasium and TorchRL), the generate fast path, prompt sources.

Importing ``envs`` registers ``textrl/TokenMDP-v0`` with Gymnasium::

    import gymnasium as gym, textrl.envs
    env = gym.make("textrl/TokenMDP-v0")        # tiny offline tokenizer, built-in digits prompts
"""

from __future__ import annotations

from textrl.envs.fast_path import (
    PromptTable,
    Scores,
    place_score,
    rollout_from_responses,
    score_completions,
)
from textrl.envs.policies import KVCachePolicy
from textrl.envs.token_mdp import ENV_ID, TokenMDPEnv, register
from textrl.envs.torchrl_env import TextGenEnv

register()

__all__ = [
    "ENV_ID",
    "KVCachePolicy",
    "PromptTable",
    "Scores",
    "TextGenEnv",
    "TokenMDPEnv",
    "place_score",
    "rollout_from_responses",
    "score_completions",
]

try:  # the prompt API lives in envs.prompts / envs.tasks (written separately)
    from textrl.envs.prompts import PromptDataset, PromptSampler, load_prompts
except ImportError:  # pragma: no cover - only while envs.prompts is absent
    pass
else:
    __all__ += ["PromptDataset", "PromptSampler", "load_prompts"]

try:
    from textrl.envs.tasks import make_digits_task
except ImportError:  # pragma: no cover
    pass
else:
    __all__ += ["make_digits_task"]
