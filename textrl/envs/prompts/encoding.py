"""Prompts to token ids: chat templates, token budgets, left-truncation, left-padding.

A row's prompt is templated (the chat template with a generation prompt, or the messages'
contents joined by newlines for a tokenizer without one) and tokenized, ``_CHUNK_ROWS`` rows a
tokenizer call. A prompt over ``max_prompt_length`` is refused (``truncate='error'``) or keeps its
last tokens (``'left'``, with a warning). :class:`_Encoder` encodes rows when first batched,
keeping the ``_CACHE_ROWS`` batched last; :func:`encode_prompts` encodes a fixed set in order;
:func:`check_prompts_fit` refuses, before training, prompts that would not fit a model's context.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from textrl.envs.prompts.batch import PromptBatch
from textrl.envs.prompts.dataset import PromptDataset, load_prompts

TruncateMode = Literal["error", "left"]
_TRUNCATE_MODES = ("error", "left")


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


_FLATTENED_WARNED: set[str] = set()
"""Tokenizers already warned about by :func:`_warn_flattened` (one warning per tokenizer a process)."""


def _warn_flattened(tokenizer: Any, conversations: Iterable[list[dict[str, str]]]) -> None:
    """Warn once per tokenizer when a tokenizer without a chat template is given conversations:
    their contents are joined by newlines, so the roles (and what marks the system prompt and each
    turn) are dropped."""
    name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    if name in _FLATTENED_WARNED:
        return
    for messages in conversations:
        roles = [m.get("role") for m in messages]
        if len(messages) > 1 or roles != ["user"]:
            _FLATTENED_WARNED.add(name)
            what = "the system prompt and the roles" if "system" in roles else "the roles of the turns"
            warnings.warn(f"tokenizer {name!r} has no chat template, so conversations (roles {roles}, ...) are "
                          f"flattened to their contents joined by newlines: {what} are dropped; give a tokenizer "
                          "with a chat template (--tokenizer) or plain 'prompt' rows", stacklevel=3)
            return


def template_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The text the policy continues: the chat template with a generation prompt, or, for a
    tokenizer without a template, the messages' contents joined by newlines (with a warning, once
    per tokenizer, when that drops roles: :func:`_warn_flattened`)."""
    if _has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    _warn_flattened(tokenizer, [messages])
    return "\n".join(m["content"] for m in messages)


_CHUNK_ROWS = 1024
"""Most rows templated and tokenized in one tokenizer call (check_prompts_fit, encode_prompts)."""
_CACHE_ROWS = 4096
"""Encoded rows a sampler keeps, the most recently drawn: a dataset this small is tokenized once."""


def _template_texts(tokenizer: Any, conversations: list[list[dict[str, str]]]) -> list[str]:
    """:func:`template_prompt` of each conversation, the chat template rendered in one call."""
    if not conversations:
        return []
    if _has_chat_template(tokenizer):
        return list(tokenizer.apply_chat_template(conversations, tokenize=False,
                                                  add_generation_prompt=True))
    _warn_flattened(tokenizer, conversations)
    return ["\n".join(m["content"] for m in messages) for messages in conversations]


def _encode_rows(
    dataset: PromptDataset, tokenizer: Any, indices: Sequence[int]
) -> tuple[list[str], list[list[int]]]:
    """The templated text and token ids of the rows at ``indices``, in one batched tokenizer
    call; a row that tokenizes to nothing is a ``ValueError`` naming it."""
    texts = _template_texts(tokenizer, [dataset.messages(i) for i in indices])
    if not texts:
        return [], []
    # After a template the special tokens are in the text; adding BOS again would double it.
    ids = tokenizer(texts, add_special_tokens=not _has_chat_template(tokenizer))["input_ids"]
    ids = [list(row) for row in ids]
    for i, text, row_ids in zip(indices, texts, ids):
        if not row_ids:
            raise ValueError(f"{dataset.where(i)}: the prompt tokenizes to no tokens: {text!r}")
    return texts, ids


def _counted(tokenizer: Any) -> str:
    """What a prompt's length counts, for messages."""
    return " (chat template included)" if _has_chat_template(tokenizer) else ""


def _too_long(where: str, n_tokens: int, max_prompt_length: int, tokenizer: Any) -> ValueError:
    """The refusal of a prompt over ``max_prompt_length`` (``truncate='error'``)."""
    return ValueError(
        f"{where}: the prompt is {n_tokens} tokens long{_counted(tokenizer)}, more than "
        f"max_prompt_length={max_prompt_length}; raise --max-prompt-length, shorten the prompt, or "
        "(Python API) pass truncate='left' to keep its last tokens"
    )


def _truncated_message(dataset: PromptDataset, truncated: list[tuple[int, int]],
                       max_prompt_length: int | None, scope: str = "") -> str:
    """The warning about ``truncated`` rows, (row, tokens before truncation), the first five named."""
    shown = ", ".join(f"{dataset.where(i)} ({n} tokens)" for i, n in truncated[:5])
    return (f"{len(truncated)} prompt(s) of {dataset.source}{scope} are longer than "
            f"max_prompt_length={max_prompt_length} and were left-truncated to their last "
            f"{max_prompt_length} tokens: {shown}{' ...' if len(truncated) > 5 else ''}")


def _check_truncate(max_prompt_length: int | None, truncate: str) -> None:
    if truncate not in _TRUNCATE_MODES:
        raise ValueError(f"truncate must be one of {_TRUNCATE_MODES}, got {truncate!r}")
    if max_prompt_length is not None and max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1 or None, got {max_prompt_length}")


def _left_pad(ids: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """(input_ids int64 ``[B, P]``, attention_mask bool ``[B, P]``): each row of ``ids`` (none
    empty) right-aligned after ``pad_id``s, ``P`` the longest row."""
    width = max(len(row) for row in ids)
    input_ids = np.full((len(ids), width), pad_id, dtype=np.int64)
    attention_mask = np.zeros((len(ids), width), dtype=bool)
    for b, row in enumerate(ids):
        input_ids[b, width - len(row) :] = row
        attention_mask[b, width - len(row) :] = True
    return torch.from_numpy(input_ids), torch.from_numpy(attention_mask)


class _Encoder:
    """Templated text and token ids of a dataset's rows, encoded when first batched; the
    ``cache_rows`` rows batched last are kept, so memory does not grow with the dataset."""

    def __init__(
        self,
        dataset: PromptDataset,
        tokenizer: Any,
        max_prompt_length: int | None,
        truncate: TruncateMode,
        cache_rows: int | None = None,
    ) -> None:
        """``cache_rows``: rows kept encoded (None: ``_CACHE_ROWS``, 0: none)."""
        _check_truncate(max_prompt_length, truncate)
        pad_id = tokenizer.pad_token_id
        if pad_id is None:
            raise ValueError(
                "the tokenizer has no pad token: set tokenizer.pad_token (e.g. to its eos token, "
                "as textrl.models.load_tokenizer does) before building a prompt sampler"
            )
        self.pad_id = int(pad_id)
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncate = truncate
        self.cache_rows = _CACHE_ROWS if cache_rows is None else cache_rows
        self._cache: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()

    def _fit(self, i: int, ids: list[int], truncated: list[tuple[int, int]]) -> list[int]:
        """Row ``i``'s ``ids`` within max_prompt_length: refused (``truncate='error'``) or its
        last tokens (``'left'``, noted in ``truncated`` as (row, tokens before))."""
        limit = self.max_prompt_length
        if limit is None or len(ids) <= limit:
            return ids
        if self.truncate == "error":
            raise _too_long(self.dataset.where(i), len(ids), limit, self.tokenizer)
        truncated.append((i, len(ids)))
        return ids[-limit:]

    def encode(
        self, indices: Iterable[int]
    ) -> tuple[dict[int, tuple[str, list[int]]], list[tuple[int, int]]]:
        """({row: (templated text, token ids)} of the distinct ``indices``, [(row, tokens
        before truncation)] of the rows left-truncated by this call)."""
        found: dict[int, tuple[str, list[int]]] = {}
        missing = []
        for i in dict.fromkeys(indices):
            if i in self._cache:
                self._cache.move_to_end(i)
                found[i] = self._cache[i]
            else:
                missing.append(i)
        truncated: list[tuple[int, int]] = []
        for start in range(0, len(missing), _CHUNK_ROWS):
            chunk = missing[start : start + _CHUNK_ROWS]
            texts, ids = _encode_rows(self.dataset, self.tokenizer, chunk)
            for i, text, row_ids in zip(chunk, texts, ids):
                found[i] = (text, self._fit(i, row_ids, truncated))
        if self.cache_rows:
            for i in missing[-self.cache_rows :]:
                self._cache[i] = found[i]
            while len(self._cache) > self.cache_rows:
                self._cache.popitem(last=False)
        return found, truncated

    def batch(self, indices: Sequence[int]) -> tuple[PromptBatch, list[tuple[int, int]]]:
        """(rows at ``indices`` (repeats allowed) left-padded to the longest of them, the rows
        left-truncated to build it as (row, tokens before))."""
        encoded, truncated = self.encode(indices)
        input_ids, attention_mask = _left_pad([encoded[i][1] for i in indices], self.pad_id)
        batch = PromptBatch(
            input_ids=input_ids,  # [B, P]
            attention_mask=attention_mask,  # [B, P]
            prompt_texts=[encoded[i][0] for i in indices],
            rows=[self.dataset[i] for i in indices],
            prompt_index=[int(i) for i in indices],
        )
        return batch, truncated


def encode_prompts(
    dataset: PromptDataset | Sequence[Any],
    tokenizer: Any,
    *,
    max_prompt_length: int | None = None,
    truncate: TruncateMode = "error",
    batch_size: int | None = None,
) -> list[PromptBatch]:
    """A fixed set (e.g. the eval split) in order, one sample per prompt, no shuffling.

    Returns batches of ``batch_size`` prompts (one batch of all when None); every row is
    encoded (and a too-long or empty one refused) before this returns.
    """
    dataset = load_prompts(dataset)
    encoder = _Encoder(dataset, tokenizer, max_prompt_length, truncate, cache_rows=0)
    size = batch_size or len(dataset)
    if size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    batches, truncated = [], []
    for start in range(0, len(dataset), size):
        batch, cut = encoder.batch(range(start, min(start + size, len(dataset))))
        batches.append(batch)
        truncated += cut
    if truncated:
        warnings.warn(_truncated_message(dataset, truncated, max_prompt_length), stacklevel=2)
    return batches


def check_prompts_fit(
    dataset: PromptDataset | Sequence[Any] | str,
    tokenizer: Any,
    *,
    context: int | None,
    max_new_tokens: int,
    model: str = "the model",
    context_field: str = "max_position_embeddings",
    max_prompt_length: int | None = None,
    truncate: TruncateMode = "error",
) -> None:
    """Refuse, before training, prompts that would not fit ``model``'s context of ``context``
    positions (read from its config's ``context_field``; None: not known, nothing checked).

    A row's sequence is its prompt (templated, tokenized as the sampler does; left-padding takes no
    position) plus up to ``max_new_tokens`` response tokens, so it needs ``len(prompt) +
    max_new_tokens <= context``. A prompt over ``max_prompt_length`` is refused as the sampler
    refuses it (``truncate='error'``, what ``textrl train`` uses: nothing is cut or dropped
    silently) or counts as its last ``max_prompt_length`` tokens (``'left'``). ``ValueError``
    names the first row that does not fit (``FILE:LINE``), its length, the limit and what to do.
    Every row is tokenized, ``_CHUNK_ROWS`` at a time, keeping only the counts the messages need.
    """
    _check_truncate(max_prompt_length, truncate)
    if context is None:
        return
    limit = f"the {context} positions of model {model!r} ({context_field} in its config)"
    if max_new_tokens >= context:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in {limit}; lower "
                         f"--max-new-tokens below {context}, or choose a model with a longer context")
    dataset = load_prompts(dataset)
    too_long = None  # (row, tokens): the first over max_prompt_length (truncate='error')
    first = longest = None  # (row, tokens): the first and the longest that do not fit
    n_over = 0
    for start in range(0, len(dataset), _CHUNK_ROWS):
        rows = range(start, min(start + _CHUNK_ROWS, len(dataset)))
        _, ids = _encode_rows(dataset, tokenizer, rows)  # an empty prompt is refused first
        for i, row_ids in zip(rows, ids):
            n = len(row_ids)
            if max_prompt_length is not None and n > max_prompt_length:
                if truncate == "error":
                    too_long = too_long or (i, n)
                    continue
                n = max_prompt_length
            if n + max_new_tokens > context:
                n_over += 1
                first = first or (i, n)
                longest = (i, n) if longest is None or n > longest[1] else longest
    if too_long is not None:
        raise _too_long(dataset.where(too_long[0]), too_long[1], max_prompt_length, tokenizer)
    if first is None or longest is None:
        return
    n = first[1]
    others = (f"; {n_over - 1} more row(s) do not fit either, the longest {dataset.where(longest[0])} "
              f"({longest[1]} tokens)" if n_over > 1 else "")
    fixes = ["shorten or remove the prompt"]
    if truncate == "left":
        fixes.append(f"lower max_prompt_length to {context - max_new_tokens}")
    if longest[1] < context:  # else the prompt alone fills the context
        fixes.append(f"lower --max-new-tokens to {context - longest[1]}")
    fixes.append("choose a model with a longer context")
    raise ValueError(
        f"{dataset.where(first[0])}: the prompt is {n} tokens long{_counted(tokenizer)}; with "
        f"max_new_tokens={max_new_tokens} its sequence reaches {n + max_new_tokens} positions, more than "
        f"{limit}{others}.\n{', '.join(fixes[:-1]).capitalize()}, or {fixes[-1]}"
    )


__all__ = ["TruncateMode", "check_prompts_fit", "encode_prompts", "template_prompt"]
