"""The single-turn built-in environments: ``digits`` (the embedded default's task), ``arithmetic``
and ``reward_model`` (the pipeline's PPO task)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from textrl.envs.builtin.common import (
    FORMAT_MAX_REWARD,
    FORMAT_REWARD,
    WARMUP_ACCURACY,
    check_int,
    check_share,
    distinct_indices,
    format_warmup,
)
from textrl.envs.environment import Environment
from textrl.envs.registry import register_env
from textrl.envs.tasks import DIGITS_ROWS, DIGITS_SEED, make_digits_task
from textrl.envs.tasks import warmup_examples as digits_warmup_examples

# -- digits ------------------------------------------------------------------------------------


@register_env("digits")
class DigitsEnv(Environment):
    """The embedded default's task (:mod:`textrl.envs.tasks`): repeat the last digit of a list.

    - Row: ``{"prompt": "Repeat the last digit: 4 8 1", "answer": "1"}``; the default rows are
      ``builtin:digits`` (``make_digits_task(512, seed=0)``, the shipped file).
    - Turns: one; the answer ends the episode.
    - Reward: ``"think_format,tag_count,accuracy"``; max reward 2.5 (0.5 + 1 + 1).
    - Held-out split: none of its own (:meth:`eval_rows` is None), so ``--env digits`` holds out
      ``eval_size`` rows as ``--dataset builtin:digits`` does and reproduces that run.
    - Warm-up: :func:`textrl.envs.tasks.warmup_examples` (random digits, ``answer_accuracy`` right).
    """

    id = "digits"
    description = "repeat the last digit of a list (the embedded default's task)"
    max_turns = 1
    max_reward = FORMAT_MAX_REWARD
    reward = FORMAT_REWARD

    def __init__(self, *, n_rows: int = DIGITS_ROWS, seed: int = DIGITS_SEED,
                 answer_accuracy: float = WARMUP_ACCURACY) -> None:
        self.n_rows = check_int("n_rows", n_rows, 1, self.id)
        self.seed = int(seed)
        self.answer_accuracy = check_share("answer_accuracy", answer_accuracy, self.id)
        self._rows = make_digits_task(self.n_rows, seed=self.seed)

    def rows(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._rows]

    def warmup_examples(self, rows: Sequence[dict[str, Any]], seed: int, *,
                        answer_accuracy: float | None = None) -> list[tuple[Any, str]]:
        accuracy = self.answer_accuracy if answer_accuracy is None else answer_accuracy
        return digits_warmup_examples(rows, seed, answer_accuracy=accuracy)


# -- arithmetic --------------------------------------------------------------------------------


@register_env("arithmetic")
class ArithmeticEnv(Environment):
    """Single-turn arithmetic with small operands: "What is 3 + 4?" -> ``7``.

    - Row: ``{"prompt": "What is 3 + 4?", "answer": "7", "a": 3, "op": "+", "b": 4}``. Instances
      are the distinct ``(a, op, b)`` with operands in ``[0, max_operand]`` and ``op`` in
      ``ops`` (any of ``+ - *``); ``n_eval`` of them (seeded) are held out
      (:meth:`eval_rows`), and :meth:`rows` holds ``n_rows`` others (None: all the rest).
    - Turns: one; the answer ends the episode.
    - Reward: ``"think_format,tag_count,accuracy"``; max reward 2.5.
    - Warm-up: the think/answer format with an answer drawn uniformly from the task's possible
      answers, right in ``answer_accuracy`` of the rows (as for ``digits``).
    """

    id = "arithmetic"
    description = "small-number arithmetic, 'What is 3 + 4?'"
    max_turns = 1
    max_reward = FORMAT_MAX_REWARD
    reward = FORMAT_REWARD

    def __init__(self, *, n_rows: int | None = None, n_eval: int = 40, max_operand: int = 9,
                 ops: str = "+-", seed: int = 0, answer_accuracy: float = WARMUP_ACCURACY) -> None:
        self.max_operand = check_int("max_operand", max_operand, 1, self.id)
        if not isinstance(ops, str) or not ops or set(ops) - set("+-*") or len(set(ops)) != len(ops):
            raise ValueError(f"{self.id}: ops={ops!r} must be distinct characters from '+-*', e.g. '+-'")
        self.ops = ops
        self.seed = int(seed)
        self.answer_accuracy = check_share("answer_accuracy", answer_accuracy, self.id)
        self.n_eval = check_int("n_eval", n_eval, 0, self.id)
        width = self.max_operand + 1
        total = width * width * len(ops)
        self.n_rows = total - self.n_eval if n_rows is None else check_int("n_rows", n_rows, 1, self.id)
        train, held_out = distinct_indices(total, self.n_eval, self.n_rows, self.seed, self.id)
        self._rows = [self._instance(i) for i in train]
        self._eval = [self._instance(i) for i in held_out]

    def _instance(self, index: int) -> dict[str, Any]:
        width = self.max_operand + 1
        op_index, rest = divmod(index, width * width)
        a, b = divmod(rest, width)
        op = self.ops[op_index]
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return {"prompt": f"What is {a} {op} {b}?", "answer": str(value), "a": a, "op": op, "b": b}

    def rows(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._rows]

    def eval_rows(self) -> list[dict[str, Any]] | None:
        return [dict(r) for r in self._eval] if self._eval else None

    def answers(self) -> list[str]:
        """Every possible answer of the task's settings, sorted by value."""
        m = self.max_operand
        values: set[int] = set()
        if "+" in self.ops:
            values.update(range(0, 2 * m + 1))
        if "-" in self.ops:
            values.update(range(-m, m + 1))
        if "*" in self.ops:
            values.update(a * b for a in range(m + 1) for b in range(m + 1))
        return [str(v) for v in sorted(values)]

    def warmup_examples(self, rows: Sequence[dict[str, Any]], seed: int, *,
                        answer_accuracy: float | None = None) -> list[tuple[Any, str]]:
        accuracy = self.answer_accuracy if answer_accuracy is None else answer_accuracy
        return format_warmup(rows, seed, check_share("answer_accuracy", accuracy, self.id),
                              self.answers(), stream=0xA41)


# -- the pipeline's reward-model task ----------------------------------------------------------

CASE_PROMPTS = "builtin:case"


@register_env("reward_model")
class RewardModelEnv(Environment):
    """The pipeline's PPO task (:mod:`textrl.stages.pipeline`): prompts scored by a reward model.

    - Row: ``{"prompt": "Describe the moon. Use capital letters.", "style": "capital",
      "topic": "moon"}`` for ``prompts="builtin:case"`` (the 128 held-out ``case`` prompts that
      the pipeline's SFT and reward model never see, :mod:`textrl.envs.synthetic`), or the rows
      of any source :func:`textrl.envs.load_prompts` reads.
    - Turns: one; the answer ends the episode.
    - Reward: ``"reward_model:<path>"`` (a folder, hub id, or ``tiny``, the untrained offline tiny
      reward model: give the pipeline's ``OUT/rm/model`` for a trained one). With the ``case``
      prompts and ``monitor=True`` the rule :func:`~textrl.envs.synthetic.case_follow_reward`
      rides along with weight 0, so the share of responses that follow the constraint is logged
      next to the score, as in the pipeline. Max reward: None (a reward model's scale is open).
    - Held-out split: none of its own; the trainer holds out ``eval_size`` rows.
    - Warm-up: for the ``case`` prompts, ``n_warmup`` of the pipeline's SFT pairs
      (``case_sft_pairs``: the requested case half of the time, on the SFT prompts), whatever
      ``answer_accuracy`` says (the task has no reference answer; a follow rate other than 0.5
      would bias the start for or against the constraint); None for other prompts.
    """

    id = "reward_model"
    description = "the pipeline's case prompts scored by a reward model (reward_model:<path>)"
    max_turns = 1
    max_reward = None

    def __init__(self, *, path: str = "tiny", prompts: Any = CASE_PROMPTS, monitor: bool = True,
                 n_warmup: int = 1024) -> None:
        if not isinstance(path, str) or not path.strip() or "," in path:
            raise ValueError(f"{self.id}: path={path!r} must be a reward model folder, hub id or 'tiny' "
                             "(without ',', which separates reward spec entries)")
        self.path = path.strip()
        self.prompts = prompts
        self.is_case = isinstance(prompts, str) and prompts == CASE_PROMPTS
        self.n_warmup = check_int("n_warmup", n_warmup, 1, self.id)
        self.reward = f"reward_model:{self.path}"
        if monitor and self.is_case:
            from textrl.envs import synthetic

            self.reward += f",{synthetic.__file__}:case_follow_reward:0"
        self._rows: list[dict[str, Any]] | None = None

    def rows(self) -> list[dict[str, Any]]:
        if self._rows is None:
            if self.is_case:
                from textrl.envs.synthetic import BUILTIN_PROMPTS

                self._rows = BUILTIN_PROMPTS["case"]()
            else:
                from textrl.envs.prompts import load_prompts

                self._rows = [dict(r) for r in load_prompts(self.prompts)]
        return [dict(r) for r in self._rows]

    def warmup_examples(self, rows: Sequence[dict[str, Any]], seed: int, *,
                        answer_accuracy: float | None = None) -> list[tuple[Any, str]] | None:
        if not self.is_case:
            return None
        from textrl.envs.synthetic import case_sft_pairs

        pairs = case_sft_pairs(self.n_warmup, follow_rate=0.5, seed=seed)
        return [(r["prompt"], r["response"]) for r in pairs]


__all__ = ["CASE_PROMPTS", "ArithmeticEnv", "DigitsEnv", "RewardModelEnv"]
