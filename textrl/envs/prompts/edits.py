"""Rows edited between a checkpoint and its resume.

A sampler's state keeps a digest of every row (:meth:`PromptDataset.row_digests`, the first
:data:`DIGEST_HEX` hex digits of each row's sha256). :func:`edited_rows` compares them with the
rows now: a few rows whose contents changed (a bad row fixed) are accepted and named; rows added,
removed or reordered, or more than one in :data:`EDITED_SHARE` changed, are refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol


class DigestedRows(Protocol):
    """What :func:`edited_rows` reads of a set of rows (a :class:`~textrl.envs.prompts.dataset.PromptDataset`)."""

    source: str

    def __len__(self) -> int: ...

    def row_digests(self) -> str: ...

    def where(self, index: int) -> str: ...

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


def edited_rows(*sets: tuple[int, str, DigestedRows, str]) -> list[dict[str, Any]]:
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


__all__ = ["DIGEST_HEX", "EDITED_SHARE", "describe_edited", "edited_rows"]
