"""What the reward functions of a batch of finished responses are called with (TRL's two forms).

:func:`reward_arguments` decodes the responses and builds the prompts, completions and batch fields
:func:`textrl.envs.fast_path.score_completions` calls every reward function with; the episode runner
builds them in its own thread for a reward scored in the background (:mod:`textrl.envs.background_scores`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

RESERVED_FIELDS = ("completion_ids", "truncated")
"""Batch fields :func:`reward_arguments` passes itself; a prompt row may not use these names."""


def _message_rows(rows: Sequence[Any], what: str, b: int) -> list[list[dict[str, Any]]]:
    """Per-row copies of ``B`` message lists; raises naming ``what`` and the row when a row is
    not a non-empty list of ``{"role": str, "content": ...}`` messages."""
    if isinstance(rows, (str, bytes)) or len(rows) != b:
        got = "a str" if isinstance(rows, (str, bytes)) else f"{len(rows)} rows"
        raise ValueError(f"{what} has {got} for {b} responses; pass one message list per row")
    out = []
    for i, row in enumerate(rows):
        if (
            not isinstance(row, (list, tuple))
            or not row
            or not all(isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in row)
        ):
            raise ValueError(
                f"{what}[{i}] is {row!r}: each row must be a non-empty list of "
                "{'role': str, 'content': str} messages"
            )
        out.append([dict(m) for m in row])
    return out


def _reward_inputs(
    prompts: Sequence[str],
    completions: list[str],
    conversations: Sequence[Sequence[Mapping[str, Any]]] | None,
    completion_messages: Sequence[Sequence[Mapping[str, Any]]] | None,
) -> tuple[list[Any], list[Any]]:
    """``(prompts, completions)`` as the reward functions get them (TRL's two forms).

    Standard rows: the prompt texts and decoded completions. Conversational rows (either
    argument given): each prompt is its message list (a plain prompt becomes one user message
    when only ``completion_messages`` is given), each completion its message list
    (``[{"role": "assistant", "content": text}]`` when ``completion_messages`` is None).
    """
    b = len(completions)
    if conversations is None and completion_messages is None:
        return list(prompts), completions
    if conversations is None:
        prompt_rows = [[{"role": "user", "content": p}] for p in prompts]
    else:
        prompt_rows = _message_rows(conversations, "conversations", b)
    if completion_messages is None:
        completion_rows = [[{"role": "assistant", "content": c}] for c in completions]
    else:
        completion_rows = _message_rows(completion_messages, "completion_messages", b)
    return prompt_rows, completion_rows


def reward_arguments(
    prompts: Sequence[str],
    responses: Tensor,
    mask: Tensor,
    *,
    tokenizer: Any,
    truncated: Tensor | None = None,
    fields: Mapping[str, Sequence[Any]] | None = None,
    conversations: Sequence[Sequence[Mapping[str, Any]]] | None = None,
    completion_messages: Sequence[Sequence[Mapping[str, Any]]] | None = None,
    texts: Sequence[str] | None = None,
) -> tuple[list[Any], list[Any], dict[str, Any], list[str]]:
    """What :func:`textrl.envs.fast_path.score_completions` calls the reward functions with, for its arguments:
    ``(prompts, completions, batch fields, decoded completions)`` (TRL's two forms: see there)."""
    if responses.dim() != 2 or mask.shape != responses.shape:
        raise ValueError(
            f"responses {tuple(responses.shape)} and mask {tuple(mask.shape)} must both be [B, T]"
        )
    b = responses.shape[0]
    if len(prompts) != b:
        raise ValueError(f"{len(prompts)} prompts for {b} responses; pass one prompt per row")
    ids = [row[m].tolist() for row, m in zip(responses.cpu(), mask.cpu())]
    if texts is not None and len(texts) != b:
        raise ValueError(f"{len(texts)} decoded texts for {b} responses; pass one per row, or None")
    completions = tokenizer.batch_decode(ids, skip_special_tokens=True) if texts is None else list(texts)
    if truncated is None:
        truncated = torch.zeros(b, dtype=torch.bool)
    kwargs: dict[str, Any] = dict(fields or {})
    clash = sorted(set(kwargs) & set(RESERVED_FIELDS))
    if clash:
        raise ValueError(
            f"prompt fields {clash} clash with fields the environment passes to rewards itself "
            f"{list(RESERVED_FIELDS)}; rename them in the prompt rows"
        )
    kwargs["completion_ids"] = ids
    kwargs["truncated"] = truncated.to(torch.bool).cpu().reshape(b)
    reward_prompts, reward_completions = _reward_inputs(
        prompts, list(completions), conversations, completion_messages
    )
    return reward_prompts, reward_completions, kwargs, list(completions)


__all__ = ["RESERVED_FIELDS", "reward_arguments"]
