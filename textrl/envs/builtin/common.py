"""What the built-in environments share: their reasoning-format reward and its maximum, the warm-up's
default share of right answers, private seeded generators, the checks of their settings, disjoint
train / held-out instances, the integer answer format and the format warm-up."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from textrl.envs.tasks import WARMUP_THINK, format_completion

FORMAT_REWARD = "think_format,tag_count,accuracy"
"""The reasoning-format reward of the single-turn built-ins (as the embedded default's)."""
FORMAT_MAX_REWARD = 0.5 + 1.0 + 1.0
"""Its maximum: think_format 0.5, tag_count 4 x 0.25, accuracy 1 (:mod:`textrl.rewards.rules`)."""
WARMUP_ACCURACY = 0.3
"""Default share of right answers in a warm-up (the embedded default's ``warmup_answer_accuracy``)."""

_INTEGER = re.compile(r"[-+]?[0-9]{1,18}")
"""An integer as the tasks write answers: ASCII digits only (``\\d`` also takes '٣'), no separators."""


def seeded_rng(seed: int, stream: int) -> np.random.Generator:
    """A private generator for one purpose (``stream``) of one ``seed``."""
    return np.random.default_rng([int(seed), stream])


def check_int(name: str, value: Any, low: int, env: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{env}: {name}={value!r} must be an int >= {low}")
    return int(value)


def check_share(name: str, value: Any, env: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{env}: {name}={value!r} must be a number in [0, 1]")
    return float(value)


def distinct_indices(total: int, n_eval: int, n_rows: int, seed: int, env: str) -> tuple[list[int], list[int]]:
    """Disjoint (train, eval) samples of ``range(total)``: ``n_rows`` and ``n_eval`` indices."""
    if n_rows < 1 or n_rows + n_eval > total:
        raise ValueError(f"{env}: n_rows={n_rows} and n_eval={n_eval} do not fit its {total} distinct "
                         f"instances (need n_rows >= 1 and n_rows + n_eval <= {total}); ask for fewer "
                         "rows or widen the task")
    picked = seeded_rng(seed, 0xA217).choice(total, size=n_rows + n_eval, replace=False)
    return [int(i) for i in picked[n_eval:]], [int(i) for i in picked[:n_eval]]


def parse_integer(text: str | None) -> int | None:
    """An integer written alone (an optional sign and ASCII digits), else None: thousands
    separators and other scripts' digits are not the answer's format.

    >>> parse_integer(" 287663 "), parse_integer("-4"), parse_integer("4 apples")
    (287663, -4, None)
    >>> parse_integer("287,663"), parse_integer("\u0663")  # a comma; ARABIC-INDIC DIGIT THREE
    (None, None)
    """
    if text is None:
        return None
    text = text.strip()
    return int(text) if _INTEGER.fullmatch(text) else None


def format_warmup(
    rows: Sequence[dict[str, Any]], seed: int, answer_accuracy: float, choices: Sequence[str], stream: int
) -> list[tuple[str, str]]:
    """(prompt, format completion) per row: the row's answer with probability
    ``answer_accuracy``, else an answer drawn uniformly from ``choices`` (independent of the
    prompt), in the think/answer format of :func:`textrl.envs.tasks.format_completion`."""
    rng = seeded_rng(seed, stream)
    pairs = []
    for row in rows:
        right = rng.random() < answer_accuracy
        guess = choices[int(rng.integers(len(choices)))]
        pairs.append((row["prompt"], format_completion(WARMUP_THINK, str(row["answer"]) if right else guess)))
    return pairs


__all__ = ["FORMAT_MAX_REWARD", "FORMAT_REWARD", "WARMUP_ACCURACY", "check_int", "check_share", "distinct_indices",
           "format_warmup", "parse_integer", "seeded_rng"]
