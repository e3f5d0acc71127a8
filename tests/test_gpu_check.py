"""benchmarks/gpu_check.py, the one command that proves a GPU: on a CPU it runs every check at tiny
sizes and writes its report; a failing check fails the command and is named in the report."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_on_a_cpu_every_check_runs_at_tiny_size_and_the_report_says_each(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(out), "--commit", "abc123"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    report = json.loads((out / "gpu_check.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    gpu_check = _module()
    assert list(checks) == list(gpu_check.CHECKS)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert all(c["status"] in ("passed", "skipped") and c["why"] for c in checks.values())
    assert checks["cuda_tests"]["status"] == "skipped" and "CUDA tests collected" in checks["cuda_tests"]["why"]
    assert checks["cuda_tests"]["figures"]["collected"] > 10
    assert checks["default_run"]["figures"]["skipped_updates"] == 0
    assert checks["generation"]["figures"]["textrl/multi_x_hf"] > 0
    assert report["commit"] == "abc123" and report["gpu"] is False
    text = (out / "gpu_check.md").read_text()
    assert "| default_run | passed |" in text and "commit abc123" in text


def test_a_failing_check_fails_the_command_and_is_named(tmp_path, monkeypatch):
    gpu_check = _module()

    def broken(sizes, budget_s):
        return gpu_check.Result("generation", "failed", "textrl 0.50x hf single-turn", {"x": 0.5}, "python bench.py", 1.0)

    def fine(sizes, budget_s):
        return gpu_check.Result("trl", "skipped", "TRL is not installed")

    monkeypatch.setattr(gpu_check, "CHECKS", {"trl": (fine, 1, 1), "generation": (broken, 1, 1)})
    assert gpu_check.main(["--out", str(tmp_path), "--tiny", "--commit", "x"]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["verdict"] == "failed: generation"
    assert [c["status"] for c in report["checks"]] == ["skipped", "failed"]
    assert "| generation | failed | textrl 0.50x hf single-turn |" in (tmp_path / "gpu_check.md").read_text()
    monkeypatch.setattr(gpu_check, "CHECKS", {"trl": (fine, 1, 1)})
    assert gpu_check.main(["--out", str(tmp_path), "--tiny"]) == 0


def test_a_check_that_raises_or_runs_out_of_time_is_a_failed_row(tmp_path, monkeypatch):
    gpu_check = _module()

    def raises(sizes, budget_s):
        raise KeyError("rows")

    monkeypatch.setattr(gpu_check, "CHECKS", {"memory_0.5b": (raises, 1, 1)})
    assert gpu_check.main(["--out", str(tmp_path), "--tiny"]) == 1
    row = json.loads((tmp_path / "gpu_check.json").read_text())["checks"][0]
    assert row["status"] == "failed" and "KeyError" in row["why"]
    result = gpu_check._bench("slow", [sys.executable, "-c", "import time; time.sleep(5)"], 0.5,
                              lambda f: (True, "", {}))
    assert result.status == "failed" and result.why == "ran past its 0 s budget" and result.seconds < 5


def test_last_json_reads_a_benchmarks_figures():
    gpu_check = _module()
    assert gpu_check.last_json('table\n{"a": 1}\nRESULT {"b": 2}\n') == {"b": 2}
    assert gpu_check.last_json("no figures\n{broken") == {}
