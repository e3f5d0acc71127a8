"""One writer per run folder: a lock that a second run meets with a message naming the holder.

The lock is an exclusive ``flock`` on ``OUTPUT_DIR/.textrl.lock``, held for the whole run by its
main process: a run's entry point is wrapped in :func:`holds_run_folder`, and its set-up calls
:func:`take_run_folder` once the config and the folder are checked, before it writes anything
(so a refused run writes nothing). The kernel releases it when the holder's process ends, however it ends (``kill -9``
included), so a lock left by a dead process is simply taken over: there is no stale lock to clean
up, and no cleanup that could touch another writer's files. The file itself names the holder (its
process id, host, command and start time) for the message the next run shows.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOCK_FILE = ".textrl.lock"
"""The lock's file inside a run folder."""


class RunFolderBusy(ValueError):
    """Another live process writes to this run folder; the message names it and what to do."""


class RunFolderLock:
    """``with RunFolderLock(output_dir):`` holds the folder's lock for the block (see the module
    docstring). Creates the folder; raises :class:`RunFolderBusy` when a live process holds it."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> RunFolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunFolderBusy(self._busy_message()) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder_record()).encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def _busy_message(self) -> str:
        try:
            holder = json.loads(self.path.read_text())
            who = (f"process {holder['pid']} on {holder['host']} (`{holder['command']}`, started "
                   f"{holder['started']})")
        except (OSError, ValueError, KeyError):  # the holder has not written its record yet
            who = "another process"
        return (f"output_dir={str(self.folder)!r} is in use by {who}; wait for that run to end (or "
                "stop it), or choose another --output-dir")


def refuse_busy_folder(folder: str | Path) -> None:
    """:class:`RunFolderBusy` when a live process holds ``folder``'s lock now; writes nothing (a
    probe before the other checks of a run, so a second run hears first that the folder is in use)."""
    lock = RunFolderLock(folder)
    if not lock.path.is_file():
        return
    fd = os.open(lock.path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunFolderBusy(lock._busy_message()) from None
    finally:
        os.close(fd)  # closing drops the probe's shared lock


_HELD: dict[Path, RunFolderLock] = {}
"""Run folders whose lock this process holds (:func:`take_run_folder` takes one,
:func:`holds_run_folder` gives it back)."""


def take_run_folder(folder: str | Path) -> None:
    """Create and lock ``folder`` for the run in progress (:class:`RunFolderBusy` when another
    process holds it); the enclosing :func:`holds_run_folder` gives it back."""
    lock = RunFolderLock(folder)
    lock.acquire()
    _HELD[Path(folder).resolve()] = lock


def holds_run_folder(run: Callable[..., Any]) -> Callable[..., Any]:
    """A run's entry point, ``run(config, ...)``: the lock its set-up takes on
    ``config.output_dir`` (:func:`take_run_folder`) is given back when it returns or fails."""

    @functools.wraps(run)
    def wrapped(config: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return run(config, *args, **kwargs)
        finally:
            held = _HELD.pop(Path(config.output_dir).resolve(), None)
            if held is not None:
                held.release()

    return wrapped


def holder_record() -> dict[str, Any]:
    """Who holds a lock: process id, host, command line, start time."""
    argv = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv and sys.argv[0] else ["python"]
    return {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(argv),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


__all__ = ["LOCK_FILE", "RunFolderBusy", "RunFolderLock", "holder_record", "holds_run_folder", "refuse_busy_folder",
           "take_run_folder"]
