"""textrl.run.RunLoop: the one loop driver of `textrl train` and the stages (cadence, rows, the stop)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from textrl.run import MetricsLog, RunLoop, StopSignals, TrainingStopped


class Body:
    """A LoopBody that records what the loop asked of it; faults from iteration ``fault_at``."""

    def __init__(self, fault_at: int | None = None) -> None:
        self.fault_at = fault_at
        self.calls: list[tuple] = []
        self.iteration = 0

    def step(self, iteration, timings):
        self.iteration = iteration
        timings["work"] = 0.0
        return {"iteration": iteration, "tokens": 8.0}

    def evaluate(self, iteration, timings):
        self.calls.append(("evaluate", iteration))
        return {"eval/score": float(iteration)}

    def checkpoint(self, iteration, stopping):
        self.calls.append(("checkpoint", iteration, stopping))
        return Path(f"iter_{iteration}")

    def faulted(self):
        return self.fault_at is not None and self.iteration >= self.fault_at

    def stop_message(self, iteration, signum, saved):
        return f"stopped after {iteration} (signal {signum}), saved {saved}"

    def postfix(self, row):
        return {}


def _loop(tmp_path, resume_after=None, **options) -> RunLoop:
    return RunLoop("test", 5, MetricsLog(tmp_path, True, resume_after=resume_after), eval_every=2,
                   checkpoint_every=2, **options)


def _rows(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("checkpoint_last, saved", [(True, [2, 4, 5]), (False, [2, 4])])
def test_evaluation_and_checkpoints_every_n_and_at_the_end(tmp_path, checkpoint_last, saved):
    body = Body()
    _loop(tmp_path, checkpoint_last=checkpoint_last, throughput="tokens").run(body, start=0)
    assert [c[1] for c in body.calls if c[0] == "evaluate"] == [2, 4, 5]
    assert [c[1] for c in body.calls if c[0] == "checkpoint"] == saved
    assert all(not c[2] for c in body.calls if c[0] == "checkpoint")
    rows = _rows(tmp_path)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
    assert ["eval/score" in r for r in rows] == [False, True, False, True, True]
    for row in rows:
        assert row["time/work_s"] == 0.0 and row["time/iteration_s"] > 0
        assert row["tokens_per_second"] == pytest.approx(8.0 / row["time/iteration_s"])


def test_a_resumed_loop_continues_after_its_start_and_keeps_earlier_rows(tmp_path):
    _loop(tmp_path).run(Body(), start=0)
    body = Body()
    loop = _loop(tmp_path, resume_after=3, timing="step", evaluates=False)
    loop.run(body, start=3)
    assert [r["iteration"] for r in _rows(tmp_path)] == [1, 2, 3, 4, 5]
    assert "time/step_s" in _rows(tmp_path)[-1] and "tokens_per_second" not in _rows(tmp_path)[-1]
    assert body.calls == [("checkpoint", 4, False), ("checkpoint", 5, False)]  # evaluates=False: none


def test_a_fault_saves_then_stops_with_status_1(tmp_path, capsys):
    body = Body(fault_at=3)
    with pytest.raises(TrainingStopped, match="stopped after 3 .*saved iter_3") as stop:
        _loop(tmp_path).run(body, start=0)
    assert stop.value.code == 1
    assert body.calls[-1] == ("checkpoint", 3, True)
    assert "stopped after 3" in capsys.readouterr().err
    assert [r["iteration"] for r in _rows(tmp_path)] == [1, 2, 3]


@pytest.mark.parametrize("start, stops", [(0, True), (4, False)])
def test_a_signal_stops_after_the_current_iteration_unless_it_is_the_last(tmp_path, start, stops):
    body, signals = Body(), StopSignals()
    signals.received = signal.SIGTERM
    loop = _loop(tmp_path, resume_after=start or None)
    if not stops:
        loop.run(body, start=start, signals=signals)
        assert body.calls[-1] == ("checkpoint", 5, False)
        return
    with pytest.raises(TrainingStopped) as stop:
        loop.run(body, start=start, signals=signals)
    assert stop.value.code == 128 + signal.SIGTERM
    assert body.calls == [("checkpoint", 1, True)]
