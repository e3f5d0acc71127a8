"""benchmarks/bench_captures.py counts the decoders and feeds a multi-turn run makes, in each set-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_captures_counts_each_rollouts_decoders_and_feeds_in_both_set_ups():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_captures.py"), "--iterations", "2", "--warmup-sft-steps", "0"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("guess_number, rloo, 2 iterations")  # the run's own table went to stderr
    figures = json.loads(lines[-1])
    filled, own = figures["setups"]["filled"], figures["setups"]["own_shapes"]
    for r in (filled, own):
        per = r["per_rollout"]
        assert len(per) >= 2 and r["decoders"] == sum(d for d, _ in per) and r["feeds"] == sum(f for _, f in per)
        assert r["later_decoders"] == sum(d for d, _ in per[len(per) // 2:])
        assert per[0][0] >= 1  # the first rollout makes its decoders
    assert len(filled["per_rollout"]) == len(own["per_rollout"])  # the same run, the same rollouts
