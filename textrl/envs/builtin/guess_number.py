"""The ``guess_number`` environment: guess a secret integer from "higher" / "lower" feedback."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from textrl.envs.builtin.common import (
    WARMUP_ACCURACY,
    check_int,
    check_share,
    parse_integer,
    seeded_rng,
)
from textrl.envs.environment import Environment, Episode, Message, Turn
from textrl.envs.registry import register_env
from textrl.rewards.rules import extract_answer

HIGHER, LOWER, INVALID = "higher", "lower", "invalid guess"
"""The game's observations: the secret is higher / lower than the guess; no guess was read."""


def parse_guess(completion: str) -> int | None:
    """The integer in the turn's first ``<answer>...</answer>`` block, or the whole turn when it
    is a bare integer; None otherwise.

    >>> parse_guess("<answer>5</answer>"), parse_guess(" 3 "), parse_guess("<answer>five</answer>")
    (5, 3, None)
    """
    answer = extract_answer(completion)
    return parse_integer(answer if answer is not None else completion)


def guess_completion(guess: int) -> str:
    """A guess as the warm-up writes it: ``<answer>5</answer>`` (3 tokens of the tiny tokenizer)."""
    return f"<answer>{guess}</answer>"


def feedback(secret: int, guess: int | None) -> str | None:
    """The game's answer to a guess: None when it is right, else ``higher`` / ``lower`` (where
    the secret lies) or ``invalid guess``."""
    if guess is None:
        return INVALID
    if guess == secret:
        return None
    return HIGHER if secret > guess else LOWER


@register_env("guess_number")
class GuessNumberEnv(Environment):
    """Guess a secret integer in ``[1, max_n]`` from "higher" / "lower" feedback.

    - Row: ``{"prompt": "Guess my number from 1 to 8.", "secret": 5, "instance": 17}``. The
      prompt is the same in every row (the secret is never shown); rows carry the secret, so an
      episode is reproducible from its row. :meth:`rows` holds ``n_rows`` instances and
      :meth:`eval_rows` ``n_eval`` others (``instance`` ids are disjoint); both are balanced over
      the secrets (each secret ``n // max_n`` or one more times), so a constant guess wins
      ``1 / max_n`` of the first turns and no more.
    - Turns (``max_turns``, default 4: enough for binary search over 8): each agent turn is a
      guess, ``<answer>K</answer>`` or a bare integer (:func:`parse_guess`). A right guess ends
      the episode; a wrong one is answered with a ``user`` message ``higher`` or ``lower``
      (where the secret lies; a guess outside the range too), and an unreadable one with
      ``invalid guess`` (it uses up the turn). The ``max_turns``-th wrong guess ends the episode.
    - Reward: on the winning turn ``t``, ``1 - turn_cost * (t - 1)`` (default ``turn_cost=0``:
      1.0 for a win on any turn), else 0; max reward 1. With the default the episode's reward
      *is* its success, so the mean reward is the success rate. ``Turn.info`` holds
      ``solved`` (bool), ``guess`` and ``feedback``. ``reward`` (the final reward) is None.
    - Warm-up: random play of every row's game to its end: each guess is uniform over the
      guesses still consistent with the feedback with probability ``answer_accuracy``, else
      uniform over ``[1, max_n]``. Each agent turn is a pair (the first with the prompt, later
      ones with the conversation so far), so the warm-up teaches the format of a guess and of
      going on after feedback, but not the strategy (binary search wins every game; uniform
      guessing wins about 41% with the defaults).
    """

    id = "guess_number"
    description = "guess a secret number from higher/lower feedback"
    max_turns = 4
    max_reward = 1.0
    reward = None

    def __init__(self, *, max_n: int = 8, max_turns: int = 4, n_rows: int = 256, n_eval: int = 64,
                 seed: int = 0, turn_cost: float = 0.0, answer_accuracy: float = WARMUP_ACCURACY) -> None:
        self.max_n = check_int("max_n", max_n, 2, self.id)
        self.max_turns = check_int("max_turns", max_turns, 1, self.id)
        self.n_rows = check_int("n_rows", n_rows, 1, self.id)
        self.n_eval = check_int("n_eval", n_eval, 0, self.id)
        self.seed = int(seed)
        if isinstance(turn_cost, bool) or not isinstance(turn_cost, (int, float)) or not 0 <= turn_cost * (self.max_turns - 1) < 1:
            raise ValueError(f"{self.id}: turn_cost={turn_cost!r} must be >= 0 and leave a win on the last "
                             f"turn worth more than 0 (turn_cost * (max_turns - 1) < 1)")
        self.turn_cost = float(turn_cost)
        self.answer_accuracy = check_share("answer_accuracy", answer_accuracy, self.id)
        self.prompt = f"Guess my number from 1 to {self.max_n}."
        self._rows = self._instances(self.n_rows, first=0, stream=0x6E55)
        self._eval = self._instances(self.n_eval, first=self.n_rows, stream=0xE7A1)

    def _instances(self, n: int, first: int, stream: int) -> list[dict[str, Any]]:
        """``n`` rows with balanced secrets in a seeded order, ids ``first .. first + n - 1``."""
        secrets = seeded_rng(self.seed, stream).permutation(np.arange(n) % self.max_n) + 1
        return [{"prompt": self.prompt, "secret": int(s), "instance": first + i} for i, s in enumerate(secrets)]

    def rows(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._rows]

    def eval_rows(self) -> list[dict[str, Any]] | None:
        return [dict(r) for r in self._eval] if self._eval else None

    def start(self, episode: Episode) -> None:
        secret = episode.row.get("secret")
        if isinstance(secret, bool) or not isinstance(secret, (int, np.integer)) or not 1 <= secret <= self.max_n:
            raise ValueError(f"{self.id}: row {episode.index} has secret={secret!r}; a row needs an int "
                             f"'secret' in [1, {self.max_n}] (use the environment's rows())")
        episode.state["secret"] = int(secret)

    def win_reward(self, turn: int) -> float:
        """The reward of a right guess on agent turn ``turn`` (1-based)."""
        return 1.0 - self.turn_cost * (turn - 1)

    def step(self, episode: Episode, completion: str) -> Turn:
        guess = parse_guess(completion)
        said = feedback(episode.state["secret"], guess)
        info = {"guess": guess, "feedback": said, "solved": said is None}
        if said is None:
            return Turn(reward=self.win_reward(episode.turn), done=True, info=info)
        if episode.turn >= self.max_turns:
            return Turn(done=True, info=info)
        return Turn(observation=said, info=info)

    def warmup_examples(self, rows: Sequence[dict[str, Any]], seed: int, *,
                        answer_accuracy: float | None = None) -> list[tuple[Any, str]]:
        consistent = check_share("answer_accuracy",
                                  self.answer_accuracy if answer_accuracy is None else answer_accuracy, self.id)
        rng = seeded_rng(seed, 0x6E5)
        pairs: list[tuple[Any, str]] = []
        for row in rows:
            secret, low, high = int(row["secret"]), 1, self.max_n
            conversation: list[Message] = [{"role": "user", "content": row["prompt"]}]
            for turn in range(1, self.max_turns + 1):
                if rng.random() < consistent:
                    guess = int(rng.integers(low, high + 1))
                else:
                    guess = int(rng.integers(1, self.max_n + 1))
                completion = guess_completion(guess)
                pairs.append((row["prompt"] if turn == 1 else [dict(m) for m in conversation], completion))
                said = feedback(secret, guess)
                if said is None:
                    break
                if said == HIGHER:
                    low = max(low, guess + 1)
                else:
                    high = min(high, guess - 1)
                conversation += [{"role": "assistant", "content": completion}, {"role": "user", "content": said}]
        return pairs


__all__ = ["HIGHER", "INVALID", "LOWER", "GuessNumberEnv", "feedback", "guess_completion", "parse_guess"]
