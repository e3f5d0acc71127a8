"""Where a prompt dataset's rows live, checked when they are loaded.

A row is a dict with either ``"prompt": str`` or ``"messages": [{"role", "content"}, ...]`` (the
conversation up to the turn the policy answers); every other field is kept. :func:`_normalize_row`
checks a row and brings it to that shape (MiniMind ``conversations``, TRL's conversational
``prompt`` list), naming it (``FILE:LINE``) when it is malformed.

Two stores hold rows: :class:`_ListRows`, validated dicts (a list, a ``datasets.Dataset``), and
:class:`_JsonlRows`, a JSONL file's bytes plus where each row starts (16 bytes a row), every line
checked at load (:func:`_scan_jsonl`: UTF-8, JSON, a prompt) and parsed again when read. Each
store says how a row is named in messages, what its content is compared by (``row_bytes``) and
the fingerprint of a set of its rows. :class:`textrl.envs.prompts.dataset.PromptDataset` is the
public face of both.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from textrl.envs.prompts.rows import keep_reference

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
            keep_reference(row, reference, where, "prompt")
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
        keep_reference(row, reference, where, conv_field)
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
