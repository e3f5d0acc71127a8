"""Start-up cost of a large prompt file: time and peak memory before the first training batch.

    python benchmarks/bench_prompts.py [--rows 200000] [--rows 1000000] [--cases floor,sampler,check]

For each ``--rows N`` a JSONL of N one-line ``{"prompt": ..., "answer": ...}`` rows is written to
a temporary folder; then each case runs in a fresh subprocess (``OMP_NUM_THREADS=1``), timed from
after the imports:

- ``floor``: read the file line by line and ``json.loads`` every row, keeping nothing (the least
  any loader that validates every row does);
- ``sampler``: ``load_prompts`` + ``split(1000)`` + ``PromptSampler`` with the tiny tokenizer
  (``textrl.models.build_tiny_tokenizer``, chat template on) + the first ``next_batch`` (64
  prompts), what ``textrl train`` does before its first iteration besides the context check;
- ``check``: ``load_prompts`` + ``check_prompts_fit`` over the whole file (``textrl train``'s
  refusal of prompts that do not fit the model's context), with ``max_prompt_length=64``.

Time is wall-clock and CPU (user + system, every thread: the tokenizer's run in parallel); on a
shared machine the CPU time is the steadier figure. Memory is the peak RSS (``ru_maxrss``) and its
rise over the RSS right after the imports (torch, transformers); ratios are against the ``floor``
case of the same run and the file's size.
Prints a table, then one JSON line last. A script, never imported.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = ("floor", "sampler", "check")
EVAL_SIZE = 1000
PROMPTS_PER_BATCH = 64


def rss_mib() -> float:
    """Current resident set size in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    """High-water RSS of this process in MiB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_s() -> float:
    """CPU seconds (user + system) this process has used, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def write_prompts(path: Path, rows: int) -> int:
    """Write ``rows`` one-line arithmetic prompts to ``path``; returns the file's size in bytes."""
    with path.open("w", encoding="utf-8") as f:
        for i in range(rows):
            a, b = (i * 7919) % 1000, (i * 104729) % 1000
            prompt = f"Row {i}: what is {a} + {b}? Think, then answer with the number only."
            f.write(json.dumps({"prompt": prompt, "answer": str(a + b)}) + "\n")
    return path.stat().st_size


def run_floor(path: Path) -> dict:
    """Read and parse every line, keeping nothing."""
    n = 0
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                json.loads(line.decode("utf-8"))
                n += 1
    return {"rows": n}


def run_sampler(path: Path) -> dict:
    """load_prompts + split + PromptSampler + the first batch, as ``textrl train`` sets up."""
    from textrl.envs import PromptSampler, load_prompts
    from textrl.models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    train, _ = load_prompts(path).split(EVAL_SIZE, seed=0)
    sampler = PromptSampler(train, tokenizer, prompts_per_batch=PROMPTS_PER_BATCH, seed=0,
                            max_prompt_length=64)
    batch = sampler.next_batch()
    return {"rows": len(train), "batch": list(batch.input_ids.shape)}


def run_check(path: Path) -> dict:
    """load_prompts + check_prompts_fit over every row."""
    from textrl.envs import check_prompts_fit, load_prompts
    from textrl.models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    prompts = load_prompts(path)
    check_prompts_fit(prompts, tokenizer, context=512, max_new_tokens=64, max_prompt_length=64)
    return {"rows": len(prompts)}


def child(case: str, path: Path) -> None:
    """One case in this (fresh) process; prints one JSON line."""
    import textrl.envs  # noqa: F401  (imports are not timed)
    import textrl.models  # noqa: F401

    base = rss_mib()
    start, cpu = time.perf_counter(), cpu_s()
    info = {"floor": run_floor, "sampler": run_sampler, "check": run_check}[case](path)
    wall, cpu = time.perf_counter() - start, cpu_s() - cpu
    peak = peak_mib()
    print(json.dumps({"case": case, "wall_s": wall, "cpu_s": cpu, "peak_mib": peak,
                      "rise_mib": peak - base, "base_mib": base, **info}))


def measure(case: str, path: Path) -> dict:
    """Run ``case`` in a fresh subprocess; its JSON line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--child", case, "--file", str(path)],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        tail = "\n".join(out.stderr.strip().splitlines()[-5:])
        sys.exit(f"case {case!r} failed (exit {out.returncode}) on {path}:\n{tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, action="append", help="rows of the file (repeatable)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.file)
        return
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {CASES}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rows in args.rows or [200_000]:
            path = Path(tmp) / f"prompts_{rows}.jsonl"
            size_mib = write_prompts(path, rows) / 2**20
            floor = measure("floor", path)
            print(f"\n{rows:,} rows, file {size_mib:.1f} MiB; floor (read + json.loads every line): "
                  f"{floor['wall_s']:.2f} s, peak {floor['peak_mib']:.0f} MiB "
                  f"(+{floor['rise_mib']:.0f} over the imports)")
            print(f"{'case':<8} {'wall s':>8} {'cpu s':>8} {'x floor':>8} {'peak MiB':>9} "
                  f"{'rise MiB':>9} {'rise/file':>9} {'B/row':>7}")
            for case in cases:
                r = floor if case == "floor" else measure(case, path)
                r.update(rows_in_file=rows, file_mib=size_mib)
                results.append(r)
                print(f"{case:<8} {r['wall_s']:>8.2f} {r['cpu_s']:>8.2f} "
                      f"{r['wall_s'] / floor['wall_s']:>8.1f} "
                      f"{r['peak_mib']:>9.0f} {r['rise_mib']:>9.0f} "
                      f"{r['rise_mib'] / size_mib:>9.2f} {r['rise_mib'] * 2**20 / rows:>7.0f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
