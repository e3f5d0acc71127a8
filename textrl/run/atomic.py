"""Atomic writes: a file or a folder is the old one or the new one, never half written.

Every writer of textrl that replaces a file or a folder goes through here (checkpoints,
``metrics.jsonl`` rewrites, bench records, adapter and merged-model folders, the tiny-model cache):

- :func:`write_bytes` / :func:`write_text` / :func:`write_json`: the data goes to a temporary file
  in the same folder (``.NAME.XXXX.tmp``), is fsync'ed, then one ``os.replace`` puts it in place;
  on an error the temporary file is removed and the old file is untouched.
- :func:`write_folder`: ``write(tmp)`` fills a temporary sibling folder, then it is renamed into
  place. A non-empty folder cannot be replaced by one rename, so an existing one is first renamed
  aside, and put back if the second rename fails; it is deleted only once the new one is in place.
  On an error (``KeyboardInterrupt`` too) the temporary folder is removed.

A rename is atomic only within one file system, hence the temporary siblings.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".tmp"
"""The suffix of a temporary file (``.NAME.XXXX.tmp``), for those listing a folder's files."""


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Flush a folder's entries (a rename into it) to disk; a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory
    finally:
        os.close(fd)


def is_temporary(name: str, of: str) -> bool:
    """Whether ``name`` is a temporary file of :func:`write_bytes` writing ``of`` (a file name)."""
    return name.startswith(f".{of}.") and name.endswith(TMP_SUFFIX)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Replace ``path`` by ``data`` atomically (see the module docstring); return ``path``."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Replace ``path`` by ``text`` atomically; return ``path``."""
    return write_bytes(path, text.encode(encoding))


def write_json(path: str | os.PathLike[str], obj: Any, **dumps: Any) -> Path:
    """Replace ``path`` by ``json.dumps(obj, **dumps)`` atomically; return ``path``."""
    return write_text(path, json.dumps(obj, **dumps))


def write_folder(path: str | os.PathLike[str], write: Callable[[Path], None], *,
                 tmp: str | os.PathLike[str] | None = None, replace: bool = True) -> Path:
    """Fill a temporary sibling folder with ``write(tmp)``, then rename it to ``path``; return ``path``.

    ``tmp``: the temporary folder's path (a sibling of ``path``, not existing yet); default a fresh
    ``.NAME.tmp-XXXX``. ``replace=False``: do not move an existing ``path`` aside, so the rename
    fails with ``OSError`` when another process put a non-empty ``path`` there first (the caller
    decides whether that lost race is an error). The temporary folder is removed whatever happens.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if tmp is None:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    else:
        tmp = Path(tmp)
        tmp.mkdir()
    aside = path.with_name(f".{path.name}.old-{os.getpid()}")
    try:
        write(tmp)
        if replace and path.exists():
            os.replace(path, aside)  # a non-empty folder cannot be replaced in one rename
        try:
            os.replace(tmp, path)
        except OSError:
            if aside.exists():
                os.replace(aside, path)
            raise
        fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)
    return path
