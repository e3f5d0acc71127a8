"""A watchdog on the environment's calls: a slow ``start()``, ``step()`` or reward is named, and
optionally cut.

An environment's code runs inside the training process: a ``step()`` that waits on a network, a
solver that loops, a reward that scores a huge answer, holds the whole run, and a stop signal
(SIGTERM) waits for it to return. :class:`CallWatch` wraps each such call:

- after ``notice_after`` seconds (default :data:`NOTICE_AFTER`) one line goes to stderr, once per
  call: ``environment 'X' step() on row 3 (turn 2) has run for 60 s (a stop signal waits for it;
  --env-timeout SECONDS cuts such a call)``, from a daemon thread that polls the calls in flight;
- with ``timeout`` (``--env-timeout``, default none) a call running past it is interrupted (in the
  main thread, by ``SIGALRM`` and ``setitimer``) and raises :class:`EnvTimeout`, an
  :class:`~textrl.envs.environment.EnvError` naming the environment, the call and the row. The
  interruption is a ``BaseException`` inside the call, so an environment's own ``except
  Exception`` does not swallow it. A call outside the main thread, or on a platform without
  ``setitimer``, is named but not cut.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from textrl.envs.environment import EnvError

NOTICE_AFTER = 60.0
"""Seconds an environment call runs before the watchdog names it."""


class EnvTimeout(EnvError):
    """An environment call ran past ``--env-timeout``; the message names the environment, the call
    and the row."""


class _Alarm(BaseException):
    """Raised inside the environment's call when its time is up (not an ``Exception``, so the
    environment's own ``except Exception`` cannot swallow it)."""


class _Flight:
    """The calls in flight, by thread, and the one daemon thread that names the slow ones."""

    def __init__(self) -> None:
        self.calls: dict[int, list[Any]] = {}  # thread id -> [label, started, notice_after, noticed, emit]
        self.lock = threading.Lock()
        self.entered = threading.Condition(self.lock)  # wakes the watcher when a call starts
        self.thread: threading.Thread | None = None

    def enter(self, label: str, notice_after: float, emit: Callable[[str], None]) -> None:
        with self.lock:
            self.calls[threading.get_ident()] = [label, time.monotonic(), notice_after, False, emit]
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._watch, name="textrl-env-watchdog", daemon=True)
                self.thread.start()
            self.entered.notify()

    def leave(self) -> None:
        with self.lock:
            self.calls.pop(threading.get_ident(), None)

    def _watch(self) -> None:
        while True:
            due = []
            with self.lock:
                now = time.monotonic()
                wait: float | None = None  # until the next call comes due; None: until a call starts
                for call in self.calls.values():
                    label, started, after, noticed, emit = call
                    if noticed:
                        continue
                    if now - started >= after:
                        call[3] = True
                        due.append((emit, f"{label} has run for {now - started:.0f} s (a stop signal waits "
                                          "for it; --env-timeout SECONDS cuts such a call)"))
                    else:
                        left = after - (now - started)
                        wait = left if wait is None else min(wait, left)
                if not due:
                    # Looked at and waited on under one hold of the lock: a call that starts meanwhile
                    # wakes this wait (it may come due sooner), none is missed.
                    self.entered.wait(wait)
            for emit, line in due:  # outside the lock: an emit may be slow
                emit(line)


_FLIGHT = _Flight()


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class CallWatch:
    """Watches environment calls (module docstring).

    Args:
        timeout: seconds after which a call is cut with :class:`EnvTimeout` (None: never).
        notice_after: seconds after which a running call is named once (default :data:`NOTICE_AFTER`).
        emit: where the notice goes (default: a line on stderr).
    """

    def __init__(self, timeout: float | None = None, notice_after: float = NOTICE_AFTER,
                 emit: Callable[[str], None] | None = None) -> None:
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"env_timeout={timeout!r}: must be a number of seconds > 0, or None (no timeout)")
        self.timeout = None if timeout is None else float(timeout)
        self.notice_after = float(notice_after)
        self.emit = emit or _stderr

    @contextmanager
    def __call__(self, label: str) -> Iterator[None]:
        """Run the body as the call ``label`` (``"environment 'X' step() on row 3 (turn 2)"``)."""
        _FLIGHT.enter(label, self.notice_after, self.emit)
        cut = self.timeout is not None and hasattr(signal, "setitimer") \
            and threading.current_thread() is threading.main_thread()
        previous = None
        if cut:
            def alarm(signum: int, frame: Any) -> None:
                raise _Alarm()

            previous = signal.signal(signal.SIGALRM, alarm)
            signal.setitimer(signal.ITIMER_REAL, self.timeout)
        try:
            try:
                yield
            finally:
                if cut:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        except _Alarm:
            raise EnvTimeout(f"{label} ran past env_timeout={self.timeout:g} s and was stopped; make it "
                             "faster, or raise --env-timeout") from None
        finally:
            if cut:
                signal.signal(signal.SIGALRM, previous)
            _FLIGHT.leave()


__all__ = ["CallWatch", "EnvTimeout", "NOTICE_AFTER"]
