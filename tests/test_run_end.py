"""Records that say what happened: the updates a run skipped for NaN/inf in its closing lines and
``summary.json``; a run that stops (a signal, repeated NaN/inf updates) or fails (an exception out
of the loop, such as an engine's) still writes ``summary.json`` and ``curves.png`` saying how and
where it ended, without a doubled row, and a resume replaces them with the run's end."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest

from tests.agents.conftest import poison_next_step
from tests.runs import SMALL
from tests.runs import metrics as _metrics
from textrl.agents import GAEPPO
from textrl.cli import main
from textrl.parallel import Backend
from textrl.run import MetricsLog, RunLoop, StopSignals, TrainingStopped
from textrl.training import ppo_run
from textrl.training.records import format_summary, skipped_line, skipped_updates


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _nan_loss_at(monkeypatch, updates_done) -> None:
    """GAEPPO's loss is NaN in the updates whose count of updates done is in ``updates_done``
    (``agent.iteration``: 1 is iteration 2's update): every minibatch of them is skipped."""
    loss = GAEPPO.loss

    def nan_at(self, mb):
        value, stats = loss(self, mb)
        return (value * math.nan if self.iteration in updates_done else value), stats

    monkeypatch.setattr(GAEPPO, "loss", nan_at)


# -- the pure records ------------------------------------------------------------------------------


def test_skipped_updates_sum_the_rows_counter_and_name_the_iterations():
    rows = [{"iteration": 1, "nonfinite/skipped_updates": 0.0, "nonfinite/rolled_back": 0.0},
            {"iteration": 2, "nonfinite/skipped_updates": 2.0, "nonfinite/rolled_back": 0.0},
            {"iteration": 3, "nonfinite/skipped_updates": 1.0, "nonfinite/rolled_back": 1.0},
            {"iteration": 4, "nonfinite/skipped_updates": math.nan},  # null read back: not a skip
            {"iteration": 5}]  # an agent that never skips has no counter
    skipped = skipped_updates(rows)
    assert skipped == {"count": 3.0, "iterations": [2, 3], "rolled_back": [3], "of_iterations": 5}
    assert skipped_line(skipped) == (
        "skipped updates: 2 of the 5 iterations skipped NaN/inf updates (iterations 2, 3: 3 minibatch steps or "
        "whole updates skipped; 1 updates rolled back), so their rollouts trained the policy in part or not at "
        "all; see nonfinite/* in metrics.jsonl")
    assert skipped_line(skipped_updates(rows[:1])) is None
    assert "skipped" not in format_summary(None, {}, None, skipped_updates(rows[:1]))
    many = skipped_updates([{"iteration": i, "nonfinite/skipped_updates": 1.0} for i in range(1, 31)])
    assert "(iterations 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, ... (18 more): 30 minibatch" in skipped_line(many)


class Body:
    """A LoopBody whose step raises at ``raise_at`` and that faults from ``fault_at``."""

    def __init__(self, raise_at=None, fault_at=None):
        self.raise_at, self.fault_at, self.iteration = raise_at, fault_at, 0

    def step(self, iteration, timings):
        self.iteration = iteration
        if iteration == self.raise_at:
            raise RuntimeError("the engine died")
        return {"iteration": iteration, "reward/mean": 0.1 * iteration}

    def evaluate(self, iteration, timings):
        return {}

    def checkpoint(self, iteration, stopping):
        return Path(f"iter_{iteration}")

    def faulted(self):
        return self.fault_at is not None and self.iteration >= self.fault_at

    def stop_message(self, iteration, signum, saved):
        return f"stopped after {iteration}"

    def postfix(self, row):
        return {}


def _loop(tmp_path) -> RunLoop:
    return RunLoop("test", 4, MetricsLog(tmp_path, True, resume_after=None), plot=tmp_path / "curves.png")


def test_the_loop_says_how_it_ended_and_draws_the_curves_every_time(tmp_path):
    loop = _loop(tmp_path / "done")
    loop.run(Body(), start=0)
    assert loop.end == {"ended": "completed", "iteration": 4} and (tmp_path / "done" / "curves.png").is_file()

    loop = _loop(tmp_path / "fault")
    with pytest.raises(TrainingStopped):
        loop.run(Body(fault_at=2), start=0)
    assert loop.end == {"ended": "stopped", "stopped_by": "fault", "reason": "stopped after 2", "iteration": 2,
                        "checkpoint": "iter_2"}
    assert (tmp_path / "fault" / "curves.png").is_file()

    signals = StopSignals()
    signals.received = signal.SIGTERM
    loop = _loop(tmp_path / "signal")
    with pytest.raises(TrainingStopped):
        loop.run(Body(), start=0, signals=signals)
    assert loop.end["stopped_by"] == "SIGTERM" and loop.end["iteration"] == 1

    loop = _loop(tmp_path / "failed")
    with pytest.raises(RuntimeError, match="the engine died"):
        loop.run(Body(raise_at=3), start=0)
    assert {k: loop.end[k] for k in ("ended", "reason", "iteration", "failed_in")} == {
        "ended": "failed", "reason": "RuntimeError: the engine died", "iteration": 2, "failed_in": 3}
    assert loop.end["where"].startswith(__file__) and "(step)" in loop.end["where"]
    assert (tmp_path / "failed" / "curves.png").is_file()
    lines = (tmp_path / "failed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1, 2]


def test_a_plot_that_fails_after_a_failure_does_not_hide_it(tmp_path, monkeypatch, capsys):
    def broken(self, path):
        raise ValueError("no backend")

    monkeypatch.setattr(MetricsLog, "plot", broken)
    loop = _loop(tmp_path)
    with pytest.raises(RuntimeError, match="the engine died"):
        loop.run(Body(raise_at=2), start=0)
    assert "curves.png not drawn: ValueError: no backend" in capsys.readouterr().err


# -- textrl train --------------------------------------------------------------------------------


def test_a_run_that_skipped_updates_says_so_at_its_end_and_in_summary_json(tmp_path, monkeypatch, capsys):
    """Iterations 2 and 4: a NaN loss in every minibatch (2 steps skipped each); iteration 6: a step
    that leaves inf weights, rolled back (no streak reaches max_nonfinite_updates=3). The run
    finishes with status 0 and says which."""
    _nan_loss_at(monkeypatch, {1, 3})
    step = Backend.step

    def stepping(self, agent):
        if agent.iteration == 5:
            poison_next_step(agent.actor_optimizer)
        try:
            return step(self, agent)
        finally:
            vars(agent.actor_optimizer).pop("step", None)

    monkeypatch.setattr(Backend, "step", stepping)
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--iterations", "6", "--output-dir", str(out)]) == 0
    rows = _metrics(out)
    assert [r["nonfinite/skipped_updates"] for r in rows] == [0.0, 2.0, 0.0, 2.0, 0.0, 1.0]
    summary = _summary(out)
    assert summary["ended"] == "completed" and summary["iteration"] == 6 and "reason" not in summary
    assert summary["skipped_updates"] == {"count": 5.0, "iterations": [2, 4, 6], "rolled_back": [6],
                                          "of_iterations": 6}
    printed = capsys.readouterr().out
    assert ("skipped updates: 3 of the 6 iterations skipped NaN/inf updates (iterations 2, 4, 6: 5 minibatch steps "
            "or whole updates skipped; 1 updates rolled back)") in printed
    assert printed.index("held-out metric") < printed.index("skipped updates:")  # the closing lines


def test_a_clean_run_records_no_skipped_update(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--iterations", "1", "--output-dir", str(out)]) == 0
    assert _summary(out)["skipped_updates"] == {"count": 0.0, "iterations": [], "rolled_back": [], "of_iterations": 1}
    assert _summary(out)["ended"] == "completed" and "skipped updates" not in capsys.readouterr().out


def test_the_nonfinite_stop_writes_summary_and_curves_saying_where(tmp_path, monkeypatch, capsys):
    _nan_loss_at(monkeypatch, set(range(1, 10)))
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped) as stop:
        main(["train", *SMALL, "--iterations", "5", "--output-dir", str(out), "--checkpoint-every", "1",
              "--max-nonfinite-updates", "2"])
    assert stop.value.code == 1
    summary = _summary(out)
    assert {k: summary[k] for k in ("ended", "stopped_by", "iteration")} == {
        "ended": "stopped", "stopped_by": "fault", "iteration": 2}
    assert summary["reason"] == str(stop.value) and "2 consecutive updates were skipped for NaN/inf" in summary["reason"]
    assert summary["checkpoint"].endswith("iter_000002")
    assert summary["skipped_updates"]["iterations"] == [2]
    assert (out / "curves.png").is_file()
    assert [r["iteration"] for r in _metrics(out)] == [1, 2]  # no row twice
    captured = capsys.readouterr()
    assert captured.err.count("consecutive updates were skipped") == 1
    assert "held-out metric" not in captured.out  # no before / after table for a stopped run


def test_a_failure_in_the_loop_writes_summary_then_a_resume_replaces_it(tmp_path, monkeypatch, capsys):
    """An engine's failure in iteration 3 (after iteration 2's checkpoint): the run exits 1 with its
    one line, summary.json says failed in 3 after 2, curves.png is drawn; the resume writes rows
    3-4 once and its summary replaces the failure's."""
    import textrl.run.rollout as rollout

    collect = rollout.collect

    def failing(agent, batch, *args, **kwargs):
        if agent.iteration == 2:
            raise RuntimeError("the generation engine died")
        return collect(agent, batch, *args, **kwargs)

    monkeypatch.setattr(rollout, "collect", failing)
    out = tmp_path / "run"
    args = ["train", *SMALL, "--iterations", "4", "--output-dir", str(out), "--checkpoint-every", "1"]
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert "the generation engine died" in str(stop.value.code)
    summary = _summary(out)
    assert {k: summary[k] for k in ("ended", "reason", "iteration", "failed_in")} == {
        "ended": "failed", "reason": "RuntimeError: the generation engine died", "iteration": 2, "failed_in": 3}
    assert summary["where"].startswith(__file__)
    assert summary["peak_memory_mib"] and summary["skipped_updates"]["of_iterations"] == 2
    assert (out / "curves.png").is_file() and [r["iteration"] for r in _metrics(out)] == [1, 2]
    monkeypatch.setattr(rollout, "collect", collect)
    assert main([*args, "--resume"]) == 0
    assert [r["iteration"] for r in _metrics(out)] == [1, 2, 3, 4]
    summary = _summary(out)
    assert summary["ended"] == "completed" and summary["iteration"] == 4 and "reason" not in summary


def test_a_sigterm_stop_writes_summary_like_the_other_ends(tmp_path, monkeypatch):
    step = ppo_run.PPORun.step

    def signalled(self, iteration, timings):
        if iteration == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # finishes iteration 2, then stops with a checkpoint
        return step(self, iteration, timings)

    monkeypatch.setattr(ppo_run.PPORun, "step", signalled)
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped) as stop:
        main(["train", *SMALL, "--iterations", "4", "--output-dir", str(out)])
    assert stop.value.code == 128 + signal.SIGTERM
    summary = _summary(out)
    assert {k: summary[k] for k in ("ended", "stopped_by", "iteration")} == {
        "ended": "stopped", "stopped_by": "SIGTERM", "iteration": 2}
    assert summary["reason"].startswith("textrl train: stopped by SIGTERM after iteration 2 of 4")
    assert summary["checkpoint"].endswith("iter_000002") and (out / "curves.png").is_file()
    assert [r["iteration"] for r in _metrics(out)] == [1, 2]
