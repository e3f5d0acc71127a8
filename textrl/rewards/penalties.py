"""Penalty rewards (scores <= 0): length over a target, repeated n-grams, missing EOS.

Plain functions; their settings are keyword-only arguments, bound by the registry
(``get_reward("length_penalty", target_tokens=128)``) or with ``functools.partial``. Completions
may be strings or message lists (conversational rows: the last assistant message's text counts).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from textrl.rewards.base import Completion, Prompt, bool_rows, completion_texts, named, token_lists


def _check_nonnegative(fn_name: str, **values: float | None) -> None:
    for key, v in values.items():
        if v is not None and v < 0:
            raise ValueError(f"{fn_name}: {key}={v} must be >= 0")


@named("length_penalty")
def length_penalty(
    prompts: list[Prompt],
    completions: list[Completion],
    *,
    completion_ids: Any = None,
    completion_mask: Any = None,
    target_tokens: int = 256,
    penalty_per_token: float = 0.01,
    max_penalty: float | None = None,
    **kwargs: Any,
) -> Tensor:
    """``-penalty_per_token * max(0, n_tokens - target_tokens)``, capped at ``-max_penalty``.

    Token counts come from ``completion_ids`` (per-row id lists, or a ``[B, T]`` tensor with
    ``completion_mask``); there is no fallback to characters or words.

    >>> length_penalty(["q"] * 3, ["", "", ""], completion_ids=[[1] * 2, [1] * 5, [1] * 30],
    ...                target_tokens=4, penalty_per_token=0.5, max_penalty=10).tolist()
    [0.0, -0.5, -10.0]
    """
    _check_nonnegative(
        "length_penalty",
        target_tokens=target_tokens,
        penalty_per_token=penalty_per_token,
        max_penalty=max_penalty,
    )
    rows = token_lists(completion_ids, completion_mask, len(completions), "length_penalty")
    n_tokens = torch.tensor([len(r) for r in rows], dtype=torch.float32)
    over = (n_tokens - target_tokens).clamp(min=0)
    penalty = penalty_per_token * over
    if max_penalty is not None:
        penalty = penalty.clamp(max=max_penalty)
    return 0.0 - penalty  # +0.0, not -0.0, for rows under the target


def repeated_ngram_fraction(units: list[Any], ngram_size: int) -> float:
    """``1 - unique / total`` over the n-grams of ``units``; 0 when there is no n-gram.

    >>> repeated_ngram_fraction("a b a b a b".split(), 2)  # ab ba ab ba ab: 2 unique of 5
    0.6
    """
    ngrams = [tuple(units[i : i + ngram_size]) for i in range(len(units) - ngram_size + 1)]
    return 1.0 - len(set(ngrams)) / len(ngrams) if ngrams else 0.0


@named("repetition_penalty")
def repetition_penalty(
    prompts: list[Prompt],
    completions: list[Completion],
    *,
    ngram_size: int = 3,
    max_penalty: float = 1.0,
    unit: str = "words",
    completion_ids: Any = None,
    completion_mask: Any = None,
    **kwargs: Any,
) -> Tensor:
    """``-max_penalty`` times the fraction of repeated n-grams in each completion.

    ``unit="words"`` splits the text on whitespace (tokenizer-independent; the default);
    ``unit="tokens"`` uses ``completion_ids``. A completion shorter than ``ngram_size`` units
    scores 0.

    >>> scores = repetition_penalty(
    ...     ["q"] * 3, ["the cat sat on the mat", "go go go go go", "hi"], ngram_size=1)
    >>> [round(x, 3) for x in scores.tolist()]  # 1 of 6 words repeated; 4 of 5; none
    [-0.167, -0.8, 0.0]
    """
    if ngram_size < 1:
        raise ValueError(f"repetition_penalty: ngram_size={ngram_size} must be >= 1")
    _check_nonnegative("repetition_penalty", max_penalty=max_penalty)
    if unit == "words":
        rows: list[list[Any]] = [c.split() for c in completion_texts(completions)]
    elif unit == "tokens":
        rows = token_lists(completion_ids, completion_mask, len(completions), "repetition_penalty")
    else:
        raise ValueError(f"repetition_penalty: unit={unit!r}; use 'words' or 'tokens'")
    fractions = [repeated_ngram_fraction(r, ngram_size) for r in rows]
    return 0.0 - max_penalty * torch.tensor(fractions, dtype=torch.float32)


@named("missing_eos_penalty")
def missing_eos_penalty(
    prompts: list[Prompt],
    completions: list[Completion],
    *,
    truncated: Any = None,
    penalty: float = 1.0,
    **kwargs: Any,
) -> Tensor:
    """``-penalty`` for rows that hit the length cap without EOS (``truncated``), else 0.

    >>> missing_eos_penalty(["q"] * 2, ["done.", "and then"], truncated=[False, True]).tolist()
    [0.0, -1.0]
    """
    _check_nonnegative("missing_eos_penalty", penalty=penalty)
    cut = bool_rows(truncated, "truncated", len(completions), "missing_eos_penalty")
    return torch.where(cut, -float(penalty), 0.0).to(torch.float32)


__all__ = [
    "length_penalty",
    "missing_eos_penalty",
    "repeated_ngram_fraction",
    "repetition_penalty",
]
