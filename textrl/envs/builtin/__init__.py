"""The built-in task environments: ``digits``, ``arithmetic``, ``calculator``, ``guess_number``
and ``reward_model`` (``textrl envs`` lists them; ``textrl train --env ID`` trains on one).

Each is an :class:`~textrl.envs.environment.Environment` registered by id; its constructor takes
keyword settings with defaults (``make_env("guess_number", max_n=16)``). Rows are generated
deterministically from a ``seed`` with private NumPy generators (the global RNGs are untouched),
and where a task has a natural held-out split, :meth:`eval_rows` returns rows disjoint from
:meth:`rows`. The class docstrings say what a row holds, the reward, the maximum reward and the
turn protocol.

The warm-up (``warmup_examples(rows, seed, *, answer_accuracy=None)``) teaches each task's
*format*, not its solution, for the reason :mod:`textrl.envs.tasks` gives: a warm-up that solves
the task leaves RL nothing to show. ``answer_accuracy`` (None: the environment's own setting)
is the share of warm-up answers that are right (for ``guess_number``: the share of guesses
that are consistent with the feedback so far). Multi-turn warm-ups give later turns as a
conversation so far (a list of messages) with the agent's next turn as the completion.

The environments live one room each: :mod:`~textrl.envs.builtin.single_turn` (``digits``,
``arithmetic``, ``reward_model``), :mod:`~textrl.envs.builtin.calculator`,
:mod:`~textrl.envs.builtin.guess_number`, and what they share in :mod:`~textrl.envs.builtin.common`.
Importing this package registers them all (:data:`textrl.envs.registry.ENVS` imports it on its
first lookup).
"""

from __future__ import annotations

from textrl.envs.builtin.calculator import CalculatorEnv, compact, parse_tool_call, run_tool
from textrl.envs.builtin.common import FORMAT_MAX_REWARD, FORMAT_REWARD, parse_integer
from textrl.envs.builtin.guess_number import (
    HIGHER,
    INVALID,
    LOWER,
    GuessNumberEnv,
    feedback,
    guess_completion,
    parse_guess,
)
from textrl.envs.builtin.single_turn import ArithmeticEnv, DigitsEnv, RewardModelEnv

__all__ = [
    "FORMAT_MAX_REWARD",
    "FORMAT_REWARD",
    "HIGHER",
    "INVALID",
    "LOWER",
    "ArithmeticEnv",
    "CalculatorEnv",
    "DigitsEnv",
    "GuessNumberEnv",
    "RewardModelEnv",
    "compact",
    "feedback",
    "guess_completion",
    "parse_guess",
    "parse_integer",
    "parse_tool_call",
    "run_tool",
]
