"""One writer per run folder: a lock that a second run meets with a message naming the holder.

The lock is an exclusive ``flock`` on ``OUTPUT_DIR/.textrl.lock``, held for the whole run by its
main process: a run's entry point is wrapped in :func:`holds_run_folder`, and its set-up calls
:func:`take_run_folder` once the config and the folder are checked, before it writes anything
(so a refused run writes nothing). The file itself names the holder (its process id, host, command
and start time) for the message the next run shows.

A run that ends, normally, by an error or by a signal it handles (Ctrl-C, SIGTERM), removes the
file while it still holds the lock, then lets go: a finished run folder holds no ``.textrl.lock``.
Removing a lock file is safe only because a taker checks, once its ``flock`` is granted, that the
file it locked is still the one at the path (same inode): a process that opened the file just
before the holder removed it would otherwise lock a file no one else can see, beside a third run
locking the new one. A taker that finds the file gone or replaced opens the path again. A
``kill -9`` leaves the file behind, but the kernel releases the lock with the process, so the next
run simply takes it over (and removes it when it ends): there is no stale lock to clean up by
hand, and no cleanup that could touch another writer's files.
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
        """Take the lock (creating the folder and the file) and write the holder's record;
        :class:`RunFolderBusy` when a live process holds it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunFolderBusy(self._busy_message()) from None
            if _is_file_at(fd, self.path):
                break
            os.close(fd)  # its holder removed it as it ended: lock the path's file, made anew if need be
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder_record()).encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Remove the lock file, then let go of the lock (see the module docstring); idempotent."""
        if self._fd is None:
            return
        if _is_file_at(self._fd, self.path):  # ours at the path: nobody else removes it while we hold it
            self.path.unlink(missing_ok=True)
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
    try:
        fd = os.open(lock.path, os.O_RDONLY)
    except FileNotFoundError:  # no run holds it (a run removes the file as it ends)
        return
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


def _is_file_at(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is the file at ``path`` now (same device and inode; False when
    ``path`` is gone)."""
    try:
        there = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)


def holder_record() -> dict[str, Any]:
    """Who holds a lock: process id, host, command line, start time."""
    argv = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv and sys.argv[0] else ["python"]
    return {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(argv),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


__all__ = ["LOCK_FILE", "RunFolderBusy", "RunFolderLock", "holder_record", "holds_run_folder", "refuse_busy_folder",
           "take_run_folder"]
