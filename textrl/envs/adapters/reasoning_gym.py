"""``reasoning_gym:<task>``: a reasoning-gym task as a single-turn environment scored by the task's own
scorer (:mod:`textrl.envs.adapters`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from textrl.envs.adapters.common import check_sizes, require, unknown_id
from textrl.envs.environment import Environment
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
            raise unknown_id("reasoning_gym", task, known, REASONING_GYM_TASKS)
        self.eval_size_given = eval_size is not None
        default_size, default_eval = REASONING_GYM_SLOW_SETUP.get(task, (500, REASONING_GYM_EVAL_SIZE))
        size = default_size if size is None else size
        eval_size = default_eval if eval_size is None else eval_size
        check_sizes(self.id, size, eval_size, seed)
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


__all__ = ["REASONING_GYM_EVAL_SIZE", "REASONING_GYM_SLOW_SETUP", "REASONING_GYM_TASKS", "REASONING_GYM_VERIFIER_TASKS",
           "ReasoningGymEnv", "ReasoningGymScorer", "load_reasoning_gym", "task_answer"]
