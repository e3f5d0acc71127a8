"""Stopping a run early: SIGINT / SIGTERM handling and :class:`TrainingStopped`."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Any


class TrainingStopped(SystemExit):
    """The run stopped early (a signal, repeated NaN/inf updates) after saving what it could.

    ``str(err)`` says why and how to resume. A ``SystemExit``: the ``textrl`` command exits with
    status ``err.code`` (128 + the signal number after a signal, 1 otherwise), no traceback.
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(exit_code)
        self.message = message

    def __str__(self) -> str:
        return self.message


class StopSignals:
    """SIGINT / SIGTERM during a run: the first asks the loop to stop after the current
    iteration (with a checkpoint); a second one aborts at once (``KeyboardInterrupt``).

    Installed only in the main thread; the previous handlers come back on exit. A signal the
    process ignores when the run starts (``SIG_IGN``: SIGINT in a background job started by a
    non-interactive shell) stays ignored: the run does not take over what its parent turned off.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) != signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            print(f"\n{name} again: aborting now, without a checkpoint", file=sys.stderr, flush=True)
            raise KeyboardInterrupt(name)
        self.received = signum
        print(f"\n{name}: finishing the current iteration, then saving a checkpoint "
              "(Ctrl-C again aborts at once)", file=sys.stderr, flush=True)


def signal_message(command: str, unit: str, done: int, total: int, signum: int | None,
                   saved: Path | None, config_path: Path) -> str:
    """What the user reads after a signal stopped ``textrl COMMAND``: after which ``unit``
    (iteration, step), where the checkpoint is, and the command that resumes."""
    name = signal.Signals(signum).name if signum is not None else "a signal"
    return (f"textrl {command}: stopped by {name} after {unit} {done} of {total}; checkpoint saved "
            f"in {saved}. Resume with: {resume_command(command, config_path)}")


def resume_command(command: str, config_path: Path) -> str:
    """``textrl COMMAND --config CONFIG --resume``: how a stopped run continues."""
    return f"textrl {command} --config {config_path} --resume"


__all__ = ["StopSignals", "TrainingStopped", "resume_command", "signal_message"]
