"""``math_verify``: 1.0 when a completion's answer is mathematically equal to the reference.

Uses Hugging Face's `math-verify <https://github.com/huggingface/Math-Verify>`_ package
(``pip install 'textrl[math]'``), imported when the reward is first called: ``1/2``, ``0.5``,
``\\frac{1}{2}`` and ``$\\frac12$`` are one answer, ``x+1`` equals ``1+x``, ``10%`` equals
``0.1``. Works with any rows that carry an ``answer`` field (a ``--dataset`` with answers, or
``reasoning_gym:basic_arithmetic`` and the other arithmetic tasks).
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from textrl.rewards.base import batch_field, named, needs
from textrl.rewards.rules import extract_answer


def _math_verify() -> ModuleType:
    """The ``math_verify`` package, or a one-line ``ImportError`` naming the extra to install."""
    try:
        import math_verify
    except ImportError as error:
        raise ImportError(f"reward 'math_verify' needs the math-verify package, which cannot be imported "
                          f"({error}); install it with: pip install 'textrl[math]'") from None
    return math_verify


def parse_math(mv: ModuleType, text: str, timeout: int | None) -> list[Any]:
    """``text`` parsed by math-verify as one LaTeX expression (``$text$``, so ``1+x`` is read
    whole), else as free text (math-verify finds the answer in it); ``[]`` when neither parses."""
    parsed = mv.parse(f"${text}$", parsing_timeout=timeout)
    return parsed if parsed else mv.parse(text, parsing_timeout=timeout)


@needs("answer")
@named("math_verify")
def math_verify_reward(
    prompts: list[str],
    completions: list[str],
    *,
    answer: Any = None,
    timeout_seconds: int | None = 5,
    **kwargs: Any,
) -> Tensor:
    r"""1.0 when the completion's answer equals the reference ``answer`` as math, else 0; float32 ``[B]``.

    The completion's answer is its first ``<answer>...</answer>`` block, parsed as one expression
    (:func:`parse_math`); a completion without a block is parsed whole, math-verify finding the
    answer in the text (a ``\boxed{}``, the last number, ...). The reference is parsed as one
    expression. A reference or answer math-verify cannot parse scores 0. ``timeout_seconds``
    bounds each parse and comparison (math-verify's ``signal.alarm``; off outside the main
    thread, where signals cannot be used).

    >>> math_verify_reward(["q"] * 4, [
    ...     "<answer>0.5</answer>",
    ...     "<answer>\\frac{1}{2}</answer>",
    ...     "so the answer is $\\frac{1}{2}$",
    ...     "<answer>0.4</answer>",
    ... ], answer=["1/2"] * 4).tolist()
    [1.0, 1.0, 1.0, 0.0]
    """
    mv = _math_verify()
    refs = batch_field(answer, "answer", len(completions), "math_verify_reward")
    missing = [i for i, r in enumerate(refs) if r is None]
    if missing:
        raise ValueError(f"math_verify_reward: the reference answer is None in rows {missing[:10]}; drop those "
                         "rows or leave math_verify out of the reward spec for this dataset")
    timeout = timeout_seconds if threading.current_thread() is threading.main_thread() else None
    scores = []
    for completion, ref in zip(completions, refs):
        gold = parse_math(mv, str(ref), timeout)
        text = extract_answer(completion)
        pred = mv.parse(completion, parsing_timeout=timeout) if text is None else parse_math(mv, text, timeout)
        same = bool(gold) and bool(pred) and mv.verify(gold, pred, timeout_seconds=timeout)
        scores.append(float(same))
    return torch.tensor(scores, dtype=torch.float32)


__all__ = ["math_verify_reward", "parse_math"]
