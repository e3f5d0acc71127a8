"""textrl.bench: statistics wiring on fabricated run records, resumability, the folder lock, bad
input, and one tiny end-to-end comparison (2 agents x 2 environments, one of them multi-turn)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from textrl import bench, bench_report, bench_runs
from textrl.bench import compare_agents, main

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
    assert "- Not significant: `weak` vs `weak2` (both intervals include no difference)" in text
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

    monkeypatch.setattr(bench, "_train", train)
    monkeypatch.setattr(bench, "warm_start", warm)
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
    assert result["report"]["pairs"][0]["verdict"] == "grpo better"  # figures read back from the folders
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
