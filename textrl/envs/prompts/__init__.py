"""Prompt sources: an immutable :class:`PromptDataset` and a seeded, resumable :class:`PromptSampler`.

A row is a dict with either ``"prompt": str`` or ``"messages": [{"role", "content"}, ...]`` (the
conversation up to the turn the policy answers); every other field (``"answer"``,
``"reference"``, ...) is kept and handed to the reward functions with each sample.

Sources (:func:`load_prompts` picks one from a spec):

* ``"builtin:NAME"``: a built-in synthetic task of :mod:`textrl.envs.tasks` (``builtin:digits``).
* a ``.jsonl`` file, one object per line, either MiniMind RLAIF
  ``{"conversations": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}`` (or the
  same list under ``"messages"``) or plain ``{"prompt": ..., "answer": ..., ...}`` rows. For a
  conversation, the prompt is everything up to and including the last user turn; a final
  assistant turn becomes ``"reference"``. ``"prompt"`` may also be a list of messages (TRL's
  conversational prompt format).
* a list of strings or row dicts; a ``datasets.Dataset`` (:meth:`PromptDataset.from_hf_dataset`).

A prompt file is read once and kept compactly: its bytes plus where each row starts (16 bytes a
row), every row checked (UTF-8, JSON, a prompt) at load, parsed again when read. Nothing is
tokenized up front: the sampler templates and tokenizes the prompts of each batch when it draws
them (keeping the last few thousand), so start-up costs about one read of the file. Run
:func:`check_prompts_fit` (``textrl train`` does) to refuse a too-long or empty prompt before
training; the sampler refuses it, with the same message, when it first draws it.

The parts live in their own modules; this one gathers their public names, so import them from
here (the most used are also in :mod:`textrl.envs`). They load on first use: the rows and stores
sit under the environments (an episode reads its row's messages), the batch and the sampler over
them (a batch runs its episodes), so importing one part does not import the others.

* :mod:`textrl.envs.prompts.rows`: prompt rows as rewards and environments read them (messages,
  raw prompt text, fields).

* :mod:`textrl.envs.prompts.stores`: a row checked and brought to its shape; the stores that hold
  rows (dicts, or a JSONL file's bytes) and hash them.
* :mod:`textrl.envs.prompts.dataset`: :class:`PromptDataset` (select, split, fingerprint, per-row
  digests), :func:`load_prompts`, :func:`check_reward_columns`.
* :mod:`textrl.envs.prompts.edits`: the rows edited between a checkpoint and its resume
  (:func:`edited_rows`, :func:`describe_edited`).
* :mod:`textrl.envs.prompts.batch`: :class:`PromptBatch` and where a batch's rows are in the data
  (:func:`batch_rows`, :class:`TrackedBatches`, :func:`placing_rows`).
* :mod:`textrl.envs.prompts.encoding`: chat templates, token budgets and left-truncation
  (:func:`template_prompt`, :func:`encode_prompts`, :func:`check_prompts_fit`).
* :mod:`textrl.envs.prompts.sampler`: the seeded, resumable :class:`PromptSampler`.
* :mod:`textrl.envs.prompts.table`: :class:`PromptTable`, the prompt side both environments share
  (rows, chat template, lazy tokenisation, reward fields).
"""

from __future__ import annotations

import importlib
from typing import Any

_PARTS = {
    "PromptBatch": "batch", "TrackedBatches": "batch", "batch_rows": "batch", "placing_rows": "batch",
    "PromptDataset": "dataset", "check_reward_columns": "dataset", "load_prompts": "dataset",
    "TruncateMode": "encoding", "check_prompts_fit": "encoding", "encode_prompts": "encoding",
    "template_prompt": "encoding",
    "PromptSampler": "sampler",
    "DIGEST_HEX": "edits", "EDITED_SHARE": "edits", "describe_edited": "edits", "edited_rows": "edits",
    "batch_fields": "rows", "raw_prompts": "rows",
}
"""Each public name and the module of this package that defines it."""


def __getattr__(name: str) -> Any:
    if name in _PARTS:
        return getattr(importlib.import_module(f"{__name__}.{_PARTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PARTS))


__all__ = sorted(_PARTS)
