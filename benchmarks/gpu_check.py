"""One command proves a GPU: the CUDA tests, the GPU benchmarks and a real run, in one report.

    python benchmarks/gpu_check.py [--out DIR] [--commit SHA] [--only NAME,...] [--tiny]
    bash .gpu/run.sh python3 benchmarks/gpu_check.py --out "$OUT/gpu-check" --commit "$(git rev-parse HEAD)"

Each check runs in a process of its own, under a time budget (9 minutes in all on one GPU), and ends
``passed``, ``failed`` or ``skipped`` with why, its figures, its command and its wall time:

- ``cuda_tests``: ``pytest -m "cuda and not slow" tests`` (every test must pass);
- ``ppo_iteration``: one PPO iteration of ``gae_ppo`` at 114M parameters against its floor, and the
  rollback guard's cost (``benchmarks/bench_ppo_iteration.py``; passes with the guard's update
  overhead <= 5%, the goal that script states);
- ``trl``: the same iteration against TRL 1.12's PPO (``benchmarks/bench_trl_ppo.py``; skipped,
  naming the wheel to add, where TRL is not installed);
- ``generation``: the ``textrl`` and ``hf`` engines, single- and multi-turn
  (``benchmarks/bench_generation.py``; passes when ``textrl`` is faster than ``hf`` both ways);
- ``default_run``: the embedded default, ``textrl train --mixed-precision bf16 --iterations 300
  --seed 0``: no skipped or rolled-back update, the rollout reward of the last 50 iterations above
  the first 50's, and the held-out reward after above before;
- ``memory_0.5b``: one memory row at 0.5B parameters (``benchmarks/bench_gpu_memory.py``, row
  ``gae_ppo-0.5b-v512-all``: every memory option on).

Without CUDA (or with ``--tiny``) every check runs at tiny sizes on the CPU in about 3 minutes: the
CUDA tests are only collected (there is no GPU to run them), the default run is 6 iterations in
float32 and its reward is reported, not judged; a rehearsal of the script, not a proof of a GPU.

Writes ``gpu_check.json`` and ``gpu_check.md`` to ``--out`` (default ``gpu-check/`` in the working
folder): the date, the card, torch and CUDA versions, the commit (``--commit``, else ``git
rev-parse HEAD`` where the checkout has its ``.git``; ``+dirty`` for uncommitted changes) and one row
per check. Exit status 1 when a check failed. docs/gpu-check.md keeps the latest report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
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
GUARD_GOAL = 0.05
"""The rollback guard's most update overhead on a GPU (benchmarks/bench_ppo_iteration.py's goal)."""
TRL_VERSION = "1.12.0"


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
    """What the checks run at: a GPU's real sizes, or the CPU's tiny ones."""

    device: str
    gpu: bool

    @property
    def model(self) -> list[str]:
        return (["--hidden", "768", "--intermediate", "3072", "--layers", "12", "--heads", "12", "--batch", "64",
                 "--new-tokens", "256"] if self.gpu else ["--batch", "4", "--new-tokens", "8", "--threads", "1"])


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


def run(command: list[str], budget_s: float, cwd: Path | None = None) -> tuple[subprocess.CompletedProcess | None, float]:
    """``command`` under ``budget_s`` seconds; (its result, or None when it ran out of time; seconds)."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=budget_s, cwd=cwd, env=env)
    except subprocess.TimeoutExpired:
        return None, time.perf_counter() - start
    return proc, time.perf_counter() - start


def tail(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in (proc.stderr + proc.stdout).strip().splitlines() if line.strip()]
    return " / ".join(lines[-2:])[-300:]


# -- the checks ---------------------------------------------------------------------------------------


def check_cuda_tests(sizes: Sizes, budget_s: float) -> Result:
    tests = ROOT / "tests" if (ROOT / "tests").is_dir() else Path.cwd() / "tests"
    marker = "cuda and not slow"
    options = ["-q", "-p", "no:randomly", "-m", marker] + ([] if sizes.gpu else ["--collect-only"])
    args = [sys.executable, "-m", "pytest", *options, str(tests)]
    proc, seconds = run(args, budget_s)
    command = shlex.join(["python", "-m", "pytest", *options, "tests"])
    if proc is None:
        return Result("cuda_tests", "failed", f"ran past its {budget_s:.0f} s budget", command=command, seconds=seconds)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected|selected)",
                                                proc.stdout)}
    if not sizes.gpu:
        collected = len([line for line in proc.stdout.splitlines() if "::" in line])
        status = "skipped" if proc.returncode == 0 else "failed"
        return Result("cuda_tests", status, f"no GPU: {collected} CUDA tests collected, not run"
                      if proc.returncode == 0 else f"collection failed: {tail(proc)}",
                      {"collected": collected}, command, seconds)
    ok = proc.returncode == 0 and counts.get("passed", 0) > 0
    return Result("cuda_tests", "passed" if ok else "failed",
                  f"{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, {counts.get('skipped', 0)} skipped"
                  + ("" if ok else f": {tail(proc)}"), counts, command, seconds)


def check_ppo_iteration(sizes: Sizes, budget_s: float) -> Result:
    args = [sys.executable, str(HERE / "bench_ppo_iteration.py"), "--device", sizes.device, *sizes.model,
            "--iterations", "10", "--warmup", "1"]  # the script's median needs 10
    return _bench("ppo_iteration", args, budget_s, _judge_iteration(sizes))


def _judge_iteration(sizes: Sizes) -> Callable[[dict[str, Any]], tuple[bool, str, dict[str, Any]]]:
    def judge(f: dict[str, Any]) -> tuple[bool, str, dict[str, Any]]:
        keep = {k: f[k] for k in ("seconds_per_iteration", "floor_seconds_per_iteration", "ratio_to_floor",
                                  "tokens_per_second", "guard/update_overhead", "guard/iteration_overhead") if k in f}
        overhead = f.get("guard/update_overhead")
        if not sizes.gpu:
            return True, f"{f.get('ratio_to_floor', float('nan')):.2f}x its floor at tiny size (the guard's goal is for a GPU)", keep
        ok = overhead is not None and overhead <= GUARD_GOAL
        return ok, (f"{f.get('ratio_to_floor', float('nan')):.2f}x its floor; the guard's update overhead "
                    f"{overhead:.3f} (goal <= {GUARD_GOAL})"), keep
    return judge


def check_trl(sizes: Sizes, budget_s: float) -> Result:
    try:
        import importlib.metadata as metadata

        version = metadata.version("trl")
    except Exception:
        return Result("trl", "skipped", f"TRL is not installed: add its wheel (pip download trl=={TRL_VERSION} "
                      "--no-deps -d .gpu/whl) to compare with TRL's PPO")
    args = [sys.executable, str(HERE / "bench_trl_ppo.py"), "--device", sizes.device, *sizes.model,
            "--iterations", "3" if sizes.gpu else "1", "--warmup", "1"]

    def judge(f: dict[str, Any]) -> tuple[bool, str, dict[str, Any]]:
        keep = {k: v for k, v in f.items() if isinstance(v, (int, float)) and ("speedup" in k or "seconds" in k)}
        return f.get("speedup", 0) > 0, f"textrl {f.get('speedup', float('nan')):.2f}x TRL {version}'s PPO iteration", keep
    return _bench("trl", args, budget_s, judge)


def check_generation(sizes: Sizes, budget_s: float) -> Result:
    shape = ["--shape", "114m", "--prompts", "16", "--samples", "4", "--new-tokens", "256", "--repeats", "2"] \
        if sizes.gpu else ["--prompts", "2", "--samples", "2", "--new-tokens", "6", "--repeats", "1", "--threads", "1"]
    args = [sys.executable, str(HERE / "bench_generation.py"), "--device", sizes.device, *shape,
            "--engines", "hf,textrl", "--turns", "4", "--observation-tokens", "4"]

    def judge(f: dict[str, Any]) -> tuple[bool, str, dict[str, Any]]:
        engines = f.get("engines", {})
        keep = {f"{name}/{k}": v for name, r in engines.items() for k, v in r.items()
                if k in ("seconds", "x_hf", "multi_tokens_per_second", "multi_over_single")}
        textrl, hf = engines.get("textrl", {}), engines.get("hf", {})
        if not textrl or not hf:
            return False, "the benchmark timed no textrl or hf engine", keep
        multi_x = textrl["multi_tokens_per_second"] / hf["multi_tokens_per_second"]
        keep["textrl/multi_x_hf"] = multi_x
        said = (f"textrl {textrl['x_hf']:.2f}x hf single-turn, {multi_x:.2f}x multi-turn "
                f"({textrl['multi_over_single']:.2f} of its single turn)")
        if not sizes.gpu:
            return True, said + " at tiny size (speed judged on a GPU)", keep
        return textrl["x_hf"] > 1 and multi_x > 1, said, keep
    return _bench("generation", args, budget_s, judge)


def check_default_run(sizes: Sizes, budget_s: float) -> Result:
    out = Path(tempfile.mkdtemp(prefix="gpu_check_run_"))
    iterations = 300 if sizes.gpu else 6
    args = [sys.executable, "-m", "textrl", "train", "--device", sizes.device, "--iterations", str(iterations),
            "--seed", "0", "--output-dir", str(out), "--progress", "false"]
    args += ["--mixed-precision", "bf16"] if sizes.gpu else ["--warmup-sft-steps", "20", "--eval-size", "8"]
    proc, seconds = run(args, budget_s)
    command = " ".join(["textrl", *args[3:]])
    if proc is None:
        return Result("default_run", "failed", f"ran past its {budget_s:.0f} s budget", command=command, seconds=seconds)
    if proc.returncode != 0:
        return Result("default_run", "failed", f"exit {proc.returncode}: {tail(proc)}", command=command, seconds=seconds)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out / "summary.json").read_text())
    skipped = sum(float(r.get("nonfinite/rolled_back") or 0) for r in rows)
    skipped = max(skipped, max((float(r.get("nonfinite/skipped_updates") or 0) for r in rows), default=0.0))
    n = min(50, len(rows) // 2)
    first = statistics.mean(r["reward/mean"] for r in rows[:n])
    last = statistics.mean(r["reward/mean"] for r in rows[-n:])
    key = "eval/sampled/reward/mean"
    before, after = (summary.get("before") or {}).get(key), (summary.get("after") or {}).get(key)
    figures = {"iterations": len(rows), "skipped_updates": skipped, f"reward_first_{n}": first, f"reward_last_{n}": last,
               "held_out_before": before, "held_out_after": after, "precision": summary.get("precision"),
               "generation_engine": summary.get("generation_engine"), "gap_closed": summary.get("gap_closed"),
               "seconds_per_iteration": statistics.median(r["time/iteration_s"] for r in rows)}
    said = (f"{len(rows)} iterations, {skipped:.0f} skipped updates, rollout reward {first:.3f} -> {last:.3f} "
            f"(first / last {n}), held-out {before} -> {after}")
    if not sizes.gpu:
        return Result("default_run", "passed" if skipped == 0 else "failed",
                      said + " (tiny: the reward is reported, not judged)", figures, command, seconds)
    ok = skipped == 0 and last > first and before is not None and after is not None and after > before
    return Result("default_run", "passed" if ok else "failed", said, figures, command, seconds)


def check_memory(sizes: Sizes, budget_s: float) -> Result:
    row = "gae_ppo-0.5b-v512-all" if sizes.gpu else "gae_ppo-0.5b-v512-off"
    args = [sys.executable, str(HERE / "bench_gpu_memory.py"), "--device", sizes.device, "--rows", row]
    if not sizes.gpu:
        args += ["--prompts", "2", "--samples", "2", "--new-tokens", "8"]

    def judge(f: dict[str, Any]) -> tuple[bool, str, dict[str, Any]]:
        found = (f.get("rows") or {}).get(row, {})
        keep = {k: v for k, v in found.items() if isinstance(v, (int, float, str))}
        ok = found.get("status") == "ok"
        return ok, (f"row {row}: peak {found.get('peak_mb', float('nan')):.0f} MiB ({f.get('memory')}), "
                    f"{found.get('seconds_per_iteration', float('nan')):.2f} s an iteration"
                    + ("" if ok else f"; status {found.get('status')!r}: {found.get('error', '')}")), keep
    return _bench("memory_0.5b", args, budget_s, judge)


def _bench(name: str, args: list[str], budget_s: float,
           judge: Callable[[dict[str, Any]], tuple[bool, str, dict[str, Any]]]) -> Result:
    """Run a benchmark script and judge its last JSON line."""
    proc, seconds = run(args, budget_s)
    command = " ".join(["python", *[Path(a).name if a.endswith(".py") else a for a in args[1:]]])
    if proc is None:
        return Result(name, "failed", f"ran past its {budget_s:.0f} s budget", command=command, seconds=seconds)
    figures = last_json(proc.stdout)
    if proc.returncode != 0 or not figures:
        return Result(name, "failed", f"exit {proc.returncode}: {tail(proc)}", command=command, seconds=seconds)
    ok, why, keep = judge(figures)
    return Result(name, "passed" if ok else "failed", why, keep, command, seconds)


CHECKS: dict[str, tuple[Callable[[Sizes, float], Result], float, float]] = {
    "cuda_tests": (check_cuda_tests, 150, 120),
    "ppo_iteration": (check_ppo_iteration, 75, 60),
    "trl": (check_trl, 75, 120),
    "generation": (check_generation, 60, 90),
    "default_run": (check_default_run, 120, 120),
    "memory_0.5b": (check_memory, 60, 180),
}
"""Name -> (the check, its budget in seconds on a GPU, on the CPU): 9 minutes in all on a GPU."""


# -- the report ---------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    import torch

    gpu = torch.cuda.is_available()
    return {"card": torch.cuda.get_device_name(0) if gpu else "none (CPU rehearsal)",
            "torch": torch.__version__, "cuda": torch.version.cuda if gpu else None,
            "python": sys.version.split()[0], "cpus": os.cpu_count()}


def commit(given: str | None) -> str:
    """``given``, else the checkout's HEAD (``+dirty`` with uncommitted changes), else 'unknown'."""
    if given:
        return given
    for folder in (ROOT, Path.cwd()):
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=folder)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                   text=True, cwd=folder).stdout.strip()
            return head.stdout.strip() + ("+dirty" if dirty else "")
    return "unknown (pass --commit)"


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"# GPU check, {report['date']}", "",
             f"Card: {m['card']}; torch {m['torch']}, CUDA {m['cuda']}, Python {m['python']}, {m['cpus']} CPUs; "
             f"commit {report['commit']}; {'GPU sizes' if report['gpu'] else 'tiny sizes on the CPU (a rehearsal)'}; "
             f"{report['seconds']:.0f} s in all. **{report['verdict']}**.", "",
             "| check | status | why | seconds | command |", "|---|---|---|---|---|"]
    for r in report["checks"]:
        lines.append(f"| {r['name']} | {r['status']} | {r['why'].replace('|', '/')} | {r['seconds']:.0f} | "
                     f"`{r['command']}` |")
    lines += ["", "Figures:", "", "```json", json.dumps({r["name"]: r["figures"] for r in report["checks"]}, indent=1),
              "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-check", help="folder of gpu_check.json and gpu_check.md")
    parser.add_argument("--commit", default=None, help="the commit checked (default: git rev-parse HEAD)")
    parser.add_argument("--only", default="", help=f"comma list of checks, of {', '.join(CHECKS)}")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU even where CUDA is")
    args = parser.parse_args(argv)
    only = [c for c in args.only.split(",") if c] or list(CHECKS)
    unknown = sorted(set(only) - set(CHECKS))
    if unknown:
        parser.error(f"--only: unknown checks {unknown}; choose among {', '.join(CHECKS)}")
    import torch

    gpu = torch.cuda.is_available() and not args.tiny
    sizes = Sizes(device="cuda" if gpu else "cpu", gpu=gpu)
    start = time.perf_counter()
    results = []
    for name in only:
        check, gpu_budget, cpu_budget = CHECKS[name]
        print(f"{name} ...", flush=True)
        try:
            result = check(sizes, gpu_budget if gpu else cpu_budget)
        except Exception as err:  # a check's own bug: its row says so, the others still run
            result = Result(name, "failed", f"the check raised {type(err).__name__}: {err}")
        results.append(result)
        print(f"{name}: {result.status} ({result.seconds:.0f} s): {result.why}", flush=True)
    failed = [r.name for r in results if r.status == "failed"]
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
              "commit": commit(args.commit), "gpu": gpu, "seconds": time.perf_counter() - start,
              "verdict": f"failed: {', '.join(failed)}" if failed else "every check passed or was skipped with why",
              "checks": [asdict(r) for r in results]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))
    print(f"report: {out / 'gpu_check.md'}; {report['verdict']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
