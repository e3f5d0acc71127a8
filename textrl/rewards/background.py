"""Reward calls run in the background, a bounded number at a time.

A reward that waits on I/O (``async def``, or declared with ``does_io = True``:
:func:`textrl.rewards.base.overlapped`) need not hold the training loop: the episode runner
(:class:`textrl.envs.collector.EpisodeRunner`) hands each finished micro-batch's reward calls to a
:class:`RewardPool` and generation of the next micro-batch goes on; it takes the results, in row
order, when the rollout is assembled. The pool runs at most ``concurrency`` calls at once (its
threads; an ``async`` reward's coroutine runs to its end on an event loop of its thread), counts
the seconds its calls ran (``time/reward_calls_s``) and hands a call's exception back to whoever
takes its result (:func:`results`), so the error surfaces where the loop needs the scores.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

DEFAULT_CONCURRENCY = 8
"""Reward calls in flight at once by default (``--reward-concurrency``)."""


def check_concurrency(value: Any, what: str = "reward_concurrency") -> int:
    """``value`` as an int >= 1; a ``ValueError`` naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what}={value!r}: must be an int >= 1, the reward calls in flight at once (default "
                         f"{DEFAULT_CONCURRENCY}; 1 runs one at a time, still beside generation)")
    return value


class RewardPool:
    """At most ``concurrency`` reward calls at once, in threads of their own (module docstring).

    ``submit(call)`` starts ``call()`` (no arguments: the caller binds them) when a thread is free
    and returns a :class:`concurrent.futures.Future` of its result; :meth:`take_busy` returns the
    seconds the calls ran since the last take (summed over the calls, so it may exceed the wall
    clock when several overlap)."""

    def __init__(self, concurrency: int = DEFAULT_CONCURRENCY) -> None:
        self.concurrency = check_concurrency(concurrency)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._busy = 0.0

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="textrl-reward")
        return self._pool.submit(self._timed, call)

    def _timed(self, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            return call()
        finally:
            with self._lock:
                self._busy += time.perf_counter() - start

    def take_busy(self) -> float:
        """Seconds the calls ran since the last take (0.0 when none ran)."""
        with self._lock:
            busy, self._busy = self._busy, 0.0
        return busy

    def close(self) -> None:
        """Stop taking calls; the calls running finish (no call is cut half way)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def results(futures: Sequence[Future[Any]]) -> list[Any]:
    """Each future's result, in order. When one raised, the calls not yet started are cancelled,
    the running ones are waited for (none is left writing behind the caller's back), and the
    first exception in order is raised."""
    out = []
    for i, future in enumerate(futures):
        try:
            out.append(future.result())
        except BaseException:
            rest = futures[i + 1:]
            for other in rest:
                other.cancel()
            wait(rest)
            raise
    return out


__all__ = ["DEFAULT_CONCURRENCY", "RewardPool", "check_concurrency", "results"]
