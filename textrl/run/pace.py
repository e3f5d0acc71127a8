"""A run's pace on a shared CPU: its torch threads fitted to the cores other processes leave it, and
one line when its iterations run far slower than its own first ones.

Why: torch runs one OpenMP thread per core, and an OpenMP parallel region ends only when every
thread has done its share. With one other busy process on a 2-core machine, one of the run's two
threads waits for a core while the other spins at the region's barrier, at every matmul: the
embedded default ran 4.4x slower (1.26 s an iteration against 0.29 s alone; up to tenfold on a
machine with more load), while one thread would run it at 0.42 s. Waiting passively
(``OMP_WAIT_POLICY=PASSIVE``) costs every region a wake-up instead: 0.50 s alone.

So each iteration, :class:`Pace` reads how much CPU the other processes of the machine used
(``/proc/stat`` less this process's own time, :func:`cores_used_elsewhere`) and, when the cores left
cannot hold the run's threads, lowers them (:func:`threads_for`); it raises them back, up to the
number the run started with, when the others are gone. A change needs two iterations agreeing and
is said in one line. Results can differ in the last bits between thread counts (reductions split
otherwise); a run whose machine is not shared never changes its threads, and neither does one whose
threads were chosen (``OMP_NUM_THREADS`` set: :func:`threads_chosen`) or whose rollouts come from a
vLLM engine process (busy by design while the run waits for it). Without ``/proc/stat`` (not
Linux) only the slow-iteration hint runs.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

SLOW_FACTOR = 3.0
"""An iteration window this many times slower than the run's first iterations gets the hint."""


@dataclass(frozen=True)
class CpuSample:
    """Seconds of CPU the whole machine (all cores) and this process (all its threads) had used at
    ``wall`` (monotonic seconds)."""

    machine: float
    own: float
    wall: float


def cpu_sample() -> CpuSample | None:
    """Now's :class:`CpuSample` (``/proc/stat``'s busy time: every field but idle and iowait);
    None where ``/proc/stat`` cannot be read."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(ticks) < 5:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return CpuSample(machine=(sum(ticks) - ticks[3] - ticks[4]) / hz, own=own.user + own.system, wall=time.monotonic())


def cores_used_elsewhere(before: CpuSample, after: CpuSample) -> float:
    """How many cores, on average between the two samples, other processes kept busy (>= 0)."""
    elapsed = after.wall - before.wall
    if elapsed <= 0:
        return 0.0
    return max(0.0, ((after.machine - before.machine) - (after.own - before.own)) / elapsed)


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform says, else every core)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def threads_for(cores: int, elsewhere: float, most: int) -> int:
    """The torch threads a run should use on ``cores`` cores of which ``elsewhere`` are busy with
    other processes: the free cores, rounded to the nearest, at least 1 and at most ``most``.

    >>> threads_for(2, 0.1, 2), threads_for(2, 1.0, 2), threads_for(8, 2.7, 8), threads_for(2, 3.0, 2)
    (2, 1, 5, 1)
    """
    return max(1, min(most, math.floor(cores - elsewhere + 0.5)))


def slow_window(seconds: Sequence[float], first: int = 5, window: int = 5, skip: int = 1,
                factor: float = SLOW_FACTOR) -> tuple[float, float] | None:
    """``(median of the last window, median of the first iterations)`` when the last ``window``
    iteration times run more than ``factor`` times slower than the run's ``first`` ones (after the
    ``skip`` first, which warm caches up); None otherwise or before there are that many.

    >>> slow_window([2.0, 0.3, 0.3, 0.3, 0.3, 0.3, 1.2, 1.3, 1.1, 1.2, 1.4])
    (1.2, 0.3)
    >>> slow_window([2.0, 0.3, 0.3, 0.3, 0.3, 0.3, 0.5, 0.6, 0.5, 0.6, 0.5]) is None
    True
    """
    if len(seconds) < skip + first + window:
        return None
    start = statistics.median(seconds[skip:skip + first])
    recent = statistics.median(seconds[-window:])
    return (recent, start) if start > 0 and recent > factor * start else None


_STARTING_THREADS: list[int] = []
"""torch's thread count before this process first fitted it (:func:`fit_threads_now`)."""


def starting_threads() -> int:
    """The torch threads this process started with, before any fitting: the most a run goes back up to."""
    return _STARTING_THREADS[0] if _STARTING_THREADS else torch.get_num_threads()


def fit_threads_now(log: Callable[[str], Any] = print, seconds: float = 0.25) -> int | None:
    """Before a run's set-up work (the models' loading, the supervised warm-up): watch the machine
    for ``seconds`` while this process waits, and fit the torch threads to the cores the others
    leave (unless chosen: :func:`threads_chosen`), saying so in a line when they change. The
    threads set; None where ``/proc/stat`` cannot be read."""
    if not _STARTING_THREADS:
        _STARTING_THREADS.append(torch.get_num_threads())
    if threads_chosen() or torch.cuda.is_initialized():
        return None
    before = cpu_sample()
    if before is None:
        return None
    time.sleep(seconds)
    after = cpu_sample()
    if after is None:
        return None
    elsewhere = cores_used_elsewhere(before, after)
    cores = usable_cores()
    wanted, current = threads_for(cores, elsewhere, starting_threads()), torch.get_num_threads()
    if wanted != current:
        torch.set_num_threads(wanted)
        log(f"other processes keep {elsewhere:.1f} of the {cores} cores busy: {wanted} torch thread(s) for the "
            f"set-up (was {current}); the iterations fit them again as the machine changes")
    return wanted


def threads_chosen() -> bool:
    """Whether the user chose the torch threads (``OMP_NUM_THREADS`` set): then they stay as chosen."""
    return bool(os.environ.get("OMP_NUM_THREADS", "").strip())


@dataclass
class Pace:
    """The pace of one process's run (module docstring). ``log``: where its lines go (the main
    process's print); ``adapt``: whether it may change the torch threads (a CPU run)."""

    log: Callable[[str], Any] = print
    adapt: bool = True
    unit: str = "iteration"
    cores: int = field(default_factory=lambda: usable_cores())
    most: int = field(default_factory=lambda: starting_threads())
    window: int = 5
    """Iterations compared with the run's first ones (:func:`slow_window`)."""
    seconds: list[float] = field(default_factory=list)
    hinted: bool = False
    _sample: CpuSample | None = None
    _wanted: int | None = None

    def start(self) -> None:
        """Take the first sample (before the first iteration)."""
        self._sample = cpu_sample()

    def after(self, iteration: int, seconds: float) -> None:
        """After ``iteration`` took ``seconds``: fit the threads to the free cores, and say once when
        the iterations have become far slower than the first ones."""
        self.seconds.append(seconds)
        elsewhere = self._fit_threads(iteration)
        slow = slow_window(self.seconds, window=self.window)
        if slow is not None and not self.hinted:
            self.hinted = True
            recent, start = slow
            busy = (f"other processes use {elsewhere:.1f} of this machine's {self.cores} cores"
                    if elsewhere is not None else "the machine may be busy with other processes")
            self.log(f"{self.unit}s {iteration - self.window + 1}-{iteration} took {recent:.2f} s each, {recent / start:.1f}x slower "
                     f"than the run's first ones ({start:.2f} s): {busy} (the run uses {torch.get_num_threads()} torch "
                     "thread(s)); free the cores, or lower the run's threads with OMP_NUM_THREADS")

    def _fit_threads(self, iteration: int) -> float | None:
        """Sample the CPU; when two iterations in a row want another thread count, set it and say so.
        The cores used elsewhere since the last sample (None without ``/proc/stat``)."""
        now = cpu_sample()
        if now is None or self._sample is None:
            return None
        elsewhere = cores_used_elsewhere(self._sample, now)
        self._sample = now
        if not self.adapt:
            return elsewhere
        wanted = threads_for(self.cores, elsewhere, self.most)
        current = torch.get_num_threads()
        if wanted != current and wanted == self._wanted:
            torch.set_num_threads(wanted)
            self.log(f"{self.unit} {iteration}: other processes keep {elsewhere:.1f} of the {self.cores} cores busy: "
                     f"{wanted} torch thread(s) from here (was {current})")
        self._wanted = wanted
        return elsewhere


__all__ = ["SLOW_FACTOR", "CpuSample", "Pace", "cores_used_elsewhere", "cpu_sample", "fit_threads_now", "slow_window",
           "starting_threads", "threads_chosen", "threads_for", "usable_cores"]
