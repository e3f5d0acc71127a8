"""One command proves a GPU: the CUDA tests, the GPU benchmarks and a real run, in one report.

    python benchmarks/gpu_check.py [--out DIR] [--commit SHA] [--only NAME,...] [--tiny] [--print-commands]
    bash .gpu/run.sh python3 benchmarks/gpu_check.py --out "$OUT/gpu-check" --commit SHA   # no git checkout there

Each check runs in a process of its own (its process group ended when its time is up), under a time
budget of its own plus what the checks before it left unused, 9 minutes in all on one GPU, and ends
``passed``, ``failed`` or ``skipped`` with why, its figures, its command and its wall time:

- ``cuda_tests``: ``pytest -m "cuda and not slow" tests`` (4 workers where pytest-xdist is
  installed): passes when every test passes or is skipped by its own marker, and one passed;
- ``ppo_iteration``: one ``gae_ppo`` iteration at 114M parameters (64 prompts x 256 new tokens)
  against its floor, and the rollback guard's cost as an A/B (``benchmarks/bench_ppo_iteration.py``):
  passes with the guard's update overhead <= 5%, that script's GPU goal (the ratio to the floor
  is reported: it has no GPU goal);
- ``trl``: the same iteration, guard included, against TRL 1.12's PPO (``benchmarks/bench_trl_ppo.py``):
  passes when textrl is >= 4x faster (docs/benchmarks.md's goal); skipped, naming the wheel to
  add, where TRL is not installed;
- ``generation``: the ``textrl`` and ``hf`` engines, single-turn and 4 turns
  (``benchmarks/bench_generation.py --shape 114m``): passes when ``textrl`` is faster both ways;
- ``default_run``: the embedded default, ``textrl train --mixed-precision bf16 --iterations 300
  --seed 0``: passes when all 300 iterations ran on CUDA under bf16 autocast, no update was skipped
  or rolled back (``nonfinite/skipped_updates``, ``nonfinite/rolled_back`` in ``metrics.jsonl``),
  the rollout reward of the last 50 iterations is above the first 50's, and the held-out sampled
  reward after training above the one before (``summary.json``);
- ``memory_0.5b``: one memory row at 0.5B parameters (``benchmarks/bench_gpu_memory.py`` row
  ``gae_ppo-0.5b-v512-all``, every memory option on): passes when the row ran and met that
  script's goal, a peak of at most 12 GB;
- ``padding_free``: the learner's prefill and forward+backward padded and padding-free
  (``benchmarks/bench_padding_free.py``, hidden 1024, 8 layers, 32 rows of ragged 32 + 1024
  tokens, bf16 autocast) at 25%, 50% and 75% padding: passes when both phases are at least 1.5x
  faster padding-free at 50% padding (``PADDING_FREE_GOAL``).

Without CUDA (or with ``--tiny``) every check runs at tiny sizes on the CPU, in about a minute and
a half on 2 cores (5 minutes at most): the CUDA tests are collected, not run (their CPU rehearsal,
``TEXTRL_CUDA_TESTS_ON=cpu``, runs 35 ``textrl`` commands: too long here), the benchmarks' speeds
and the default run's reward (6 iterations, bf16 autocast where the CPU has bf16 instructions,
else float32) are reported, not judged; a rehearsal of the script, not a proof of a GPU.

Writes ``gpu_check.json`` and ``gpu_check.md`` to ``--out`` (default ``docs/gpu-check/`` of this
checkout on a GPU, ``docs/gpu-check/cpu-rehearsal/`` on a CPU): the date, the card (or the CPU),
torch and CUDA versions, the commit (``--commit``, else ``git rev-parse HEAD`` with ``+dirty``
and the changed files where tracked files differ from it) and one row per check. Exit status 1
when a check failed. docs/gpu-check.md says what each check is and keeps the latest report.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRL_VERSION = "1.12.0"
GUARD_GOAL = 0.05
"""The rollback guard's most update overhead on a GPU (benchmarks/bench_ppo_iteration.py's goal)."""
TRL_GOAL = 4.0
"""The least speed-up over TRL 1.12's PPO iteration on a GPU (docs/benchmarks.md's goal)."""
MEMORY_ROW = "gae_ppo-0.5b-v512-all"
MEMORY_GOAL = "gae_ppo 0.5B <= 12 GB"
"""benchmarks/bench_gpu_memory.py's goal that MEMORY_ROW meets (its GOALS)."""
PADDING_FREE_GOAL = 1.5
"""The least padded / padding-free ratio of the prefill and of the forward+backward at 50% padding
(benchmarks/bench_padding_free.py's goal)."""
TOTAL_S = {"gpu": 530.0, "cpu": 300.0}
"""Seconds for the checks in all: 9 minutes on a GPU with the script's own start and report."""


@dataclass
class Result:
    """One check's row of the report."""

    name: str
    status: str  # passed | failed | skipped
    why: str
    figures: dict[str, Any] = field(default_factory=dict)
    command: str = ""
    seconds: float = 0.0


@dataclass
class Sizes:
    """What the checks run at: a GPU's real sizes, or the CPU's tiny ones; ``work``: a scratch folder."""

    gpu: bool
    work: Path

    @property
    def device(self) -> str:
        return "cuda" if self.gpu else "cpu"

    @property
    def model(self) -> list[str]:
        """bench_ppo_iteration.py's (and bench_trl_ppo.py's) model and batch arguments."""
        if self.gpu:
            return ["--hidden", "768", "--intermediate", "3072", "--layers", "12", "--heads", "12", "--batch", "64",
                    "--new-tokens", "256"]
        return ["--batch", "4", "--new-tokens", "8", "--threads", "1"]


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 instructions (x86 ``avx512_bf16`` / ``amx_bf16``, Arm ``bf16``)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"^(flags|Features)\s*:.*\b(avx512_bf16|amx_bf16|bf16)\b", flags, re.M))


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# -- each check's command -------------------------------------------------------------------------------


def commands(sizes: Sizes) -> dict[str, list[str]]:
    """Each check's argv (``sys.executable`` first) at ``sizes``."""
    py, gpu = sys.executable, sizes.gpu
    pytest_options = ["-q", "-p", "no:randomly", "-m", "cuda and not slow"]
    pytest_options += (["-n", "4"] if has_module("xdist") else []) if gpu else ["--collect-only"]
    generation = (["--shape", "114m", "--prompts", "16", "--samples", "4", "--new-tokens", "256", "--repeats", "2",
                   "--observation-tokens", "14"] if gpu else
                  ["--prompts", "2", "--samples", "2", "--new-tokens", "8", "--repeats", "1", "--threads", "1",
                   "--observation-tokens", "4"])
    run = ["--iterations", "300", "--mixed-precision", "bf16"] if gpu else [
        "--iterations", "6", "--mixed-precision", "bf16" if cpu_has_bf16() else "no",
        "--warmup-sft-steps", "20", "--eval-size", "8"]
    memory = ["--row-timeout", "150"] if gpu else ["--prompts", "2", "--samples", "2", "--new-tokens", "8"]
    padding_free = (["--hidden", "1024", "--intermediate", "4096", "--layers", "8", "--heads", "16", "--rows", "32",
                     "--new-tokens", "1024", "--threads", "0", "--mixed-precision", "bf16", "--repeats", "3"] if gpu else
                    ["--hidden", "64", "--intermediate", "128", "--layers", "2", "--rows", "8", "--prompt-tokens", "8", "--new-tokens", "64",
                     "--repeats", "1"])
    return {
        "cuda_tests": [py, "-m", "pytest", *pytest_options, str(ROOT / "tests")],
        "ppo_iteration": [py, str(HERE / "bench_ppo_iteration.py"), "--device", sizes.device, *sizes.model,
                          "--iterations", "10", "--warmup", "1"],  # the script's median wants 10
        "trl": [py, str(HERE / "bench_trl_ppo.py"), "--device", sizes.device, *sizes.model,
                "--iterations", "3" if gpu else "1", "--warmup", "1"],
        "generation": [py, str(HERE / "bench_generation.py"), "--device", sizes.device, *generation,
                       "--engines", "hf,textrl", "--turns", "4"],
        "default_run": [py, "-m", "textrl", "train", "--device", sizes.device, "--seed", "0", *run,
                        "--output-dir", str(sizes.work / "default_run"), "--progress", "false"],
        "memory_0.5b": [py, str(HERE / "bench_gpu_memory.py"), "--device", sizes.device, "--rows", MEMORY_ROW,
                        "--no-prespawn", *memory],
        "padding_free": [py, str(HERE / "bench_padding_free.py"), "--device", sizes.device, *padding_free],
    }


def shown(argv: list[str]) -> str:
    """``argv`` as a user types it from the checkout's root: ``python benchmarks/x.py``, ``textrl train``."""
    words = ["python", *argv[1:]]
    if words[1:3] == ["-m", "textrl"]:
        words = ["textrl", *words[3:]]
    return shlex.join(os.path.relpath(w, ROOT) if w.startswith(str(ROOT)) else w for w in words)


def run(argv: list[str], budget_s: float) -> tuple[subprocess.CompletedProcess | None, str, float]:
    """``argv`` in a process group of its own under ``budget_s`` seconds: (its result, or None when it
    ran out of time and its group was killed; its output so far; seconds)."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(budget_s, 0.1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the benchmarks' own workers and pytest's too
        out, _ = proc.communicate()
        return None, out, time.perf_counter() - start
    return subprocess.CompletedProcess(argv, proc.returncode, out, ""), out, time.perf_counter() - start


def last_json(text: str) -> dict[str, Any]:
    """The last line of ``text`` that is a JSON object (a benchmark's figures); {} when none is."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip().removeprefix("RESULT ")
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return {}


def tail(text: str) -> str:
    """The last two non-empty lines of ``text``, for a failed row's why."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " / ".join(lines[-2:])[-300:]


def num(value: Any, fmt: str = ".2f") -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "n/a"


# -- the judges: a finished command's output -> (status, why, figures) ----------------------------------

Verdict = tuple[str, str, dict[str, Any]]


def judge_cuda_tests(out: str, rc: int, gpu: bool) -> Verdict:
    """pytest's summary line; on the CPU its collection."""
    if not gpu:
        collected = sum("::" in line for line in out.splitlines())
        if rc != 0 or collected == 0:
            return "failed", f"collection failed (exit {rc}): {tail(out)}", {"collected": collected}
        return "skipped", (f"no GPU: {collected} CUDA tests collected, not run (their CPU rehearsal, "
                           "TEXTRL_CUDA_TESTS_ON=cpu, runs 35 textrl commands: too long here)"), {"collected": collected}
    counts = {kind.rstrip("s"): int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", out)}
    said = ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "error", "skipped"))
    ok = rc == 0 and counts.get("passed", 0) > 0
    return ("passed" if ok else "failed"), said + ("" if ok else f" (exit {rc}): {tail(out)}"), counts


def judge_ppo_iteration(f: dict[str, Any], gpu: bool) -> Verdict:
    keep = {k: f[k] for k in ("seconds_per_iteration", "floor_seconds_per_iteration", "ratio_to_floor",
                              "tokens_per_second", "guard/update_overhead", "guard/iteration_overhead",
                              "guard/placement") if k in f}
    overhead = f.get("guard/update_overhead")
    said = (f"{num(f.get('seconds_per_iteration'), '.3f')} s an iteration, {num(f.get('ratio_to_floor'))}x its floor; "
            f"the guard's update overhead {num(overhead, '.3f')}")
    if not gpu:
        return "passed", said + " at tiny size (the guard's goal is for a GPU)", keep
    ok = isinstance(overhead, (int, float)) and overhead <= GUARD_GOAL
    return ("passed" if ok else "failed"), said + f" (goal <= {GUARD_GOAL})", keep


def judge_trl(f: dict[str, Any], gpu: bool) -> Verdict:
    keep = {k: f[k] for k in ("trl_version", "trl_seconds_per_iteration", "textrl_seconds_per_iteration", "speedup",
                              "speedup_without_gc", "generation_engine", "trl_mixed_precision") if k in f}
    speedup = f.get("speedup")
    said = (f"textrl {num(speedup)}x TRL {f.get('trl_version', '?')}'s PPO iteration, textrl's rollback guard "
            f"included ({num(f.get('speedup_without_gc'))}x with TRL's garbage collection left out)")
    if f.get("trl_version") != TRL_VERSION:
        said += f" (the benchmark is written against TRL {TRL_VERSION})"
    if not gpu:
        return "passed", said + " at tiny size (the goal is for a GPU)", keep
    ok = isinstance(speedup, (int, float)) and speedup >= TRL_GOAL
    return ("passed" if ok else "failed"), said + f" (goal >= {TRL_GOAL:g}x)", keep


def judge_generation(f: dict[str, Any], gpu: bool) -> Verdict:
    engines = f.get("engines", {})
    keep = {f"{name}/{k}": v for name, r in engines.items() for k, v in r.items()
            if k in ("seconds", "x_hf", "multi_tokens_per_second", "multi_over_single")}
    textrl, hf = engines.get("textrl", {}), engines.get("hf", {})
    if not textrl.get("multi_tokens_per_second") or not hf.get("multi_tokens_per_second"):
        return "failed", "the benchmark timed no textrl or hf engine single- and multi-turn", keep
    multi_x = textrl["multi_tokens_per_second"] / hf["multi_tokens_per_second"]
    keep["textrl/multi_x_hf"] = multi_x
    said = (f"textrl {num(textrl.get('x_hf'))}x hf single-turn, {multi_x:.2f}x multi-turn "
            f"(multi-turn {num(textrl.get('multi_over_single'))} of its single turn)")
    if not gpu:
        return "passed", said + " at tiny size (speed judged on a GPU)", keep
    ok = textrl.get("x_hf", 0) > 1 and multi_x > 1
    return ("passed" if ok else "failed"), said + " (goal: > 1x both)", keep


def judge_run(rows: list[dict[str, Any]], summary: dict[str, Any], iterations: int, gpu: bool) -> Verdict:
    """A finished ``textrl train``: ``rows`` of its metrics.jsonl, its summary.json. Fails on a skipped or
    rolled-back update, fewer rows than ``iterations``, and (on a GPU) a run not on CUDA under bf16
    autocast, a last-50 rollout reward not above the first 50's, a held-out reward not risen."""
    problems = []
    if any("nonfinite/skipped_updates" not in r for r in rows):
        problems.append("a metrics row has no nonfinite/skipped_updates (cannot tell whether an update was skipped)")
    skipped = sum(float(r.get("nonfinite/skipped_updates") or 0) for r in rows)
    rolled_back = sum(float(r.get("nonfinite/rolled_back") or 0) for r in rows)
    if skipped or rolled_back:
        problems.append(f"{skipped:.0f} skipped updates, {rolled_back:.0f} rolled back")
    if len(rows) != iterations:
        problems.append(f"{len(rows)} iterations of {iterations}")
    rewards = [float(r["reward/mean"]) for r in rows if isinstance(r.get("reward/mean"), (int, float))]
    n = min(50, len(rewards) // 2)
    first = statistics.mean(rewards[:n]) if n else math.nan
    last = statistics.mean(rewards[-n:]) if n else math.nan
    key = "eval/sampled/reward/mean"
    before, after = (summary.get("before") or {}).get(key), (summary.get("after") or {}).get(key)
    precision = summary.get("precision") or {}
    figures = {"iterations": len(rows), "skipped_updates": skipped, "rolled_back": rolled_back,
               f"reward_first_{n}": first, f"reward_last_{n}": last, "held_out_before": before,
               "held_out_after": after, "precision": precision, "generation_engine": summary.get("generation_engine"),
               "gap_closed": (summary.get("gap_closed") or {}).get("share"),
               "seconds_per_iteration": statistics.median(float(r.get("time/iteration_s", math.nan)) for r in rows)
               if rows else None}
    said = (f"{len(rows)} iterations, {skipped:.0f} skipped updates, rollout reward {first:.3f} -> {last:.3f} "
            f"(first / last {n}), held-out {num(before, '.3f')} -> {num(after, '.3f')}, "
            f"autocast {precision.get('autocast', '?')} on {precision.get('device', '?')}")
    if gpu:
        if not str(precision.get("device", "")).startswith("cuda") or precision.get("autocast") != "bfloat16":
            problems.append(f"ran on {precision.get('device')!r} with autocast {precision.get('autocast')!r}, "
                            "not on CUDA under bf16")
        if not last > first:
            problems.append("the rollout reward did not rise")
        if not (isinstance(before, (int, float)) and isinstance(after, (int, float)) and after > before):
            problems.append("the held-out reward did not rise")
    else:
        said += " (tiny: the reward is reported, not judged)"
    return ("failed" if problems else "passed"), said + "".join(f"; FAILED: {p}" for p in problems), figures


def judge_memory(f: dict[str, Any], gpu: bool) -> Verdict:
    row = (f.get("rows") or {}).get(MEMORY_ROW, {})
    keep = {k: v for k, v in row.items() if isinstance(v, (int, float, str)) and k != "row"}
    goal = (f.get("goals") or {}).get(MEMORY_GOAL, {})
    keep["goal"] = goal
    status = str(row.get("status", "missing"))
    said = (f"row {MEMORY_ROW}: peak {num(row.get('peak_with_build_mb'), '.0f')} MiB ({f.get('memory')}), "
            f"{num(row.get('seconds_per_iteration'))} s an iteration")
    if status.startswith("skipped"):
        return "skipped", f"row {MEMORY_ROW} {status}", keep
    if status != "ok":
        return "failed", f"row {MEMORY_ROW}: status {status!r}: {row.get('error', '')}"[:400], keep
    if not gpu:
        return "passed", said + " at tiny size (the 12 GB goal is for a GPU)", keep
    ok = goal.get("status") == "met"
    return ("passed" if ok else "failed"), said + f"; goal {MEMORY_GOAL}: {goal.get('status', 'not reported')}", keep


def judge_padding_free(f: dict[str, Any], gpu: bool) -> Verdict:
    keep = {k: v for k, v in f.items() if k.endswith(("_speedup", "/share", "max_abs_diff"))}
    half = [f.get(f"padding_50/{phase}/packed_speedup") for phase in ("prefill", "fwd+bwd")]
    said = (f"padding-free at 50% padding: prefill {num(half[0])}x, forward+backward {num(half[1])}x the padded "
            f"(25%: {num(f.get('padding_25/fwd+bwd/packed_speedup'))}x, 75%: "
            f"{num(f.get('padding_75/fwd+bwd/packed_speedup'))}x forward+backward)")
    if not gpu:
        return "passed", said + " at tiny size (the goal is for a GPU)", keep
    ok = all(isinstance(x, (int, float)) and x >= PADDING_FREE_GOAL for x in half)
    return ("passed" if ok else "failed"), said + f" (goal >= {PADDING_FREE_GOAL:g}x both)", keep


# -- the checks ---------------------------------------------------------------------------------------


def check_cuda_tests(sizes: Sizes, argv: list[str], budget_s: float, name: str = "cuda_tests") -> Result:
    proc, out, seconds = run(argv, budget_s)
    if proc is None:
        return Result(name, "failed", f"ran past its {budget_s:.0f} s budget: {tail(out)}", command=shown(argv),
                      seconds=seconds)
    return Result(name, *judge_cuda_tests(out, proc.returncode, sizes.gpu), shown(argv), seconds)


def bench(judge: Callable[[dict[str, Any], bool], Verdict]) -> Callable[[Sizes, list[str], float], Result]:
    """A check that runs a benchmark script and judges the JSON line it prints last."""

    def check(sizes: Sizes, argv: list[str], budget_s: float, name: str = "") -> Result:
        proc, out, seconds = run(argv, budget_s)
        if proc is None:
            return Result(name, "failed", f"ran past its {budget_s:.0f} s budget: {tail(out)}", command=shown(argv),
                          seconds=seconds)
        figures = last_json(out)
        if proc.returncode != 0 or not figures:
            return Result(name, "failed", f"exit {proc.returncode}: {tail(out)}", command=shown(argv), seconds=seconds)
        return Result(name, *judge(figures, sizes.gpu), shown(argv), seconds)

    return check


def check_trl(sizes: Sizes, argv: list[str], budget_s: float, name: str = "trl") -> Result:
    if not has_module("trl"):
        return Result(name, "skipped", f"TRL is not installed: pip install trl=={TRL_VERSION} (for a GPU machine "
                      f"without network: pip download trl=={TRL_VERSION} --no-deps -d .gpu/whl, after prepare.sh)",
                      command=shown(argv))
    return bench(judge_trl)(sizes, argv, budget_s, name)


def check_default_run(sizes: Sizes, argv: list[str], budget_s: float, name: str = "default_run") -> Result:
    folder = Path(argv[argv.index("--output-dir") + 1])
    iterations = int(argv[argv.index("--iterations") + 1])
    proc, out, seconds = run(argv, budget_s)
    metrics = folder / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    if proc is None or proc.returncode != 0:
        cause = f"ran past its {budget_s:.0f} s budget" if proc is None else f"exit {proc.returncode}"
        return Result(name, "failed", f"{cause} after {len(rows)} of {iterations} iterations: {tail(out)}",
                      {"iterations": len(rows)}, shown(argv), seconds)
    summary = json.loads((folder / "summary.json").read_text())
    status, why, figures = judge_run(rows, summary, iterations, sizes.gpu)
    if not sizes.gpu:
        why += "; bf16 as on a GPU" if cpu_has_bf16() else "; float32: this CPU has no bf16 instructions"
    return Result(name, status, why, figures, shown(argv), seconds)


CHECKS: dict[str, tuple[Callable[..., Result], float, float]] = {
    "cuda_tests": (check_cuda_tests, 130, 55),
    "ppo_iteration": (bench(judge_ppo_iteration), 60, 45),
    "trl": (check_trl, 50, 40),
    "generation": (bench(judge_generation), 50, 30),
    "default_run": (check_default_run, 140, 60),
    "memory_0.5b": (bench(judge_memory), 60, 45),
    "padding_free": (bench(judge_padding_free), 40, 25),
}
"""Name -> (the check, its budget in seconds on a GPU, on the CPU); the budgets sum to TOTAL_S."""


# -- the report ---------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """The card (or the CPU), torch, CUDA, Python and the CPU count."""
    import torch

    gpu = torch.cuda.is_available()
    cpu = platform.processor() or platform.machine()
    try:
        cpu = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M).group(1)
    except (OSError, AttributeError):
        pass
    card = (f"{torch.cuda.get_device_name(0)} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"
            if gpu else "none")
    return {"card": card, "cpu": cpu, "cpus": os.cpu_count(), "torch": torch.__version__,
            "cuda": torch.version.cuda if gpu else None, "python": platform.python_version()}


def commit(given: str | None) -> dict[str, Any]:
    """``given``, else the checkout's HEAD with ``+dirty`` and the changed tracked files, else 'unknown'."""
    if given:
        return {"commit": given, "changed": []}
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    if head.returncode != 0:
        return {"commit": "unknown (no git checkout here: pass --commit)", "changed": []}
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                             cwd=ROOT).stdout.splitlines()
    changed = [line[3:] for line in changed if line.strip()]
    return {"commit": head.stdout.strip() + ("+dirty" if changed else ""), "changed": changed}


def rounded(value: Any) -> Any:
    """``value`` with every float kept to 4 significant digits (the markdown's figures; the JSON keeps all)."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: a heading, the machine, a row per check, each check's figures."""
    m = report["machine"]
    where = (f"Card {m['card']}, CUDA {m['cuda']}; CPU {m['cpu']}" if report["gpu"] else
             f"A CPU rehearsal at tiny sizes, not a proof of a GPU (card: {m['card']}); CPU {m['cpu']}")
    changed = report["changed"]
    lines = [f"# GPU check, {report['date']}", "",
             f"{where}; {m['cpus']} CPUs; torch {m['torch']}, Python {m['python']}; commit {report['commit']}"
             + (f" (changed: {', '.join(changed[:8])}{', ...' if len(changed) > 8 else ''})" if changed else "")
             + f"; {report['seconds']:.0f} s in all. **{report['verdict']}**.", "",
             "| check | status | why | seconds | command |", "|---|---|---|---|---|"]
    for r in report["checks"]:
        lines.append(f"| {r['name']} | {r['status']} | {r['why'].replace('|', '/')} | {r['seconds']:.0f} | "
                     f"`{r['command']}` |")
    lines += ["", "Figures:", "", "```json",
              json.dumps({r["name"]: rounded(r["figures"]) for r in report["checks"]}, indent=1, default=str), "```", ""]
    return "\n".join(lines)


def run_checks(names: list[str], sizes: Sizes) -> list[Result]:
    """Each check under its budget plus what the checks before it left unused, within TOTAL_S."""
    key = "gpu" if sizes.gpu else "cpu"
    argvs = commands(sizes)
    deadline = time.perf_counter() + TOTAL_S[key]
    spare, results = 0.0, []
    for name in names:
        check, gpu_budget, cpu_budget = CHECKS[name]
        own = gpu_budget if sizes.gpu else cpu_budget
        budget = min(own + spare, deadline - time.perf_counter())
        print(f"{name} (budget {budget:.0f} s): {shown(argvs[name])}", flush=True)
        if budget < 5:
            result = Result(name, "failed", f"not run: the {TOTAL_S[key]:.0f} s of the checks were spent",
                            command=shown(argvs[name]))
        else:
            try:
                result = check(sizes, argvs[name], budget, name=name)
            except Exception as err:  # a check's own bug: its row says so, the others still run
                result = Result(name, "failed", f"the check raised {type(err).__name__}: {err}",
                                command=shown(argvs[name]))
        spare = max(0.0, own + spare - result.seconds)
        results.append(result)
        print(f"{name}: {result.status} ({result.seconds:.0f} s): {result.why}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="folder of gpu_check.json and gpu_check.md (default docs/gpu-check/, on a CPU "
                             "docs/gpu-check/cpu-rehearsal/)")
    parser.add_argument("--commit", default=None, help="the commit checked (default: git rev-parse HEAD)")
    parser.add_argument("--only", default="", help=f"comma list of checks, of {', '.join(CHECKS)}")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU even where CUDA is")
    parser.add_argument("--print-commands", action="store_true",
                        help="print each check's command at GPU and at tiny sizes as JSON, run nothing")
    args = parser.parse_args(argv)
    only = [c.strip() for c in args.only.split(",") if c.strip()] or list(CHECKS)
    unknown = sorted(set(only) - set(CHECKS))
    if unknown:
        parser.error(f"--only: no check {', '.join(unknown)}; choose among {', '.join(CHECKS)}")
    if args.print_commands:
        work = Path(tempfile.gettempdir()) / "gpu_check"
        print(json.dumps({k: commands(Sizes(gpu=k == "gpu", work=work)) for k in ("gpu", "tiny")}, indent=1))
        return 0
    import torch

    gpu = torch.cuda.is_available() and not args.tiny
    out = args.out or ROOT / "docs" / "gpu-check" / ("" if gpu else "cpu-rehearsal")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        results = run_checks(only, Sizes(gpu=gpu, work=Path(work)))
    failed = [r.name for r in results if r.status == "failed"]
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": gpu, "machine": machine(),
              **commit(args.commit), "seconds": time.perf_counter() - start,
              "verdict": f"failed: {', '.join(failed)}" if failed else "every check passed or was skipped with why",
              "checks": [asdict(r) for r in results]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))
    print(f"report: {out / 'gpu_check.md'}; {report['verdict']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
