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
    from tensorboard.summary.writer import event_file_writer

    # The first run's event file ends in ...9 and the resumed one's in ...10 (the process's file
    # counter): in one second, name order alone would read the resumed file first.
    counter = event_file_writer._global_uid
    while counter.get() % 10 != 8:
        pass
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


def test_curves_label_the_kl_estimator_and_draw_a_negative_k1_curve():
    """curves.png's KL panel says which estimator ``kl/collection`` is (k1 is the mean log-ratio,
    which goes below 0) and draws the values, negative ones in view."""
    from textrl.run.metrics import curves_figure, kl_axis_label

    kl = [0.02, -0.03, -0.05, 0.01]
    rows = [{"iteration": i + 1, "reward/mean": 0.1 * i, "kl/collection": v} for i, v in enumerate(kl)]
    fig = curves_figure(rows, "k1")
    reward_ax, kl_ax = fig.axes
    assert kl_ax.get_ylabel() == "k1 estimate of KL(policy || ref) at collection\n(mean log-ratio; can be negative)"
    (curve, zero) = kl_ax.get_lines()
    assert list(curve.get_ydata()) == kl and list(zero.get_ydata()) == [0.0, 0.0]
    low, high = kl_ax.get_ylim()
    assert low <= min(kl) and high >= max(kl)
    assert reward_ax.get_lines()[0].get_ydata()[-1] == pytest.approx(0.3)
    assert kl_axis_label("k3").startswith("k3 estimate of KL(policy || ref) at collection\n(") and ">= 0" in kl_axis_label("k3")
    assert "KL(policy || ref)" in kl_axis_label(None)


def test_a_run_passes_its_kl_kind_to_the_curves(tmp_path):
    """MetricsLog keeps the estimator it is given for the label of the curves it plots."""
    log = MetricsLog(tmp_path, enabled=True, resume_after=None, kl_kind="k3")
    log.write({"iteration": 1, "reward/mean": 0.5, "kl/collection": 0.01})
    log.plot(tmp_path / "curves.png")
    log.close()
    assert log.kl_kind == "k3" and (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def strict_loads(line):
    """``json.loads`` as a strict JSON reader (jq, JavaScript's JSON.parse): no NaN / Infinity."""
    def reject(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(line, parse_constant=reject)


def test_non_finite_values_are_written_as_strict_json_and_read_back_as_nan(tmp_path):
    """``explained_variance`` is NaN when the returns are constant: metrics.jsonl holds null, which
    every JSON reader takes, and a resume (and the bench's reader) reads it back as NaN."""
    import math

    from textrl.bench.jobs import read_run

    log = MetricsLog(tmp_path, enabled=True, resume_after=None)
    bad = {"explained_variance": float("nan"), "loss/value": float("inf"), "kl/collection": float("-inf")}
    log.write({"iteration": 1, "reward/mean": 0.5, **bad, "time/iteration_s": 1.0, "tokens": 4})
    log.write({"iteration": 2, "reward/mean": 0.25, "explained_variance": 0.5, "kl/before_update": float("nan"),
               "time/iteration_s": 1.0, "tokens": 4})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first = strict_loads(lines[0])
    assert [first[k] for k in bad] == [None, None, None] and first["reward/mean"] == 0.5
    assert strict_loads(lines[1])["explained_variance"] == 0.5

    resumed = MetricsLog(tmp_path, enabled=True, resume_after=2)
    resumed.close()
    assert all(math.isnan(resumed.rows[0][k]) for k in bad) and resumed.rows[1]["explained_variance"] == 0.5
    assert all(strict_loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())  # rewritten strict

    (tmp_path / "summary.json").write_text("{}")
    figures = read_run(tmp_path)  # the bench's reader: a number, NaN, not None
    assert isinstance(figures["kl"], float) and math.isnan(figures["kl"]) and figures["train_reward"] == [0.5, 0.25]


def test_the_samples_log_is_strict_json_and_an_older_bare_nan_still_reads(tmp_path):
    import math

    from textrl.run.metrics import rows_up_to

    SamplesLog(tmp_path, enabled=True, resume_after=None).write(0, [{"prompt": "p", "completion": "c",
                                                                      "score": float("nan")}])
    assert strict_loads((tmp_path / "samples.jsonl").read_text())["score"] is None
    old = tmp_path / "old.jsonl"
    old.write_text('{"iteration": 1, "explained_variance": NaN}\n')  # written by an older textrl
    assert math.isnan(rows_up_to(old, 1)[0]["explained_variance"])


def test_the_curves_show_the_evaluation_before_training_at_iteration_0(tmp_path, monkeypatch):
    """curves.png's held-out line starts at iteration 0 with eval_before.json's reward."""
    from textrl.run.metrics import EVAL_BEFORE_FILE, curves_figure

    (tmp_path / EVAL_BEFORE_FILE).write_text(json.dumps({"eval/sampled/reward/mean": 0.125,
                                                         "eval/greedy/reward/mean": 0.25}))
    log = MetricsLog(tmp_path, enabled=True, resume_after=None)
    for i in (1, 2):
        log.write({"iteration": i, "reward/mean": 0.5, "kl/collection": 0.0,
                   **({"eval/sampled/reward/mean": 0.75} if i == 2 else {})})
    import matplotlib.pyplot as plt

    import textrl.run.metrics as metrics

    figures = []
    monkeypatch.setattr(metrics, "curves_figure", lambda *a, **k: figures.append(curves_figure(*a, **k)) or figures[-1])
    log.plot(tmp_path / "curves.png")  # the figure MetricsLog saves as curves.png
    log.close()
    reward_ax = figures[0].axes[0]
    held_out = next(line for line in reward_ax.get_lines() if line.get_label() == "held-out (sampled)")
    assert list(held_out.get_xdata()) == [0, 2] and list(held_out.get_ydata()) == [0.125, 0.75]
    plt.close(figures[0])
    # without eval_before.json (a run with no evaluation): the line as before
    fig = curves_figure(log.rows)
    (rollout, held_out) = fig.axes[0].get_lines()
    assert list(held_out.get_xdata()) == [2]
    plt.close(fig)
