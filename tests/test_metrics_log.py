"""The run's JSON-lines logs and TensorBoard across a resume: a torn last line is dropped with a
warning, a bad earlier line is named, and TensorBoard shows each iteration once."""

from __future__ import annotations

import json

import pytest

from textrl.run import MetricsLog, SamplesLog
from textrl.run.metrics import rows_up_to


def write_rows(path, iterations, torn=""):
    path.write_text("".join(json.dumps({"iteration": i, "reward/mean": float(i)}) + "\n" for i in iterations) + torn)


def test_a_torn_last_line_is_dropped_with_a_warning_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_rows(path, [1, 2, 3], torn='{"iteration": 4, "rew')  # a full disk while appending row 4
    with pytest.warns(UserWarning, match=r"metrics.jsonl: dropped its last line 4, torn by an interrupted write"):
        log = MetricsLog(tmp_path, enabled=True, resume_after=3)
    log.close()
    assert [r["iteration"] for r in log.rows] == [1, 2, 3]
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_a_bad_line_before_the_last_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1}\nnot json\n{"iteration": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not a JSON row with an 'iteration'.*repair or delete"):
        rows_up_to(path, 2)


def test_samples_keep_the_lines_up_to_the_resumed_iteration_and_drop_a_torn_one(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"iteration": 0, "prompt": "p", "completion": "c"}\n'
                    '{"iteration": 2, "prompt": "p", "completion": "c"}\n{"iteration": 4, "pro')
    with pytest.warns(UserWarning, match="torn"):
        SamplesLog(tmp_path, enabled=True, resume_after=1)
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [0]


def test_tensorboard_shows_each_iteration_once_after_a_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLog(tmp_path, enabled=True, resume_after=None)
    for i in (1, 2, 3):  # the run stopped after iteration 3, its newest checkpoint is iteration 2
        first.write({"iteration": i, "reward/mean": float(i)})
    first.close()
    resumed = MetricsLog(tmp_path, enabled=True, resume_after=2)
    for i in (3, 4):
        resumed.write({"iteration": i, "reward/mean": 10.0 * i})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Scalars("reward/mean")
    assert [(s.step, s.value) for s in scalars] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
