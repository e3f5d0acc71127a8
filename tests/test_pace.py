"""A run on a shared CPU (textrl.run.pace): its torch threads fitted to the cores other processes
leave it, against a reference loop over drawn loads, the work that yields to it told from the work
that competes over synthetic /proc trees, and one line when its iterations crawl."""

from __future__ import annotations

import doctest
import os
import statistics

import torch
from hypothesis import given
from hypothesis import strategies as st

from textrl.run import pace
from textrl.run.pace import (
    CpuSample,
    Pace,
    cores_used_elsewhere,
    cpu_sample,
    slow_window,
    threads_for,
)

HZ = os.sysconf("SC_CLK_TCK")


@given(st.integers(1, 64), st.floats(0, 80, allow_nan=False), st.integers(1, 64))
def test_threads_for_is_the_free_cores_rounded_within_one_and_most(cores, elsewhere, most):
    free = cores - elsewhere
    expected = 1
    for n in range(1, most + 1):  # the reference: the largest count the free cores hold, rounded
        if free >= n - 0.5:
            expected = n
    assert threads_for(cores, elsewhere, most) == expected


def test_cores_used_elsewhere_is_the_machines_busy_time_less_this_process():
    a = CpuSample(machine=100.0, own=10.0, wall=50.0)
    b = CpuSample(machine=104.0, own=12.0, wall=52.0)  # 4 core-seconds busy in 2 s, 2 of them ours
    assert cores_used_elsewhere(a, b) == 1.0
    assert cores_used_elsewhere(b, a) == 0.0 and cores_used_elsewhere(a, a) == 0.0


@given(st.lists(st.floats(0.01, 10, allow_nan=False), min_size=0, max_size=30))
def test_slow_window_matches_its_definition(seconds):
    found = slow_window(seconds)
    if len(seconds) < 11:
        assert found is None
        return
    start, recent = statistics.median(seconds[1:6]), statistics.median(seconds[-5:])
    assert (found is not None) == (recent > 3 * start)
    if found is not None:
        assert found == (recent, start)


def _fake_machine(monkeypatch, elsewhere_per_iteration):
    """cpu_sample() as a machine where other processes use the given cores during each iteration
    (one second each), this process one core."""
    state = {"t": 0.0, "machine": 0.0, "own": 0.0, "loads": iter(elsewhere_per_iteration)}

    def sample(since=None):
        sample = CpuSample(machine=state["machine"], own=state["own"], wall=state["t"])
        load = next(state["loads"], 0.0)
        state["t"] += 1.0
        state["own"] += 1.0
        state["machine"] += 1.0 + load
        return sample

    monkeypatch.setattr(pace, "cpu_sample", sample)


def test_the_threads_go_down_while_another_process_is_busy_and_back_after(monkeypatch):
    previous = torch.get_num_threads()
    lines: list[str] = []
    _fake_machine(monkeypatch, [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    try:
        run = Pace(log=lines.append, cores=2, most=2)
        torch.set_num_threads(2)
        run.start()
        threads = []
        for i in range(1, 9):
            run.after(i, 0.3)
            threads.append(torch.get_num_threads())
        assert threads == [2, 2, 2, 1, 1, 1, 1, 2]  # two iterations agreeing before each change
        assert lines[0] == "iteration 4: other processes keep 1.0 of the 2 cores busy: 1 torch thread(s) from here (was 2)"
        assert "2 torch thread(s) from here (was 1)" in lines[1]
    finally:
        torch.set_num_threads(previous)


def test_a_run_that_may_not_adapt_keeps_its_threads_and_a_run_alone_never_changes(monkeypatch):
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _fake_machine(monkeypatch, [1.0] * 10)
        run = Pace(log=lambda line: None, adapt=False, cores=2, most=2)
        run.start()
        for i in range(1, 6):
            run.after(i, 0.3)
        assert torch.get_num_threads() == 2
        _fake_machine(monkeypatch, [0.2] * 10)
        run = Pace(log=lambda line: None, cores=2, most=2)
        run.start()
        for i in range(1, 6):
            run.after(i, 0.3)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)


def test_crawling_iterations_get_one_line_naming_the_cause_and_the_lever(monkeypatch):
    _fake_machine(monkeypatch, [1.5] * 30)
    lines: list[str] = []
    run = Pace(log=lines.append, adapt=False, cores=2, most=1)
    run.start()
    times = [2.0] + [0.3] * 5 + [1.2] * 8
    for i, seconds in enumerate(times, start=1):
        run.after(i, seconds)
    hints = [line for line in lines if "slower than" in line]
    assert hints == ["iterations 7-11 took 1.20 s each, 4.0x slower than the run's first ones (0.30 s): other "
                     "processes use 1.5 of this machine's 2 cores (the run uses "
                     f"{torch.get_num_threads()} torch thread(s)); free the cores, or lower the run's threads "
                     "with OMP_NUM_THREADS"]


def test_a_real_sample_reads_this_machine():
    sample = pace.cpu_sample()
    if sample is not None:  # Linux
        later = pace.cpu_sample()
        assert later.machine >= sample.machine and later.own >= sample.own
        assert cores_used_elsewhere(sample, later) >= 0.0


def test_chosen_threads_and_vllm_engine_processes_keep_the_runs_threads(monkeypatch):
    from textrl.run.pace import threads_chosen

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads_chosen()
    monkeypatch.setenv("OMP_NUM_THREADS", " ")
    assert not threads_chosen()
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert not threads_chosen()


def test_the_loop_fits_threads_only_when_it_may(monkeypatch, tmp_path):
    from textrl.run import loop as loop_module
    from textrl.run.loop import RunLoop
    from textrl.run.metrics import MetricsLog

    seen = []

    def Spy(**kwargs):  # noqa: N802 - stands for the class
        seen.append(kwargs["adapt"])
        return Pace(**kwargs)

    class Body:
        def step(self, i, timings):
            return {"iteration": i}

        def evaluate(self, i, timings):
            return {}

        def checkpoint(self, i, stopping):
            return None

        def faulted(self):
            return False

        def stop_message(self, i, signum, saved):
            return ""

        def postfix(self, row):
            return {}

    monkeypatch.setattr(loop_module, "Pace", Spy)
    for chosen, fit in ((None, True), ("1", True), (None, False)):
        if chosen is None:
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OMP_NUM_THREADS", chosen)
        folder = tmp_path / str(len(seen))
        folder.mkdir()
        RunLoop("x", 1, MetricsLog(folder, True, None), fit_threads=fit).run(Body(), 0)
    assert seen == [True, False, False]


def test_the_set_up_runs_on_the_cores_others_leave_unless_the_threads_were_chosen(monkeypatch):
    previous = torch.get_num_threads()
    lines: list[str] = []
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(pace, "_STARTING_THREADS", [2])
        monkeypatch.setattr(pace.time, "sleep", lambda s: None)
        monkeypatch.setattr(pace.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        _fake_machine(monkeypatch, [1.0, 1.0])
        assert pace.fit_threads_now(lines.append) is None and torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        _fake_machine(monkeypatch, [1.0, 1.0])
        assert pace.fit_threads_now(lines.append) == 1 and torch.get_num_threads() == 1
        assert lines == ["other processes keep 1.0 of the 2 cores busy: 1 torch thread(s) for the set-up (was 2); "
                         "the iterations fit them again as the machine changes"]
        assert Pace(log=lines.append, cores=2).most == 2  # a run may go back up to the threads it started with
    finally:
        torch.set_num_threads(previous)


def test_the_docstring_examples_hold():
    assert doctest.testmod(pace).failed == 0


class FakeProc:
    """A synthetic /proc under ``root``: the machine's cpu line and each process's stat, cgroup and
    autogroup, advanced a second at a time by :meth:`second`."""

    def __init__(self, root, autogroup_on=True):
        self.root, self.ticks, self.processes = root, {"user": 0, "nice": 0, "system": 0}, {}
        (root / "sys/kernel").mkdir(parents=True)
        (root / "sys/kernel/sched_autogroup_enabled").write_text("1\n" if autogroup_on else "0\n")

    def process(self, pid, nice=0, session=1, cgroup="/", start=1000):
        """A process in ``cgroup`` (v1 cpu controller) and the autogroup of ``session``."""
        self.processes[pid] = {"nice": nice, "ticks": 0, "start": start}
        (self.root / str(pid)).mkdir(exist_ok=True)
        (self.root / str(pid) / "cgroup").write_text(f"2:cpuacct:/\n1:cpu:{cgroup}\n0::/\n")
        (self.root / str(pid) / "autogroup").write_text(f"/autogroup-{session} nice 0\n")
        self.write()

    def second(self, **cores):
        """One second in which process ``p<PID>`` used the given cores (user time)."""
        for name, used in cores.items():
            process = self.processes[int(name[1:])]
            process["ticks"] += round(used * HZ)
            self.ticks["nice" if process["nice"] > 0 else "user"] += round(used * HZ)
        self.write()

    def write(self):
        t = self.ticks
        (self.root / "stat").write_text(f"cpu  {t['user']} {t['nice']} {t['system']} 5000 10 0 0 0 0 0\ncpu0 0 0 0 0\n")
        for pid, p in self.processes.items():
            (self.root / str(pid) / "stat").write_text(
                f"{pid} (py thon) S 1 {pid} {pid} 0 -1 0 0 0 0 0 {p['ticks']} 0 0 0 {20 + p['nice']} {p['nice']} 1 0 "
                f"{p['start']} 0 0\n")


def _elsewhere(proc, own, **cores):
    """Cores used elsewhere over one second of the synthetic machine, as process ``own`` sees it."""
    before = cpu_sample(proc=proc.root, pid=own)
    proc.second(**cores)
    after = cpu_sample(proc=proc.root, pid=own)
    return round(cores_used_elsewhere(before, after) * (after.wall - before.wall), 9)  # per second of the fake clock


def test_a_niced_job_of_the_runs_session_yields_and_one_of_another_session_or_cgroup_competes(tmp_path):
    proc = FakeProc(tmp_path)
    proc.process(10)                          # the run, nice 0, session 1
    proc.process(11, nice=19)                 # a test suite at nice 19 from the run's session
    proc.process(12, nice=19, session=2)      # the same from another session (its own autogroup)
    proc.process(13, nice=19, cgroup="/other")  # ... from another cpu cgroup (a container)
    proc.process(14)                          # a plain busy process
    assert _elsewhere(proc, 10, p10=1.0, p11=1.0) == 0.0
    assert _elsewhere(proc, 10, p10=1.0, p12=1.0) == 1.0
    assert _elsewhere(proc, 10, p10=1.0, p13=1.0) == 1.0
    assert _elsewhere(proc, 10, p10=1.0, p14=0.75, p11=0.5) == 0.75
    assert _elsewhere(proc, 11, p10=1.0, p11=1.0) == 1.0  # to the niced job, the run competes


def test_without_autogroup_a_niced_job_of_another_session_yields(tmp_path):
    proc = FakeProc(tmp_path, autogroup_on=False)
    proc.process(10)
    proc.process(12, nice=19, session=2)
    assert _elsewhere(proc, 10, p10=1.0, p12=1.0) == 0.0


def test_a_run_at_nice_19_counts_a_job_at_its_own_nice_and_not_a_nicer_one(tmp_path):
    proc = FakeProc(tmp_path)
    proc.process(10, nice=10)
    proc.process(11, nice=10)
    proc.process(12, nice=19)
    assert _elsewhere(proc, 10, p10=1.0, p11=1.0) == 1.0
    assert _elsewhere(proc, 10, p10=1.0, p12=1.0) == 0.0


def test_a_niced_process_seen_in_one_sample_only_or_under_a_reused_pid_counts(tmp_path):
    proc = FakeProc(tmp_path)
    proc.process(10)
    before = cpu_sample(proc=proc.root, pid=10)
    proc.process(11, nice=19)                  # started after the first sample
    proc.second(p10=1.0, p11=1.0)
    after = cpu_sample(proc=proc.root, pid=10)
    assert round(cores_used_elsewhere(before, after) * (after.wall - before.wall), 9) == 1.0
    proc.process(11, nice=19, start=2000)      # pid 11 ended; a new process took its number
    proc.second(p10=1.0, p11=0.5)
    last = cpu_sample(proc=proc.root, pid=10)
    assert round(cores_used_elsewhere(after, last) * (last.wall - after.wall), 9) == 0.5


def test_unreadable_or_vanished_processes_are_skipped_and_no_proc_stat_is_none(tmp_path):
    proc = FakeProc(tmp_path)
    proc.process(10)
    (tmp_path / "99").mkdir()                  # a process gone between the listing and its stat
    (tmp_path / "self").mkdir()
    sample = cpu_sample(proc=proc.root, pid=10)
    assert sample is not None and sample.yielding == {}
    (tmp_path / "stat").unlink()
    assert cpu_sample(proc=proc.root, pid=10) is None


def test_a_run_keeps_its_threads_beside_a_niced_job_of_its_session_and_fits_them_beside_another(monkeypatch, tmp_path):
    """The Pace over a synthetic /proc: each iteration a fake second in which the run used one
    core and a job at nice 19 another; the processes are read only once niced work was seen."""
    previous = torch.get_num_threads()
    clock = iter(range(10**6))
    monkeypatch.setattr(pace.time, "monotonic", lambda: float(next(clock)))
    reads = []
    real_yielding = pace.yielding_seconds
    monkeypatch.setattr(pace, "yielding_seconds", lambda *a: reads.append(1) or real_yielding(*a))
    try:
        for session, expected in ((1, [2, 2, 2, 2, 2, 2]), (2, [2, 2, 1, 1, 1, 1])):
            proc = FakeProc(tmp_path / str(session))
            proc.process(10)
            proc.process(11, nice=19, session=session)
            monkeypatch.setattr(pace, "cpu_sample", lambda since=None, proc=proc: cpu_sample(since, proc.root, 10))
            torch.set_num_threads(2)
            run = Pace(log=lambda line: None, cores=2, most=2)
            run.start()
            threads = []
            for i in range(1, 7):
                proc.second(p10=1.0, **({"p11": 1.0} if i > 1 else {}))  # the niced job from the second on
                run.after(i, 1.0)
                threads.append(torch.get_num_threads())
            assert threads == expected
        assert len(reads) == 2 * 6  # at the start, then at each sample after a second of niced work (iterations 2-6)
        reads.clear()
        proc = FakeProc(tmp_path / "alone")
        proc.process(10)
        monkeypatch.setattr(pace, "cpu_sample", lambda since=None, proc=proc: cpu_sample(since, proc.root, 10))
        run = Pace(log=lambda line: None, cores=2, most=2)
        run.start()
        for i in range(1, 5):
            proc.second(p10=1.0)
            run.after(i, 1.0)
        assert len(reads) == 1  # alone: read at the start only
    finally:
        torch.set_num_threads(previous)
