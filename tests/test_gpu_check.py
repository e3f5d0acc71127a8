"""benchmarks/gpu_check.py, the one command that proves a GPU: on a CPU it runs every check at tiny
sizes and writes its report; each check's judge fails what it should; a failing check fails the
command and is named in the report; the GPU's commands use flags the scripts have."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
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


gpu_check = _module()


@pytest.mark.slow
def test_on_a_cpu_every_check_runs_at_tiny_size_and_the_report_says_each(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(out), "--commit", "abc123"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    report = json.loads((out / "gpu_check.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == list(gpu_check.CHECKS)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for c in checks.values():
        assert c["status"] in ("passed", "skipped") and c["why"] and c["command"] and c["seconds"] > 0, c
    assert checks["cuda_tests"]["status"] == "skipped" and "CUDA tests collected, not run" in checks["cuda_tests"]["why"]
    assert checks["cuda_tests"]["figures"]["collected"] > 10
    run = checks["default_run"]["figures"]
    assert run["iterations"] == 6 and run["skipped_updates"] == 0 and run["rolled_back"] == 0
    assert run["precision"]["device"] == "cpu"
    assert run["precision"]["autocast"] == ("bfloat16" if gpu_check.cpu_has_bf16() else "no")
    assert checks["ppo_iteration"]["figures"]["ratio_to_floor"] > 0
    assert checks["generation"]["figures"]["textrl/multi_x_hf"] > 0
    assert checks["memory_0.5b"]["figures"]["status"] == "ok"
    if checks["trl"]["status"] == "passed":
        assert checks["trl"]["figures"]["speedup"] > 0
    else:
        assert "pip install trl==1.12.0" in checks["trl"]["why"]
    assert report["commit"] == "abc123" and report["gpu"] is False and report["machine"]["cpus"] >= 1
    text = (out / "gpu_check.md").read_text()
    assert "commit abc123" in text and "A CPU rehearsal at tiny sizes, not a proof of a GPU" in text
    for name, c in checks.items():
        assert f"| {name} | {c['status']} | " in text


def _rows(n: int, start: float, end: float, **extra) -> list[dict]:
    """``n`` metrics rows whose reward/mean goes linearly from ``start`` to ``end``, no update skipped."""
    return [{"iteration": i + 1, "reward/mean": start + (end - start) * i / max(n - 1, 1),
             "nonfinite/skipped_updates": 0.0, "nonfinite/rolled_back": 0.0, "time/iteration_s": 0.3, **extra}
            for i in range(n)]


SUMMARY = {"before": {"eval/sampled/reward/mean": 0.4}, "after": {"eval/sampled/reward/mean": 1.6},
           "precision": {"device": "cuda:0", "autocast": "bfloat16"}, "gap_closed": {"share": 0.57}}


def test_the_default_runs_judge_passes_a_rising_run_and_fails_each_broken_one():
    status, why, figures = gpu_check.judge_run(_rows(300, 0.3, 1.5), SUMMARY, 300, gpu=True)
    assert status == "passed", why
    assert figures["reward_first_50"] == pytest.approx(0.3 + 1.2 * 24.5 / 299)  # the mean of rows 0..49
    assert figures["reward_last_50"] == pytest.approx(0.3 + 1.2 * 274.5 / 299)

    rolled = _rows(300, 0.3, 1.5)
    rolled[120].update({"nonfinite/skipped_updates": 1.0, "nonfinite/rolled_back": 1.0})
    status, why, _ = gpu_check.judge_run(rolled, SUMMARY, 300, gpu=True)
    assert status == "failed" and "1 skipped updates, 1 rolled back" in why

    status, why, _ = gpu_check.judge_run(_rows(300, 1.5, 0.3), SUMMARY, 300, gpu=True)
    assert status == "failed" and "the rollout reward did not rise" in why
    fell = {**SUMMARY, "after": {"eval/sampled/reward/mean": 0.2}}
    assert "the held-out reward did not rise" in gpu_check.judge_run(_rows(300, 0.3, 1.5), fell, 300, gpu=True)[1]
    on_cpu = {**SUMMARY, "precision": {"device": "cpu", "autocast": "no"}}
    assert "not on CUDA under bf16" in gpu_check.judge_run(_rows(300, 0.3, 1.5), on_cpu, 300, gpu=True)[1]
    assert "299 iterations of 300" in gpu_check.judge_run(_rows(299, 0.3, 1.5), SUMMARY, 300, gpu=True)[1]
    unknown = [{k: v for k, v in r.items() if not k.startswith("nonfinite/")} for r in _rows(300, 0.3, 1.5)]
    assert gpu_check.judge_run(unknown, SUMMARY, 300, gpu=True)[0] == "failed"

    # on the CPU (6 iterations) the reward is reported, not judged; a skipped update still fails
    assert gpu_check.judge_run(_rows(6, 0.5, 0.3), on_cpu, 6, gpu=False)[0] == "passed"
    skipped = _rows(6, 0.5, 0.3)
    skipped[2]["nonfinite/skipped_updates"] = 1.0
    assert gpu_check.judge_run(skipped, on_cpu, 6, gpu=False)[0] == "failed"


def test_the_benchmark_judges_hold_the_gpu_goals():
    iteration = {"seconds_per_iteration": 0.75, "ratio_to_floor": 1.4, "guard/update_overhead": 0.03}
    assert gpu_check.judge_ppo_iteration(iteration, gpu=True)[0] == "passed"
    assert gpu_check.judge_ppo_iteration({**iteration, "guard/update_overhead": 0.08}, gpu=True)[0] == "failed"
    assert gpu_check.judge_ppo_iteration({"ratio_to_floor": 1.4}, gpu=True)[0] == "failed"  # no guard figure
    assert gpu_check.judge_ppo_iteration({**iteration, "guard/update_overhead": 0.08}, gpu=False)[0] == "passed"

    trl = {"trl_version": "1.12.0", "speedup": 7.3}
    assert gpu_check.judge_trl(trl, gpu=True)[0] == "passed"
    status, why, _ = gpu_check.judge_trl({**trl, "speedup": 3.5}, gpu=True)
    assert status == "failed" and "3.50x" in why and ">= 4x" in why
    assert "written against TRL 1.12.0" in gpu_check.judge_trl({**trl, "trl_version": "1.13.0"}, gpu=True)[1]

    engines = {"hf": {"x_hf": 1.0, "multi_tokens_per_second": 5000.0},
               "textrl": {"x_hf": 11.9, "multi_tokens_per_second": 48000.0, "multi_over_single": 0.69}}
    status, why, figures = gpu_check.judge_generation({"engines": engines}, gpu=True)
    assert status == "passed" and figures["textrl/multi_x_hf"] == pytest.approx(9.6)
    slow_multi = {**engines, "textrl": {**engines["textrl"], "multi_tokens_per_second": 4000.0}}
    assert gpu_check.judge_generation({"engines": slow_multi}, gpu=True)[0] == "failed"
    assert gpu_check.judge_generation({"engines": {"hf": engines["hf"]}}, gpu=True)[0] == "failed"

    row = {"status": "ok", "peak_with_build_mb": 9000.0, "seconds_per_iteration": 10.0}
    met = {"rows": {gpu_check.MEMORY_ROW: row}, "goals": {gpu_check.MEMORY_GOAL: {"status": "met", "gb": 9.4}}}
    assert gpu_check.judge_memory(met, gpu=True)[0] == "passed"
    missed = {**met, "goals": {gpu_check.MEMORY_GOAL: {"status": "not met", "gb": 13.0}}}
    assert gpu_check.judge_memory(missed, gpu=True)[0] == "failed"
    oom = {"rows": {gpu_check.MEMORY_ROW: {"status": "OOM", "error": "worker exited -9"}}}
    assert gpu_check.judge_memory(oom, gpu=True)[0] == "failed"

    packed = {"padding_50/prefill/packed_speedup": 1.8, "padding_50/fwd+bwd/packed_speedup": 1.9,
              "padding_50/max_abs_diff": 0.01}
    status, why, figures = gpu_check.judge_padding_free(packed, gpu=True)
    assert status == "passed" and "prefill 1.80x" in why and figures["padding_50/max_abs_diff"] == 0.01
    slow_backward = {**packed, "padding_50/fwd+bwd/packed_speedup": 1.4}
    assert gpu_check.judge_padding_free(slow_backward, gpu=True)[0] == "failed"
    assert gpu_check.judge_padding_free({"padding_50/prefill/packed_speedup": 1.8}, gpu=True)[0] == "failed"
    assert gpu_check.judge_padding_free(slow_backward, gpu=False)[0] == "passed"
    lacking = {"rows": {gpu_check.MEMORY_ROW: {"status": "skipped: TrainConfig has no field optim"}}}
    assert gpu_check.judge_memory(lacking, gpu=True)[0] == "skipped"


def test_the_cuda_tests_judge_reads_pytests_summary():
    assert gpu_check.judge_cuda_tests("....\n60 passed, 4 skipped, 3083 deselected in 201.3s\n", 0, gpu=True)[0] == "passed"
    status, why, counts = gpu_check.judge_cuda_tests("F...\n1 failed, 59 passed, 3083 deselected in 190s\n", 1, gpu=True)
    assert status == "failed" and counts == {"failed": 1, "passed": 59, "deselected": 3083} and why.startswith("59 passed, 1 failed")
    assert gpu_check.judge_cuda_tests("2 errors in 3s\n", 2, gpu=True)[0] == "failed"
    assert gpu_check.judge_cuda_tests("64 skipped, 3083 deselected\n", 0, gpu=True)[0] == "failed"  # none ran


def test_a_failing_check_fails_the_command_and_is_named(tmp_path, monkeypatch):
    # a benchmark that exits non-zero (an option it lacks), run for real, beside a check that skips
    commands = gpu_check.commands

    def broken(sizes):
        argvs = commands(sizes)
        argvs["generation"] = [*argvs["generation"], "--no-such-option"]
        return argvs

    monkeypatch.setattr(gpu_check, "commands", broken)
    monkeypatch.setattr(gpu_check, "has_module", lambda name: False)  # TRL "not installed": skipped
    assert gpu_check.main(["--out", str(tmp_path), "--tiny", "--commit", "x", "--only", "trl,generation"]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["verdict"] == "failed: generation"
    trl, generation = report["checks"]
    assert trl["status"] == "skipped" and "pip download trl==1.12.0" in trl["why"]
    assert generation["status"] == "failed" and "exit 2" in generation["why"] and "--no-such-option" in generation["why"]
    assert "| generation | failed | exit 2" in (tmp_path / "gpu_check.md").read_text()
    assert gpu_check.main(["--out", str(tmp_path), "--tiny", "--only", "trl"]) == 0


def test_a_check_that_raises_is_a_failed_row_and_the_others_still_run(tmp_path, monkeypatch):
    def raises(sizes, argv, budget_s, name):
        raise KeyError("rows")

    def skips(sizes, argv, budget_s, name):
        return gpu_check.Result(name, "skipped", "not here", command="x", seconds=0.1)

    monkeypatch.setattr(gpu_check, "CHECKS", {"memory_0.5b": (raises, 1, 10), "trl": (skips, 1, 10)})
    assert gpu_check.main(["--out", str(tmp_path), "--tiny", "--only", "memory_0.5b,trl"]) == 1
    first, second = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
    assert first["status"] == "failed" and "KeyError" in first["why"] and second["status"] == "skipped"


def test_a_check_past_its_budget_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); print('started', flush=True); time.sleep(60)")
    check = gpu_check.bench(gpu_check.judge_generation)
    result = check(gpu_check.Sizes(gpu=False, work=tmp_path), [sys.executable, "-c", code], 3.0, name="slow")
    assert result.status == "failed" and result.why.startswith("ran past its 3 s budget: started")
    assert result.seconds < 30
    child = int(pid_file.read_text())
    for _ in range(50):  # the killed grandchild is reaped by init
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        pytest.fail(f"the check's grandchild {child} outlived its budget")


@pytest.mark.slow
def test_the_gpu_commands_use_options_the_scripts_have():
    """The GPU sizes never run here: each option of their commands is in its script's --help."""
    argvs = json.loads(subprocess.run([sys.executable, str(SCRIPT), "--print-commands"], capture_output=True,
                                      text=True, timeout=120, cwd=ROOT, check=True).stdout)["gpu"]
    assert set(argvs) == set(gpu_check.CHECKS)
    for name, argv in argvs.items():
        if name == "cuda_tests":
            assert argv[1:3] == ["-m", "pytest"] and "cuda and not slow" in argv
            continue
        helper = argv[:4] + ["--help"] if argv[1:3] == ["-m", "textrl"] else argv[:2] + ["--help"]
        text = subprocess.run(helper, capture_output=True, text=True, timeout=120, cwd=ROOT).stdout
        for option in (a for a in argv if a.startswith("--")):
            assert re.search(rf"{re.escape(option)}\b", text), f"{name}: {option} is not an option of {helper[1:-1]}"
    assert "--mixed-precision" in argvs["default_run"] and "300" in argvs["default_run"]
    listed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu_memory.py"), "--list"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT).stdout
    assert gpu_check.MEMORY_ROW in listed
    assert repr(gpu_check.MEMORY_GOAL).strip("'") in (ROOT / "benchmarks" / "bench_gpu_memory.py").read_text()


def test_the_markdown_rounds_figures_and_the_json_keeps_them(tmp_path, monkeypatch):
    def measured(sizes, argv, budget_s, name):
        return gpu_check.Result(name, "passed", "ran", {"ratio": 1.3381621876729575, "rows": [0.06276264350162819]},
                                "x", 1.0)

    monkeypatch.setattr(gpu_check, "CHECKS", {"ppo_iteration": (measured, 1, 10)})
    assert gpu_check.main(["--out", str(tmp_path), "--tiny", "--only", "ppo_iteration"]) == 0
    assert json.loads((tmp_path / "gpu_check.json").read_text())["checks"][0]["figures"]["ratio"] == 1.3381621876729575
    text = (tmp_path / "gpu_check.md").read_text()
    assert '"ratio": 1.338,' in text and "0.06276" in text and "1.33816" not in text


def test_last_json_reads_a_benchmarks_figures():
    assert gpu_check.last_json('table\n{"a": 1}\nRESULT {"b": 2}\n') == {"b": 2}
    assert gpu_check.last_json("no figures\n{broken") == {}
