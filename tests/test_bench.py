"""textrl.bench: the agent comparison on tiny sizes writes a table of finite figures and plots."""

from __future__ import annotations

import json
import math

import pytest

from textrl.bench import aggregate, compare_agents, main, markdown_table

TINY = dict(
    iterations=2, prompts_per_iteration=2, n_samples_per_prompt=2, max_new_tokens=8, eval_size=4,
    warmup_sft_steps=5, warmup_sft_batch_size=4, eval_every=0, ppo_epochs=1, num_minibatches=1,
)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))


@pytest.mark.slow
def test_compare_agents_writes_table_and_plots_with_finite_numbers(tmp_path):
    out = tmp_path / "bench"
    result = compare_agents(["gae_ppo", "one_step_ppo", "no_such_agent"], [0, 1], out, isolate=False,
                            log=lambda *a: None, **TINY)
    assert result["skipped"].keys() == {"no_such_agent"}
    assert [r["agent"] for r in result["agents"]] == ["gae_ppo", "one_step_ppo"]
    for row in result["agents"]:
        assert row["seeds"] == 2 and not row["errors"]
        for key in ("reward", "kl", "response_length", "seconds_per_iteration", "tokens_per_second", "peak_rss_mib"):
            mean, std = row[key]
            assert math.isfinite(mean) and math.isfinite(std), key
    for run in result["runs"]:
        assert len(run["train_reward"]) == len(run["elapsed_s"]) == 2
    table = (out / "results.md").read_text()
    assert "| `gae_ppo` | 2 |" in table and "| `one_step_ppo` | 2 |" in table
    assert "`no_such_agent` skipped" in table and "budget of 64 generated tokens" in table
    for name in ("reward_vs_iteration.png", "reward_vs_time.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "results.json").read_text())["agents"][0]["agent"] == "gae_ppo"
    # both agents of a seed started from the same warmed-up policy
    assert (out / "warmup" / "seed0" / "config.json").is_file()
    starts = {r["seed"]: set() for r in result["runs"]}
    for run in result["runs"]:
        starts[run["seed"]].add(run["reward_start"])
    assert all(len(s) == 1 for s in starts.values())


@pytest.mark.slow
def test_command_line_runs_each_run_in_a_subprocess_and_reports_a_failed_run(tmp_path):
    out = tmp_path / "bench"
    args = ["--agents", "gae_ppo", "--seeds", "0", "--output-dir", str(out), "--actor-lr", "1e-3"]
    for key, value in TINY.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    assert main(args) == 0
    record = json.loads((out / "runs" / "gae_ppo" / "seed0" / "bench_run.json").read_text())
    assert record["peak_rss_mib"] > 50 and record["wall_s"] > 0
    config = json.loads((out / "runs" / "gae_ppo" / "seed0" / "bench_config.json").read_text())
    assert config["config"]["actor_lr"] == 1e-3 and config["config"]["warmup_sft_steps"] == 0  # the shared warm-up was loaded
    assert main(["--agents", "gae_ppo", "--seed", "1", "--output-dir", str(out)]) == 2
    failed = compare_agents(["gae_ppo"], [0], tmp_path / "failed", log=lambda *a: None,
                            **{**TINY, "reward": "no_such_reward"})
    assert failed["runs"][0]["error"].startswith("exit 1:")
    assert "- `gae_ppo` failed: seed 0: exit 1:" in failed["table"]


def test_failed_runs_are_reported_not_aggregated():
    runs = [
        {"agent": "a", "seed": 0, "error": None, "tokens": 10, "reward": 1.0, "kl": 0.1},
        {"agent": "a", "seed": 1, "error": "exit 1: boom", "tokens": math.nan},
    ]
    (row,) = aggregate(runs)
    assert row["seeds"] == 1 and row["reward"] == (1.0, 0.0) and row["errors"] == ["seed 1: exit 1: boom"]
    assert math.isnan(row["accuracy"][0])
    table = markdown_table([row], {"b": "not registered"})
    assert "| `a` | 1 | 1.000 ± 0.000 |" in table
    assert "- `a` failed: seed 1: exit 1: boom" in table and "- `b` skipped: not registered" in table
