"""Adapters: other suites as textrl environments (optional extras).

- ``reasoning_gym:<task>`` (``pip install 'textrl[reasoning-gym]'``): a
  `reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ task. Single turn: each row's
  prompt is an item's question, its ``answer`` and ``metadata`` are kept as fields, and the final
  reward is the task's own scorer (``dataset.score_answer``) applied to :func:`task_answer` of the
  completion. :data:`REASONING_GYM_TASKS` lists the tasks checked to work offline.
- ``textarena:<game id>`` (``pip install 'textrl[textarena]'``): a single-player
  `TextArena <https://github.com/LeonGuertler/TextArena>`_ game, played over several turns: each
  agent turn is the game's action, the game's new messages are the next observation, and the
  game's reward is paid when it ends. :data:`TEXTARENA_GAMES` lists the games checked to work
  offline.

Both are loaded by scheme (``make_env("reasoning_gym:basic_arithmetic", size=200)``, ``textrl
train --env textarena:GuessTheNumber-v0``); the suites are imported only when an environment is
built, and a missing one raises an ``ImportError`` naming the extra to install. The
``math_verify`` reward for math answers lives in :mod:`textrl.rewards.math_verify`.

One module each: :mod:`~textrl.envs.adapters.reasoning_gym`, :mod:`~textrl.envs.adapters.textarena`,
and what they share in :mod:`~textrl.envs.adapters.common`. Importing this package registers both
schemes (:data:`textrl.envs.registry.ENVS` imports it on its first lookup).
"""

from __future__ import annotations

from textrl.envs.adapters.common import require
from textrl.envs.adapters.reasoning_gym import (
    REASONING_GYM_EVAL_SIZE,
    REASONING_GYM_SLOW_SETUP,
    REASONING_GYM_TASKS,
    REASONING_GYM_VERIFIER_TASKS,
    ReasoningGymEnv,
    ReasoningGymScorer,
    load_reasoning_gym,
    task_answer,
)
from textrl.envs.adapters.textarena import (
    EMPTY_OBSERVATION,
    TEXTARENA_DEFAULT_MAX_TURNS,
    TEXTARENA_GAMES,
    TEXTARENA_SLOW_SETUP,
    TextArenaEnv,
    game_max_turns,
    load_textarena,
    observation_text,
)

__all__ = [
    "EMPTY_OBSERVATION",
    "REASONING_GYM_EVAL_SIZE",
    "REASONING_GYM_SLOW_SETUP",
    "REASONING_GYM_TASKS",
    "REASONING_GYM_VERIFIER_TASKS",
    "TEXTARENA_DEFAULT_MAX_TURNS",
    "TEXTARENA_GAMES",
    "TEXTARENA_SLOW_SETUP",
    "ReasoningGymEnv",
    "ReasoningGymScorer",
    "TextArenaEnv",
    "game_max_turns",
    "load_reasoning_gym",
    "load_textarena",
    "observation_text",
    "require",
    "task_answer",
]
