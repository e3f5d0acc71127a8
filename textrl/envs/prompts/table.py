"""The prompt side both environments share: rows, chat template, lazy tokenisation, reward fields.

:class:`PromptTable` reads ``None`` (the built-in digits task), a prompt source string (anything
:func:`textrl.envs.prompts.load_prompts` reads) or a sequence of rows; :class:`TokenMDPSetup` is
the set-up :class:`~textrl.envs.TokenMDPEnv` and :class:`~textrl.envs.TextGenEnv` have in common.
Imports point one way: ``fast_path`` <- ``prompts`` <- ``prompts.table`` <- the environments.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from textrl.envs.fast_path import (
    TRUNCATE_MODES,
    RewardLike,
    as_reward_fn,
    default_tokenizer,
    special_ids,
)
from textrl.envs.prompts import load_prompts
from textrl.envs.prompts.rows import row_messages, split_reference
from textrl.envs.tasks import make_digits_task

_CACHE_ROWS = 4096
"""Prompts whose token ids a :class:`PromptTable` keeps, those read last: memory stays bounded
however many rows a prompt file has (a file's rows are parsed when read, see
:class:`textrl.envs.PromptDataset`)."""


def _as_row(item: Any, index: int) -> dict[str, Any]:
    """Prompt ``index`` as a row dict; a conversation's closing assistant turn becomes its
    ``"reference"`` (:func:`textrl.envs.prompts.rows.split_reference`), as when a prompt file loads."""
    if isinstance(item, str):
        return {"prompt": item}
    if isinstance(item, Mapping):
        return dict(split_reference(item, index))
    raise ValueError(f"prompt {index} is a {type(item).__name__}; give a str or a dict row")


def _load_prompt_source(prompts: Any) -> Any:
    """Rows from ``None`` (built-in digits task), a source spec string, or a sequence of rows."""
    if prompts is None:
        return make_digits_task()
    if isinstance(prompts, str):
        return load_prompts(prompts)
    if not (hasattr(prompts, "__len__") and hasattr(prompts, "__getitem__")):
        raise ValueError(
            f"prompts is a {type(prompts).__name__}; pass a list of str, a list of dict rows "
            "with a 'prompt' field, or an indexable dataset of such rows"
        )
    return prompts


class TokenMDPSetup:
    """What both environments set up alike: tokenizer, prompts, reward, special ids, sizes."""

    def _setup_mdp(
        self,
        *,
        tokenizer: Any,
        prompts: Any,
        reward: RewardLike,
        max_new_tokens: int,
        max_prompt_length: int,
        truncate_prompt: str,
        apply_chat_template: bool | None,
        eos_token_id: int | Sequence[int] | None,
        pad_token_id: int | None,
    ) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an int >= 1")
        self.tokenizer = default_tokenizer() if tokenizer is None else tokenizer
        self.prompts = PromptTable(
            prompts,
            self.tokenizer,
            max_prompt_length=max_prompt_length,
            truncate_prompt=truncate_prompt,
            apply_chat_template=apply_chat_template,
        )
        self.reward_fn = as_reward_fn(reward)
        self.eos_token_ids, self.pad_token_id = special_ids(
            self.tokenizer, eos_token_id, pad_token_id
        )
        self.vocab_size = len(self.tokenizer)
        self.max_new_tokens = max_new_tokens
        self.max_prompt_length = max_prompt_length


class PromptTable:
    """Indexable prompts: raw text for the rewards, token ids for the policy, reward fields.

    ``prompts``: ``None`` (the built-in digits task), a source string (``"builtin:digits"``,
    a ``.jsonl`` path, see :func:`textrl.envs.prompts.load_prompts`), a list of str, a list of dict rows
    (``"prompt"`` or ``"messages"`` plus extra fields such as ``"answer"``), or any indexable
    dataset of such rows. Prompts are wrapped in the tokenizer's chat template (with the
    generation prompt) when it has one and ``apply_chat_template`` is not False, tokenised on
    first use; the ids of the last ``_CACHE_ROWS`` prompts read are kept. Lists are checked for
    empty prompts up front (a prompt file is checked as it loads).
    """

    def __init__(
        self,
        prompts: Any,
        tokenizer: Any,
        *,
        max_prompt_length: int,
        truncate_prompt: str = "error",
        apply_chat_template: bool | None = None,
    ) -> None:
        if truncate_prompt not in TRUNCATE_MODES:
            raise ValueError(
                f"truncate_prompt={truncate_prompt!r}: must be one of {TRUNCATE_MODES}"
            )
        if not isinstance(max_prompt_length, int) or max_prompt_length < 1:
            raise ValueError(f"max_prompt_length={max_prompt_length!r}: must be an int >= 1")
        self.rows = _load_prompt_source(prompts)
        if len(self.rows) == 0:
            raise ValueError("prompts is empty; give at least one prompt")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncate_prompt = truncate_prompt
        has_template = getattr(tokenizer, "chat_template", None) is not None
        self.apply_chat_template = (
            has_template if apply_chat_template is None else apply_chat_template
        )
        if self.apply_chat_template and not has_template:
            raise ValueError("apply_chat_template=True but the tokenizer has no chat_template")
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        if isinstance(self.rows, (list, tuple)):
            for i, item in enumerate(self.rows):
                row_messages(_as_row(item, i), i)

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> dict[str, Any]:
        """The row ``index`` as a dict (a str prompt becomes ``{"prompt": str}``)."""
        if not 0 <= index < len(self):
            raise ValueError(f"prompt_index={index} is out of range for {len(self)} prompts")
        return _as_row(self.rows[index], index)

    def text(self, index: int) -> str:
        """The prompt text handed to the reward functions (the raw prompt, no template)."""
        return row_messages(self.row(index), index)[1]

    def fields(self, index: int) -> dict[str, Any]:
        """Extra per-row fields for the rewards (everything but ``prompt`` / ``messages``)."""
        return {k: v for k, v in self.row(index).items() if k not in ("prompt", "messages")}

    def ids(self, index: int) -> np.ndarray:
        """int64 token ids of prompt ``index`` (templated), at most ``max_prompt_length``."""
        ids = self._cache.get(index)
        if ids is not None:
            self._cache.move_to_end(index)
            return ids
        ids = self._cache[index] = self.encode(self.row(index), index)
        if len(self._cache) > _CACHE_ROWS:
            self._cache.popitem(last=False)
        return ids

    def encode(self, row: Mapping[str, Any], index: int | str) -> np.ndarray:
        """Token ids of one row; raises (or left-truncates) when longer than the maximum."""
        messages, text = row_messages(row, index)  # type: ignore[arg-type]
        if self.apply_chat_template:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        ids = np.asarray(
            self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64
        )
        if ids.size == 0:
            raise ValueError(f"prompt {index} encodes to no tokens; give it text")
        if ids.size > self.max_prompt_length:
            if self.truncate_prompt == "error":
                raise ValueError(
                    f"prompt {index} has {ids.size} tokens > max_prompt_length="
                    f"{self.max_prompt_length}; raise max_prompt_length or pass "
                    "truncate_prompt='left' to keep its last tokens"
                )
            warnings.warn(
                f"prompt {index} has {ids.size} tokens > max_prompt_length="
                f"{self.max_prompt_length}; keeping its last {self.max_prompt_length}",
                stacklevel=3,
            )
            ids = ids[-self.max_prompt_length :]
        return ids


__all__ = ["PromptTable", "TokenMDPSetup", "row_messages"]
