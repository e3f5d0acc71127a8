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
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import importlib
import io
import math
import random
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from textrl.envs.environment import Environment, Episode, Turn
from textrl.envs.registry import register_env_loader
from textrl.rewards.base import batch_field
from textrl.rewards.rules import extract_answer

REASONING_GYM_TASKS: tuple[str, ...] = (
    "ab", "acre", "advanced_geometry", "aiw", "arc_1d", "arc_agi", "base_conversion",
    "basic_arithmetic", "bf", "binary_alternation", "binary_matrix", "bitwise_arithmetic",
    "caesar_cipher", "calendar_arithmetic", "chain_sum", "circuit_logic", "codeio", "coin_flip",
    "color_cube_rotation", "complex_arithmetic", "count_bits", "count_primes", "countdown",
    "course_schedule", "cryptarithm", "decimal_arithmetic", "decimal_chain_sum", "dice",
    "emoji_mystery", "family_relationships", "figlet_font", "fraction_simplification", "futoshiki",
    "game_of_life", "gcd", "group_anagrams", "gsm_symbolic", "intermediate_integration",
    "isomorphic_strings", "jugs", "kakurasu", "knight_swap", "knights_knaves", "largest_island",
    "lcm", "leg_counting", "letter_counting", "letter_jumble", "mahjong_puzzle",
    "manipulate_matrix", "maze", "mini_sudoku", "modulo_grid", "n_queens", "needle_haystack",
    "number_filtering", "number_format", "number_sequence", "number_sorting",
    "palindrome_generation", "palindrome_partitioning", "path_star", "polynomial_equations",
    "polynomial_multiplication", "pool_matrix", "power_function", "prime_factorization", "products",
    "puzzle24", "quantum_lock", "ransom_note", "rearc", "rectangle_count", "rotate_matrix",
    "rotten_oranges", "self_reference", "sentence_reordering", "shortest_path", "simple_equations",
    "simple_geometry", "simple_integration", "sokoban", "spell_backward", "spiral_matrix",
    "string_insertion", "string_manipulation", "string_splitting", "string_synthesis", "sudoku",
    "survo", "syllogism", "time_intervals", "tower_of_hanoi", "tsumego", "word_ladder",
    "word_sequence_reversal", "word_sorting", "zebra_puzzles",
)
"""reasoning-gym (0.1.25) tasks checked offline: they build with the network blocked, give the
same items for the same seed, their scorer gives their own answer inside ``<answer>`` tags 1.0
and a wrong answer less. Slow to generate (per item): knight_swap, sokoban, futoshiki and
zebra_puzzles (docs/benchmarks.md, "Environment set-up times"). Left out: ``composite`` (it needs a list
of tasks as its settings), ``game_of_life_halting`` (its scorer gives any non-empty answer 1.0),
``list_functions`` (its items differ between two datasets of the same seed)."""

REASONING_GYM_SLOW_SETUP: dict[str, tuple[int, int]] = {
    "knight_swap": (32, 8),
    "futoshiki": (64, 16),
    "zebra_puzzles": (96, 16),
    "sokoban": (96, 16),
    "puzzle24": (128, 16),
    "intermediate_integration": (160, 32),
    "quantum_lock": (256, 32),
}
"""Default ``(size, eval_size)`` of the tasks whose questions are slow to make (else 500 and
:data:`REASONING_GYM_EVAL_SIZE`). Seconds a question on a busy 2-core CPU: knight_swap 2.6,
futoshiki 0.83, zebra_puzzles 0.64, sokoban 0.60, puzzle24 0.48, intermediate_integration 0.33,
quantum_lock 0.21 (every other listed task 0.14 or less), so 550 of them kept ``textrl train --env
reasoning_gym:knight_swap`` setting up for over 20 minutes; these sizes keep each set-up near a
minute there. ``--env-args size=N,eval_size=M`` chooses."""

REASONING_GYM_EVAL_SIZE = 50
"""Held-out rows of a reasoning-gym task when ``eval_size`` is not given: at most this many (a
task with few distinct questions, such as coin_flip, has fewer that are not training questions)."""

REASONING_GYM_VERIFIER_TASKS: tuple[str, ...] = (
    "boxnet", "graph_color", "propositional_logic", "rubiks_cube", "rush_hour",
)
"""reasoning-gym tasks that also work offline but have no reference answer (``answer`` is None):
the scorer checks the agent's solution against the item's ``metadata``."""

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

_EXTRAS = {"reasoning_gym": ("reasoning-gym", "reasoning-gym"), "textarena": ("textarena", "textarena")}
"""Import name -> (PyPI package, textrl extra)."""


def require(module: str, what: str) -> ModuleType:
    """``import module``, or a one-line ``ImportError`` naming ``what`` needs it and the extra
    that installs it (``pip install 'textrl[reasoning-gym]'``). The global ``random`` state is
    kept: importing reasoning_gym or textarena draws from it."""
    outer = random.getstate()
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package, extra = _EXTRAS[module]
        raise ImportError(f"{what} needs the {package} package, which cannot be imported ({error}); "
                          f"install it with: pip install 'textrl[{extra}]'") from None
    finally:
        random.setstate(outer)


def _unknown(kind: str, name: str, known: Sequence[str], checked: Sequence[str]) -> ValueError:
    close = difflib.get_close_matches(name, list(known), n=3)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    return ValueError(f"{kind}:{name}: no such {kind} id{hint}; ids checked to work offline: "
                      f"{', '.join(checked)}")


def _check_sizes(what: str, size: Any, eval_size: Any, seed: Any) -> None:
    for name, value, low in (("size", size, 1), ("eval_size", eval_size, 0), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{what}: {name}={value!r} must be an int >= {low}")


# -- reasoning-gym ---------------------------------------------------------------------------------


def task_answer(completion: str) -> str:
    """The answer a reasoning-gym scorer reads: the text of the first ``<answer>...</answer>``
    block, stripped (as the ``accuracy`` reward reads it), else the whole completion, stripped.

    >>> task_answer("<think>\\n2+2\\n</think>\\n<answer>\\n4\\n</answer>"), task_answer(" 4\\n")
    ('4', '4')
    """
    answer = extract_answer(completion)
    return completion.strip() if answer is None else answer


class ReasoningGymScorer:
    """A reasoning-gym task's own scorer as a textrl reward:
    ``fn(prompts, completions, *, answer, metadata, **kwargs)`` -> float32 ``[B]``.

    Row ``i`` scores ``dataset.score_answer(answer=task_answer(completions[i]), entry={"question":
    prompts[i], "answer": answer[i], "metadata": metadata[i]})`` (in [0, 1]); ``answer`` and
    ``metadata`` are the rows' fields. An answer the scorer raises on (``prime_factorization``
    reads ``int()`` of it) scores 0.
    """

    name = "reasoning_gym"

    def __init__(self, task: str, dataset: Any) -> None:
        self.task = task
        self.dataset = dataset

    def score(self, prompt: str, completion: str, answer: Any, metadata: Any) -> float:
        """One row's score."""
        entry = {"question": prompt, "answer": answer, "metadata": metadata}
        try:
            return float(self.dataset.score_answer(answer=task_answer(completion), entry=entry))
        except Exception:  # the scorer's own parsing of a malformed answer
            return 0.0

    def __call__(self, prompts: list[str], completions: list[str], *, answer: Any = None,
                 metadata: Any = None, **kwargs: Any) -> Tensor:
        n = len(completions)
        what = f"reasoning_gym:{self.task} reward"
        answers = batch_field(answer, "answer", n, what)
        metas = batch_field(metadata, "metadata", n, what)
        missing = [i for i, m in enumerate(metas) if m is None]
        if missing:
            raise ValueError(f"{what}: rows {missing[:10]} have no 'metadata' field; score rows made by "
                             f"the reasoning_gym:{self.task} environment")
        scores = [self.score(p, c, a, m) for p, c, a, m in zip(prompts, completions, answers, metas)]
        return torch.tensor(scores, dtype=torch.float32)


class ReasoningGymEnv(Environment):
    """``reasoning_gym:<task>``: a reasoning-gym task as a single-turn environment.

    Settings: ``size`` training rows (items ``0..size-1`` of the dataset made with ``seed``; default
    500, fewer for a task of :data:`REASONING_GYM_SLOW_SETUP`);
    ``eval_size`` held-out rows (default: up to :data:`REASONING_GYM_EVAL_SIZE`), drawn from the
    dataset made with seed ``seed + size`` and kept only when their question is not one of the
    training questions (0: no held-out rows of its own, the trainer holds out some of :meth:`rows`); ``system_prompt`` (optional) puts a system
    message before each question; any other setting is the task's own configuration
    (``basic_arithmetic``: ``min_terms``, ``max_digits``, ...). Rows: ``prompt`` (the question)
    or ``messages``, ``answer`` (None for :data:`REASONING_GYM_VERIFIER_TASKS`), ``metadata``.
    The reward is :class:`ReasoningGymScorer`.
    """

    description = "a reasoning-gym task: procedural questions, scored by the task's own scorer"
    max_turns = 1
    max_reward = 1.0

    def __init__(self, task: str, *, size: int | None = None, seed: int = 0, eval_size: int | None = None,
                 system_prompt: str | None = None, **config: Any) -> None:
        self.id = f"reasoning_gym:{task}"  # type: ignore[misc]
        rg = require("reasoning_gym", self.id)
        known = sorted(rg.factory.DATASETS)
        if task not in known:
            raise _unknown("reasoning_gym", task, known, REASONING_GYM_TASKS)
        self.eval_size_given = eval_size is not None
        default_size, default_eval = REASONING_GYM_SLOW_SETUP.get(task, (500, REASONING_GYM_EVAL_SIZE))
        size = default_size if size is None else size
        eval_size = default_eval if eval_size is None else eval_size
        _check_sizes(self.id, size, eval_size, seed)
        if system_prompt is not None and (not isinstance(system_prompt, str) or not system_prompt.strip()):
            raise ValueError(f"{self.id}: system_prompt={system_prompt!r} must be a non-empty str or None")
        self.task, self.size, self.seed, self.eval_size = task, size, seed, eval_size
        self.system_prompt = system_prompt
        self.config = dict(config)
        self.dataset = self._dataset(size, seed)
        self.reward = ReasoningGymScorer(task, self.dataset)
        self._rows: list[dict[str, Any]] | None = None
        self._questions: set[str] = set()
        self._eval_rows: list[dict[str, Any]] | None = None

    def _dataset(self, size: int, seed: int) -> Any:
        rg = require("reasoning_gym", self.id)
        try:
            return rg.create_dataset(self.task, size=size, seed=seed, **self.config)
        except (TypeError, AssertionError, ValueError) as error:
            config_cls = rg.factory.DATASETS[self.task][1]
            fields = sorted(getattr(config_cls, "__dataclass_fields__", {}))
            raise ValueError(f"{self.id}: the task rejects the settings {self.config} ({type(error).__name__}: "
                             f"{error}); its settings: {', '.join(fields)}") from None

    def _row(self, item: dict[str, Any]) -> dict[str, Any]:
        question = item["question"]
        if self.system_prompt is None:
            head: dict[str, Any] = {"prompt": question}
        else:
            head = {"messages": [{"role": "system", "content": self.system_prompt},
                                 {"role": "user", "content": question}]}
        return {**head, "answer": item["answer"], "metadata": item["metadata"]}

    def rows(self) -> list[dict[str, Any]]:
        """Items ``0..size-1`` of the dataset of ``seed``, as rows (built once)."""
        if self._rows is None:
            items = [self.dataset[i] for i in range(self.size)]
            self._questions = {item["question"] for item in items}
            self._rows = [self._row(item) for item in items]
        return self._rows

    def eval_rows(self) -> list[dict[str, Any]] | None:
        """``eval_size`` rows whose questions are not training questions (built once); None when
        ``eval_size`` is 0. When the task has too few distinct questions for both: the ones found
        with the default eval_size (coin_flip: 25), else (an eval_size given, or none found) a
        ``ValueError`` naming the settings to lower."""
        if self.eval_size == 0:
            return None
        if self._eval_rows is None:
            self.rows()
            seen = set(self._questions)
            tries = 4 * self.eval_size + 64
            held = self._dataset(tries, self.seed + self.size)
            rows = []
            for i in range(tries):
                item = held[i]
                if item["question"] not in seen:
                    seen.add(item["question"])
                    rows.append(self._row(item))
                    if len(rows) == self.eval_size:
                        break
            if len(rows) < self.eval_size and (self.eval_size_given or not rows):
                raise ValueError(f"{self.id}: only {len(rows)} of {tries} held-out items have a question "
                                 f"that is not a training question; lower eval_size={self.eval_size} or "
                                 f"size={self.size}, or widen the task's settings")
            self._eval_rows = rows
        return self._eval_rows


@register_env_loader("reasoning_gym")
def load_reasoning_gym(task: str, **settings: Any) -> ReasoningGymEnv:
    """A reasoning-gym task by name, scored by its own scorer (pip install 'textrl[reasoning-gym]').

    ``make_env("reasoning_gym:<task>", **settings)``: a :class:`ReasoningGymEnv`."""
    return ReasoningGymEnv(task, **settings)


# -- TextArena -------------------------------------------------------------------------------------


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
            raise _unknown("textarena", game, known, TEXTARENA_GAMES)
        default_size, default_eval = TEXTARENA_SLOW_SETUP.get(game, (256, 32))
        size = default_size if size is None else size
        eval_size = default_eval if eval_size is None else eval_size
        _check_sizes(self.id, size, eval_size, seed)
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
