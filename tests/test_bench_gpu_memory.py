"""benchmarks/bench_gpu_memory.py (the memory table) runs end to end: on the CPU at its tiny
sizes, a couple of rows with their figures in the last JSON line; rows whose fields this
``TrainConfig`` lacks are skipped by name, an exhausted budget lists the rows not run, ``--list``
has a row per registered agent; on a GPU (``pytest -m cuda``) the same with CUDA's peak."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from textrl.core.agent_registry import agent_names

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--prompts", "2", "--samples", "2", "--new-tokens", "8"]


def bench(*argv: str, timeout: int = 900) -> str:
    """``python benchmarks/bench_gpu_memory.py ARGV``; its stdout (a non-zero exit fails with stderr)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_gpu_memory.py"), *map(str, argv)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert result.returncode == 0, f"{' '.join(cmd)} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return result.stdout


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def check_ran(figures: dict, names: list[str], memory: str) -> None:
    assert list(figures["rows"]) == names
    for name in names:
        row = figures["rows"][name]
        assert row["status"] == "ok", row
        assert row["memory"] == memory
        assert row["peak_mb"] > 0 and row["peak_with_build_mb"] >= row["peak_mb"]
        assert row["seconds_per_iteration"] > 0 and row["first_iteration_s"] > 0
        assert row["tokens"] > 0 and row["loaded_mb"] > 0


@pytest.mark.slow
def test_two_rows_on_the_cpu_give_peaks_seconds_ratios_and_goals():
    names = ["gae_ppo-0.5b-v512-off", "rloo-0.5b-v512-all"]
    out = bench("--device", "cpu", "--rows", ",".join(names), *SMALL)
    figures = last_json(out)
    check_ran(figures, names, "rss_rise")
    assert sum(line.startswith("ROW {") for line in out.splitlines()) == 2  # each row printed as it ended
    assert figures["sizes"] == {"prompts": 2, "samples": 2, "new_tokens": 8}
    assert figures["rows"]["gae_ppo-0.5b-v512-off"]["tokens"] == 2 * 2 * 8  # every row full length
    off = figures["rows"]["gae_ppo-0.5b-v512-off"]["fields"]
    assert off.get("frozen_dtype", "float32") == "float32" and not off.get("gradient_checkpointing", False)
    assert "critic" not in figures["rows"]["rloo-0.5b-v512-all"]["fields"]  # rloo has no critic to share
    ratio = figures["ratios"]["rloo-0.5b-v512-all"]
    assert ratio["to"] == "gae_ppo-0.5b-v512-off" and ratio["peak"] > 0  # no rloo off row: gae_ppo's
    assert {g["status"] for g in figures["goals"].values()} == {"not run (CPU sizes)"}
    assert figures["not_run"] == []


def test_a_field_trainconfig_lacks_skips_the_row_and_the_budget_leaves_rows_not_run():
    out = bench("--device", "cpu", "--rows", "gae_ppo-0.5b-v512-off,gae_ppo-0.5b-v512-gc", "--set",
                "no_such_field=1")
    figures = last_json(out)
    assert {r["status"] for r in figures["rows"].values()} == {"skipped: TrainConfig has no field no_such_field"}
    figures = last_json(bench("--device", "cpu", "--budget-s", "0", "--rows", "gae_ppo-0.5b-v512-off"))
    assert figures["rows"] == {} and figures["not_run"] == ["gae_ppo-0.5b-v512-off"]


def test_the_list_has_every_agent_every_option_and_the_issues_rows_first():
    listed = [line.split()[0] for line in bench("--list").splitlines()[1:]]
    assert len(listed) == len(set(listed))
    assert listed[:5] == ["gae_ppo-0.5b-v512-off", "gae_ppo-0.5b-v512-all", "gae_ppo-1.5b-v152k-all",
                          "rloo-1.5b-v152k-all", "multi_adapter_ppo-7b-v152k-4bit"]
    assert {f"{agent}-0.5b-v512-defaults" for agent in agent_names()} <= set(listed)
    for option in ("gc", "shared", "lora_critic", "frozen_bf16", "8bit", "bf16_anyprec", "chunk", "all"):
        assert {f"gae_ppo-0.5b-v512-{option}", f"gae_ppo-0.5b-v152k-{option}"} <= set(listed)


@pytest.mark.cuda
def test_rows_on_the_run_device(tmp_path, run_device):
    """On a GPU: the issue's 0.5B shape at a small batch, four full models and a 4-bit LoRA base."""
    pytest.importorskip("bitsandbytes")
    names = ["gae_ppo-0.5b-v512-off", "gae_ppo-0.5b-v512-all", "multi_adapter_ppo-0.5b-v512-4bit"]
    figures = last_json(bench("--device", run_device, "--rows", ",".join(names), *SMALL, "--workdir", tmp_path))
    check_ran(figures, names, "cuda_max_allocated" if run_device == "cuda" else "rss_rise")
    if run_device == "cuda":  # one 4-bit base against four float32 models
        assert figures["ratios"]["multi_adapter_ppo-0.5b-v512-4bit"]["peak"] < 1


# -- the allocator trace's replay (--trace) -------------------------------------------------------


def _frame(path, line, name):
    return {"filename": path, "line": line, "name": name}


def test_the_trace_replay_finds_the_peak_and_what_was_live_there(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from memory_trace import NO_STACK, peak_breakdown, where

    layer = [_frame("/x/site-packages/torch/nn/functional.py", 1, "linear"),
             _frame("/x/site-packages/transformers/models/qwen2/modeling_qwen2.py", 50, "forward"),
             _frame("/x/textrl/agents/update.py", 88, "run_epochs")]
    ours = [_frame("/x/site-packages/torch/_tensor.py", 2, "clone"), _frame("/x/textrl/parallel/rollback.py", 250, "_allocate")]
    mib = 2**20
    entries = [
        {"action": "alloc", "addr": 1, "size": 100 * mib, "frames": ours},   # lives through
        {"action": "alloc", "addr": 2, "size": 30 * mib, "frames": layer},
        {"action": "alloc", "addr": 3, "size": 30 * mib, "frames": layer},   # peak: 160
        {"action": "free_requested", "addr": 2, "size": 30 * mib},
        {"action": "free_completed", "addr": 2, "size": 30 * mib},
        {"action": "free_completed", "addr": 3, "size": 30 * mib},
        {"action": "alloc", "addr": 4, "size": 50 * mib, "frames": []},     # 150: below the peak
    ]
    out = peak_breakdown(entries, top=1)
    assert out["peak_mb"] == 160 and out["entries"] == 7 and out["complete"]
    assert out["at_peak"] == [{"where": "textrl/parallel/rollback.py:250 _allocate", "mb": 100.0, "blocks": 1}]
    assert out["rest_mb"] == 60.0
    both = peak_breakdown(entries)["at_peak"]
    assert both[1] == {"where": "transformers/models/qwen2/modeling_qwen2.py:50 forward < textrl/agents/update.py:88 "
                                "run_epochs", "mb": 60.0, "blocks": 2}
    # a free of a block allocated before the recording is not in the sum; a full ring buffer is said
    earlier = peak_breakdown([{"action": "free_completed", "addr": 9, "size": 5 * mib}, *entries], max_entries=9)
    assert earlier["complete"] and earlier["peak_mb"] == 160
    assert not peak_breakdown(entries, max_entries=7)["complete"]
    # frames as a GPU machine's venv under a folder named torch gives them; no frames: the backward's thread
    venv = "/opt/torch/.venv/lib/python3.12/site-packages/"
    frames = [_frame(venv + "torch/nn/modules/linear.py", 134, "forward"),
              _frame(venv + "transformers/models/qwen2/modeling_qwen2.py", 251, "forward"),
              _frame("/tmp/site/textrl/models/forward.py", 250, "response_hidden")]
    assert where(frames) == "transformers/models/qwen2/modeling_qwen2.py:251 forward < textrl/models/forward.py:250 " \
                            "response_hidden"
    assert where([]) == NO_STACK
