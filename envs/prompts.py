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

The sampler templates and tokenizes every prompt once, up front, so a too-long or empty prompt
fails before training starts rather than hours into it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tensordict import TensorDict
from textrl.envs.collector import EpisodeRunner
from textrl.envs.fast_path import rollout_from_responses
from textrl.envs.rows import batch_fields, raw_prompts
from textrl.envs.tasks import BUILTIN_TASKS, DATA_DIR
from torch import Tensor

from textrl.keys import KEYS

TruncateMode = Literal["error", "left"]
_TRUNCATE_MODES = ("error", "left")
_CONVERSATION_FIELDS = ("conversations", "messages")


# -- rows ------------------------------------------------------------------------------------------


def _parse_messages(
    messages: Any, where: str, field: str
) -> tuple[list[dict[str, str]], str | None]:
    """Split a conversation into (prompt messages up to the last user turn, reference or None)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"{where}: {field!r} must be a non-empty list of messages, got {messages!r}"
        )
    clean = []
    for j, turn in enumerate(messages):
        if not isinstance(turn, Mapping):
            raise ValueError(f"{where}: {field}[{j}] must be an object with 'role' and 'content'")
        role, content = turn.get("role"), turn.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(
                f"{where}: {field}[{j}] needs string 'role' and 'content', "
                f"got role={role!r}, content={type(content).__name__}"
            )
        clean.append({"role": role, "content": content})
    users = [j for j, turn in enumerate(clean) if turn["role"] == "user"]
    if not users:
        raise ValueError(f"{where}: {field!r} has no 'user' turn to answer")
    last = users[-1]
    if not clean[last]["content"].strip():
        raise ValueError(f"{where}: the last user turn of {field!r} is empty")
    tail = clean[last + 1 :]
    if len(tail) > 1 or any(turn["role"] != "assistant" for turn in tail):
        raise ValueError(
            f"{where}: after the last user turn of {field!r} expected at most one assistant turn "
            f"(the reference), got roles {[turn['role'] for turn in tail]}"
        )
    return clean[: last + 1], (tail[0]["content"] if tail else None)


def _normalize_row(raw: Any, where: str) -> dict[str, Any]:
    """A validated copy of one row: ``prompt: str`` or ``messages: list``, other fields kept."""
    if isinstance(raw, str):
        raw = {"prompt": raw}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: a row must be a string or an object, got {type(raw).__name__}")
    row = copy.deepcopy(dict(raw))
    conv_field = next((f for f in _CONVERSATION_FIELDS if f in row), None)
    if "prompt" in row:
        prompt = row["prompt"]
        if isinstance(prompt, list):  # TRL conversational prompt
            messages, reference = _parse_messages(row.pop("prompt"), where, "prompt")
            row["messages"] = messages
            if reference is not None:
                row.setdefault("reference", reference)
        elif not isinstance(prompt, str):
            raise ValueError(
                f"{where}: 'prompt' must be a string or a list of messages, "
                f"got {type(prompt).__name__}"
            )
        elif not prompt.strip():
            raise ValueError(f"{where}: empty prompt")
    elif conv_field is not None:
        messages, reference = _parse_messages(row.pop(conv_field), where, conv_field)
        row["messages"] = messages
        if reference is not None:
            row.setdefault("reference", reference)
    else:
        raise ValueError(
            f"{where}: no prompt: expected a 'prompt' field or a 'conversations' / 'messages' "
            f"list, got fields {sorted(row)}"
        )
    return row


def _row_messages(row: Mapping[str, Any]) -> list[dict[str, str]]:
    if "messages" in row:
        return [dict(m) for m in row["messages"]]
    return [{"role": "user", "content": row["prompt"]}]


class PromptDataset(Sequence[dict]):
    """An immutable, validated list of prompt rows; indexing returns copies.

    >>> ds = PromptDataset.from_list(["2+2?", {"prompt": "3+3?", "answer": "6"}])
    >>> len(ds), ds[1]["answer"]
    (2, '6')
    """

    __slots__ = ("_rows", "source", "_origins", "_lines")

    def __init__(self, rows: Iterable[Any], *, source: str = "list") -> None:
        """Validate ``rows`` (strings or dicts); ``source`` names them in error messages."""
        normalized = tuple(_normalize_row(row, f"{source}: row {i}") for i, row in enumerate(rows))
        if not normalized:
            raise ValueError(f"{source}: the prompt dataset is empty")
        self._rows = normalized
        self.source = source
        self._origins = tuple(range(len(normalized)))
        self._lines = False

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def from_list(
        cls, rows: Iterable[str | Mapping[str, Any]], *, source: str = "list"
    ) -> PromptDataset:
        """From prompt strings or row dicts (``prompt`` / ``messages`` / ``conversations``)."""
        return cls(rows, source=source)

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike[str]) -> PromptDataset:
        """From a JSONL file of MiniMind ``conversations`` rows or ``{"prompt": ...}`` rows.

        Blank lines are skipped; a malformed or non-UTF-8 line raises ``ValueError`` naming file
        and line.
        """
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"prompt file {str(path)!r} does not exist")
        rows, lines = [], []
        with path.open("rb") as f:
            for lineno, data in enumerate(f, start=1):
                where = f"{path}:{lineno}"
                try:
                    line = data.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise ValueError(f"{where}: not UTF-8 text (byte 0x{data[err.start]:02x} at column "
                                     f"{err.start + 1}); save the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
                if not isinstance(raw, dict):
                    raise ValueError(f"{where}: expected a JSON object, got {type(raw).__name__}")
                rows.append(_normalize_row(raw, where))
                lines.append(lineno)
        if not rows:
            raise ValueError(f"{path}: the prompt file has no rows")
        return cls._trusted(rows, source=str(path), origins=lines, lines=True)

    @classmethod
    def from_hf_dataset(cls, ds: Any, prompt_field: str = "prompt") -> PromptDataset:
        """From a ``datasets.Dataset``; ``prompt_field`` holds a string or a list of messages."""
        columns = list(getattr(ds, "column_names", None) or [])
        if prompt_field not in columns:
            raise ValueError(
                f"dataset has no column {prompt_field!r}; columns: {columns}. "
                "Pass prompt_field= the column holding the prompt text or messages."
            )
        rows = []
        for i, raw in enumerate(ds):
            row = dict(raw)
            if prompt_field not in _CONVERSATION_FIELDS:
                row["prompt"] = row.pop(prompt_field)  # a string, or a list of messages
            rows.append(_normalize_row(row, f"dataset column {prompt_field!r}: row {i}"))
        if not rows:
            raise ValueError("the Hugging Face dataset is empty")
        return cls._trusted(rows, source=f"datasets.Dataset[{prompt_field}]")

    @classmethod
    def _trusted(cls, rows: list[dict[str, Any]], *, source: str, origins: Sequence[int] | None = None,
                 lines: bool = False) -> PromptDataset:
        """Wrap rows already normalized (and owned) by this module, without a second copy.
        ``origins``: where each row came from, a 1-based line of the file (``lines``) or an
        index of the source list (default: the rows' own indices)."""
        self = cls.__new__(cls)
        self._rows = tuple(rows)
        self.source = source
        self._origins = tuple(origins) if origins is not None else tuple(range(len(rows)))
        self._lines = lines
        return self

    # -- sequence -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]
        if isinstance(index, slice):
            raise TypeError("PromptDataset does not slice; use select(indices)")
        return copy.deepcopy(self._rows[index])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (copy.deepcopy(row) for row in self._rows)

    def __repr__(self) -> str:
        return f"PromptDataset({len(self)} rows from {self.source})"

    def where(self, index: int) -> str:
        """How messages name row ``index``: ``FILE:LINE`` (1-based) for a prompt file, else
        ``SOURCE[i]`` (the row's 0-based index in the list or dataset it came from), also after
        :meth:`select` and :meth:`split`."""
        origin = self._origins[index]
        return f"{self.source}:{origin}" if self._lines else f"{self.source}[{origin}]"

    def messages(self, index: int) -> list[dict[str, str]]:
        """The chat messages of row ``index`` (a plain prompt is one user turn)."""
        return _row_messages(self._rows[index])

    def select(self, indices: Iterable[int]) -> PromptDataset:
        """The rows at ``indices``, in that order."""
        indices = list(indices)
        rows = [copy.deepcopy(self._rows[i]) for i in indices]
        if not rows:
            raise ValueError("select: no indices given; a prompt dataset cannot be empty")
        return PromptDataset._trusted(rows, source=self.source, origins=[self._origins[i] for i in indices],
                                      lines=self._lines)

    def split(self, eval_size: int, seed: int = 0) -> tuple[PromptDataset, PromptDataset]:
        """(train, eval): ``eval_size`` rows drawn with a seeded permutation, the rest train.

        Disjoint by row, deterministic in ``seed``; both keep the dataset's order. The global
        RNGs are untouched. Don't call it to skip evaluation (``eval_size`` must be >= 1).
        """
        n = len(self)
        if not 1 <= eval_size < n:
            raise ValueError(
                f"split: eval_size={eval_size} must be in [1, {n - 1}] for a dataset of {n} rows "
                "(both parts must be non-empty); lower eval_size or add prompts"
            )
        perm = np.random.default_rng(seed).permutation(n)
        eval_idx = np.sort(perm[:eval_size])
        train_idx = np.sort(perm[eval_size:])
        return self.select(train_idx.tolist()), self.select(eval_idx.tolist())

    def fingerprint(self) -> str:
        """A short hash of the rows, to check a resumed sampler sees the same data."""
        blob = json.dumps(self._rows, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def load_prompts(
    spec: str | os.PathLike[str] | Sequence[Any] | PromptDataset | Any,
) -> PromptDataset:
    """A :class:`PromptDataset` from ``"builtin:NAME"``, a ``.jsonl`` path, a list or a Dataset.

    >>> len(load_prompts("builtin:digits"))
    512
    """
    if isinstance(spec, PromptDataset):
        return spec
    if isinstance(spec, str) and spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in BUILTIN_TASKS:
            raise ValueError(
                f"unknown built-in dataset {spec!r}; available: "
                + ", ".join(f"'builtin:{k}'" for k in sorted(BUILTIN_TASKS))
            )
        path = DATA_DIR / f"{name}.jsonl"
        if path.is_file():
            return PromptDataset.from_jsonl(path)
        return PromptDataset.from_list(BUILTIN_TASKS[name](), source=spec)
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        if path.suffix != ".jsonl" and not path.is_file():
            raise ValueError(
                f"dataset {str(spec)!r} is neither 'builtin:NAME' nor an existing .jsonl file"
            )
        return PromptDataset.from_jsonl(path)
    if hasattr(spec, "column_names") and hasattr(spec, "features"):
        return PromptDataset.from_hf_dataset(spec)
    if isinstance(spec, Sequence):
        return PromptDataset.from_list(spec)
    raise ValueError(
        f"cannot load prompts from {type(spec).__name__}: pass 'builtin:NAME', a .jsonl path, "
        "a list of strings / row dicts, or a datasets.Dataset"
    )


# -- tokenization ----------------------------------------------------------------------------------


@dataclass
class PromptBatch:
    """One batch of left-padded prompts; rows ``i*n .. i*n+n-1`` share a prompt (a group)."""

    input_ids: Tensor
    """int64 ``[B, P]``, left-padded with the tokenizer's pad id."""
    attention_mask: Tensor
    """bool ``[B, P]``, True on prompt tokens (a suffix of each row)."""
    prompt_texts: list[str]
    """The templated prompt of each row, as tokenized."""
    rows: list[dict[str, Any]]
    """The dataset fields of each row (``answer``, ``reference``, ...), one copy per sample."""
    prompt_index: list[int]
    """Index of each row's prompt in the sampler's dataset."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> PromptBatch:
        """The same batch with its tensors on ``device``."""
        return PromptBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.prompt_texts,
            self.rows,
            self.prompt_index,
        )

    def select(self, rows: slice) -> PromptBatch:
        """The rows ``rows`` of this batch (e.g. one process's share of a global batch)."""
        return PromptBatch(
            self.input_ids[rows],
            self.attention_mask[rows],
            self.prompt_texts[rows],
            self.rows[rows],
            self.prompt_index[rows],
        )

    def episode_runner(self, env: Any, **settings: Any) -> Any:
        """An :class:`textrl.envs.collector.EpisodeRunner` of ``env`` (an environment, or a reward
        spec / callable: the single-turn task it scores) for batches like this one; ``settings``
        are its keyword arguments (``tokenizer``, ``max_new_tokens``, ...)."""
        return EpisodeRunner(env, **settings)

    def rollout(
        self,
        responses: Tensor,
        *,
        tokenizer: Any,
        reward_fn: Any,
        eos_token_id: int | Sequence[int],
        pad_token_id: int,
        max_new_tokens: int,
        reward_placement: str = "last",
        reward_nonfinite: str = "raise",
    ) -> TensorDict:
        """The token MDP's rollout rows (docs/design.md, "The rollout TensorDict") of ``responses`` to these prompts.

        ``responses`` int64 ``[B, T]`` from the policy's batched ``generate`` (the fast path);
        :func:`textrl.envs.fast_path.rollout_from_responses` pays them as the MDP would, with the raw
        prompts and the rows' fields (``answer``, ...) passed to ``reward_fn`` (a callable or a
        spec string). Adds ``KEYS.score`` float ``[B]``: the task score of each row, the sum
        over time of the task reward (read before any agent shapes the reward with a KL term).
        Tensors live on ``responses.device``.
        """
        if len(self.rows) != len(self):
            raise ValueError(
                f"PromptBatch has {len(self)} prompts but {len(self.rows)} rows of fields; build it "
                "with PromptSampler / encode_prompts"
            )
        device = responses.device
        td = rollout_from_responses(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            responses,
            tokenizer=tokenizer,
            reward_fn=reward_fn,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            max_new_tokens=max_new_tokens,
            reward_placement=reward_placement,
            fields=batch_fields(self.rows),
            prompt_texts=raw_prompts(self.rows),
            reward_nonfinite=reward_nonfinite,
        )
        td.set(KEYS.score, td.get(KEYS.reward).squeeze(-1).sum(1))
        return td


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def template_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The text the policy continues: the chat template with a generation prompt, or, for a
    tokenizer without a template, the messages' contents joined by newlines."""
    if _has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in messages)


def _encode_rows(dataset: PromptDataset, tokenizer: Any) -> tuple[list[str], list[list[int]]]:
    """The templated text and token ids of every row, in one batched tokenizer call; a row that
    tokenizes to nothing is a ``ValueError`` naming it."""
    templated = _has_chat_template(tokenizer)
    texts = [template_prompt(tokenizer, dataset.messages(i)) for i in range(len(dataset))]
    # After a template the special tokens are in the text; adding BOS again would double it.
    ids = [list(row) for row in tokenizer(texts, add_special_tokens=not templated)["input_ids"]]
    for i, row_ids in enumerate(ids):
        if not row_ids:
            raise ValueError(f"{dataset.where(i)}: the prompt tokenizes to no tokens: {texts[i]!r}")
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


def _check_truncate(max_prompt_length: int | None, truncate: str) -> None:
    if truncate not in _TRUNCATE_MODES:
        raise ValueError(f"truncate must be one of {_TRUNCATE_MODES}, got {truncate!r}")
    if max_prompt_length is not None and max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1 or None, got {max_prompt_length}")


class _Encoded:
    """Templated text and token ids of every row of a dataset, computed once."""

    def __init__(
        self,
        dataset: PromptDataset,
        tokenizer: Any,
        max_prompt_length: int | None,
        truncate: TruncateMode,
    ) -> None:
        _check_truncate(max_prompt_length, truncate)
        pad_id = tokenizer.pad_token_id
        if pad_id is None:
            raise ValueError(
                "the tokenizer has no pad token: set tokenizer.pad_token (e.g. to its eos token, "
                "as textrl.models.load_tokenizer does) before building a prompt sampler"
            )
        self.pad_id = int(pad_id)
        self.dataset = dataset
        self.texts, ids = _encode_rows(dataset, tokenizer)
        self.ids: list[list[int]] = []
        truncated = []
        for i, row_ids in enumerate(ids):
            if max_prompt_length is not None and len(row_ids) > max_prompt_length:
                if truncate == "error":
                    raise _too_long(dataset.where(i), len(row_ids), max_prompt_length, tokenizer)
                row_ids = row_ids[-max_prompt_length:]
                truncated.append((i, len(ids[i])))
            self.ids.append(row_ids)
        if truncated:
            shown = ", ".join(f"{dataset.where(i)} ({n} tokens)" for i, n in truncated[:5])
            warnings.warn(
                f"{len(truncated)} prompt(s) of {dataset.source} are longer than "
                f"max_prompt_length={max_prompt_length} and were left-truncated to their last "
                f"{max_prompt_length} tokens: {shown}{' ...' if len(truncated) > 5 else ''}",
                stacklevel=3,
            )

    def batch(self, indices: Sequence[int]) -> PromptBatch:
        """Rows at ``indices`` (repeats allowed), left-padded to the longest of them."""
        width = max(len(self.ids[i]) for i in indices)
        input_ids = torch.full((len(indices), width), self.pad_id, dtype=torch.long)  # [B, P]
        attention_mask = torch.zeros((len(indices), width), dtype=torch.bool)  # [B, P]
        for b, i in enumerate(indices):
            row = self.ids[i]
            input_ids[b, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            attention_mask[b, width - len(row) :] = True
        return PromptBatch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            prompt_texts=[self.texts[i] for i in indices],
            rows=[self.dataset[i] for i in indices],
            prompt_index=[int(i) for i in indices],
        )


def encode_prompts(
    dataset: PromptDataset | Sequence[Any],
    tokenizer: Any,
    *,
    max_prompt_length: int | None = None,
    truncate: TruncateMode = "error",
    batch_size: int | None = None,
) -> list[PromptBatch]:
    """A fixed set (e.g. the eval split) in order, one sample per prompt, no shuffling.

    Returns batches of ``batch_size`` prompts (one batch of all when None).
    """
    dataset = load_prompts(dataset)
    encoded = _Encoded(dataset, tokenizer, max_prompt_length, truncate)
    size = batch_size or len(dataset)
    if size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    return [
        encoded.batch(range(s, min(s + size, len(dataset)))) for s in range(0, len(dataset), size)
    ]


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
    """
    _check_truncate(max_prompt_length, truncate)
    if context is None:
        return
    limit = f"the {context} positions of model {model!r} ({context_field} in its config)"
    if max_new_tokens >= context:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in {limit}; lower "
                         f"--max-new-tokens below {context}, or choose a model with a longer context")
    dataset = load_prompts(dataset)
    _, ids = _encode_rows(dataset, tokenizer)
    lengths = []
    for i, row_ids in enumerate(ids):
        if max_prompt_length is not None and len(row_ids) > max_prompt_length:
            if truncate == "error":
                raise _too_long(dataset.where(i), len(row_ids), max_prompt_length, tokenizer)
            lengths.append(max_prompt_length)
        else:
            lengths.append(len(row_ids))
    over = [i for i, n in enumerate(lengths) if n + max_new_tokens > context]
    if not over:
        return
    first, longest = over[0], max(over, key=lambda i: lengths[i])
    n = lengths[first]
    others = (f"; {len(over) - 1} more row(s) do not fit either, the longest {dataset.where(longest)} "
              f"({lengths[longest]} tokens)" if len(over) > 1 else "")
    fixes = ["shorten or remove the prompt"]
    if truncate == "left":
        fixes.append(f"lower max_prompt_length to {context - max_new_tokens}")
    if lengths[longest] < context:  # else the prompt alone fills the context
        fixes.append(f"lower --max-new-tokens to {context - lengths[longest]}")
    fixes.append("choose a model with a longer context")
    raise ValueError(
        f"{dataset.where(first)}: the prompt is {n} tokens long{_counted(tokenizer)}; with "
        f"max_new_tokens={max_new_tokens} its sequence reaches {n + max_new_tokens} positions, more than "
        f"{limit}{others}.\n{', '.join(fixes[:-1]).capitalize()}, or {fixes[-1]}"
    )


# -- sampler ---------------------------------------------------------------------------------------


class PromptSampler:
    """Endless seeded batches of prompts, each repeated ``n_samples_per_prompt`` times in a row.

    Every epoch visits every prompt once, in an order drawn from ``numpy.random.default_rng(
    [seed, epoch])`` (private: the global RNGs are untouched); batches run on across epoch
    boundaries, so no prompt is dropped. Because the order of epoch ``e`` depends only on
    ``(seed, e)``, ``state_dict()`` is just ``(seed, epoch, position)`` and a sampler restored
    from it yields exactly the batches the uninterrupted one would have.

    Args:
        dataset: a :class:`PromptDataset` or anything :func:`load_prompts` accepts.
        tokenizer: a Hugging Face tokenizer with a pad token; its chat template is applied
            (``add_generation_prompt=True``) when it has one, else the raw prompt is used.
        prompts_per_batch: distinct prompt draws per batch (B = this x n_samples_per_prompt).
        n_samples_per_prompt: consecutive copies of each prompt (a group, for GRPO / RLOO).
        seed: seed of the shuffling.
        max_prompt_length: longest prompt in tokens after templating (None = no limit).
        truncate: ``"error"`` (raise, naming the prompt) or ``"left"`` (keep the last tokens,
            with a warning) for prompts over ``max_prompt_length``.
        shuffle: False visits the prompts in dataset order every epoch.
    """

    def __init__(
        self,
        dataset: PromptDataset | Sequence[Any] | str,
        tokenizer: Any,
        *,
        prompts_per_batch: int,
        n_samples_per_prompt: int = 1,
        seed: int = 0,
        max_prompt_length: int | None = None,
        truncate: TruncateMode = "error",
        shuffle: bool = True,
    ) -> None:
        if prompts_per_batch < 1:
            raise ValueError(f"prompts_per_batch must be >= 1, got {prompts_per_batch}")
        if n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        self.dataset = load_prompts(dataset)
        self.tokenizer = tokenizer
        self.prompts_per_batch = prompts_per_batch
        self.n_samples_per_prompt = n_samples_per_prompt
        self.seed = int(seed)
        self.max_prompt_length = max_prompt_length
        self.truncate = truncate
        self.shuffle = shuffle
        self._encoded = _Encoded(self.dataset, tokenizer, max_prompt_length, truncate)
        self._fingerprint = self.dataset.fingerprint()
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    @property
    def batch_size(self) -> int:
        """Rows per batch: prompts_per_batch x n_samples_per_prompt."""
        return self.prompts_per_batch * self.n_samples_per_prompt

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def _next_indices(self) -> list[int]:
        picked: list[int] = []
        while len(picked) < self.prompts_per_batch:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.prompts_per_batch - len(picked), len(self._order) - self.position)
            picked += self._order[self.position : self.position + take].tolist()
            self.position += take
        return picked

    def next_batch(self) -> PromptBatch:
        """The next ``prompts_per_batch`` prompts, each repeated ``n_samples_per_prompt`` times."""
        indices = self._next_indices()
        n = self.n_samples_per_prompt
        return self._encoded.batch([i for i in indices for _ in range(n)])

    def __iter__(self) -> Iterator[PromptBatch]:
        while True:
            yield self.next_batch()

    def encode_eval(
        self, dataset: PromptDataset | Sequence[Any], batch_size: int | None = None
    ) -> list[PromptBatch]:
        """A fixed eval set with this sampler's tokenizer and length rules, in order, n = 1."""
        return encode_prompts(
            dataset,
            self.tokenizer,
            max_prompt_length=self.max_prompt_length,
            truncate=self.truncate,
            batch_size=batch_size,
        )

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream; enough to resume it exactly (JSON-serialisable)."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "shuffle": self.shuffle,
            "num_prompts": len(self.dataset),
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; the dataset must be the one the state was taken on."""
        if state["num_prompts"] != len(self.dataset) or state["fingerprint"] != self._fingerprint:
            raise ValueError(
                f"sampler state was saved on a different prompt dataset ({state['num_prompts']} "
                f"prompts, fingerprint {state['fingerprint']}) than this one ({len(self.dataset)} "
                f"prompts, fingerprint {self._fingerprint}); resume with the same dataset and split"
            )
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)


__all__ = [
    "PromptBatch",
    "PromptDataset",
    "PromptSampler",
    "batch_fields",
    "check_prompts_fit",
    "encode_prompts",
    "load_prompts",
    "raw_prompts",
    "template_prompt",
]
