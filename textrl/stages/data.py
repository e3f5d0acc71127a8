"""A supervised stage's rows: read from a built-in set, a ``.jsonl`` / ``.json`` file or memory,
each named by its place for messages (``FILE: row N (line L)``); the held-out split; left padding.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor


def read_jsonl(path: Path) -> list[tuple[str, Any]]:
    """``(where, row)`` per non-blank line; ``where`` = ``"<path>: row N (line L)"`` for errors."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}: row {len(rows)} (line {lineno})"
            try:
                rows.append((where, json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
    return rows


def source_rows(source: Any, builtins: dict[str, Callable[[], list]], what: str) -> list[tuple[str, Any]]:
    """``(where, row)`` pairs of a stage's data: ``builtin:NAME`` (one of ``builtins``), a ``.jsonl``
    file (or a ``.json`` list of rows), or rows already in memory (a list of dicts, a
    ``datasets.Dataset``). ``what`` names the data in errors (``"SFT data"``)."""
    if isinstance(source, str) and source.startswith("builtin:"):
        name = source.removeprefix("builtin:")
        if name not in builtins:
            known = ", ".join(f"builtin:{k}" for k in builtins)
            raise ValueError(f"{what} {source!r}: unknown built-in set; available: {known}")
        rows = [(f"{source}: row {i}", r) for i, r in enumerate(builtins[name]())]
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            raise ValueError(f"{what} {str(source)!r}: is a folder, not a file; pass a .jsonl / .json file in it "
                             "or 'builtin:case'")
        if not path.is_file():
            raise ValueError(f"{what} {str(source)!r}: no such file; pass a .jsonl / .json file or 'builtin:case'")
        if path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, list):
                raise ValueError(f"{path}: a .json data file must hold a list of rows")
            rows = [(f"{path}: row {i}", r) for i, r in enumerate(data)]
        else:
            rows = read_jsonl(path)
    else:
        rows = [(f"row {i}", r) for i, r in enumerate(source)]
    if not rows:
        raise ValueError(f"{what} {source!r} has no rows")
    return rows


def split_rows(rows: Sequence[Any], eval_size: int, seed: int, what: str) -> tuple[list, list]:
    """(train, held-out) with ``eval_size`` rows held out, chosen by ``seed``."""
    n = len(rows)
    if eval_size >= n:
        raise ValueError(
            f"eval_size={eval_size}: the {what} has only {n} rows and training needs at least "
            f"one; lower --eval-size (0 = no held-out evaluation) or add data"
        )
    perm = np.random.default_rng([seed, 0x5B17]).permutation(n)
    held = sorted(perm[:eval_size].tolist())
    train = sorted(perm[eval_size:].tolist())
    return [rows[i] for i in train], [rows[i] for i in held]


def pad_left(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-padded ``input_ids`` int64 ``[B, L]`` and ``attention_mask`` int64 ``[B, L]``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(list(row), dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids, mask


__all__ = ["pad_left", "read_jsonl", "source_rows", "split_rows"]
