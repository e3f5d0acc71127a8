"""Built-in synthetic tasks: prompts with a rule-checkable ``answer``, and their SFT warm-up.

The embedded default (``dataset="builtin:digits"``) must show PPO *working* on a CPU in a few
minutes with a 2-layer, 64-wide Llama. So the task is deliberately easy and fully rule-checked:

``digits``: "Repeat the last digit: 4 8 1" -> ``"1"``.
    The answer is one of ten single tokens ``"0"``..``"9"`` and sits right before the end of the
    user turn, a fixed distance from where the model writes it: a copy any attention layer can
    learn. A policy that ignores the prompt scores 1/10 on accuracy, a solved one 1/1, so the
    reward curve has a wide, unambiguous range. Lists have 3 to 6 digits (so "take the last
    one" is the rule, not "take the 3rd one"); answers are exactly balanced over the ten digits
    (row ``i`` has answer ``i % 10`` before shuffling), so no constant guess beats chance.

The warm-up (:func:`warmup_examples`) teaches the completion *format* but not the task: every
completion is ``<think>\\nThe answer is\\n</think>\\n<answer>\\nD\\n</answer>`` with ``D`` drawn
uniformly from 0-9, independently of the prompt. Why random: supervised training on the correct
answers would solve the task before RL starts, leaving a flat reward curve that looks the same
whether the agent learns or is broken. With random answers the warmed-up policy is well formed
(format rewards near their maximum, responses short enough for ``max_new_tokens``) yet answers
at chance, so every gain in accuracy is PPO's doing. Uniform (not "any digit but the right
one") keeps the answer independent of the prompt instead of teaching the model to avoid it.

``answer_accuracy`` (the trainer's ``warmup_answer_accuracy``, 0.3 in the embedded default)
shows the correct answer in that share of the examples. Measured on the tiny model: with fully
random answers, PPO left accuracy at chance within the 5-minute budget (it has to discover the
copy from about one correct sample in ten); with 0.3, 200 warm-up steps still leave sampled
accuracy near chance (about 0.1) but plant a weak prompt-answer link that PPO then amplifies.

``textrl/envs/data/digits.jsonl`` is ``make_digits_task(512, seed=0)`` written with
:func:`write_jsonl`; ``builtin:digits`` reads that file, and a test checks it regenerates
byte for byte, so the shipped data and the generator cannot drift apart.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

DATA_DIR = Path(__file__).resolve().parent / "data"
"""Where the built-in JSONL files live (shipped as package data)."""

DIGITS_ROWS = 512
DIGITS_SEED = 0
DIGITS_INSTRUCTION = "Repeat the last digit:"
DIGITS_MIN_LEN, DIGITS_MAX_LEN = 3, 6
WARMUP_THINK = "The answer is"
"""Fixed reasoning text of the warm-up: 3 tokens of the tiny tokenizer, so a whole completion
(think + answer + tags + EOS) is 14 tokens and fits the default ``max_new_tokens=24``."""


def digits_answer(prompt: str) -> str:
    """The rule of the ``digits`` task: the last whitespace-separated token of the prompt.

    >>> digits_answer("Repeat the last digit: 4 8 1")
    '1'
    """
    return prompt.split()[-1]


def make_digits_task(n: int = DIGITS_ROWS, seed: int = DIGITS_SEED) -> list[dict[str, str]]:
    """``n`` distinct rows ``{"prompt": "Repeat the last digit: 4 8 1", "answer": "1"}``.

    Deterministic in ``seed`` (a private ``numpy`` Generator; the global RNGs are untouched).
    Answers are balanced: each digit is the answer of ``n // 10`` or ``n // 10 + 1`` rows.

    >>> make_digits_task(2, seed=0) == make_digits_task(2, seed=0)
    True
    """
    if n < 1:
        raise ValueError(f"make_digits_task: n must be >= 1, got {n}")
    rng = np.random.default_rng(seed)
    answers = rng.permutation(np.arange(n) % 10)
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    for answer in answers:
        while True:  # distinct prompts, so that a train / eval split shares no prompt
            length = int(rng.integers(DIGITS_MIN_LEN, DIGITS_MAX_LEN + 1))
            digits = [str(d) for d in rng.integers(0, 10, size=length - 1)] + [str(answer)]
            prompt = f"{DIGITS_INSTRUCTION} {' '.join(digits)}"
            if prompt not in seen:
                break
        seen.add(prompt)
        rows.append({"prompt": prompt, "answer": str(answer)})
    return rows


def format_completion(think: str, answer: str) -> str:
    r"""A well-formed reasoning completion (no EOS: the tokenizer's EOS is appended by SFT).

    >>> format_completion("The answer is", "7")
    '<think>\nThe answer is\n</think>\n<answer>\n7\n</answer>'
    """
    return f"<think>\n{think}\n</think>\n<answer>\n{answer}\n</answer>"


def warmup_examples(
    rows: Iterable[dict],
    seed: int = 0,
    *,
    think: str = WARMUP_THINK,
    answer_accuracy: float = 0.0,
) -> list[tuple[str, str]]:
    """(prompt, completion) pairs that teach the format; the answer is mostly a RANDOM digit.

    With probability ``answer_accuracy`` a row's answer is the reference ``answer``; otherwise
    it is uniform over 0-9 and independent of the prompt (see the module docstring for why).
    A small ``answer_accuracy`` leaves RL a weak prompt-answer link to amplify instead of none.
    ``prompt`` is the row's raw prompt, to be wrapped in the chat template by the caller.
    Deterministic in ``seed``.
    """
    if not 0.0 <= answer_accuracy <= 1.0:
        raise ValueError(f"answer_accuracy={answer_accuracy!r}: must lie in [0, 1]")
    rows = list(rows)
    rng = np.random.default_rng([seed, 0x5F7])  # a stream apart from make_digits_task(seed)
    guesses = rng.integers(0, 10, size=len(rows))
    use_reference = rng.random(len(rows)) < answer_accuracy
    pairs = []
    for i, (row, guess, exact) in enumerate(zip(rows, guesses, use_reference)):
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(prompt, str):
            raise ValueError(f"warmup_examples: row {i} has no string 'prompt' field: {row!r}")
        answer = str(row["answer"]) if exact and "answer" in row else str(int(guess))
        pairs.append((prompt, format_completion(think, answer)))
    return pairs


BUILTIN_TASKS: dict[str, Callable[[], list[dict[str, str]]]] = {
    "digits": lambda: make_digits_task(DIGITS_ROWS, seed=DIGITS_SEED),
}
"""Generators of the built-in tasks. ``builtin:NAME`` (``textrl.envs.prompts.load_prompts``) reads
``DATA_DIR / NAME.jsonl`` when it is shipped and generates the rows with this otherwise."""


def write_jsonl(rows: Iterable[dict], path: str | os.PathLike[str]) -> None:
    """One JSON object per line, keys in order, UTF-8, ``\\n`` line ends."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


__all__ = [
    "BUILTIN_TASKS",
    "DATA_DIR",
    "digits_answer",
    "format_completion",
    "make_digits_task",
    "warmup_examples",
    "write_jsonl",
]
