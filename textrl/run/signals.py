"""Stopping a run early: SIGINT / SIGTERM handling and :class:`TrainingStopped`.

The first signal sets a flag that the run checks at the next boundary of whatever runs: the loop
after its iteration (:class:`textrl.run.RunLoop`), and, through :func:`until_stopped`, the next
step of the supervised warm-up or the next batch of an evaluation, which raise
:class:`StopRequested`. What runs says so with :func:`stop_phase`, and the handler's message names
it: ``SIGTERM: finishing the current warm-up step, then stopping before iteration 1 ...``.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


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


class StopRequested(Exception):
    """A stop signal arrived while a part that stops between its steps ran (:func:`until_stopped`:
    a warm-up step, an evaluation batch); raised at its next step. ``where`` says how far it got."""

    def __init__(self, signum: int, where: str) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} during {where}")
        self.signum = signum
        self.where = where


_ACTIVE: list[StopSignals] = []
"""The installed handlers, the innermost last (one per run in practice)."""


class StopSignals:
    """SIGINT / SIGTERM during a run: the first asks the run to stop at the next boundary of what
    runs (:attr:`doing`: the current iteration, warm-up step or evaluation batch), then
    :attr:`then` (saving a checkpoint, or stopping before the first iteration); a second one
    aborts at once (``KeyboardInterrupt``).

    Installed only in the main thread; the previous handlers come back on exit. A signal the
    process ignores when the run starts (``SIG_IGN``: SIGINT in a background job started by a
    non-interactive shell) stays ignored: the run does not take over what its parent turned off.
    """

    def __init__(self, doing: str = "the current iteration", then: str = "saving a checkpoint") -> None:
        self.received: int | None = None
        self.doing = doing
        """What the run finishes before it stops (the handler's message says it)."""
        self.then = then
        """What it does after that."""
        self.stoppable = True
        """Whether :func:`until_stopped` stops a part between its steps (not in the last iteration,
        whose evaluation the run's summary needs)."""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) != signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            print(f"\n{name} again: aborting now, without a checkpoint", file=sys.stderr, flush=True)
            raise KeyboardInterrupt(name)
        self.received = signum
        print(f"\n{name}: finishing {self.doing}, then {self.then} (Ctrl-C again aborts at once)",
              file=sys.stderr, flush=True)


def active_signals() -> StopSignals | None:
    """The run's installed :class:`StopSignals` (None outside a run)."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def stop_phase(doing: str, then: str | None = None, stoppable: bool | None = None) -> Iterator[None]:
    """While the block runs, a signal's message says it finishes ``doing`` then ``then`` (and
    :func:`until_stopped` stops between steps, or not, as ``stoppable`` says); restored after.
    Nothing outside a run."""
    signals = active_signals()
    if signals is None:
        yield
        return
    saved = signals.doing, signals.then, signals.stoppable
    signals.doing = doing
    signals.then = then if then is not None else signals.then
    signals.stoppable = stoppable if stoppable is not None else signals.stoppable
    try:
        yield
    finally:
        signals.doing, signals.then, signals.stoppable = saved


def until_stopped(items: Iterable[T], what: str, unit: str = "step") -> Iterator[T]:
    """The items of ``items``, one at a time; before each, :class:`StopRequested` when the run
    received a stop signal (and may stop here): the caller's part (``what``: "the supervised
    warm-up") ends between two of its steps. Outside a run, every item."""
    total = len(items) if hasattr(items, "__len__") else None  # type: ignore[arg-type]
    for done, item in enumerate(items):
        signals = active_signals()
        if signals is not None and signals.received is not None and signals.stoppable:
            of = f" of {total}" if total is not None else ""
            raise StopRequested(signals.received, f"{what} (after {unit} {done}{of})")
        yield item


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


class Stoppable:
    """``items`` iterated any number of times, each pass through :func:`until_stopped` (a
    held-out evaluation goes over its batches once greedy, once sampled)."""

    def __init__(self, items: Any, what: str, unit: str = "step") -> None:
        self.items, self.what, self.unit = items, what, unit

    def __iter__(self) -> Iterator[Any]:
        return until_stopped(self.items, self.what, self.unit)

    def __len__(self) -> int:
        return len(self.items)


def stop_before_loop(command: str, err: StopRequested, done: int, checkpoint: Path | None) -> TrainingStopped:
    """The :class:`TrainingStopped` of a stop before the loop's first iteration (in the warm-up,
    or the held-out evaluation before it): nothing new was saved, so the same command starts
    over, or resumes from ``checkpoint`` (the run's newest, None for a fresh run); printed too."""
    if checkpoint is None:
        where = "nothing was saved (a checkpoint comes after an iteration): run the same command again to start over"
    else:
        where = (f"the run stays as its checkpoint {checkpoint} left it: run the same command again to "
                 "resume from there")
    message = f"textrl {command}: {err} before {'iteration' if command == 'train' else 'step'} {done + 1}; {where}"
    print(message, file=sys.stderr, flush=True)
    return TrainingStopped(message, 128 + err.signum)


__all__ = ["StopRequested", "StopSignals", "Stoppable", "TrainingStopped", "active_signals", "resume_command", "signal_message",
           "stop_before_loop", "stop_phase", "until_stopped"]
