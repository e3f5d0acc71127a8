"""benchmarks/bench_trl_ppo.py times TRL's PPO and textrl's GAEPPO on the CPU and says what it measured."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"hidden": 32, "intermediate": 64, "layers": 1, "heads": 2, "batch": 4, "prompt_tokens": 16,
         "new_tokens": 8, "iterations": 1, "warmup": 1}


@pytest.mark.slow
def test_bench_trl_ppo_times_one_iteration_of_each_at_the_same_sizes():
    pytest.importorskip("trl")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_trl_ppo.py"), "--threads", "1",
           "--generation-engine", "textrl"]
    for name, value in SIZES.items():
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    trl_s, textrl_s = figures["trl_seconds_per_iteration"], figures["textrl_seconds_per_iteration"]
    for seconds in (trl_s, textrl_s):
        assert math.isfinite(seconds) and seconds > 0
    assert figures["speedup"] == pytest.approx(trl_s / textrl_s)
    assert {name: figures[name] for name in SIZES} == SIZES
    assert figures["device"] == "cpu" and figures["generation_engine"] == "textrl"
    assert figures["trl_version"] == "1.12.0" and figures["trl_mixed_precision"] == "no"
    # read from what TRL generated: every row ran to full length, as textrl's do (the LM head's bias)
    assert figures["trl_new_tokens"] == figures["trl_response_width"] == SIZES["new_tokens"]
    assert figures["trl_tokens_per_second"] == pytest.approx(4 * 8 / trl_s)
    assert figures["textrl_tokens_per_second"] == pytest.approx(4 * 8 / textrl_s)
    assert 0 <= figures["trl_gc_seconds"] < trl_s and 0 <= figures["textrl_gc_seconds"] < textrl_s


def test_bench_trl_ppo_says_how_to_install_trl_when_it_is_missing(tmp_path):
    (tmp_path / "trl.py").write_text("raise ImportError('no trl here')\n")  # shadows an installed trl
    path = os.pathsep.join(filter(None, (str(tmp_path), os.environ.get("PYTHONPATH"))))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_trl_ppo.py")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == "bench_trl_ppo.py needs TRL: pip install trl==1.12.0"
