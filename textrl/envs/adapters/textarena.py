"""``textarena:<game id>``: a single-player TextArena game as a multi-turn environment
(:mod:`textrl.envs.adapters`)."""

from __future__ import annotations

import contextlib
import copy
import io
import math
import random
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

from textrl.envs.adapters.common import check_sizes, require, unknown_id
from textrl.envs.environment import Environment, Episode, Turn
from textrl.envs.registry import register_env_loader

TEXTARENA_GAMES: tuple[str, ...] = (
    "2048-v0", "2048-v0-3x3", "2048-v0-5x5", "2048-v0-6x6", "2048-v0-8x8", "2048-v0-10x10",
    "2048-v0-easy", "2048-v0-extreme", "2048-v0-hard", "2048-v0-mega-easy", "2048-v0-super-easy",
    "2048-v0-ultra-easy", "2048-v0-very-easy", "2048-v0-very-hard",
    "Bandit-v0", "Bandit-v0-hard", "Blackjack-v0", "Blackjack-v0-long",
    "Crosswords-v0", "Crosswords-v0-hardcore", "FifteenPuzzle-v0",
    "FrozenLake-v0", "FrozenLake-v0-hardcore", "FrozenLake-v0-random",
    "GuessTheNumber-v0", "GuessTheNumber-v0-hardcore", "LightsOut-v0",
    "LogicPuzzle-v0", "LogicPuzzle-v0-hard", "Mastermind-v0", "Mastermind-v0-hard",
    "Mastermind-v0-extreme", "Minesweeper-v0", "Minesweeper-v0-small", "Minesweeper-v0-medium",
    "Minesweeper-v0-hard", "PegJump-v0", "RushHour-v0", "Secretary-v0", "Secretary-v0-long",
    "Set-v0", "Sokoban-v0", "Sudoku-v0", "Sudoku-v0-very-easy", "Sudoku-v0-easy",
    "Sudoku-v0-medium", "Sudoku-v0-hard", "TowerOfHanoi-v0", "TowerOfHanoi-v0-medium",
    "TowerOfHanoi-v0-hard", "TowerOfHanoi-v0-hardcore", "TowerOfHanoi-v0-extreme",
)
"""Single-player TextArena (0.7.4) games checked offline: they build and play with the network
blocked, the same seed gives the same first observation, and they pay a numeric reward. Slow to set up
(per game): Sudoku-v0-hard, Sokoban-v0, RushHour-v0 (docs/benchmarks.md, "Environment set-up times"). Left out:
games that download the NLTK word list at reset (Wordle, Hangman, SpellingBee, WordLadder,
WordSearch, ...), that call an online model (TwentyQuestions, GuessWho, ...), that pay a string
as their reward after an invalid move (Countdown, Cryptarithm, Slitherlink, ThreeCardMonte),
that fail to import on Python 3.11 or time out at reset (Sokoban-v0-medium), and every game
for two or more players."""

TEXTARENA_SLOW_SETUP: dict[str, tuple[int, int]] = {"Sudoku-v0-hard": (48, 16)}
"""Default ``(size, eval_size)`` of the games whose set-up is slow (else 256 and 32): a
Sudoku-v0-hard reset takes seconds, so 256 + 32 rows kept ``textrl train --env
textarena:Sudoku-v0-hard`` setting up for many minutes (benchmarks/env_sweep.py; the figures:
docs/benchmarks.md, "Environment set-up times")."""

TEXTARENA_DEFAULT_MAX_TURNS = 50
"""``max_turns`` of a TextArena game that sets no turn limit of its own (2048, Blackjack, ...)."""

EMPTY_OBSERVATION = "(the game sent no message)"
"""The observation of a turn after which the game sent no new message (the episode goes on)."""


def observation_text(messages: Sequence[Sequence[Any]]) -> str:
    """The text of TextArena messages ``(sender id, text, observation type)``, one per line, the
    echo of the player's own action (type ``PLAYER_ACTION``) left out.

    >>> from enum import Enum
    >>> Kind = Enum("Kind", "PROMPT PLAYER_ACTION GAME_MESSAGE")
    >>> observation_text([(0, "[12]", Kind.PLAYER_ACTION), (-1, "The target number is higher.", Kind.GAME_MESSAGE)])
    'The target number is higher.'
    """
    kept = [str(m[1]) for m in messages if getattr(m[2], "name", None) != "PLAYER_ACTION"]
    return "\n".join(kept)


def _base_env(game: Any, textarena: ModuleType) -> Any:
    """The game under its wrappers: its ``get_observation`` gives only the new messages."""
    while isinstance(game, textarena.Wrapper):
        game = game.env
    return game


@contextlib.contextmanager
def _playing(state: dict[str, Any]) -> Iterator[None]:
    """Run TextArena code with the episode's own ``random`` state and its prints silenced.

    TextArena games seed and draw from the global ``random`` module (``State.__init__`` calls
    ``random.seed``), so each game keeps its generator state in ``state["random"]``: an episode
    plays the same whatever other episodes run beside it, and the caller's global state is left
    as it was.
    """
    outer = random.getstate()
    if "random" in state:
        random.setstate(state["random"])
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        state["random"] = random.getstate()
        random.setstate(outer)


def game_max_turns(state: Any) -> int:
    """Agent turns that let a single-player game end by itself: its turn limit times ``1 +
    error_allowance`` (an allowed invalid move does not count as a game turn), or
    :data:`TEXTARENA_DEFAULT_MAX_TURNS` for a game without a limit."""
    limit = getattr(state, "max_turns", None)
    if not isinstance(limit, int) or limit < 1:
        return TEXTARENA_DEFAULT_MAX_TURNS
    allowance = getattr(state, "error_allowance", 0)
    return limit * (1 + (allowance if isinstance(allowance, int) and allowance > 0 else 0))


class TextArenaEnv(Environment):
    """``textarena:<game id>``: a single-player TextArena game as a multi-turn environment.

    A row is one game, ``{"prompt": first observation, "seed": s, "game": id}``: :meth:`rows`
    resets one game per seed ``seed .. seed+size-1`` to read its first observation (so the prompt
    is known before the episode starts), :meth:`eval_rows` the seeds after those (disjoint seeds;
    a game with few instances, such as GuessTheNumber's 20 secrets, repeats instances across the
    splits). :meth:`start` plays a copy of the game the row was built with (a row made elsewhere:
    a game reset with the row's seed) and checks that it shows the row's prompt. Each agent turn is passed as the action to the game's ``step`` (through the
    game's default wrappers, which put an action without brackets in brackets); the game's new
    messages are the observation (:func:`observation_text`). When the game says done, the turn
    pays TextArena's reward for the player, as the game gives it (1 a win, 0 a loss, partial
    credit in some games, -1 for an invalid move in Bandit and Secretary); ``max_reward`` is 1.

    Settings: ``size`` (default 256), ``seed``, ``eval_size`` (default 32; 0: the trainer holds
    out some of :meth:`rows`; both smaller for a game of :data:`TEXTARENA_SLOW_SETUP`),
    ``max_turns`` (default :func:`game_max_turns`, so the game ends the episode itself).
    """

    description = "a single-player TextArena game: several turns, the game's reward at its end"
    max_reward = 1.0

    def __init__(self, game: str, *, size: int | None = None, seed: int = 0, eval_size: int | None = None,
                 max_turns: int | None = None) -> None:
        self.id = f"textarena:{game}"  # type: ignore[misc]
        ta = require("textarena", self.id)
        known = sorted(ta.envs.registration.ENV_REGISTRY)
        if game not in known:
            raise unknown_id("textarena", game, known, TEXTARENA_GAMES)
        default_size, default_eval = TEXTARENA_SLOW_SETUP.get(game, (256, 32))
        size = default_size if size is None else size
        eval_size = default_eval if eval_size is None else eval_size
        check_sizes(self.id, size, eval_size, seed)
        if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
            raise ValueError(f"{self.id}: max_turns={max_turns!r} must be an int >= 1 or None")
        self.game, self.size, self.seed, self.eval_size = game, size, seed, eval_size
        probe: dict[str, Any] = {}
        env = self._reset(seed, probe)
        state = _base_env(env, ta).state
        if not isinstance(state, ta.SinglePlayerState):
            raise ValueError(f"{self.id} is a game for several players ({type(state).__name__}); the adapter "
                             f"plays single-player games: {', '.join(TEXTARENA_GAMES)}")
        self.max_turns = game_max_turns(state) if max_turns is None else max_turns
        self._rows: list[dict[str, Any]] | None = None
        self._eval_rows: list[dict[str, Any]] | None = None
        self._games: dict[int, tuple[Any, dict[str, Any]]] = {}
        """Seed -> (the game just reset with it, its ``state``): :meth:`start` copies it rather
        than generate the game again (RushHour or Sudoku-v0-hard take seconds a reset)."""

    def _reset(self, seed: int, state: dict[str, Any]) -> Any:
        """A new game reset with ``seed``; its first observation goes to ``state["first"]``."""
        ta = require("textarena", self.id)
        try:
            with _playing(state):
                env = ta.make(self.game)
                env.reset(num_players=1, seed=seed)
                _, messages = _base_env(env, ta).get_observation()
        except Exception as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise ValueError(f"{self.id}: the game cannot be set up for one player offline "
                             f"({type(error).__name__}: {reason}); games checked to work offline: "
                             f"{', '.join(TEXTARENA_GAMES)}") from error
        state["first"] = observation_text(messages)
        return env

    def _row(self, seed: int) -> dict[str, Any]:
        state: dict[str, Any] = {}
        self._games[seed] = (self._reset(seed, state), state)
        return {"prompt": state["first"], "seed": seed, "game": self.game}

    def _fresh_game(self, seed: int, state: dict[str, Any]) -> Any:
        """A game as ``_reset(seed, state)`` makes it: a copy of the one the row was built with
        (its ``random`` state and first observation copied into ``state`` too), else a new reset."""
        kept = self._games.get(seed)
        if kept is not None:
            try:
                game = copy.deepcopy(kept[0])
            except Exception:  # a game holding something that cannot be copied: set it up again
                pass
            else:
                state.update(random=kept[1]["random"], first=kept[1]["first"])
                return game
        return self._reset(seed, state)

    def rows(self) -> list[dict[str, Any]]:
        """One game per seed ``seed .. seed+size-1`` (built once)."""
        if self._rows is None:
            self._rows = [self._row(self.seed + i) for i in range(self.size)]
        return self._rows

    def eval_rows(self) -> list[dict[str, Any]] | None:
        """One game per seed ``seed+size .. seed+size+eval_size-1`` (built once); None when
        ``eval_size`` is 0."""
        if self.eval_size == 0:
            return None
        if self._eval_rows is None:
            first = self.seed + self.size
            self._eval_rows = [self._row(first + i) for i in range(self.eval_size)]
        return self._eval_rows

    def start(self, episode: Episode) -> None:
        seed = episode.row.get("seed")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{self.id}: the row has no int 'seed' (got {seed!r}); use the rows of this environment")
        episode.state["game"] = self._fresh_game(seed, episode.state)
        prompt = episode.row.get("prompt")
        if isinstance(prompt, str) and prompt != episode.state["first"]:
            raise ValueError(f"{self.id}: the game of seed {seed} opens with another observation than the "
                             "row's prompt; the row comes from another TextArena version or game")

    def step(self, episode: Episode, completion: str) -> Turn:
        game = episode.state["game"]
        with _playing(episode.state):
            done, _ = game.step(completion)
            if done:
                rewards, info = game.close()
            else:
                _, messages = _base_env(game, require("textarena", self.id)).get_observation()
        if not done:
            return Turn(observation=observation_text(messages) or EMPTY_OBSERVATION)
        reward = (rewards or {}).get(0)
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"{self.id}: the game ended with reward {reward!r} for the player, not a finite "
                             f"number (a TextArena bug in this game); play one of {', '.join(TEXTARENA_GAMES)}")
        reason = (info or {}).get(0, {}).get("reason")
        return Turn(reward=float(reward), done=True, info={"reason": reason})


@register_env_loader("textarena")
def load_textarena(game: str, **settings: Any) -> TextArenaEnv:
    """A single-player TextArena game by its id, multi-turn (pip install 'textrl[textarena]').

    ``make_env("textarena:<game id>", **settings)``: a :class:`TextArenaEnv`."""
    return TextArenaEnv(game, **settings)


__all__ = ["EMPTY_OBSERVATION", "TEXTARENA_DEFAULT_MAX_TURNS", "TEXTARENA_GAMES", "TEXTARENA_SLOW_SETUP", "TextArenaEnv",
           "game_max_turns", "load_textarena", "observation_text"]
