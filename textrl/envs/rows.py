"""Prompt rows as the rewards and the environments read them: messages, raw prompt text, fields.

A row is a dict with ``"prompt"`` (a string, or a TRL conversational list of messages) or
``"messages"``, plus fields such as ``"answer"`` that reach the reward functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def row_messages(row: Mapping[str, Any], index: int) -> tuple[list[dict[str, str]], str]:
    """(chat messages, prompt text for the rewards) of a row with ``prompt`` or ``messages``."""
    messages = row.get("messages")
    prompt = row.get("prompt")
    if messages is None and isinstance(prompt, list):
        messages = prompt
    if messages is not None:
        user = [m.get("content", "") for m in messages if m.get("role") == "user"]
        text = prompt if isinstance(prompt, str) else (user[-1] if user else "")
        if not any(str(m.get("content", "")).strip() for m in messages):
            raise ValueError(f"prompt {index} is empty (its messages have no content)")
        return list(messages), text
    if not isinstance(prompt, str):
        raise ValueError(
            f"prompt {index} is {row!r}: a row needs a 'prompt' str (or a 'messages' list)"
        )
    if not prompt.strip():
        raise ValueError(f"prompt {index} is empty; remove it or give it text")
    return [{"role": "user", "content": prompt}], prompt



_PROMPT_FIELDS = ("prompt", "messages")


def batch_fields(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """The rows' reward fields as a dict of lists (``prompt`` / ``messages`` left out).

    A field missing from some rows is ``None`` there, so every list has one entry per row.

    >>> batch_fields([{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    {'answer': ['1', None]}
    """
    names: dict[str, None] = {}
    for row in rows:
        names.update((k, None) for k in row if k not in _PROMPT_FIELDS)
    return {name: [row.get(name) for row in rows] for name in names}


def raw_prompts(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The text the reward functions see for each row: the raw prompt, no chat template
    (for a conversation, its last user turn)."""
    return [row_messages(row, i)[1] for i, row in enumerate(rows)]


__all__ = ["batch_fields", "raw_prompts", "row_messages"]
