"""Reward calls run in the background, a bounded number at a time.

A reward that waits on I/O (``async def``, or declared with ``does_io = True``:
:func:`textrl.rewards.base.overlapped`) need not hold the training loop: the episode runner
(:class:`textrl.envs.collector.EpisodeRunner`) hands each finished micro-batch's calls of those
functions (:func:`background_functions`, :func:`answers`) to a :class:`RewardPool` and generation of
the next micro-batch goes on; when the rollout is assembled it scores the rows in the loop, in row
order, with each background function replaced by the :class:`Replay` of its answer
(:func:`replayed`): the other functions of a composite (rules, an in-process reward model) run in
the loop as before, and every rule of the scoring path applies as it would have. The pool runs at most ``concurrency`` calls at once (its
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

from torch import Tensor

from textrl.rewards.base import (
    AnsweredRewardError,
    RewardError,
    evaluate_reward,
    overlapped,
    reward_name,
)
from textrl.rewards.composite import CompositeReward

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


def background_functions(fn: Any) -> dict[str, Any] | None:
    """The functions of reward ``fn`` scored in the background, by the name it reports them under:
    a :class:`CompositeReward`'s components that are ``async`` or ``does_io`` (the others are scored
    in the loop, as they always were), or ``fn`` itself when it is a plain function that is; ``{}``
    when none is. None for another object that reports components of its own (``components`` and
    ``weights``): it cannot be split, and is scored whole in the background when it overlaps."""
    if isinstance(fn, CompositeReward):
        return {name: f for name, f in fn.functions.items() if overlapped(f)}
    if callable(getattr(fn, "components", None)) and hasattr(fn, "weights"):
        return None
    return {reward_name(fn): fn} if overlapped(fn) else {}


def answers(functions: dict[str, Any], prompts: list[Any], completions: list[Any],
            kwargs: dict[str, Any]) -> dict[str, tuple[Tensor, Tensor] | Exception]:
    """Each function's ``(scores float32 [B], applies bool [B])`` by :func:`evaluate_reward` (NaN/inf
    let through: the loop applies its policy when it replays them), or the exception it ended with
    (a :class:`RewardError` named as the loop would name it)."""
    out: dict[str, tuple[Tensor, Tensor] | Exception] = {}
    for name, fn in functions.items():
        try:
            out[name] = evaluate_reward(fn, prompts, completions, allow_nonfinite=True, **kwargs)
        except Exception as err:  # raised again where the scores are needed (Replay)
            out[name] = err
    return out


class Replay:
    """A reward function that answers with what a background call got (``answer``: scores and
    applies flags, or the exception), under the name it ran under: the loop scores the same rows
    with it in the background function's place, so its rules (None, NaN/inf, the weighted total)
    apply exactly as to the function itself."""

    def __init__(self, name: str, answer: tuple[Tensor, Tensor] | Exception) -> None:
        self.name, self.answer = name, answer

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        if isinstance(self.answer, RewardError):
            raise AnsweredRewardError(str(self.answer)) from self.answer
        if isinstance(self.answer, Exception):
            raise self.answer
        scores, applies = self.answer
        if len(completions) != scores.shape[0]:
            raise RuntimeError(f"reward {self.name!r} answered {scores.shape[0]} rows in the background and is "
                               f"asked for {len(completions)}: the rows of a call changed")
        return [float(v) if a else None for v, a in zip(scores.tolist(), applies.tolist())]


def replayed(fn: Any, answer: dict[str, tuple[Tensor, Tensor] | Exception]) -> Any:
    """Reward ``fn`` with each background function (:func:`background_functions`) replaced by its
    :class:`Replay` of ``answer``: a :class:`CompositeReward` of the same names, weights and order,
    or the replay itself for a plain function."""
    if isinstance(fn, CompositeReward):
        weights = fn.weights
        return CompositeReward({name: (Replay(name, answer[name]) if name in answer else f, weights[name])
                                for name, f in fn.functions.items()})
    (name,) = answer
    return Replay(name, answer[name])


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


__all__ = ["DEFAULT_CONCURRENCY", "Replay", "RewardPool", "answers", "background_functions", "check_concurrency",
           "replayed", "results"]
