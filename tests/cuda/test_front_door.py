"""textrl on a GPU through the front door: the commands and scripts a user runs, with ``--device cuda``.

Every test here is marked ``cuda`` and takes its device from the ``run_device`` fixture
(tests/conftest.py): ``pytest -m cuda`` on a GPU machine runs them all on CUDA;
``TEXTRL_CUDA_TESTS_ON=cpu pytest -m cuda tests/cuda`` rehearses them on a CPU. The commands run
through ``textrl.cli.main`` (argument parsing, config validation, ``train``, the stages) in this
process, the console script and the benchmark scripts as subprocesses.

Covered: ``textrl train`` for every registered agent, a multi-turn environment, a LoRA policy on
a 4-bit base, a resume, an asynchronous run (``--max-staleness``) and its resume, ``sft`` / ``rm`` / ``dpo`` (and a LoRA stage on a 4-bit base),
``pipeline``, ``bench``, the benchmark scripts that compute with models (the others,
``bench_env``, ``bench_functional``, ``bench_prompts``, ``fault_catalogue`` and
``code_shape``, time Python, tokenisation or the CPU functions and take no device), the
embedded default for 300 iterations in bf16 without a skipped update, and the attention kernels a
forward with gradients may use (a masked backward at a sequence length of 64 mod 128 whose rows
have a very negative log-sum-exp: the cuDNN kernel's NaN).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from textrl.agents import AGENTS

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--prompts-per-iteration", "2", "--n-samples-per-prompt", "2", "--max-new-tokens", "8",
         "--warmup-sft-steps", "5", "--warmup-sft-batch-size", "4", "--eval-size", "4", "--eval-every", "2",
         "--ppo-epochs", "1", "--num-minibatches", "1", "--progress", "false"]
"""A few-second ``textrl train``: 4 rows per iteration, short responses, one held-out evaluation."""


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path_factory.getbasetemp() / "textrl-cache"))


def textrl(*argv: str) -> str:
    """``textrl ARGV`` in this process; its printed output. A non-zero exit fails with that output."""
    from textrl.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main([str(a) for a in argv])
    assert code == 0, f"textrl {' '.join(map(str, argv))} exited {code}:\n{out.getvalue()[-4000:]}"
    return out.getvalue()


def script(path: str, *argv: str, timeout: int = 900) -> str:
    """``python benchmarks/PATH ARGV`` (or a module with ``-m``) as a subprocess; its stdout."""
    cmd = [sys.executable, *(["-m", path] if not path.endswith(".py") else [str(ROOT / path)]), *map(str, argv)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert result.returncode == 0, f"{' '.join(cmd)} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return result.stdout


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_run(out: Path, device: str, iterations: int) -> list[dict]:
    """A finished train run: ``iterations`` rows, no skipped update, finite losses, on ``device``
    in the precision it should have had there (bf16 autocast on CUDA by default)."""
    metrics = rows(out)
    assert [r["iteration"] for r in metrics] == list(range(1, iterations + 1))
    for r in metrics:
        assert r["nonfinite/skipped_updates"] == 0, r
        assert math.isfinite(r.get("loss/policy", 0.0)) and math.isfinite(r["reward/mean"]), r  # dapo: a
        # rollout whose groups all scored alike leaves the loss (dynamic sampling), so no loss/policy
    summary = json.loads((out / "summary.json").read_text())
    precision = summary["precision"]
    assert precision["device"].startswith(device)
    assert precision["autocast"] == ("bfloat16" if device == "cuda" else "no")
    return metrics


# -- textrl train ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_train_runs_every_registered_agent(tmp_path, run_device, agent):
    out = tmp_path / agent
    textrl("train", "--device", run_device, "--agent", agent, "--iterations", "3", "--output-dir", out, *SMALL)
    check_run(out, run_device, 3)


def test_train_runs_a_multi_turn_environment(tmp_path, run_device):
    out = tmp_path / "guess"
    textrl("train", "--device", run_device, "--env", "guess_number", "--agent", "gae_ppo", "--iterations", "3",
           "--output-dir", out, *SMALL)
    metrics = check_run(out, run_device, 3)
    assert all(r["episode/turns/mean"] >= 1 for r in metrics)


@pytest.mark.parametrize("agent", ["rloo", "gae_ppo", "multi_adapter_ppo"])
def test_train_runs_a_lora_policy_on_a_4bit_base(tmp_path, run_device, agent):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / agent
    textrl("train", "--device", run_device, "--agent", agent, "--lora-r", "8", "--load-in-4bit",
           "--iterations", "2", "--output-dir", out, *SMALL)
    check_run(out, run_device, 2)


def test_a_resumed_run_continues_as_the_uninterrupted_one(tmp_path, run_device):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    common = ["--device", run_device, "--agent", "gae_ppo", "--checkpoint-every", "2", *SMALL]
    textrl("train", "--iterations", "4", "--output-dir", whole, *common)
    textrl("train", "--iterations", "2", "--output-dir", cut, *common)
    textrl("train", "--config", cut / "config.yaml", "--resume", "--iterations", "4")
    a, b = check_run(whole, run_device, 4), check_run(cut, run_device, 4)
    for x, y in zip(a, b):  # float atomics in some CUDA backward kernels: equal up to rounding
        assert x["reward/mean"] == pytest.approx(y["reward/mean"], abs=1e-6)
        assert x["loss/policy"] == pytest.approx(y["loss/policy"], rel=1e-3, abs=1e-4)


@pytest.mark.parametrize("options", [["--env", "digits"], ["--env", "guess_number", "--partial-rollouts", "continue"]],
                         ids=["digits", "guess_number-partial"])
def test_an_asynchronous_run_is_k_behind_and_resumes_as_the_uninterrupted_one(tmp_path, run_device, options):
    """--max-staleness 2 on the device: the actor's thread draws rollout n with the weights of iteration
    max(0, n - 2) while the learner updates (docs/async.md); a resume continues it."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    common = ["--device", run_device, "--agent", "gae_ppo", "--checkpoint-every", "2", "--max-staleness", "2",
              *SMALL, *options]
    textrl("train", "--iterations", "4", "--output-dir", whole, *common)
    textrl("train", "--iterations", "2", "--output-dir", cut, *common)
    textrl("train", "--config", cut / "config.yaml", "--resume", "--iterations", "4")
    a, b = check_run(whole, run_device, 4), check_run(cut, run_device, 4)
    assert a[0]["rollout/staleness"] == 0.0 and a[3]["rollout/staleness_max"] == 2.0
    for x, y in zip(a, b):  # float atomics in some CUDA backward kernels: equal up to rounding
        assert x["rollout/staleness"] == y["rollout/staleness"]
        assert x["reward/mean"] == pytest.approx(y["reward/mean"], abs=1e-6)
        assert x["loss/policy"] == pytest.approx(y["loss/policy"], rel=1e-3, abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_embedded_default_runs_300_iterations_in_bf16_without_a_skipped_update(tmp_path, run_device, seed):
    """The README's main job (rloo, the warm-up, the digits task) at 300 iterations: it stopped at
    iteration 12 (seed 0) and 202 (seed 1) on an H100 before padding and kernels were fixed."""
    out = tmp_path / f"default{seed}"
    textrl("train", "--device", run_device, "--iterations", "300", "--seed", seed, "--output-dir", out,
           "--progress", "false")
    metrics = check_run(out, run_device, 300)
    assert all(r["nonfinite/rolled_back"] == 0 for r in metrics)
    summary = json.loads((out / "summary.json").read_text())
    key = "eval/sampled/reward/mean"
    assert summary["after"][key] > summary["before"][key], "it did not learn"


# -- the stages, the pipeline, the bench ------------------------------------------------------------


def check_stage(out: Path, device: str) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    assert summary["precision"]["device"].startswith(device)
    assert summary["precision"]["autocast"] == ("bfloat16" if device == "cuda" else "no")
    assert (out / "model").is_dir()
    return summary


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo"])
def test_each_stage_trains_on_the_device_in_bf16(tmp_path, run_device, stage):
    out = tmp_path / stage
    textrl(stage, "--device", run_device, "--steps", "4", "--batch-size", "8", "--eval-size", "8",
           "--output-dir", out, "--progress", "false")
    summary = check_stage(out, run_device)
    assert all(math.isfinite(v) for v in summary["after"].values())


def test_a_lora_stage_trains_on_a_4bit_base(tmp_path, run_device):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "rm"
    textrl("rm", "--device", run_device, "--lora", "--load-in-4bit", "--steps", "4", "--batch-size", "8",
           "--eval-size", "8", "--output-dir", out, "--progress", "false")
    check_stage(out, run_device)


def test_the_pipeline_runs_end_to_end(tmp_path, run_device):
    out = tmp_path / "pipeline"
    textrl("pipeline", "--device", run_device, "--output-dir", out, "--sft-steps", "5", "--rm-steps", "5",
           "--ppo-iterations", "2", "--batch-size", "8", "--eval-size", "4", "--rm-eval-size", "8",
           "--max-new-tokens", "8", "--progress", "false")
    for stage in ("sft", "rm"):
        check_stage(out / stage, run_device)
    check_run(out / "ppo", run_device, 2)


def test_the_bench_compares_agents_at_a_tiny_budget(tmp_path, run_device):
    out = tmp_path / "bench"
    textrl("bench", "--agents", "gae_ppo,rloo", "--envs", "digits", "--seeds", "0", "--jobs", "1",
           "--token-budget", "96", "--reps", "50", "--output-dir", out, "--device", run_device,
           "--prompts-per-iteration", "2", "--n-samples-per-prompt", "2", "--max-new-tokens", "8",
           "--warmup-sft-steps", "5", "--eval-size", "4", "--ppo-epochs", "1", "--num-minibatches", "1")
    results = json.loads((out / "results.json").read_text())
    runs = results["runs"] if isinstance(results, dict) and "runs" in results else results
    assert runs and all(r.get("error") is None for r in runs), runs


def test_the_console_script_trains(tmp_path, run_device):
    out = tmp_path / "script"
    script("textrl.cli", "train", "--device", run_device, "--iterations", "2", "--output-dir", out, *SMALL)
    check_run(out, run_device, 2)


# -- the benchmark scripts --------------------------------------------------------------------------


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_bench_ppo_iteration_runs(run_device):
    figures = last_json(script("benchmarks/bench_ppo_iteration.py", "--device", run_device, "--iterations", "10",
                               "--warmup", "1", "--batch", "8", "--new-tokens", "16"))
    assert figures["device"].startswith(run_device) and figures["ratio_to_floor"] > 0


def test_bench_memory_runs(tmp_path, run_device):
    pytest.importorskip("bitsandbytes")
    figures = last_json(script("benchmarks/bench_memory.py", "--device", run_device, "--hidden", "64",
                               "--layers", "2", "--workdir", tmp_path))
    assert figures["memory"] == ("cuda_max_allocated" if run_device == "cuda" else "rss_rise")


def test_bench_logprobs_runs(run_device):
    figures = last_json(script("benchmarks/bench_logprobs.py", "--device", run_device, "--vocab", "512,3000",
                               "--positions", "64", "--hidden", "32", "--variants", "unfused,checkpoint,fused"))
    assert figures["device"].startswith(run_device) and len(figures["rows"]) == 6


def test_bench_multiturn_runs(run_device):
    figures = last_json(script("benchmarks/bench_multiturn.py", "--device", run_device, "--rows", "4",
                               "--repeats", "1", "--turn-tokens", "4"))
    assert figures


def test_bench_sharding_runs_one_process(tmp_path, run_device):
    """One GPU: one process, replicated (sharding over one process is refused by textrl train)."""
    figures = last_json(script("benchmarks/bench_sharding.py", "--device", run_device, "--processes", "1",
                               "--variants", "replicated", "--hidden", "64", "--layers", "2",
                               "--iterations", "2", "--workdir", tmp_path))
    assert figures


def test_compare_agents_runs(tmp_path, run_device):
    script("benchmarks/compare_agents.py", "--agents", "rloo", "--envs", "digits", "--seeds", "0", "--jobs", "1",
           "--token-budget", "64", "--reps", "50", "--output-dir", tmp_path / "cmp", "--device", run_device,
           "--prompts-per-iteration", "2", "--n-samples-per-prompt", "2", "--max-new-tokens", "8",
           "--warmup-sft-steps", "5", "--eval-size", "4", "--ppo-epochs", "1", "--num-minibatches", "1")
    assert (tmp_path / "cmp" / "report.md").is_file()


# -- the attention kernels of a forward with gradients ------------------------------------------------


@pytest.mark.parametrize("length", [64, 192, 320])
def test_a_masked_attention_backward_at_64_mod_128_gives_finite_gradients(run_device, length):
    """The cuDNN regression (PyTorch >= 2.11): with a mask passed, a sequence length of 64 mod 128
    and rows whose log-sum-exp is below ln(FLT_MAX) ~ -88.7, its backward gives NaN query
    gradients. Every logit here is about -100; the training context must not pick that kernel."""
    import torch.nn.functional as F

    from textrl.core.precision import Precision

    dtype = torch.bfloat16 if run_device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    dim = 64
    q = (torch.randn(2, 4, length, dim, generator=gen) * 0.05).to(run_device, dtype)
    k = (torch.randn(2, 4, length, dim, generator=gen) * 0.05).to(run_device, dtype)
    v = torch.randn(2, 4, length, dim, generator=gen).to(run_device, dtype)
    q[..., 0] = 1.0
    k[..., 0] = -100.0 * math.sqrt(dim)  # q.k / sqrt(d) ~ -100 for every pair
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = torch.ones(length, length, dtype=torch.bool, device=run_device).tril()[None, None]
    with Precision(torch.device(run_device), autocast_dtype=torch.bfloat16 if run_device == "cuda" else None).autocast():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.float().square().sum().backward()
    for name, t in (("query", q), ("key", k), ("value", v)):
        assert torch.isfinite(t.grad).all(), f"{name} gradients are not finite at length {length}"
