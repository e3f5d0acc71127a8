"""A run's pace on a shared CPU: its torch threads fitted to the cores other processes leave it, and
one line when its iterations run far slower than its own first ones.

Why: torch runs one OpenMP thread per core, and an OpenMP parallel region ends only when every
thread has done its share. With one other busy process on a 2-core machine, one of the run's two
threads waits for a core while the other spins at the region's barrier, at every matmul: the
embedded default ran several times slower than alone, while one thread would run it nearly as fast
as alone. Waiting passively (``OMP_WAIT_POLICY=PASSIVE``) costs every region a wake-up instead,
slower alone (the figures: docs/benchmarks.md, "A busy machine").

So each iteration, :class:`Pace` reads how much CPU the other processes of the machine used
(``/proc/stat`` less this process's own time, :func:`cores_used_elsewhere`) and, when the cores left
cannot hold the run's threads, lowers them (:func:`threads_for`). Work that gives its core up to the
run's threads is not counted (:func:`yields`: a niced job of the run's own scheduling group, such
as a test suite at nice 19 started from the same session); a niced job of another session or
container competes at full weight (the kernel weighs nice values only within a group) and is
counted. The run raises its threads back, up to the
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

SLOW_FACTOR = 3.0
"""An iteration window this many times slower than the run's first iterations gets the hint."""


PROC = Path("/proc")
"""Where the kernel's process and CPU counters are read."""

NICED_SCAN = 0.1
"""Cores of niced work (``/proc/stat``'s nice column) since the previous sample from which a sample
also reads each process (:func:`yielding_seconds`), to tell the work that yields from the work that
competes (a machine without niced work is never read process by process after the first sample)."""


@dataclass(frozen=True)
class CpuSample:
    """Seconds of CPU the whole machine (all cores), its niced processes and this process (all its
    threads) had used at ``wall`` (monotonic seconds); ``yielding``: the CPU seconds of each process
    (by ``(pid, start tick)``) that gives its core up to this one (:func:`yields`), None where the
    processes were not read."""

    machine: float
    own: float
    wall: float
    niced: float = 0.0
    yielding: Mapping[tuple[int, int], float] | None = None


def machine_seconds(line: str, hz: float) -> tuple[float, float]:
    """``(busy, niced)`` core-seconds of ``/proc/stat``'s ``cpu`` line: busy is every field but idle,
    iowait and the guest fields (already inside user and nice); niced is the nice field, the user
    time of processes at nice > 0 (their system time is inside system). ``ValueError`` when the
    line is not one.

    >>> machine_seconds("cpu  200 100 50 900 10 0 5 0 30 20", 100)
    (3.55, 1.0)
    """
    ticks = [int(x) for x in line.split()[1:]]
    if len(ticks) < 5:
        raise ValueError(f"not a /proc/stat cpu line: {line!r}")
    busy = sum(ticks[:8]) - ticks[3] - ticks[4]
    return busy / hz, ticks[1] / hz


def process_stat(text: str) -> tuple[int, int, int]:
    """``(start tick, nice, utime + stime ticks)`` of a ``/proc/PID/stat`` text (its name, in
    parentheses, may hold spaces and parentheses). ``ValueError`` when the text is not one.

    >>> process_stat("42 (a (b) c) R 1 42 42 0 -1 0 0 0 0 0 700 300 0 0 39 19 1 0 12345 0 0")
    (12345, 19, 1000)
    """
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[19]), int(fields[16]), int(fields[11]) + int(fields[12])


def sched_group(cgroup: str, autogroup: str | None) -> str:
    """The scheduling group a process's CPU time is weighed in: its cpu cgroup (the v1 line naming
    ``cpu``, else the v2 line) and, where the kernel's autogroup is on, its autogroup (one a session)
    from the texts of ``/proc/PID/cgroup`` and ``/proc/PID/autogroup``.

    >>> sched_group("2:cpuacct:/\\n1:cpu,cpuacct:/user.slice\\n0::/x\\n", "/autogroup-7 nice 0\\n")
    '/user.slice /autogroup-7 nice 0'
    >>> sched_group("0::/system.slice/a.service\\n", None)
    '/system.slice/a.service'
    """
    lines = [line.split(":", 2) for line in cgroup.splitlines() if line.count(":") >= 2]
    cpu = [path for _, controllers, path in lines if "cpu" in controllers.split(",")]
    unified = [path for number, controllers, path in lines if number == "0" and not controllers]
    path = (cpu or unified or [cgroup.strip()])[0]
    return f"{path} {autogroup.strip()}" if autogroup is not None else path


def yields(nice: int, group: str, own_nice: int, own_group: str) -> bool:
    """Whether another process's CPU time leaves this run's threads their cores, so that it is not
    counted as busy: only when it is nicer (a higher nice value) and in the run's scheduling group
    (:func:`sched_group`). The kernel weighs nice values only between the tasks of one group: a job
    at nice 19 beside a run at nice 0 gets about 1.5% of a core the run wants (weights 15 against
    1024) within a group, and its group's full share from another cgroup or, with autogroup, from
    another session.

    >>> yields(19, "/ /autogroup-3 nice 0", 0, "/ /autogroup-3 nice 0")
    True
    >>> yields(19, "/ /autogroup-4 nice 0", 0, "/ /autogroup-3 nice 0"), yields(0, "/", 0, "/"), yields(5, "/", 10, "/")
    (False, False, False)
    """
    return nice > own_nice and group == own_group


def _read(path: Path) -> str | None:
    """The text of ``path``; None when it cannot be read (gone, not permitted, absent)."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _group(proc: Path, pid: str, autogroup_on: bool) -> str:
    """:func:`sched_group` of process ``pid`` (``''`` for a cgroup that cannot be read)."""
    return sched_group(_read(proc / pid / "cgroup") or "", _read(proc / pid / "autogroup") if autogroup_on else None)


def yielding_seconds(proc: Path, pid: int, hz: float) -> dict[tuple[int, int], float]:
    """The CPU seconds of each other process (by ``(pid, start tick)``) under ``proc`` that yields
    to process ``pid`` (:func:`yields`); only the niced ones' groups are read."""
    own = _read(proc / str(pid) / "stat")
    if own is None:
        return {}
    autogroup_on = (_read(proc / "sys/kernel/sched_autogroup_enabled") or "0").strip() == "1"
    own_nice, own_group = process_stat(own)[1], None
    found: dict[tuple[int, int], float] = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit() or entry.name == str(pid):
            continue
        text = _read(Path(entry.path) / "stat")
        try:
            start, nice, ticks = process_stat(text or "")
        except (ValueError, IndexError):  # gone since the listing
            continue
        if nice <= own_nice:
            continue
        own_group = own_group if own_group is not None else _group(proc, str(pid), autogroup_on)
        if yields(nice, _group(proc, entry.name, autogroup_on), own_nice, own_group):
            found[(int(entry.name), start)] = ticks / hz
    return found


def cpu_sample(since: CpuSample | None = None, proc: Path = PROC, pid: int | None = None) -> CpuSample | None:
    """Now's :class:`CpuSample` of process ``pid`` (this one) from ``proc``, with the work that yields
    to it read process by process unless ``since`` (the previous sample) is given and niced work kept
    fewer than :data:`NICED_SCAN` cores busy since. None where ``/proc/stat`` cannot be read."""
    pid = os.getpid() if pid is None else pid
    machine, own = _read(proc / "stat"), _read(proc / str(pid) / "stat")
    if machine is None or own is None:  # not Linux
        return None
    hz = os.sysconf("SC_CLK_TCK")
    try:
        busy, niced = machine_seconds(machine.partition("\n")[0], hz)
        own_ticks = process_stat(own)[2]
    except (ValueError, IndexError):
        return None
    now = CpuSample(machine=busy, own=own_ticks / hz, wall=time.monotonic(), niced=niced)
    if since is not None and niced_cores(since, now) < NICED_SCAN:
        return now
    return replace(now, yielding=yielding_seconds(proc, pid, hz))


def cores_used_elsewhere(before: CpuSample, after: CpuSample) -> float:
    """How many cores, on average between the two samples, other processes kept busy with work that
    competes with this one (>= 0): the machine's busy time less this process's, less that of the
    processes that yield to it (:func:`yields`) and were read in both samples."""
    elapsed = after.wall - before.wall
    if elapsed <= 0:
        return 0.0
    yielded = 0.0
    if before.yielding is not None and after.yielding is not None:
        yielded = sum(after.yielding[key] - seconds for key, seconds in before.yielding.items() if key in after.yielding)
    return max(0.0, ((after.machine - before.machine) - (after.own - before.own) - yielded) / elapsed)


def niced_cores(before: CpuSample, after: CpuSample) -> float:
    """How many cores, on average between the two samples, niced processes kept busy (this one
    included when it is niced)."""
    elapsed = after.wall - before.wall
    return (after.niced - before.niced) / elapsed if elapsed > 0 else 0.0


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
        now = cpu_sample(since=self._sample)  # each process read only while niced work runs
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


__all__ = ["NICED_SCAN", "PROC", "SLOW_FACTOR", "CpuSample", "Pace", "cores_used_elsewhere", "cpu_sample", "fit_threads_now",
           "machine_seconds", "niced_cores", "process_stat", "sched_group", "slow_window", "starting_threads",
           "threads_chosen", "threads_for", "usable_cores", "yielding_seconds", "yields"]
