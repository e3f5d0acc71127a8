"""The user's own code a run depends on, by content: ``--env file.py:Class``, ``--reward
file.py:fn`` (each entry of a spec), ``--agent file.py:Name`` and any other field of a config that
names a ``PATH.py:NAME``.

Settings alone cannot tell that a reward file was edited between a stop and a ``--resume`` (its
path is the same), so each checkpoint also holds :data:`USER_CODE_FILE`: every such path, as the
config writes it, with the sha256 of its contents when the run started. ``--resume`` compares
them (:func:`check_user_code`) and refuses a changed or vanished file, as it refuses a changed
``reward`` / ``env`` / ``agent`` setting: the code defines the run. The bench keys its reusable jobs
with :func:`user_code_digest` too.

Only the named file is digested, not the modules it imports; a ``module:NAME`` spec (an
installed package) is not a file and is not digested.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from textrl.core.user_files import absolute_file, absolute_spec

USER_CODE_FILE = "user_code.json"
"""In each checkpoint (and the run folder): ``{path as the config writes it: sha256 hex}`` of the
user's files the run imported; a path that was missing is recorded as ``null``."""


def user_code_paths(config: Any) -> list[str]:
    """The ``PATH.py`` of every ``PATH.py:NAME`` in the string fields of ``config`` (a config
    dataclass or a mapping of field -> value), a reward spec's entries each, in field order,
    each path once; a relative path that names a file from the working folder is made absolute."""
    values = ([getattr(config, f.name) for f in fields(config)] if is_dataclass(config)
              else list(dict(config).values()))
    paths: list[str] = []
    for value in values:
        texts = value.values() if isinstance(value, dict) else [value]
        for text in texts:
            if not isinstance(text, str):
                continue
            for entry in text.split(","):
                entry = absolute_spec(entry.strip())  # the record names the file from any working folder
                cut = entry.find(".py:")
                if cut > 0 and entry[:cut + 3] not in paths:
                    paths.append(entry[:cut + 3])
    return paths


def file_sha256(path: str | Path) -> str | None:
    """The sha256 hex digest of the file at ``path`` (``~`` expanded); None when it is not a file."""
    file = Path(path).expanduser()
    if not file.is_file():
        return None
    digest = hashlib.sha256()
    with file.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def user_code_digest(config: Any) -> dict[str, str | None]:
    """``{path: sha256 hex}`` of every user code file ``config`` names (:func:`user_code_paths`),
    read now; ``None`` for a path that is not a file. Empty when the run uses no file of its own."""
    return {path: file_sha256(path) for path in user_code_paths(config)}


def user_code_json(digest: dict[str, str | None]) -> str:
    """The text of :data:`USER_CODE_FILE`."""
    return json.dumps(digest, indent=2, sort_keys=True) + "\n"


def saved_user_code(checkpoint: Path) -> dict[str, str | None] | None:
    """The digests ``checkpoint`` recorded; None for a checkpoint written before they were kept."""
    path = Path(checkpoint) / USER_CODE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError:
        data = None
    if not isinstance(data, dict):
        from textrl.run.checkpoints import CheckpointError

        raise CheckpointError(f"{path} is not a JSON object of path: sha256; restore it, or delete "
                              f"{checkpoint} to resume from an earlier checkpoint")
    return data


def user_code_changes(saved: dict[str, str | None], now: dict[str, str | None]) -> dict[str, tuple[Any, Any]]:
    """``{path: (saved sha256, current sha256)}`` of each file the run used whose contents differ
    now (``None``: missing). A path only one side names is a changed setting, refused elsewhere."""
    saved = {absolute_file(path): old for path, old in saved.items()}  # recorded relative by an older textrl
    return {path: (old, now[path]) for path, old in saved.items() if path in now and now[path] != old}


def describe_code_changes(changes: dict[str, tuple[Any, Any]]) -> str:
    """``rewards.py: edited (sha256 3f2a9c1b -> 77d0e4aa)``; ``; `` between files."""
    def short(sha: str | None) -> str:
        return sha[:8] if sha else "missing"

    return "; ".join(f"{path}: {'edited' if new else 'gone'} (sha256 {short(old)} -> {short(new)})"
                     for path, (old, new) in changes.items())


__all__ = ["USER_CODE_FILE", "describe_code_changes", "file_sha256", "saved_user_code", "user_code_changes",
           "user_code_digest", "user_code_json", "user_code_paths"]
