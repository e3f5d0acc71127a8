"""The default run on a machine with one core busy elsewhere, against the same run alone.

    python benchmarks/bench_busy.py [--iterations 12] [--busy 1] [--max-ratio 2.5] [--env KEY=VALUE ...]

Runs ``textrl train`` as its defaults have it (the tiny model, rloo on digits; a short supervised
warm-up, ``--iterations`` iterations, no progress bar) three times, each its own process:

- ``alone``: nothing else running from this script;
- ``busy``: beside ``--busy`` processes spinning a core each (``while True: pass``), started
  before the run;
- ``busy_later``: the same, started once the run has logged its first iteration (a machine that
  becomes busy during a run: the run's thread choice at start cannot see it).

Seconds an iteration of each are the median of its iterations after the first two, the held-out
evaluation's seconds left out (``time/iteration_s - time/eval_s`` in ``metrics.jsonl``). Prints
them, the ratio of each busy case to ``alone`` and whether it is within ``--max-ratio`` (exit
status 1 if not), then one JSON line. ``--env KEY=VALUE`` sets a variable for every run (to try
``OMP_NUM_THREADS=2`` or ``OMP_WAIT_POLICY=ACTIVE`` against the defaults); ``--cases`` picks the
runs. Other load on the machine makes the figures noisy: the load average before each run is
printed beside it. A script, never imported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUSY_LOOP = "while True: pass"
CASES = ("alone", "busy", "busy_later")


def iteration_seconds(metrics: Path, skip: int) -> list[float]:
    """Seconds of each iteration in ``metrics`` (a ``metrics.jsonl``) after the first ``skip``,
    the held-out evaluation's seconds left out."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r["time/iteration_s"] - r.get("time/eval_s", 0.0) for r in rows if r["iteration"] > skip]


def run_case(case: str, args: argparse.Namespace, env: dict[str, str], folder: Path) -> dict:
    """One ``textrl train`` run for ``case``; its iteration seconds and the load before it."""
    out = folder / case
    command = [sys.executable, "-m", "textrl", "train", "--iterations", str(args.iterations),
               "--warmup-sft-steps", str(args.warmup_sft_steps), "--eval-every", "0",
               "--output-dir", str(out), "--progress", "false", *args.train_args]
    load = os.getloadavg()[0]
    busy: list[subprocess.Popen] = []
    if case == "busy":
        busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.busy)]
        time.sleep(1.0)  # spinning before the run starts
    start = time.perf_counter()
    log = open(folder / f"{case}.log", "w")
    try:
        run = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        if case == "busy_later":
            metrics = out / "metrics.jsonl"
            while run.poll() is None and not (metrics.is_file() and metrics.read_text().strip()):
                time.sleep(0.05)
            busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.busy)]
        code = run.wait()
    finally:
        for process in busy:
            process.kill()
            process.wait()
        log.close()
    if code != 0:
        raise SystemExit(f"{case}: textrl train exited {code}; its output is in {folder / (case + '.log')}:\n"
                         + (folder / f"{case}.log").read_text()[-3000:])
    seconds = iteration_seconds(out / "metrics.jsonl", args.skip)
    said = ("slower than", "torch thread(s) from here")  # the run's pace lines (textrl.run.pace)
    hints = [line for line in (folder / f"{case}.log").read_text().splitlines() if any(s in line for s in said)]
    return {"seconds": statistics.median(seconds), "all": seconds, "load_before": load,
            "wall": time.perf_counter() - start, "hints": hints}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--warmup-sft-steps", type=int, default=5)
    parser.add_argument("--skip", type=int, default=2, help="iterations left out at the start")
    parser.add_argument("--busy", type=int, default=1, help="busy processes beside the run")
    parser.add_argument("--max-ratio", type=float, default=2.5)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("train_args", nargs="*", help="more `textrl train` arguments (after --)")
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown or "alone" not in cases:
        parser.error(f"--cases {args.cases!r}: must include 'alone' and name only {', '.join(CASES)}")
    env = dict(os.environ)
    for item in args.env:
        key, _, value = item.partition("=")
        env[key] = value
    print(f"{os.cpu_count()} cores; textrl train --iterations {args.iterations} --warmup-sft-steps "
          f"{args.warmup_sft_steps} {' '.join(args.train_args)}; env {' '.join(args.env) or '(as is)'}", flush=True)

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_busy_") as tmp:
        for case in cases:
            results[case] = run_case(case, args, env, Path(tmp))
            r = results[case]
            print(f"{case:>10}: {r['seconds']:.3f} s an iteration (load before {r['load_before']:.2f}; "
                  f"each: {' '.join(f'{s:.2f}' for s in r['all'])})", flush=True)
            for hint in r["hints"]:
                print(f"{'':>12}{hint}")
    alone = results["alone"]["seconds"]
    failed = False
    summary = {"alone_s": alone}
    for case in cases[1:] if cases[0] == "alone" else [c for c in cases if c != "alone"]:
        ratio = results[case]["seconds"] / alone
        ok = ratio <= args.max_ratio
        failed |= not ok
        summary |= {f"{case}_s": results[case]["seconds"], f"{case}_ratio": ratio}
        print(f"{case} / alone: {ratio:.2f}x ({'within' if ok else 'OVER'} {args.max_ratio}x)")
    print(json.dumps(summary | {"passed": not failed}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
