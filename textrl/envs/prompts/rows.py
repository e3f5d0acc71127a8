"""Prompt rows as the rewards and the environments read them: messages, raw prompt text, fields.

A row is a dict with ``"prompt"`` (a string, or a TRL conversational list of messages) or
``"messages"``, plus fields such as ``"answer"`` that reach the reward functions.

A conversation that ends with an assistant turn after its last user turn carries its reference
answer (an SFT-style row, TRL's conversational language-modeling format): the prompt is the
conversation up to and including the last user turn, and the assistant's text is kept as the row's
``"reference"`` field, which the reward functions receive (:func:`split_reference`,
:func:`keep_reference`). A row whose own ``"reference"`` says something else is refused: neither is
dropped silently. (:func:`textrl.envs.prompts.load_prompts` does this as it loads a row; rows given
straight to an environment get it here.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def keep_reference(row: dict[str, Any], reference: str | None, where: str, field: str) -> dict[str, Any]:
    """``row`` with ``reference`` (the text of its conversation's closing assistant turn, None when
    there is none) as its ``"reference"`` field; ``ValueError`` naming the row when it already holds
    a different ``"reference"``."""
    if reference is None:
        return row
    held = row.setdefault("reference", reference)
    if held != reference:
        raise ValueError(
            f"{where}: {field!r} ends with an assistant turn ({reference[:40]!r}), kept as the row's "
            f"'reference', but the row has its own 'reference' ({str(held)[:40]!r}); drop one of the two "
            f"(end {field!r} with its last user turn, or remove the 'reference' field)"
        )
    return row


def split_reference(row: Mapping[str, Any], where: Any) -> Mapping[str, Any]:
    """``row`` as a prompt: when its conversation (``messages``, or ``prompt`` given as a list)
    ends with one assistant turn after its last user turn, a copy cut at that user turn whose
    ``"reference"`` holds the assistant's text (:func:`keep_reference`); else ``row`` itself.

    >>> row = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    >>> split_reference(row, 0)
    {'messages': [{'role': 'user', 'content': '2+2?'}], 'reference': '4'}
    """
    field = "messages" if row.get("messages") is not None else "prompt"
    messages = row.get(field)
    if not isinstance(messages, list) or not messages:
        return row
    roles = [turn.get("role") if isinstance(turn, Mapping) else None for turn in messages]
    if roles[-1] != "assistant" or "user" not in roles:
        return row
    last_user = len(roles) - 1 - roles[::-1].index("user")
    reference = messages[-1].get("content")
    if last_user != len(roles) - 2 or not isinstance(reference, str):
        return row  # not one closing answer: the conversation goes to the template as it is
    name = f"prompt {where}" if isinstance(where, int) else str(where)
    return keep_reference({**row, field: list(messages[:-1])}, reference, name, field)


def row_messages(row: Mapping[str, Any], index: int) -> tuple[list[dict[str, str]], str]:
    """(chat messages, prompt text for the rewards) of a row with ``prompt`` or ``messages``; a
    closing assistant turn is not part of the prompt (:func:`split_reference`)."""
    row = split_reference(row, index)
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


__all__ = ["batch_fields", "keep_reference", "raw_prompts", "row_messages", "split_reference"]
