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
here (the most used are also in :mod:`textrl.envs`):

* :mod:`textrl.envs.row_stores`: a row checked and brought to its shape; the stores that hold
  rows (dicts, or a JSONL file's bytes) and hash them.
* :mod:`textrl.envs.prompt_dataset`: :class:`PromptDataset` (select, split, fingerprint, per-row
  digests), :func:`load_prompts`, :func:`check_reward_columns`.
* :mod:`textrl.envs.row_edits`: the rows edited between a checkpoint and its resume
  (:func:`edited_rows`, :func:`describe_edited`).
* :mod:`textrl.envs.prompt_batch`: :class:`PromptBatch` and where a batch's rows are in the data
  (:func:`batch_rows`, :class:`TrackedBatches`, :func:`placing_rows`).
* :mod:`textrl.envs.prompt_encoding`: chat templates, token budgets and left-truncation
  (:func:`template_prompt`, :func:`encode_prompts`, :func:`check_prompts_fit`).
* :mod:`textrl.envs.prompt_sampler`: the seeded, resumable :class:`PromptSampler`.
"""

from __future__ import annotations

from textrl.envs.prompt_batch import PromptBatch, TrackedBatches, batch_rows, placing_rows
from textrl.envs.prompt_dataset import PromptDataset, check_reward_columns, load_prompts
from textrl.envs.prompt_encoding import (
    TruncateMode,
    check_prompts_fit,
    encode_prompts,
    template_prompt,
)
from textrl.envs.prompt_sampler import PromptSampler
from textrl.envs.row_edits import DIGEST_HEX, EDITED_SHARE, describe_edited, edited_rows
from textrl.envs.rows import batch_fields, raw_prompts

__all__ = [
    "DIGEST_HEX",
    "EDITED_SHARE",
    "PromptBatch",
    "PromptDataset",
    "PromptSampler",
    "TrackedBatches",
    "TruncateMode",
    "batch_fields",
    "batch_rows",
    "check_prompts_fit",
    "check_reward_columns",
    "describe_edited",
    "edited_rows",
    "encode_prompts",
    "load_prompts",
    "placing_rows",
    "raw_prompts",
    "template_prompt",
]
