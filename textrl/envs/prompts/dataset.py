"""An immutable, validated prompt dataset (:class:`PromptDataset`) and :func:`load_prompts`.

:func:`load_prompts` picks a source from a spec (``"builtin:NAME"``, a ``.jsonl`` path, a list, a
``datasets.Dataset``; see :mod:`textrl.envs.prompts`). A dataset names its rows in messages
(``FILE:LINE`` for a prompt file), selects and splits them sharing the rows, and hashes them: a
fingerprint of the set and a digest per row, which a sampler's state keeps
(:mod:`textrl.envs.prompts.edits`). :func:`check_reward_columns` refuses rows that lack a column the
reward reads.
"""

from __future__ import annotations

import hashlib
import operator
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from textrl.envs.prompts.edits import DIGEST_HEX
from textrl.envs.prompts.stores import (
    _CONVERSATION_FIELDS,
    _content_hash,
    _JsonlRows,
    _ListRows,
    _normalize_row,
    _scan_jsonl,
)
from textrl.envs.tasks import BUILTIN_TASKS, DATA_DIR


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
            # a conversation's closing assistant turn is the row's 'reference': say where it went
            held = (f" (its 'reference', where a conversation's closing assistant turn goes, holds "
                    f"{str(first['reference'])[:40]!r}: copy it to {column!r} if it is the answer)"
                    if first.get("reference") is not None and column != "reference" else "")
            raise ValueError(
                f"{dataset.where(missing[0])}: row {what}, which reward {names[0]!r} reads{count}; "
                f"add it or choose another reward{held}"
            )


__all__ = ["PromptDataset", "check_reward_columns", "load_prompts"]
