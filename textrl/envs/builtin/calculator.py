"""The ``calculator`` environment (tool use): a multiplication with a calculator the model may call
(``<tool>EXPR</tool>``), answered by :mod:`textrl.envs.calculator`'s bounded evaluator."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from textrl.envs.builtin.common import (
    WARMUP_ACCURACY,
    check_int,
    check_share,
    distinct_indices,
    parse_integer,
    seeded_rng,
)
from textrl.envs.calculator import CalculatorError, evaluate, format_number
from textrl.envs.environment import Environment, Episode, Message, Turn
from textrl.envs.registry import register_env
from textrl.rewards.rules import extract_answer, tag_content

_TOOL_OPEN, _TOOL_CLOSE = "<tool>", "</tool>"


def parse_tool_call(completion: str) -> tuple[str | None, str | None]:
    """``(expression, None)`` for a turn holding ``<tool>EXPR</tool>``, ``(None, error)`` for a
    malformed call, ``(None, None)`` for a turn without a call.

    >>> parse_tool_call("<tool>3*4</tool>"), parse_tool_call("<tool>3*4"), parse_tool_call("12")
    (('3*4', None), (None, 'error: unclosed <tool> (write <tool>EXPR</tool>)'), (None, None))
    """
    found = tag_content(completion, _TOOL_OPEN, _TOOL_CLOSE)  # linear in the completion's length
    if found is not None:
        expression = found.strip()
        return (expression, None) if expression else (None, "error: empty <tool></tool> call")
    if _TOOL_OPEN in completion:
        return None, "error: unclosed <tool> (write <tool>EXPR</tool>)"
    if _TOOL_CLOSE in completion:
        return None, "error: </tool> without <tool> (write <tool>EXPR</tool>)"
    return None, None


def run_tool(expression: str) -> str:
    """The calculator's answer to an expression: its value, or ``"error: ..."``.

    >>> run_tool("347*829"), run_tool("7/2"), run_tool("1/0")
    ('287663', '3.5', 'error: division by zero')
    """
    try:
        return format_number(evaluate(expression))
    except CalculatorError as error:
        return f"error: {error}"


@register_env("calculator")
class CalculatorEnv(Environment):
    """Tool use: multiply two ``digits``-digit numbers with a calculator the model may call.

    - Row: ``{"prompt": "What is 347 * 829? ...", "answer": "287663", "expression": "347 * 829"}``;
      instances are distinct ordered pairs, ``n_eval`` of them held out (:meth:`eval_rows`).
    - Turns (``max_turns``, default 3; a turn also ends at ``</tool>``, the stop string): a turn holding
      ``<answer>N</answer>`` ends the episode. Otherwise a turn holding ``<tool>EXPR</tool>`` is
      answered with one ``observation_role`` ("tool") message: the value of ``EXPR``
      (:func:`textrl.envs.calculator.evaluate`, shown by :func:`format_number`) or
      ``"error: ..."`` for a malformed call (unclosed, empty, not arithmetic, too large). A turn
      with neither gets a ``user`` message saying how to call the tool or answer. The last turn
      without an answer ends the episode unanswered.
    - Reward: 1.0 on the answering turn when its answer (:func:`parse_integer`) is the product,
      else 0; no bonus or penalty for calling the tool, so the tool is used exactly when it
      makes the answer right. Max reward 1. ``reward`` (the final reward) is None.
    - Warm-up: per row, a tool call (the row's expression with probability ``answer_accuracy``,
      else a random one of the same shape) and, after the tool's result, an answer (a copy of
      the result with probability ``answer_accuracy``, else a random number as long).
    """

    id = "calculator"
    description = "multiply big numbers with a calculator tool, <tool>EXPR</tool>"
    max_turns = 3
    max_reward = 1.0
    stop_strings = (_TOOL_CLOSE,)
    reward = None

    INSTRUCTION = "Use <tool>EXPR</tool>, then <answer>N</answer>."

    def __init__(self, *, n_rows: int = 512, n_eval: int = 64, digits: int = 3, max_turns: int = 3,
                 seed: int = 0, observation_role: str = "tool",
                 answer_accuracy: float = WARMUP_ACCURACY) -> None:
        self.digits = check_int("digits", digits, 1, self.id)
        self.max_turns = check_int("max_turns", max_turns, 1, self.id)
        if self.digits > 9:
            raise ValueError(f"{self.id}: digits={digits} must be at most 9")
        self.n_rows = check_int("n_rows", n_rows, 1, self.id)
        self.n_eval = check_int("n_eval", n_eval, 0, self.id)
        self.seed = int(seed)
        if not isinstance(observation_role, str) or not observation_role:
            raise ValueError(f"{self.id}: observation_role={observation_role!r} must be a role name such as 'tool'")
        self.observation_role = observation_role
        self.answer_accuracy = check_share("answer_accuracy", answer_accuracy, self.id)
        low, high = 10 ** (self.digits - 1), 10**self.digits
        self._low, self._span = low, high - low
        train, held_out = distinct_indices(self._span**2, self.n_eval, self.n_rows, self.seed, self.id)
        self._rows = [self._instance(i) for i in train]
        self._eval = [self._instance(i) for i in held_out]

    def _instance(self, index: int) -> dict[str, Any]:
        a, b = (self._low + i for i in divmod(index, self._span))
        expression = f"{a} * {b}"
        return {"prompt": f"What is {expression}? {self.INSTRUCTION}", "answer": str(a * b),
                "expression": expression}

    def rows(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._rows]

    def eval_rows(self) -> list[dict[str, Any]] | None:
        return [dict(r) for r in self._eval] if self._eval else None

    def step(self, episode: Episode, completion: str) -> Turn:
        answer = extract_answer(completion)
        if answer is not None:
            got = parse_integer(answer)
            correct = got is not None and str(got) == str(episode.row["answer"])
            return Turn(reward=float(correct), done=True, info={"correct": correct, "answer": answer})
        if episode.turn >= self.max_turns:
            return Turn(done=True, info={"correct": False, "answer": None})
        expression, error = parse_tool_call(completion)
        if expression is None and error is None:
            return Turn(observation=f"No tool call or answer. {self.INSTRUCTION}", info={"tool": None})
        result = run_tool(expression) if expression is not None else error
        return Turn(observation=[{"role": self.observation_role, "content": result}],
                    info={"tool": expression, "result": result})

    def warmup_examples(self, rows: Sequence[dict[str, Any]], seed: int, *,
                        answer_accuracy: float | None = None) -> list[tuple[Any, str]]:
        accuracy = check_share("answer_accuracy",
                                self.answer_accuracy if answer_accuracy is None else answer_accuracy, self.id)
        rng = seeded_rng(seed, 0xCA1C)
        pairs: list[tuple[Any, str]] = []
        for row in rows:
            if rng.random() < accuracy:
                expression = compact(row["expression"])
            else:
                a, b = (int(x) for x in self._low + rng.integers(self._span, size=2))
                expression = f"{a}*{b}"
            call = f"{_TOOL_OPEN}{expression}{_TOOL_CLOSE}"
            result = run_tool(expression)
            if rng.random() < accuracy:
                final = result
            else:
                final = str(int(rng.integers(10 ** (len(result) - 1), 10 ** len(result))))
            conversation: list[Message] = [
                {"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": call},
                {"role": self.observation_role, "content": result},
            ]
            pairs.append((row["prompt"], call))
            pairs.append((conversation, f"<answer>{final}</answer>"))
        return pairs


def compact(expression: str) -> str:
    """``expression`` without whitespace: ``"347 * 829"`` -> ``"347*829"``."""
    return "".join(expression.split())


__all__ = ["CalculatorEnv", "compact", "parse_tool_call", "run_tool"]
