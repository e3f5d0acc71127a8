"""benchmarks/bench_generation.py runs on the CPU and says what it measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_generation_times_every_engine_against_hf_and_the_floor():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_generation.py"), "--prompts", "2", "--samples", "3",
           "--new-tokens", "4", "--repeats", "1", "--threads", "1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["rows"] == 6 and figures["new_tokens"] == 4 and figures["floor_seconds"] > 0
    assert set(figures["engines"]) == {"hf", "static", "textrl", "textrl_unshared", "textrl_dynamic", "textrl_eager", "textrl_graph",
                                          "textrl_full_width", "textrl_windows"}
    for r in figures["engines"].values():
        assert r["seconds"] > 0 and r["tokens_per_second"] == 24 / r["seconds"] and r["x_floor"] >= 1
    assert figures["engines"]["hf"]["x_hf"] == 1.0


def test_bench_generation_times_multi_turn_episodes_too():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_generation.py"), "--prompts", "2", "--samples", "2",
           "--new-tokens", "6", "--turns", "3", "--observation-tokens", "4", "--repeats", "1", "--threads", "1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["turns"] == 3 and figures["tokens_per_turn"] == 2
    for r in figures["engines"].values():
        assert r["multi_tokens_per_second"] == 4 * 3 * 2 / r["multi_seconds"]
        assert r["multi_over_single"] == r["multi_tokens_per_second"] / r["tokens_per_second"]
        assert r["first_call_seconds"] > 0


def test_bench_generation_counts_the_ops_of_each_turn_outside_the_decode_steps():
    """``--turn-ops``: the textrl engines' ops a turn, nothing timed (that a carried turn's count does
    not grow with the rows: tests/generation/test_engines.py)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_generation.py"), "--turn-ops", "--engines", "hf,textrl",
           "--prompts", "2", "--samples", "2", "--new-tokens", "6", "--turns", "3", "--threads", "1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["turns"] == 3 and set(figures["turn_ops"]) == {"textrl"}  # hf has no decode steps of its own
    counts, uncaptured = figures["turn_ops"]["textrl"], figures["turn_ops_uncaptured"]["textrl"]
    assert len(counts) == 3 and min(counts) > 0 and "seconds" not in result.stdout
    assert uncaptured[0] == counts[0]  # the first turn has no feed: its prefill is eager everywhere
    assert all(u < c // 2 for u, c in zip(uncaptured[1:], counts[1:]))  # a carried turn's forward is its feed


def test_bench_generation_refuses_an_unknown_engine():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_generation.py"), "--engines", "sglang", "--new-tokens", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode != 0
    assert ("generation_engine='sglang': not a registered engine; choose auto or one of hf, static, textrl, vllm, "
            "vllm-server") in result.stderr


def test_bench_generation_counts_a_decode_steps_bytes_in_each_set_up():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_generation.py"), "--traffic", "--prompts", "2",
           "--samples", "2", "--new-tokens", "8", "--threads", "1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["rows"] == 4 and figures["context"] == 16 + 4 and figures["width"] == 64
    mb = figures["traffic_mb"]
    assert set(mb) == {"float32", "autocast", "bfloat16", "autocast_window", "autocast_f32_cache",
                       "autocast_no_weight_casts"}
    for r in mb.values():
        assert r["total"] == pytest.approx(r["casts"] + r["matmul"] + r["attention"] + r["other"])
        assert r["x_floor"] == pytest.approx(r["total"] / r["floor"]) and r["x_floor"] > 1
    assert mb["float32"]["casts"] == 0 and mb["autocast"]["matmul"] == pytest.approx(mb["float32"]["matmul"] / 2, rel=0.05)
    assert mb["autocast"]["matmul"] == mb["bfloat16"]["matmul"]  # the same matmuls, in bf16
    assert figures["window"] == 64 and figures["width"] == 64  # one window: the whole width
    assert mb["autocast_window"]["attention"] == mb["autocast"]["attention"]
    # the baselines cast what the engine does not: the cache each layer, the weights each step
    assert mb["autocast_f32_cache"]["casts"] > mb["autocast"]["casts"] + mb["autocast"]["attention"] / 2
    assert mb["autocast_no_weight_casts"]["casts"] > figures["matmul_weights"] * 6 / 1e6
