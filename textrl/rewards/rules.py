"""Rule rewards for ``<think>...</think><answer>...</answer>`` reasoning completions.

Plain functions in the style of TRL's ``format_rewards``: batched in, float32 ``[B]`` out, no
hidden state; each docstring is a doctest. Completions may be strings or, for conversational
rows, message lists (TRL's form): then the text of the last assistant message is scored
(:func:`textrl.rewards.base.completion_text`). ``think_format_reward`` and ``tag_count_reward``
reproduce MiniMind's PPO reasoning rewards (format: 0.5, tags: 0.25 each).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from textrl.rewards.base import Completion, Prompt, batch_field, completion_texts, named, needs

# One regex for MiniMind's two patterns: ``\n\n?`` allows the blank line between the blocks.
# ``re.match`` anchors the start; ``$`` (no MULTILINE) matches at the end of the string or just
# before a final "\n", so exactly one trailing newline after </answer> is accepted, as in
# MiniMind. DOTALL lets the lazy ``.*?`` span lines, which also means it can swallow a whole
# earlier block: doubled tags may still score 0.5 here, and tag_count_reward is what marks them.
THINK_FORMAT_PATTERN = re.compile(
    r"^<think>\n.*?\n</think>\n\n?<answer>\n.*?\n</answer>$", re.DOTALL
)
TAGS = ("<think>", "</think>", "<answer>", "</answer>")


@named("think_format")
def think_format_reward(
    prompts: list[Prompt], completions: list[Completion], **kwargs: Any
) -> Tensor:
    r"""0.5 when a completion is ``<think>\n...\n</think>\n<answer>\n...\n</answer>``, else 0.

    A blank line between the blocks and one trailing newline are accepted (MiniMind's
    ``re.match(..., re.S)`` with ``$``); text before ``<think>`` or after ``</answer>``, a
    missing newline inside a tag, or "\r\n" line endings score 0. The think block needs at least
    the two newlines around its content: ``<think>\n\n</think>`` passes, ``<think>\n</think>``
    does not.

    >>> good = "<think>\nsix times seven\n</think>\n<answer>\n42\n</answer>"
    >>> think_format_reward(["q"] * 4, [
    ...     good,
    ...     good.replace("</think>\n", "</think>\n\n"),  # blank line between blocks
    ...     good + "\n",                                  # one trailing newline
    ...     good.replace("<think>\n", "<think>"),         # no newline after <think>
    ... ]).tolist()
    [0.5, 0.5, 0.5, 0.0]
    """
    scores = [0.5 if THINK_FORMAT_PATTERN.match(c) else 0.0 for c in completion_texts(completions)]
    return torch.tensor(scores, dtype=torch.float32)


@named("tag_count")
def tag_count_reward(prompts: list[Prompt], completions: list[Completion], **kwargs: Any) -> Tensor:
    """+0.25 for each of ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` seen exactly once.

    A dense partial-credit signal for the format (MiniMind's ``mark_num``): a doubled or missing
    tag earns nothing for that tag; the order of the tags is not checked.

    >>> tag_count_reward(["q"] * 4, [
    ...     "<think>\\na\\n</think>\\n<answer>\\nb\\n</answer>",  # all four once
    ...     "<think>\\na\\n</think>",                          # no answer block
    ...     "<think><think></think><answer></answer>",       # <think> twice
    ...     "plain text",
    ... ]).tolist()
    [1.0, 0.5, 0.75, 0.0]
    """
    scores = [0.25 * sum(c.count(tag) == 1 for tag in TAGS) for c in completion_texts(completions)]
    return torch.tensor(scores, dtype=torch.float32)


def tag_content(text: str, open_tag: str, close_tag: str) -> str | None:
    """The text between the first ``open_tag`` and the first ``close_tag`` after it (what the
    regex ``OPEN(.*?)CLOSE`` with DOTALL finds), None without such a pair. Two ``str.find``
    calls: linear in ``len(text)`` however many unclosed open tags it holds (the lazy regex
    rescans the rest of the text from each of them, quadratic).

    >>> tag_content("a<t>x</t><t>y</t>", "<t>", "</t>"), tag_content("<t><t>x", "<t>", "</t>")
    ('x', None)
    """
    start = text.find(open_tag)
    if start < 0:
        return None
    start += len(open_tag)
    end = text.find(close_tag, start)
    return None if end < 0 else text[start:end]


def extract_answer(completion: str) -> str | None:
    """Content of the first ``<answer>...</answer>`` block, stripped; None without one
    (:func:`tag_content`: linear time).

    >>> extract_answer("<think>\\nx\\n</think>\\n<answer>\\n 42 \\n</answer>")
    '42'
    >>> extract_answer("42") is None
    True
    """
    content = tag_content(completion, "<answer>", "</answer>")
    return None if content is None else content.strip()


def normalize_answer(text: Any) -> str:
    """``str(text)`` stripped, with every run of whitespace collapsed to one space.

    >>> normalize_answer("  x =\\n 4 ")
    'x = 4'
    """
    return " ".join(str(text).split())


@needs("answer")
@named("accuracy")
def accuracy_reward(
    prompts: list[Prompt],
    completions: list[Completion],
    *,
    answer: Any = None,
    require_tags: bool = False,
    **kwargs: Any,
) -> Tensor:
    """1.0 when the completion's answer equals the reference ``answer``, else 0.

    The answer is the first ``<answer>...</answer>`` block; a completion without a complete
    block is compared as a whole (so the reward also works for plain-answer datasets), unless
    ``require_tags=True``, which scores it 0. Both sides are normalised with
    :func:`normalize_answer` (strip, collapse whitespace); the comparison is case-sensitive.
    ``answer`` is required: one reference per completion (the dataset's ``answer`` field).

    >>> accuracy_reward(["q"] * 4, [
    ...     "<think>\\nx\\n</think>\\n<answer>\\n 42\\n</answer>",
    ...     "42",                       # no tags: the whole completion is the answer
    ...     "<answer>41</answer>",
    ...     "<answer>4 2</answer>",
    ... ], answer=["42", 42, "42", "4  2"]).tolist()
    [1.0, 1.0, 0.0, 1.0]
    >>> accuracy_reward(["q"], ["42"], answer=["42"], require_tags=True).tolist()
    [0.0]
    >>> accuracy_reward([[{"role": "user", "content": "6*7?"}]],  # a conversational row
    ...                 [[{"role": "assistant", "content": "<answer>42</answer>"}]],
    ...                 answer=["42"]).tolist()
    [1.0]
    """
    refs = batch_field(answer, "answer", len(completions), "accuracy_reward")
    missing = [i for i, r in enumerate(refs) if r is None]
    if missing:
        raise ValueError(
            f"accuracy_reward: the reference answer is None in rows {missing[:10]}; "
            "drop those rows or leave accuracy out of the reward spec for this dataset"
        )
    scores = []
    for completion, ref in zip(completion_texts(completions), refs):
        got = extract_answer(completion)
        if got is None:
            got = None if require_tags else completion
        scores.append(float(got is not None and normalize_answer(got) == normalize_answer(ref)))
    return torch.tensor(scores, dtype=torch.float32)


__all__ = [
    "THINK_FORMAT_PATTERN",
    "accuracy_reward",
    "extract_answer",
    "normalize_answer",
    "tag_content",
    "tag_count_reward",
    "think_format_reward",
]
