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
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import operator
import os
import warnings
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor

from textrl.envs.collector import EpisodeRunner
from textrl.envs.fast_path import rollout_from_responses
from textrl.envs.rows import batch_fields, raw_prompts
from textrl.envs.tasks import BUILTIN_TASKS, DATA_DIR
from textrl.keys import KEYS
from textrl.rewards import RewardError

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


def _normalize_row(raw: Any, where: str, *, owned: bool = False) -> dict[str, Any]:
    """A validated copy of one row: ``prompt: str`` or ``messages: list``, other fields kept.

    ``owned``: ``raw`` is a dict nobody else holds (just parsed from JSON), reused, not copied."""
    if isinstance(raw, str):
        raw = {"prompt": raw}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: a row must be a string or an object, got {type(raw).__name__}")
    row = raw if owned and isinstance(raw, dict) else copy.deepcopy(dict(raw))
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


# -- row stores ------------------------------------------------------------------------------------


def _content_hash(rows: Iterable[Mapping[str, Any]]) -> str:
    """sha256 (16 hex digits) of ``json.dumps(list(rows), sort_keys=True, default=str)``, one row
    at a time: the fingerprint of rows held as dicts (and of every dataset before file rows were
    hashed by their bytes)."""
    digest = hashlib.sha256(b"[")
    for k, row in enumerate(rows):
        if k:
            digest.update(b", ")
        digest.update(json.dumps(row, sort_keys=True, default=str).encode())
    digest.update(b"]")
    return digest.hexdigest()[:16]


class _ListRows:
    """Rows held as validated dicts (a list, a ``datasets.Dataset``); row ``k`` is ``SOURCE[k]``."""

    __slots__ = ("rows", "source")

    def __init__(self, rows: Sequence[dict[str, Any]], source: str) -> None:
        self.rows = tuple(rows)
        self.source = source

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, k: int) -> dict[str, Any]:
        """A copy of row ``k``."""
        return copy.deepcopy(self.rows[k])

    def messages(self, k: int) -> list[dict[str, str]]:
        return _row_messages(self.rows[k])

    def where(self, k: int) -> str:
        return f"{self.source}[{k}]"

    def fingerprint(self, index: np.ndarray) -> str:
        """The content hash of the rows at ``index`` (int64 ``[n]``)."""
        return _content_hash(self.rows[k] for k in index.tolist())

    def row_bytes(self, k: int) -> bytes:
        """What row ``k``'s content is compared by: its JSON (keys sorted)."""
        return json.dumps(self.rows[k], sort_keys=True, default=str).encode()


class _JsonlRows:
    """The rows of a JSONL file, kept as the file's bytes plus, per non-blank line, ``starts``
    (int64 ``[N]``, its byte offset) and ``lines`` (int64 ``[N]``, its 1-based line number).
    Every row was checked at load (:func:`_scan_jsonl`); a row is parsed again when read."""

    __slots__ = ("data", "starts", "lines", "source")

    def __init__(self, data: bytes, starts: np.ndarray, lines: np.ndarray, source: str) -> None:
        self.data, self.starts, self.lines, self.source = data, starts, lines, source

    def __len__(self) -> int:
        return len(self.starts)

    def _line(self, start: int) -> bytes:
        """The line starting at byte ``start``, without its newline."""
        end = self.data.find(b"\n", start)
        return self.data[start : end if end >= 0 else len(self.data)]

    def row(self, k: int) -> dict[str, Any]:
        """Row ``k`` parsed afresh (a new dict each call)."""
        text = self._line(int(self.starts[k])).decode("utf-8")
        return _normalize_row(json.loads(text), self.where(k), owned=True)

    def messages(self, k: int) -> list[dict[str, str]]:
        return _row_messages(self.row(k))

    def where(self, k: int) -> str:
        return f"{self.source}:{int(self.lines[k])}"

    def row_bytes(self, k: int) -> bytes:
        """What row ``k``'s content is compared by: its line's bytes."""
        return self._line(int(self.starts[k]))

    def fingerprint(self, index: np.ndarray) -> str:
        """A hash of the lines (bytes) of the rows at ``index`` (int64 ``[n]``), in order."""
        digest = hashlib.sha256(b"textrl jsonl rows v1\n")
        for start in range(0, len(index), 65536):  # a bounded list of offsets at a time
            for offset in self.starts[index[start : start + 65536]].tolist():
                digest.update(self._line(offset))
                digest.update(b"\n")
        return digest.hexdigest()[:16]


def _not_utf8(where: str, line: bytes, err: UnicodeDecodeError) -> ValueError:
    return ValueError(f"{where}: not UTF-8 text (byte 0x{line[err.start]:02x} at column "
                      f"{err.start + 1}); save the file as UTF-8")


def _scan_jsonl(data: bytes, source: str) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lines), int64 ``[N]`` each: byte offset and 1-based line number of every
    non-blank line of ``data`` (lines end at ``\\n``). Each such line must be UTF-8 and one JSON
    object holding a prompt, else ``ValueError`` names ``SOURCE:LINE``; nothing parsed is kept."""
    starts, lines = array("q"), array("q")
    offset = 0
    for lineno, line in enumerate(io.BytesIO(data), start=1):
        start, offset = offset, offset + len(line)
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise _not_utf8(f"{source}:{lineno}", line, err) from None
        if not text.strip():
            continue
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source}:{lineno}: not valid JSON ({err.msg})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{source}:{lineno}: expected a JSON object, got {type(raw).__name__}")
        _normalize_row(raw, f"{source}:{lineno}", owned=True)
        starts.append(start)
        lines.append(lineno)
    return np.frombuffer(starts, dtype=np.int64), np.frombuffer(lines, dtype=np.int64)


def _row_ids(indices: Iterable[int] | np.ndarray, n: int) -> np.ndarray:
    """``indices`` as int64 ``[k]`` in ``[0, n)`` (negative ones count from the end)."""
    ids = np.asarray(indices if isinstance(indices, (np.ndarray, Sequence)) else list(indices))
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"select: indices must be integers, got an array of {ids.dtype} {ids.shape}")
    ids = ids.astype(np.int64)
    bad = (ids < -n) | (ids >= n)
    if bad.any():
        raise IndexError(f"select: index {int(ids[bad][0])} is out of range for {n} rows")
    return np.where(ids < 0, ids + n, ids)


class PromptDataset(Sequence[dict]):
    """An immutable, validated list of prompt rows; indexing returns copies.

    A prompt file's rows stay as the file's bytes until read (see the module's docstring);
    :meth:`select` and :meth:`split` share the rows and keep only their indices (int64).

    >>> ds = PromptDataset.from_list(["2+2?", {"prompt": "3+3?", "answer": "6"}])
    >>> len(ds), ds[1]["answer"]
    (2, '6')
    """

    __slots__ = ("_store", "_index", "source", "_fingerprint", "_digests")

    def __init__(self, rows: Iterable[Any], *, source: str = "list") -> None:
        """Validate ``rows`` (strings or dicts); ``source`` names them in error messages."""
        normalized = tuple(_normalize_row(row, f"{source}: row {i}") for i, row in enumerate(rows))
        if not normalized:
            raise ValueError(f"{source}: the prompt dataset is empty")
        self._init(_ListRows(normalized, source), None)

    def _init(self, store: _ListRows | _JsonlRows, index: np.ndarray | None) -> None:
        """``index``: int64 ``[n]``, the store's rows this dataset holds (None: all, in order)."""
        self._store = store
        self._index = index
        self.source = store.source
        self._fingerprint: str | None = None
        self._digests: str | None = None

    @classmethod
    def _over(cls, store: _ListRows | _JsonlRows, index: np.ndarray | None = None) -> PromptDataset:
        self = cls.__new__(cls)
        self._init(store, index)
        return self

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
        and line. Holds the file's bytes plus 16 bytes a row; rows are parsed when read.
        """
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"prompt file {str(path)!r} is a folder, not a file; give the .jsonl file's path")
        if not path.is_file():
            raise ValueError(f"prompt file {str(path)!r} does not exist")
        data = path.read_bytes()
        starts, lines = _scan_jsonl(data, str(path))
        if not len(starts):
            raise ValueError(f"{path}: the prompt file has no rows")
        return cls._over(_JsonlRows(data, starts, lines, str(path)))

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
        return cls._over(_ListRows(rows, f"datasets.Dataset[{prompt_field}]"))

    # -- sequence -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._store) if self._index is None else len(self._index)

    def _row_id(self, index: int) -> int:
        """The store's row of position ``index`` (negative counts from the end)."""
        i, n = operator.index(index), len(self)
        if not -n <= i < n:
            raise IndexError(f"PromptDataset index {i} is out of range for {n} rows")
        i %= n
        return i if self._index is None else int(self._index[i])

    def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]
        if isinstance(index, slice):
            raise TypeError("PromptDataset does not slice; use select(indices)")
        return self._store.row(self._row_id(index))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"PromptDataset({len(self)} rows from {self.source})"

    def where(self, index: int) -> str:
        """How messages name row ``index``: ``FILE:LINE`` (1-based) for a prompt file, else
        ``SOURCE[i]`` (the row's 0-based index in the list or dataset it came from), also after
        :meth:`select` and :meth:`split`."""
        return self._store.where(self._row_id(index))

    def messages(self, index: int) -> list[dict[str, str]]:
        """The chat messages of row ``index`` (a plain prompt is one user turn)."""
        return self._store.messages(self._row_id(index))

    def _ids(self) -> np.ndarray:
        """int64 ``[n]``: the store's rows of this dataset, in order."""
        return np.arange(len(self._store), dtype=np.int64) if self._index is None else self._index

    def select(self, indices: Iterable[int]) -> PromptDataset:
        """The rows at ``indices`` (a sequence or an integer array), in that order."""
        ids = _row_ids(indices, len(self))
        if not len(ids):
            raise ValueError("select: no indices given; a prompt dataset cannot be empty")
        return PromptDataset._over(self._store, ids if self._index is None else self._index[ids])

    def split(self, eval_size: int, seed: int = 0) -> tuple[PromptDataset, PromptDataset]:
        """(train, eval): ``eval_size`` rows drawn with a seeded permutation, the rest train.

        Disjoint by row, deterministic in ``seed``; both keep the dataset's order. The global
        RNGs are untouched. Don't call it to skip evaluation (``eval_size`` must be >= 1).
        """
        n = len(self)
        if n < 2:
            raise ValueError(
                f"{self.source}: the dataset has {n} row, and a run holds out eval_size rows for its "
                "evaluation and trains on the rest, so it needs at least 2 rows; add prompts"
            )
        if not 1 <= eval_size < n:
            raise ValueError(
                f"eval_size={eval_size} (--eval-size): must be in [1, {n - 1}] for the {n} rows of "
                f"{self.source} (both the held-out and the training part must be non-empty); lower "
                "--eval-size or add prompts"
            )
        perm = np.random.default_rng(seed).permutation(n)
        eval_idx = np.sort(perm[:eval_size])
        train_idx = np.sort(perm[eval_size:])
        train, held_out = self.select(train_idx), self.select(eval_idx)
        _warn_shared_rows(train, held_out)
        return train, held_out

    def row_keys(self) -> list[str]:
        """A key per row, equal for rows with the same content (a prompt file's line bytes, else
        the row's JSON): what duplicate detection compares."""
        return [hashlib.sha1(self._store.row_bytes(k)).hexdigest() for k in self._ids().tolist()]

    def row_digests(self) -> str:
        """Each row's digest, in order, joined: the first :data:`DIGEST_HEX` hex digits of the
        sha256 of its content (a prompt file's line bytes, else the row's JSON). A sampler's state
        keeps them so that a resume can tell which rows' contents changed (:func:`edited_rows`)."""
        if self._digests is None:
            self._digests = "".join(hashlib.sha256(self._store.row_bytes(k)).hexdigest()[:DIGEST_HEX]
                                    for k in self._ids().tolist())
        return self._digests

    def fingerprint(self) -> str:
        """A short hash of the rows, to check a resumed sampler sees the same data: of their
        lines' bytes for a prompt file (where in the file they are does not count), of the
        rows' JSON otherwise."""
        if self._fingerprint is None:
            self._fingerprint = self._store.fingerprint(self._ids())
        return self._fingerprint

    def _has_fingerprint(self, fingerprint: str) -> bool:
        """Whether ``fingerprint`` is this dataset's, or the hash of its rows' JSON that a
        sampler state written before prompt files were hashed by their bytes holds."""
        if fingerprint == self.fingerprint():
            return True
        return isinstance(self._store, _JsonlRows) and fingerprint == _content_hash(self)


_SHARED_NAMED = 5


def _warn_shared_rows(train: PromptDataset, held_out: PromptDataset) -> None:
    """Warn, naming them, when held-out rows are duplicates of training rows (the same line or
    row twice in the source): the held-out evaluation would then measure prompts it trains on."""
    seen: dict[str, int] = {}
    for i, key in enumerate(train.row_keys()):
        seen.setdefault(key, i)
    shared = [(held_out.where(j), train.where(seen[key])) for j, key in enumerate(held_out.row_keys()) if key in seen]
    if not shared:
        return
    named = ", ".join(f"{a} = {b}" for a, b in shared[:_SHARED_NAMED])
    more = f" and {len(shared) - _SHARED_NAMED} more" if len(shared) > _SHARED_NAMED else ""
    warnings.warn(
        f"{len(shared)} of {len(held_out)} held-out rows are duplicates of training rows ({named}{more}): the "
        "held-out evaluation measures prompts the run trains on; remove the duplicate rows", stacklevel=3)


# -- rows edited between a checkpoint and its resume -------------------------------------------------

DIGEST_HEX = 16
"""Hex digits of a row's sha256 that a sampler state keeps (8 bytes a row)."""
EDITED_SHARE = 10
"""A resume accepts edited rows up to one in this many of a set (and always one): more is another dataset."""
_NAMED = 5
"""Rows named in a message before '... and N more'."""

_START_OVER = ("a resume may change what rows hold, not how many there are or their order (the batches "
               "drawn depend on both): restore the file as it was, or start a new run in another --output-dir")


def _named(places: Sequence[str]) -> str:
    """The first :data:`_NAMED` of ``places``, and how many more."""
    more = f" and {len(places) - _NAMED} more" if len(places) > _NAMED else ""
    return ", ".join(places[:_NAMED]) + more


def _digest_list(digests: str) -> list[str]:
    """``digests`` (:meth:`PromptDataset.row_digests`) split into one digest a row."""
    return [digests[k:k + DIGEST_HEX] for k in range(0, len(digests), DIGEST_HEX)]


def edited_rows(*sets: tuple[int, str, PromptDataset, str]) -> list[dict[str, Any]]:
    """The rows whose content differs from a checkpoint's, each ``{"row": FILE:LINE, "sha256":
    {"from", "to"}}`` (``[]`` when none did), over ``sets`` of ``(saved_count, saved_digests,
    rows, what)``: the checkpoint's row count and digests (:meth:`PromptDataset.row_digests`) of
    a set of rows, the set now, and its name in messages ("training prompts").

    ``ValueError`` naming the rows and the fix when a set's rows were added or removed, when a row
    moved (a changed row now holds what a changed row of any set held: the rows were reordered),
    or when more than one in :data:`EDITED_SHARE` of a set changed (another dataset)."""
    per_set = []  # (rows, what, [(position, digest then, digest now) of each changed row])
    for saved_count, saved, rows, what in sets:
        if saved_count != len(rows):
            change = "added" if len(rows) > saved_count else "removed"
            raise ValueError(f"the checkpoint was taken on {saved_count} {what} and {rows.source} now gives "
                             f"{len(rows)}: rows were {change}; {_START_OVER}")
        then, now = _digest_list(saved), _digest_list(rows.row_digests())
        per_set.append((rows, what, [(i, then[i], now[i]) for i in range(len(rows)) if then[i] != now[i]]))
    changed = [(rows, i, old, new) for rows, _, mine in per_set for i, old, new in mine]
    held = {old: (rows, i) for rows, i, old, _ in changed}
    moved = [(rows, i, held[new]) for rows, i, _, new in changed if new in held]
    if moved:
        rows, i, (other, j) = moved[0]
        raise ValueError(f"{rows.where(i)} now holds the row that was at {other.where(j)} ({len(moved)} "
                         f"rows moved: the rows were reordered); {_START_OVER}")
    for rows, what, mine in per_set:
        if len(mine) > max(1, len(rows) // EDITED_SHARE):
            raise ValueError(f"{len(mine)} of the {len(rows)} {what} changed since the checkpoint "
                             f"({_named([rows.where(i) for i, _, _ in mine])}): more than one in "
                             f"{EDITED_SHARE}, so this is another dataset; {_START_OVER}")
    return [{"row": rows.where(i), "sha256": {"from": old, "to": new}} for rows, i, old, new in changed]


def describe_edited(edited: Sequence[Mapping[str, Any]], checkpoint: str | os.PathLike[str]) -> str:
    """The one line a resume prints about the rows :func:`edited_rows` accepted."""
    places = [change["row"] for change in edited]
    return (f"--resume: {len(places)} row(s) changed since {Path(checkpoint).name}: {_named(places)}; the "
            "number and order of the rows are the same, so the batches are drawn as before (recorded in "
            "resumes.jsonl)")


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
        if path.is_dir():
            raise ValueError(f"dataset {str(spec)!r} is a folder, not a file; give the .jsonl file's path")
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


def check_reward_columns(rows: Any, reward: Any) -> None:
    """Refuse, before any model loads, rows that lack a column ``reward`` reads (the ``needs`` of
    its functions, :func:`textrl.rewards.options.reward_columns`; a None value counts as missing):
    ``ValueError`` naming the first such row (``FILE:LINE`` for a prompt file), the column, the
    reward and how many rows lack it. ``rows``: anything :func:`load_prompts` accepts."""
    from textrl.rewards.options import reward_columns

    required = reward_columns(reward)
    if not required:
        return
    dataset = load_prompts(rows)
    for column, names in required.items():
        missing = [i for i in range(len(dataset)) if dataset[i].get(column) is None]
        if missing:
            first = dataset[missing[0]]
            what = f"has {column!r} null" if column in first else f"has no {column!r}"
            count = (f" ({len(missing)} of {len(dataset)} rows lack it)" if len(missing) > 1 else "")
            raise ValueError(
                f"{dataset.where(missing[0])}: row {what}, which reward {names[0]!r} reads{count}; "
                f"add it or choose another reward"
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


def batch_rows(batch: PromptBatch, dataset: PromptDataset, most: int = 8) -> str:
    """Where the rows of ``batch`` (drawn from ``dataset``) come from, by their positions in it:
    ``"0-1 = data.jsonl:5, 2-3 = data.jsonl:9"``, the first ``most`` prompts named."""
    spans: list[list[int]] = []  # [first, last, dataset row] of each run of one prompt
    for b, i in enumerate(batch.prompt_index):
        if spans and spans[-1][2] == i and spans[-1][1] == b - 1:
            spans[-1][1] = b
        else:
            spans.append([b, b, i])
    named = [f"{a} = {dataset.where(i)}" if a == z else f"{a}-{z} = {dataset.where(i)}" for a, z, i in spans[:most]]
    return ", ".join(named) + (f" and {len(spans) - most} more prompts" if len(spans) > most else "")


class TrackedBatches:
    """Prompt batches of ``dataset``, iterated any number of times, the one handed out last kept
    (``current``) so that a fault in it can be placed in the data (:meth:`rows`)."""

    def __init__(self, batches: Any, dataset: PromptDataset | None) -> None:
        self.batches, self.dataset = batches, dataset
        self.current: PromptBatch | None = None

    def __iter__(self) -> Iterator[PromptBatch]:
        for batch in self.batches:
            self.current = batch
            yield batch

    def __len__(self) -> int:
        return len(self.batches)

    def rows(self) -> str:
        """:func:`batch_rows` of the batch handed out last ('unknown' before any, or without a dataset)."""
        if self.current is None or self.dataset is None:
            return "unknown"
        return batch_rows(self.current, self.dataset)


@contextmanager
def placing_rows(what: str, rows: Callable[[], str]) -> Iterator[None]:
    """A :class:`textrl.rewards.RewardError` raised inside is raised again (one line), its message
    followed by what ran (``"iteration 14"``) and where its batch's rows are in the data
    (``rows()``, e.g. :func:`batch_rows`): the rows a reward's error names are positions in that
    batch. ``...; in iteration 14, batch rows 0-1 = data.jsonl:12, 2-3 = data.jsonl:5``."""
    try:
        yield
    except RewardError as err:
        raise RewardError(f"{err}; in {what}, batch rows {rows()}") from err


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


# -- sampler ---------------------------------------------------------------------------------------


class PromptSampler:
    """Endless seeded batches of prompts, each repeated ``n_samples_per_prompt`` times in a row.

    Every epoch visits every prompt once, in an order drawn from ``numpy.random.default_rng(
    [seed, epoch])`` (private: the global RNGs are untouched); batches run on across epoch
    boundaries, so no prompt is dropped. Because the order of epoch ``e`` depends only on
    ``(seed, e)``, ``state_dict()`` is just ``(seed, epoch, position)`` and a sampler restored
    from it yields exactly the batches the uninterrupted one would have.

    Prompts are templated and tokenized when first drawn (the last ``_CACHE_ROWS`` kept), so
    building a sampler costs no tokenization; a prompt over ``max_prompt_length`` (with
    ``truncate="error"``) or one that tokenizes to nothing is refused by the ``next_batch`` that
    first draws it, the stream left where it was. Run :func:`check_prompts_fit` first to refuse
    such prompts before training (``textrl train`` does).

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
        held_out: the rows the run evaluates on (a :class:`PromptDataset`), or None; its rows'
            digests go into the state with the sampler's own, so a resume names an edit of them too.

    A resume on a prompt file whose rows' contents were edited since the checkpoint (a bad row
    fixed), with as many rows in the same places, continues with the same batches; the state's
    per-row digests tell which rows changed (:attr:`edited`, :func:`edited_rows`). Rows added,
    removed or reordered are refused.
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
        held_out: PromptDataset | None = None,
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
        self.held_out = held_out
        self.edited: list[dict[str, Any]] = []
        """The rows whose contents the last :meth:`load_state_dict` found changed (:func:`edited_rows`)."""
        self._encoder = _Encoder(self.dataset, tokenizer, max_prompt_length, truncate)
        self._warned_truncation = False
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
        """The next ``prompts_per_batch`` prompts, each repeated ``n_samples_per_prompt`` times.

        A prompt it refuses (too long, tokenizes to nothing) raises ``ValueError`` naming it
        (``FILE:LINE``) and leaves the stream unmoved. The first batch that left-truncates
        prompts (``truncate="left"``) warns, naming them; later ones truncate silently."""
        where = (self.epoch, self.position, self._order)
        indices = self._next_indices()
        n = self.n_samples_per_prompt
        try:
            batch, truncated = self._encoder.batch([i for i in indices for _ in range(n)])
        except Exception:
            self.epoch, self.position, self._order = where
            raise
        if truncated and not self._warned_truncation:
            self._warned_truncation = True
            scope = " in this batch"
            warnings.warn(_truncated_message(self.dataset, truncated, self.max_prompt_length, scope)
                          + "; later batches truncate without a warning", stacklevel=2)
        return batch

    def __iter__(self) -> Iterator[PromptBatch]:
        while True:
            yield self.next_batch()

    def batch_rows(self, batch: PromptBatch) -> str:
        """Where the rows of ``batch`` (one of this sampler's) come from: :func:`batch_rows`."""
        return batch_rows(batch, self.dataset)

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
        """Position in the stream; enough to resume it exactly (JSON-serialisable). With each
        row's digest (``row_digests``: :meth:`PromptDataset.row_digests`; ``held_out``: the
        held-out rows' count and digests) so that a resume can accept edited rows, naming them."""
        state = {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "shuffle": self.shuffle,
            "num_prompts": len(self.dataset),
            "fingerprint": self.dataset.fingerprint(),
            "row_digests": self.dataset.row_digests(),
        }
        if self.held_out is not None:
            state["held_out"] = {"num_prompts": len(self.held_out), "row_digests": self.held_out.row_digests()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: the dataset must be the one the state was taken on, or that
        dataset with some rows' contents edited (as many rows, in the same order: the batches
        are drawn as before), which :attr:`edited` then names. A state without per-row digests
        (an older checkpoint) needs the very same rows. ``ValueError`` says what changed; the
        sampler is left as it was."""
        edited = self._edited_since(state)
        self.edited = edited
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)

    def _edited_since(self, state: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The rows (training, then held-out) edited since ``state`` was taken (:func:`edited_rows`)."""
        if "row_digests" not in state:  # saved before per-row digests: the same rows or nothing
            same = state["num_prompts"] == len(self.dataset)
            if not (same and self.dataset._has_fingerprint(state["fingerprint"])):
                raise ValueError(
                    f"sampler state was saved on a different prompt dataset ({state['num_prompts']} "
                    f"prompts, fingerprint {state['fingerprint']}) than this one ({len(self.dataset)} "
                    f"prompts, fingerprint {self.dataset.fingerprint()}); resume with the same dataset "
                    "and split"
                )
            return []
        sets = [(state["num_prompts"], state["row_digests"], self.dataset, "training prompts")]
        held = state.get("held_out")
        if held is not None and self.held_out is not None:
            sets.append((held["num_prompts"], held["row_digests"], self.held_out, "held-out prompts"))
        return edited_rows(*sets)


__all__ = [
    "PromptBatch",
    "PromptDataset",
    "PromptSampler",
    "TrackedBatches",
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
