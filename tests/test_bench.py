"""textrl.bench: statistics wiring on fabricated run records, resumability, the folder lock, bad
input, and one tiny end-to-end comparison (2 agents x 2 environments, one of them multi-turn)."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from textrl import bench
from textrl.bench import compare as bench_compare
from textrl.bench import compare_agents, main
from textrl.bench import jobs as bench_runs
from textrl.bench import report as bench_report

TINY = dict(
    prompts_per_iteration=2, n_samples_per_prompt=2, max_new_tokens=8, eval_size=4,
    warmup_sft_steps=5, warmup_sft_batch_size=4, eval_every=0, ppo_epochs=1, num_minibatches=1,
)
QUIET = dict(log=lambda *a: None)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))


def record(agent, env, seed, reward, start=0.5, error=None):
    """A fabricated finished run (or a failed one with ``error``)."""
    if error:
        return {"agent": agent, "env": env, "seed": seed, "error": error}
    return {"agent": agent, "env": env, "seed": seed, "error": None, "reward": reward, "reward_start": start,
            "reward_change": reward - start, "iterations": [1, 2], "train_reward": [start, reward],
            "tokens_so_far": [100, 200], "tokens": 200}


# -- normalisation -------------------------------------------------------------------------------


def test_normalised_score_is_the_share_of_the_gap_closed():
    assert bench_report.normalised_score(1.5, 0.5, 2.5) == pytest.approx(0.5)
    assert bench_report.normalised_score(0.5, 0.5, 2.5) == 0.0
    assert bench_report.normalised_score(2.5, 0.5, 2.5) == 1.0
    assert bench_report.normalised_score(0.0, 0.5, 2.5) == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="does not exceed start"):
        bench_report.normalised_score(1.0, 2.5, 2.5)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 0.5)), min_size=4, max_size=4))
def test_normalised_scores_match_a_reference_loop(values):
    """2 agents x 2 seeds on an env with max_reward 1 and one without (high = best final there)."""
    runs = []
    for i, (agent, seed) in enumerate([("a", 0), ("a", 1), ("b", 0), ("b", 1)]):
        final, start = values[i]
        runs += [record(agent, "known", seed, final, start), record(agent, "unknown", seed, final + 1.0, start)]
    out = bench_report.normalised_scores(runs, ["a", "b"], ["known", "unknown"], [0, 1],
                                         {"known": 1.0, "unknown": None})
    best = max(v[0] for v in values) + 1.0
    for agent, rows in (("a", values[:2]), ("b", values[2:])):
        expected = [[(f - s) / (1.0 - s), (f + 1.0 - s) / (best - s)] for f, s in rows]
        np.testing.assert_allclose(out["scores"][agent], expected)
    assert out["highs"] == {"known": (1.0, "max_reward"), "unknown": (best, "best run")}


def test_failed_runs_and_gapless_envs_are_left_out_with_a_note():
    runs = [record("a", "e", 0, 1.0), record("a", "e", 1, 0.9, error="exit 1: boom"),
            record("b", "e", 0, 0.7), record("b", "e", 1, 0.8),
            record("a", "flat", 0, 0.5, start=1.0), record("a", "flat", 1, 0.5, start=1.0),
            record("b", "flat", 0, 0.5, start=1.0), record("b", "flat", 1, 0.5, start=1.0)]
    out = bench_report.normalised_scores(runs, ["a", "b"], ["e", "flat"], [0, 1], {"e": 2.0, "flat": 1.0})
    assert out["envs"] == ["e"] and out["seeds"] == {"a": [0], "b": [0, 1]}
    np.testing.assert_allclose(out["scores"]["a"], [[(1.0 - 0.5) / 1.5]])
    assert any("`flat` is left out" in n for n in out["notes"])
    assert any("`a`: seed(s) [1] left out" in n for n in out["notes"])


def test_runs_of_one_env_and_seed_that_measured_different_starts_are_noted():
    runs = [record("a", "e", 0, 1.0, start=0.5), record("b", "e", 0, 1.0, start=0.25), record("a", "e", 1, 1.0)]
    (note,) = bench_report.start_disagreements(runs)
    assert note.startswith("`e` seed 0: its runs measured different start rewards [0.25, 0.5]")


# -- the report's verdicts -----------------------------------------------------------------------


def fabricated_comparison(rng_seed=0):
    """``strong`` closes ~80% of the gap, ``weak`` and ``weak2`` ~0%: 6 seeds x 2 envs."""
    rng = np.random.default_rng(rng_seed)
    runs = []
    for agent, level in (("strong", 0.8), ("weak", 0.0), ("weak2", 0.0)):
        for env in ("digits", "guess_number"):
            for seed in range(6):
                runs.append(record(agent, env, seed, 0.5 + 0.5 * (level + rng.normal(0, 0.05))))
    return runs


def test_report_names_significant_and_non_significant_differences():
    runs = fabricated_comparison()
    envs, agents = ["digits", "guess_number"], ["strong", "weak", "weak2"]
    normalised = bench_report.normalised_scores(runs, agents, envs, range(6), {e: 1.0 for e in envs})
    report = bench_report.compare_scores(normalised, reps=500)
    verdicts = {(p["x"], p["y"]): p["verdict"] for p in report["pairs"]}
    assert verdicts == {("strong", "weak"): "strong better", ("strong", "weak2"): "strong better",
                        ("weak", "weak2"): "not distinguishable"}
    text = bench_report.markdown("set-up line", runs, envs, normalised, report)
    assert "- **Significant**: `strong` beats `weak`" in text
    assert "- **Significant**: `strong` beats `weak2`" in text
    assert "- Not significant: `weak` vs `weak2` (both intervals include no difference; exact rank test p = " in text
    assert "- A verdict needs" not in text  # 6 seeds on 2 environments are enough (3 are needed)
    assert "## Raw results on `guess_number`" in text and "| `strong` | 6 |" in text
    assert report["per_task"]["strong"]["digits"]["low"] > 0.7  # per-env mean with its interval


def test_plots_are_written(tmp_path):
    runs = fabricated_comparison()
    envs = ["digits", "guess_number"]
    normalised = bench_report.normalised_scores(runs, ["strong", "weak"], envs, range(6), {e: 1.0 for e in envs})
    report = bench_report.compare_scores(normalised, reps=100)
    paths = bench_report.write_plots(runs, envs, report, tmp_path)
    assert [p.name for p in paths] == ["learning_curves.png", "intervals.png", "profiles.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def _report_of(levels, seeds=3, envs=("digits",)):
    """The statistics of fabricated runs: agent -> the normalised score it reaches (noise 0.05)."""
    rng = np.random.default_rng(1)
    runs = [record(agent, env, seed, 0.5 + 0.5 * (level + rng.normal(0, 0.05)))
            for agent, level in levels.items() for env in envs for seed in range(seeds)]
    normalised = bench_report.normalised_scores(runs, list(levels), list(envs), range(seeds), {e: 1.0 for e in envs})
    return bench_report.compare_scores(normalised, reps=100), normalised


def test_profiles_show_the_drop_when_every_score_is_below_zero():
    report, normalised = _report_of({"gae_ppo": -0.6, "rloo": -0.3})
    scores = np.concatenate([a.ravel() for a in normalised["scores"].values()])
    assert scores.max() < 0
    fig = bench_report.profile_figure(report)
    (ax,) = fig.axes
    low, high = ax.get_xlim()
    assert low < scores.min() and high >= 1.0  # every score, and the 0..1 range, in view
    lines = [line for line in ax.get_lines() if line.get_label() in report["agents"]]
    assert len(lines) == 2
    for line in lines:
        x, y = np.asarray(line.get_xdata()), np.asarray(line.get_ydata())
        assert low <= x.min() and x.max() <= high
        assert y[0] == 1.0 and y[-1] == 0.0  # the whole fall of the profile is drawn, below tau = 0
        assert x[np.argmax(y < 1.0)] < 0
    assert len(ax.collections) == 2  # the bootstrap bands


def test_profile_taus_span_every_score():
    from textrl.bench.stats import DEFAULT_TAUS

    assert bench_report.profile_taus({"a": np.array([[0.2], [0.7]])}) == list(DEFAULT_TAUS)  # 0..1 as before
    assert bench_report.profile_taus({"a": np.array([[0.0], [0.7]])})[:2] == [-0.05, 0.0]  # 0 itself is counted
    taus = bench_report.profile_taus({"a": np.array([[-2.3]]), "b": np.array([[1.6]])})
    assert taus[0] < -2.3 and taus[-1] >= 1.6 and len(taus) <= 201
    assert all(b > a for a, b in zip(taus, taus[1:]))


def _text_boxes(fig):
    """Every visible, non-empty text of ``fig`` (tick labels, titles, axis labels) and its box."""
    renderer = fig.canvas.get_renderer()

    def shown(ax, labels, axis):  # tick labels whose tick lies within the view (those are drawn)
        low, high = sorted(ax.get_xlim() if axis == 0 else ax.get_ylim())
        return [t for t in labels if low - 1e-9 <= t.get_position()[axis] <= high + 1e-9]

    texts = [t for ax in fig.axes for t in (*shown(ax, ax.get_xticklabels(), 0), *shown(ax, ax.get_yticklabels(), 1),
                                            ax.title, ax.xaxis.label, ax.yaxis.label)]
    texts += [fig._suptitle] if fig._suptitle is not None else []
    return [(t.get_text(), t.get_window_extent(renderer)) for t in texts if t.get_visible() and t.get_text()]


@pytest.mark.parametrize("agents", [["gae_ppo", "rloo"],
                                    ["gae_ppo", "one_step_ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "remax",
                                     "cispo", "gspo", "dapo", "vapo", "multi_adapter_ppo", "MyVeryLongAgentClassName",
                                     "prime", "opo", "sapo"]])
def test_interval_labels_neither_overlap_nor_leave_the_figure(agents):
    report, _ = _report_of({a: 0.1 * (i % 7) - 0.2 for i, a in enumerate(agents)}, envs=("digits", "arithmetic"))
    fig = bench_report.interval_figure(report)
    fig.canvas.draw()
    boxes = _text_boxes(fig)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == agents
    whole = fig.bbox
    for text, box in boxes:
        assert whole.x0 <= box.x0 and box.x1 <= whole.x1 and whole.y0 <= box.y0 and box.y1 <= whole.y1, text
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1:]:
            assert not box_a.overlaps(box_b), (a, b)
    for ax in fig.axes:  # every agent drawn in every panel
        assert len(ax.patches) == len(agents) and len(ax.get_lines()) == len(agents)


def test_intervals_of_one_seed_say_they_are_points():
    report, _ = _report_of({"gae_ppo": 0.3, "rloo": 0.4}, seeds=1)
    fig = bench_report.interval_figure(report)
    assert fig._suptitle.get_text() == "point estimates (one run per agent: no interval)"
    assert all(len(ax.patches) == 0 and len(ax.get_lines()) == 2 for ax in fig.axes)
    many, _ = _report_of({"gae_ppo": 0.3, "rloo": 0.4}, seeds=3)
    assert bench_report.interval_figure(many)._suptitle.get_text() == "95% stratified-bootstrap intervals"


# -- resumability, failures and the lock (a fake trainer: no training) ---------------------------


@pytest.fixture
def fake_training(monkeypatch):
    """Replace training and the warm-up by writers of plausible outputs; count the calls."""
    calls = {"runs": [], "warmups": []}

    def train(config, threads):
        if config.agent == "rloo" and config.seed == 1:
            raise RuntimeError("fake failure")
        calls["runs"].append((config.agent, config.env, config.seed))
        out = Path(config.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        final = {"gae_ppo": 0.6, "grpo": 0.9}.get(config.agent, 0.5) + 0.01 * config.seed
        rows = [{"iteration": i, "time/iteration_s": 0.1, "tokens": 32, "reward/mean": final}
                for i in range(1, config.iterations + 1)]
        (out / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        (out / "summary.json").write_text(json.dumps({"before": {"eval/sampled/reward/mean": 0.5},
                                                      "after": {"eval/sampled/reward/mean": final}}))

    def warm(config, folder, log=print, threads=None):
        calls["warmups"].append((config.env, config.seed))
        (Path(folder) / "config.json").write_text("{}")
        return str(folder)

    monkeypatch.setattr(bench_compare, "_train", train)
    monkeypatch.setattr(bench_compare, "warm_start", warm)
    monkeypatch.setattr(bench_report, "write_plots", lambda *a: [])  # tested on their own above
    return calls


def fake_compare(out, agents=("gae_ppo", "grpo"), **extra):
    lines = []
    result = compare_agents(list(agents), [0, 1], out, envs=["digits", "guess_number"], isolate=False, reps=50,
                            token_budget=256, log=lambda *a: lines.append(" ".join(map(str, a))), **{**TINY, **extra})
    return result, "\n".join(lines)


def test_a_second_invocation_reruns_nothing_and_a_changed_setting_reruns(tmp_path, fake_training):
    out = tmp_path / "bench"
    fake_compare(out)
    assert len(fake_training["runs"]) == 8 and len(fake_training["warmups"]) == 4
    record_file = out / "runs" / "digits" / "gae_ppo" / "seed0" / bench_runs.RECORD
    mtime = record_file.stat().st_mtime_ns
    result, log = fake_compare(out)
    assert len(fake_training["runs"]) == 8 and len(fake_training["warmups"]) == 4
    assert record_file.stat().st_mtime_ns == mtime and "reused" in log
    pair = result["report"]["pairs"][0]  # figures read back from the folders: grpo above gae_ppo in every run
    assert pair["probability_of_improvement"]["point"] == 0.0 and pair["verdict"] == "not enough runs"
    _, log = fake_compare(out, actor_lr=1e-3)  # a run setting: every run again, the warm-ups reused
    assert len(fake_training["runs"]) == 16 and len(fake_training["warmups"]) == 4
    assert "its config changed, rerunning" in log
    fake_compare(out, actor_lr=1e-3, fresh=True)
    assert len(fake_training["runs"]) == 24 and len(fake_training["warmups"]) == 8


def test_a_killed_run_is_rerun_alone(tmp_path, fake_training):
    out = tmp_path / "bench"
    fake_compare(out)
    (out / "runs" / "guess_number" / "grpo" / "seed1" / bench_runs.RECORD).unlink()  # killed before its record
    _, log = fake_compare(out)
    assert fake_training["runs"][8:] == [("grpo", "guess_number", 1)]
    assert "incomplete (killed or failed), rerunning" in log


def test_a_failed_run_is_reported_and_the_others_go_on(tmp_path, fake_training):
    result, _ = fake_compare(tmp_path / "bench", agents=("gae_ppo", "rloo"))
    failed = [r for r in result["runs"] if r["error"]]
    assert {(r["agent"], r["seed"]) for r in failed} == {("rloo", 1)} and len(failed) == 2
    assert "RuntimeError: fake failure" in failed[0]["error"]
    assert len(fake_training["runs"]) == 6
    assert "`rloo` failed: seed 1: RuntimeError: fake failure" in result["markdown"]
    assert result["normalisation"]["seeds"] == {"gae_ppo": [0, 1], "rloo": [0]}


def test_a_second_bench_on_the_same_folder_is_refused(tmp_path, fake_training, capsys):
    from textrl.run.lock import RunFolderLock

    out = tmp_path / "bench"
    with RunFolderLock(out):  # what a running `textrl bench` holds
        assert main(["--agents", "gae_ppo", "--envs", "digits", "--seeds", "0", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is in use by process" in err and "choose another --output-dir" in err
    assert not (out / "runs").exists() and not fake_training["runs"]


def test_deleted_outputs_are_rerun_not_reused_forever(tmp_path, fake_training):
    out = tmp_path / "bench"
    fake_compare(out)
    (out / "runs" / "digits" / "grpo" / "seed0" / "metrics.jsonl").unlink()  # a run's outputs deleted
    _, log = fake_compare(out)
    assert fake_training["runs"][8:] == [("grpo", "digits", 0)] and len(fake_training["warmups"]) == 4
    assert "finished, but its outputs were deleted or changed, rerunning" in log
    (out / "warmup" / "guess_number" / "seed1" / "config.json").unlink()  # a warm-up's policy deleted
    _, log = fake_compare(out)
    assert fake_training["warmups"][4:] == [("guess_number", 1)]  # the warm-up again, and every run on it
    assert sorted(fake_training["runs"][9:]) == [("gae_ppo", "guess_number", 1), ("grpo", "guess_number", 1)]
    assert "its warm-up was rerun, rerunning" in log
    fake_compare(out)
    assert len(fake_training["runs"]) == 11  # then reused again


@pytest.mark.parametrize("text, what", [("[]", "is a JSON list, not a bench record"),
                                        ('{"wall_s": 1}', "is an object without a fingerprint"),
                                        ('{"fingerp', "is not valid JSON")])
def test_a_malformed_record_is_one_line_naming_the_file(tmp_path, fake_training, capsys, text, what):
    out = tmp_path / "bench"
    args = ["--agents", "gae_ppo", "--envs", "digits", "--seeds", "0", "--in-process", "--token-budget", "64",
            "--output-dir", str(out)] + [a for k, v in TINY.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    assert main(args) == 0
    record_file = out / "runs" / "digits" / "gae_ppo" / "seed0" / bench_runs.RECORD
    record_file.write_text(text)
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"textrl bench: {record_file} {what}") and err.count("\n") == 1
    assert "delete it (or pass --fresh)" in err and record_file.read_text() == text  # nothing touched
    assert main([*args, "--fresh"]) == 0 and bench_runs.read_record(record_file.parent)["fingerprint"]


def test_a_failed_run_makes_the_command_exit_1_naming_the_job_and_its_log(tmp_path, fake_training, capsys):
    out = tmp_path / "bench"
    args = ["--agents", "gae_ppo,rloo", "--envs", "digits", "--seeds", "0,1", "--in-process", "--token-budget",
            "64", "--output-dir", str(out)] + [a for k, v in TINY.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    assert main(args) == 1  # fake_training fails rloo on seed 1
    err = capsys.readouterr().err
    failed = out / "runs" / "digits" / "rloo" / "seed1"
    assert err.startswith("textrl bench: 1 of 4 runs failed, left out of the report: ") and err.count("\n") == 1
    assert str(failed) in err and "rerun the same command to retry only these" in err
    assert (out / "report.md").is_file()  # the report of the others is still written
    assert json.loads((out / "results.json").read_text())["failed"] == err.removeprefix("textrl bench: ").strip()


def test_the_failure_summary_names_a_failed_warm_up_once_with_its_log(tmp_path):
    warm = tmp_path / "warmup" / "digits" / "seed0"
    warm.mkdir(parents=True)
    (warm / bench_runs.LOG_FILE).write_text("boom\n")
    runs = [{**record(a, "digits", 0, 0, error="its warm-up failed: exit 1: boom"), "output_dir": f"runs/{a}",
             "failed_job": str(warm)} for a in ("gae_ppo", "rloo")]
    line = bench.failure_summary(runs + [record("grpo", "digits", 1, 1.0)])
    assert line.startswith("2 of 3 runs failed") and line.count(str(warm)) == 2  # the folder and its log
    assert f"(the warm-up of 2 runs; log {warm / bench_runs.LOG_FILE})" in line
    assert bench.failure_summary([record("grpo", "digits", 1, 1.0)]) is None


def test_an_edited_user_file_changes_the_job_key(tmp_path):
    reward = tmp_path / "my_rewards.py"
    reward.write_text("def brevity(prompts, completions, **kwargs):\n    return [0.0] * len(completions)\n")
    described = {"agent": "rloo", "reward": f"think_format,{reward}:brevity:0.5", "env": "digits"}
    key = bench.job_key(described)
    assert bench.job_key(dict(described)) == key
    assert bench.job_key({"agent": "rloo", "env": "digits"}) == bench_runs.fingerprint({"agent": "rloo", "env": "digits"})
    reward.write_text(reward.read_text() + "# edited\n")
    assert bench.job_key(described) != key


def test_an_edited_reward_file_reruns_its_jobs(tmp_path, fake_training):
    reward = tmp_path / "my_rewards.py"
    reward.write_text("def brevity(prompts, completions, **kwargs):\n    return [0.0] * len(completions)\n")
    out = tmp_path / "bench"
    fake_compare(out, reward=f"{reward}:brevity")
    fake_compare(out, reward=f"{reward}:brevity")
    assert len(fake_training["runs"]) == 8 and len(fake_training["warmups"]) == 4
    reward.write_text(reward.read_text().replace("0.0", "1.0"))
    _, log = fake_compare(out, reward=f"{reward}:brevity")
    assert len(fake_training["runs"]) == 16 and len(fake_training["warmups"]) == 8
    assert "its config changed, rerunning" in log


# -- one writer per job folder: locks and workers that die with the bench ------------------------

HOLD = """
import sys, time
from textrl.bench import jobs as bench_runs
with bench_runs.JobLock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_job_folder_held_by_a_live_worker_is_refused_naming_it(tmp_path):
    import subprocess
    import sys

    folder = tmp_path / "runs" / "digits" / "rloo" / "seed0"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(bench_runs.JobBusy, match=rf"in use by process {holder.pid} .*kill {holder.pid}"):
            bench_runs.refuse_busy_jobs([tmp_path / "elsewhere", folder], wait_s=0.3)
        with pytest.raises(bench_runs.JobBusy):
            bench_runs.prepare(folder, {"kind": "run"})  # nothing is emptied under a live writer
    finally:
        holder.kill()
        holder.wait()
    bench_runs.refuse_busy_jobs([folder], wait_s=0.3)  # its lock went with it
    assert bench_runs.prepare(folder, {"kind": "run"}).is_file()


PARENT = """
import os, subprocess, sys, time
from textrl.bench import jobs as bench_runs
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**os.environ, bench_runs.PARENT_ENV: str(os.getpid())})
print(child.pid, flush=True)
time.sleep(60)
"""
CHILD = """
import os, time
from textrl.bench import jobs as bench_runs
bench_runs.die_with_parent(int(os.environ[bench_runs.PARENT_ENV]))
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_dies_when_its_bench_is_killed(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(1.0)  # the child has imported and asked to die with its parent
    assert _alive(child)
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_worker_whose_bench_is_already_gone_exits(tmp_path):
    import subprocess
    import sys

    code = "from textrl.bench import jobs as bench_runs; bench_runs.die_with_parent(1); print('still here')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "still here" not in proc.stdout


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("args, culprit", [
    (["--envs", "digits,no_such_env"], "environment 'no_such_env': unknown environment"),
    (["--agents", "gae_ppo,no_such_agent"], "agent='no_such_agent': must be one of"),
    (["--seeds", ""], "seeds is empty"),
    (["--envs", ","], "envs is empty"),
    (["--seed", "1"], "--seed is set per run by the comparison; use --seeds"),
    (["--jobs", "0"], "--jobs 0: give at least 1"),
    (["--token-budget", "-5"], "token_budget=-5: must be an int >= 1"),
    (["--reps", "0"], "reps=0: must be an int >= 1"),
    (["--seeds", "0,1,0"], "seeds [0, 1, 0]: seed(s) [0] repeated; give each seed once"),
])
def test_bad_input_is_one_line_naming_the_culprit(tmp_path, capsys, args, culprit):
    assert main([*args, "--output-dir", str(tmp_path / "bench")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("textrl bench: ") and culprit in err and err.count("\n") == 1
    assert not (tmp_path / "bench").exists()


def test_an_env_without_max_reward_is_normalised_by_the_best_run():
    assert bench.describe_envs(["reward_model"], {})["reward_model"]["max_reward"] is None
    assert bench.describe_envs(["digits"], {"reward": "accuracy"})["digits"]["max_reward"] is None  # another reward
    assert bench.describe_envs(["digits"], {})["digits"] == {"max_turns": 1, "max_reward": 2.5}


def test_iterations_spend_the_same_token_budget_per_episode_cap():
    from textrl.config import TrainConfig

    config = TrainConfig(**TINY)  # 4 episodes of at most 8 tokens a turn
    assert bench.iterations_for(320, config, max_turns=1) == 10
    assert bench.iterations_for(320, config, max_turns=4) == 3  # ceil(320 / 128)
    assert bench.iterations_for(320, TrainConfig(**TINY, max_episode_tokens=16), max_turns=4) == 5


# -- arms: agents x max_staleness x rollout_correction (asynchronous-RL variants) ----------------


def _plan_of(agents, output_dir, seeds=(0, 1), envs=("digits",), **axes):
    """The plan of ``agents`` (crossed with ``axes``: ``max_staleness``, ``rollout_correction``)
    as :func:`compare_agents` makes it, without running anything."""
    from textrl.bench import plan as bench_plan

    common = bench_plan.run_settings(TINY)
    names, _ = bench_plan.resolve_agents(list(agents), common)
    arms, skipped = bench_plan.resolve_arms(names, common, axes.get("max_staleness"), axes.get("rollout_correction"))
    env_info = bench_plan.describe_envs(list(envs), common)
    return bench_plan.plan(arms, env_info, list(seeds), output_dir, TINY, 256, True), arms, skipped


def test_arms_have_their_labels_folders_and_configs_and_share_the_warm_ups(tmp_path):
    from textrl.bench.plan import arm_label

    jobs, arms, skipped = _plan_of(["grpo", "rloo"], tmp_path, max_staleness=[0, 1, 4],
                                   rollout_correction=["none", "tis"])
    labels = [arm.label for arm in arms]
    assert labels == [f"{a}@K{k}+{c}" for a in ("grpo", "rloo") for k in (0, 1, 4) for c in ("none", "tis")]
    assert not skipped and all(re.fullmatch(r"[A-Za-z0-9_.@+-]+", label) for label in labels)  # safe folder names
    runs = jobs["runs"]
    assert len(runs) == 12 * 2 and len(jobs["warmups"]) == 2  # one warm-up per (env, seed), shared by every arm
    for run in runs:
        arm, config = run["arm"], run["config"]
        assert run["agent"] == arm.label
        assert run["folder"] == tmp_path / "runs" / "digits" / arm.label / f"seed{run['seed']}"
        assert (config.agent, config.max_staleness, config.rollout_correction) == (arm.agent, arm.max_staleness,
                                                                                   arm.rollout_correction)
        assert run["warmup"] == tmp_path / "warmup" / "digits" / f"seed{run['seed']}"
        assert config.model == str(run["warmup"]) and config.warmup_sft_steps == 0
    assert len({run["config"].iterations for run in runs}) == 1  # the same token budget for every arm
    assert len({run["fingerprint"] for run in runs}) == len(runs)
    # one axis alone labels by that axis only
    assert [a.label for a in _plan_of(["grpo"], tmp_path, max_staleness=[0, 1])[1]] == ["grpo@K0", "grpo@K1"]
    assert [a.label for a in _plan_of(["grpo"], tmp_path, rollout_correction=["tis"])[1]] == ["grpo+tis"]
    assert arm_label("my_agents.py:MyGRPO", 2, "icepop") == "MyGRPO@K2+icepop"


def test_without_the_axes_the_plan_is_the_agents_plan(tmp_path):
    from textrl.bench.plan import Arm, job_key

    jobs, arms, _ = _plan_of(["gae_ppo", "grpo"], tmp_path)
    assert arms == [Arm("gae_ppo"), Arm("grpo")] and [a.label for a in arms] == ["gae_ppo", "grpo"]
    from textrl.bench import plan as bench_plan

    env_info = bench_plan.describe_envs(["digits"], {})
    plain = bench_plan.plan(["gae_ppo", "grpo"], env_info, [0, 1], tmp_path, TINY, 256, True)  # agent specs
    assert [(j["agent"], j["folder"], j["fingerprint"], j["config"]) for j in jobs["runs"]] == [
        (j["agent"], j["folder"], j["fingerprint"], j["config"]) for j in plain["runs"]]
    for run in jobs["runs"]:
        assert run["folder"] == tmp_path / "runs" / "digits" / run["config"].agent / f"seed{run['seed']}"
        assert (run["config"].max_staleness, run["config"].rollout_correction) == (0, "none")
        warm = next(w for w in jobs["warmups"] if w["folder"] == run["warmup"])
        described = {k: v for k, v in run["config"].to_dict().items() if k != "output_dir"}
        described.update(model=warm["config"].model, warmup_sft_steps=warm["config"].warmup_sft_steps)
        assert run["fingerprint"] == job_key({**described, "warmup": warm["fingerprint"]})  # the formula as before
    # the K=0, 'none' arm trains the same config as the agent alone, in a folder of its own
    arm_jobs, _, _ = _plan_of(["gae_ppo"], tmp_path, max_staleness=[0], rollout_correction=["none"])
    arm_run = arm_jobs["runs"][0]
    folder = tmp_path / "runs" / "digits" / "gae_ppo@K0+none" / "seed0"
    assert arm_run["config"].to_dict() == {**jobs["runs"][0]["config"].to_dict(), "output_dir": str(folder)}


def test_an_arm_that_does_not_validate_is_refused_or_skipped_with_all(tmp_path):
    from textrl.bench.plan import resolve_arms, run_settings

    common = run_settings(TINY)
    with pytest.raises(ValueError, match=r"^arm 'one_step_ppo@K0\+tis': rollout_correction='tis': one_step_ppo "):
        resolve_arms(["grpo", "one_step_ppo"], common, [0, 1], ["none", "tis"])
    arms, skipped = resolve_arms(["grpo", "one_step_ppo"], common, [1], ["none", "tis"], every=True)
    assert [a.label for a in arms] == ["grpo@K1+none", "grpo@K1+tis", "one_step_ppo@K1+none"]
    assert list(skipped) == ["one_step_ppo@K1+tis"] and "one_step_ppo applies none" in skipped["one_step_ppo@K1+tis"]
    with pytest.raises(ValueError, match="none of the arms"):
        resolve_arms(["one_step_ppo"], common, None, ["tis"], every=True)
    with pytest.raises(ValueError, match=r"max_staleness=1 for every run and the max_staleness axis \[0, 1\]"):
        compare_agents(["grpo"], [0], tmp_path / "bench", staleness=[0, 1], max_staleness=1, **QUIET, **TINY)
    assert not (tmp_path / "bench").exists()


@pytest.mark.parametrize("args, culprit", [
    (["--agents", "one_step_ppo", "--rollout-correction", "none,tis"],
     "arm 'one_step_ppo+tis': rollout_correction='tis': one_step_ppo applies none, mis, geo_mean only"),
    (["--max-staleness", "0,1,0"], "max_staleness [0, 1, 0]: 0 repeated; give each value once"),
    (["--max-staleness", "0,-1"], "max_staleness -1: each value must be an integer >= 0"),
    (["--max-staleness", ","], "max_staleness is empty; give at least one value"),
    (["--rollout-correction", "none,nope"], "rollout_correction 'nope': must be one of none, tis, mis"),
])
def test_bad_axes_are_one_line_naming_the_culprit(tmp_path, capsys, args, culprit):
    assert main([*args, "--output-dir", str(tmp_path / "bench")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("textrl bench: ") and culprit in err and err.count("\n") == 1
    assert not (tmp_path / "bench").exists()


def test_a_bench_with_too_few_seeds_says_so_before_it_runs(tmp_path, fake_training):
    _, log = fake_compare(tmp_path / "bench")  # 2 seeds on 2 environments: 3 are needed
    assert log.splitlines()[0] == ("note: 2 seed(s) on 2 environment(s) can tell no two agents apart at 0.05: the "
                                   "exact rank test reaches p >= 0.0556 at best; a verdict needs 3 seeds a side "
                                   "(the report gives the figures, without verdicts)")
    assert bench_compare.seeds_too_few(3, 2) is None and bench_compare.seeds_too_few(4, 1) is None
    assert "p >= 0.333 at best; a verdict needs 4" in bench_compare.seeds_too_few(2, 1)


def test_arms_are_reported_as_agents_with_their_wall_clock(tmp_path, fake_training):
    out = tmp_path / "bench"
    result, _ = fake_compare(out, agents=("gae_ppo", "grpo"), staleness=[0, 2])
    labels = ["gae_ppo@K0", "gae_ppo@K2", "grpo@K0", "grpo@K2"]
    assert sorted(fake_training["runs"]) == sorted((a, e, s) for a in ("gae_ppo", "grpo") for _ in (0, 2)
                                                   for e in ("digits", "guess_number") for s in (0, 1))
    assert len(fake_training["warmups"]) == 4  # shared by the arms
    assert [a["agent"] for a in result["agents"]] == labels and result["agents"][1] == {
        "agent": "gae_ppo@K2", "spec": "gae_ppo", "max_staleness": 2}
    assert result["report"]["agents"] == labels
    verdicts = {(p["x"], p["y"]): p["verdict"] for p in result["report"]["pairs"]}
    # 2 seeds on 2 environments: the exact rank test reaches p >= 2 / 36 at best, so no verdict
    assert len(verdicts) == 6 and set(verdicts.values()) == {"not enough runs"}
    assert "- Not enough runs: `gae_ppo@K2` vs `grpo@K2` (n=2 a side can reach p >= 0.0556 at best (exact rank " \
           "test), above 0.05; 3 seeds a side are needed)." in result["markdown"]
    assert "- A verdict needs 3 seeds a side on 2 environment(s)" in result["markdown"]
    assert "**Significant**" not in result["markdown"]
    text = result["markdown"]
    assert "4 arms (2 agents x max_staleness [0, 2], labelled `AGENT@K<max_staleness>`)" in text
    # fake iterations of 0.1 s: 8 on digits, 2 on guess_number (4 turns), so 0.8 s and 0.2 s a run
    assert "## Wall clock per arm" in text and "| `grpo@K2` | 4 | 0.50 ± 0.35 | 1.00x |" in text
    assert "| arm | seeds |" in text and "| 0.100 ± 0.000 | 0.80 ± 0.00 | 320 ± 0 |" in text  # s / it, training s
    for run in result["runs"]:
        assert run["train_s"] == pytest.approx(0.1 * len(run["iterations"]))
        assert Path(run["output_dir"]).parent.name == run["agent"]
    _, log = fake_compare(out, agents=("gae_ppo", "grpo"), staleness=[0, 2])
    assert len(fake_training["runs"]) == 16 and "reused" in log  # resumable like agents


def test_without_the_axes_the_report_has_no_arms(tmp_path, fake_training):
    result, _ = fake_compare(tmp_path / "bench")
    text = result["markdown"]
    assert "2 agents x 2 environments x 2 seeds" in text and "| agent | seeds |" in text
    assert "Wall clock per arm" not in text and "| arm |" not in text and "training s" not in text
    assert result["agents"] == [{"agent": "gae_ppo", "spec": "gae_ppo"}, {"agent": "grpo", "spec": "grpo"}]
    assert "train_s" not in result["tables"]["digits"][0]


def test_the_wall_clock_table_times_each_arm_against_its_k0_arm():
    runs = [{**record(arm, env, seed, 1.0), "train_s": seconds}
            for arm, seconds in (("grpo@K0", 10.0), ("grpo@K1", 5.0), ("grpo@K4", 4.0)) for env in ("a", "b")
            for seed in (0, 1)]
    runs[-1] = record("grpo@K4", "b", 1, 0, error="boom")  # a failed run: timed on the pairs both finished
    table = bench_report.wall_clock_table(runs, ["grpo@K0", "grpo@K1", "grpo@K4"],
                                          {"grpo@K0": "grpo@K0", "grpo@K1": "grpo@K0", "grpo@K4": "grpo@K0"})
    assert table.splitlines()[2:] == ["| `grpo@K0` | 4 | 10.00 ± 0.00 | 1.00x |",
                                      "| `grpo@K1` | 4 | 5.00 ± 0.00 | 2.00x |",
                                      "| `grpo@K4` | 3 | 4.00 ± 0.00 | 2.50x |"]
    assert "speed-up" not in bench_report.wall_clock_table(runs, ["grpo@K0"])
    assert bench_report.wall_clock_table(runs, ["grpo@K1"], {"grpo@K1": None}).splitlines()[2].endswith("| - |")



def test_the_wall_clock_table_shows_the_reward_seconds_where_runs_logged_them():
    runs = [{**record("sync", "a", 0, 1.0), "train_s": 10.0, "reward_s": 6.0},
            {**record("io", "a", 0, 1.0), "train_s": 5.0, "reward_s": 1.0, "reward_calls_s": 6.5}]
    table = bench_report.wall_clock_table(runs, ["sync", "io"], {"sync": "sync", "io": "sync"})
    assert table.splitlines()[0] == "| arm | runs | training s | reward wait s | reward calls s | speed-up |"
    assert table.splitlines()[2:] == ["| `sync` | 1 | 10.00 ± 0.00 | 6.00 ± 0.00 | - | 1.00x |",
                                      "| `io` | 1 | 5.00 ± 0.00 | 1.00 ± 0.00 | 6.50 ± 0.00 | 2.00x |"]

# -- end to end ----------------------------------------------------------------------------------


def test_two_agents_on_a_single_and_a_multi_turn_env_end_to_end(tmp_path):
    out = tmp_path / "bench"
    result = compare_agents(["gae_ppo", "grpo"], [0], out, envs=["digits", "guess_number"], isolate=False,
                            token_budget=128, reps=50, **QUIET, **TINY)
    runs = result["runs"]
    assert len(runs) == 4 and not any(r["error"] for r in runs)
    assert {r["env"]: len(r["iterations"]) for r in runs} == {"digits": 4, "guess_number": 1}
    for env in ("digits", "guess_number"):
        starts = {r["reward_start"] for r in runs if r["env"] == env}
        assert len(starts) == 1 and all(math.isfinite(r["normalised"]) for r in runs if r["env"] == env)
    text = (out / "report.md").read_text()
    assert "Not significant: `gae_ppo` vs `grpo` (one seed gives no interval; run more seeds)" in text
    assert "`digits` 4 iterations, `guess_number` 1 iterations" in text and "min of runs and warm-ups" in text
    for name in ("learning_curves.png", "intervals.png", "profiles.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((out / "results.json").read_text())
    assert saved["report"]["agents"] == ["gae_ppo", "grpo"] and len(saved["fingerprints"]["runs"]) == 4


@pytest.mark.slow
def test_command_line_runs_jobs_in_parallel_subprocesses(tmp_path):
    out = tmp_path / "bench"
    args = ["--agents", "gae_ppo", "--envs", "guess_number", "--seeds", "0", "--jobs", "2", "--token-budget", "64",
            "--output-dir", str(out), "--reps", "50"]
    for key, value in TINY.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    assert main(args) == 0
    folder = out / "runs" / "guess_number" / "gae_ppo" / "seed0"
    done = json.loads((folder / bench_runs.RECORD).read_text())
    assert done["peak_rss_mib"] > 50 and done["wall_s"] > 0
    job = json.loads((folder / bench_runs.JOB_FILE).read_text())
    assert job["config"]["warmup_sft_steps"] == 0 and job["config"]["model"].endswith("seed0")  # the shared warm-up
    assert (out / "report.md").is_file()


def test_two_staleness_arms_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["--agents", "grpo", "--max-staleness", "0,1", "--seeds", "0", "--envs", "digits", "--in-process",
            "--token-budget", "64", "--reps", "50", "--output-dir", str(out)]
    args += [a for k, v in TINY.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    assert main(args) == 0
    text = (out / "report.md").read_text()
    assert "Not significant: `grpo@K0` vs `grpo@K1` (one seed gives no interval; run more seeds)" in text
    assert "## Wall clock per arm" in text and "| `grpo@K1` | 1 |" in text
    saved = json.loads((out / "results.json").read_text())
    assert saved["report"]["agents"] == ["grpo@K0", "grpo@K1"]
    for k in (0, 1):
        job = json.loads((out / "runs" / "digits" / f"grpo@K{k}" / "seed0" / bench_runs.JOB_FILE).read_text())
        assert job["config"]["max_staleness"] == k
        assert job["config"]["model"] == str(out / "warmup" / "digits" / "seed0")  # the one shared warm-up
    assert [p.name for p in (out / "warmup" / "digits").iterdir()] == ["seed0"]
    assert all(r["train_s"] > 0 and len(r["iterations"]) == 2 for r in saved["runs"])


def test_the_report_says_which_engine_and_precision_ran_and_flags_a_mixed_comparison():
    same = [{"engine": "textrl", "precision": "float32", "error": None}] * 3
    assert bench_compare.what_ran(same) == "Generation engine `textrl` in float32 in every run."
    mixed = [*same, {"engine": "hf", "precision": "bfloat16", "error": None},
             {"engine": "vllm", "precision": "float32", "error": "it failed"}]
    line = bench_compare.what_ran(mixed)
    assert "differ" in line and "`textrl` in float32 (3 runs)" in line and "`hf` in bfloat16 (1 runs)" in line
    assert "vllm" not in line  # a failed run ran nothing to compare


def test_the_raw_table_shows_the_perf_metrics_and_a_run_that_did_not_log_them_still_renders(tmp_path):
    def run_folder(name, perf):
        out = tmp_path / name
        out.mkdir()
        rows = [{"iteration": i, "time/iteration_s": 0.5, "tokens": 40, "reward/mean": 0.7,
                 **({"perf/tokens_per_s": rate, "perf/padding_fraction": pad} if perf else {})}
                for i, (rate, pad) in enumerate([(900.0, 0.25), (1200.0, 0.35), (1000.0, 0.3)], 1)]
        (out / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        (out / "summary.json").write_text(json.dumps({"before": {"eval/sampled/reward/mean": 0.5},
                                                      "after": {"eval/sampled/reward/mean": 0.7}}))
        return {"agent": name, "env": "digits", "seed": 0, "error": None, **bench_runs.read_run(out)}

    new, old = run_folder("grpo", perf=True), run_folder("rloo", perf=False)
    assert new["perf_tokens_per_s"] == 1000.0 and new["padding_fraction"] == pytest.approx(0.3)  # median, mean
    assert math.isnan(old["perf_tokens_per_s"]) and math.isnan(old["padding_fraction"])
    table = bench_report.markdown_table(bench_report.aggregate([new, old]))
    head, _, *lines = table.splitlines()
    titles = [t.strip() for t in head.strip("|").split("|")]
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")] for line in lines if line}
    rate, pad = titles.index("`perf/tokens_per_s`"), titles.index("`perf/padding_fraction`")
    assert cells["`grpo`"][rate] == "1000 ± 0" and cells["`grpo`"][pad] == "0.30 ± 0.00"
    assert cells["`rloo`"][rate] == "-" and cells["`rloo`"][pad] == "-"
    arms = bench_report.markdown_table(bench_report.aggregate([new, old], bench_report.ARM_COLUMNS),
                                       columns=bench_report.ARM_COLUMNS, name="arm")
    assert "`perf/tokens_per_s`" in arms and "`perf/padding_fraction`" in arms
