"""The default run on a machine with one core busy elsewhere, against the same run alone.

    python benchmarks/bench_busy.py [--iterations 12] [--busy 1] [--max-ratio 2.5] [--env KEY=VALUE ...]

Runs ``textrl train`` as its defaults have it (the tiny model, rloo on digits; a short supervised
warm-up, ``--iterations`` iterations, no progress bar) once a case, each its own process:

- ``alone``: nothing else running from this script;
- ``niced``: beside ``--busy`` processes spinning a core each (``while True: pass``) at nice 19,
  started before the run from this script's session (the run's own scheduling group: they yield
  to it, and the run should keep its threads);
- ``niced_elsewhere``: the same from a session of their own (``setsid``: where the kernel's
  autogroup is on, as on most desktops and this machine, nice values count only within a session,
  so these compete at full weight and the run should fit its threads);
- ``busy``: beside ``--busy`` plain spinning processes (nice 0), started before the run;
- ``busy_later``: the same, started once the run has logged its first iteration (a machine that
  becomes busy during a run: the run's thread choice at start cannot see it).

Seconds an iteration of each are the median of its iterations after the first two, the held-out
evaluation's seconds left out (``time/iteration_s - time/eval_s`` in ``metrics.jsonl``), and the
threads the run ended with (its start's, less the changes it said: ``textrl.run.pace``). Prints
them, the run's wall clock (set-up and warm-up included), the ratio of each case to ``alone`` and
whether it is within ``--max-ratio`` (exit status 1 if not), then one JSON line. ``--env
KEY=VALUE`` sets a variable for every run (``OMP_NUM_THREADS=2`` keeps the threads as they start,
to see what fitting them gains or costs); ``--cases`` picks the runs. Other load on the machine
makes the figures noisy: the load average before each run is printed beside it. A script, never
imported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUSY_LOOP = "while True: pass"
LOADS = {"alone": None, "niced": (19, False, False), "niced_elsewhere": (19, True, False), "busy": (0, False, False),
         "busy_later": (0, False, True)}
"""Each case's spinning processes: ``(nice, in a session of their own, started after the first iteration)``."""
CASES = tuple(LOADS)
THREAD_CHANGE = re.compile(r"(\d+) torch thread\(s\) (?:from here|for the set-up) \(was (\d+)\)")


def iteration_seconds(metrics: Path, skip: int) -> list[float]:
    """Seconds of each iteration in ``metrics`` (a ``metrics.jsonl``) after the first ``skip``,
    the held-out evaluation's seconds left out."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r["time/iteration_s"] - r.get("time/eval_s", 0.0) for r in rows if r["iteration"] > skip]


def spin(nice: int, own_session: bool) -> subprocess.Popen:
    """A process spinning a core at ``nice``, in this script's session or one of its own."""
    return subprocess.Popen([sys.executable, "-c", BUSY_LOOP], start_new_session=own_session,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)


def threads_used(log: str, starting: int) -> str:
    """The torch threads a run ended with, from the changes its ``log`` said (``2`` or ``2 -> 1``)."""
    changes = [(int(now), int(was)) for now, was in THREAD_CHANGE.findall(log)]
    return " -> ".join(str(n) for n in [changes[0][1] if changes else starting] + [now for now, _ in changes])


def run_case(case: str, args: argparse.Namespace, env: dict[str, str], folder: Path, starting: int) -> dict:
    """One ``textrl train`` run for ``case``; its iteration seconds, threads and the load before it."""
    out = folder / case
    command = [sys.executable, "-m", "textrl", "train", "--iterations", str(args.iterations),
               "--warmup-sft-steps", str(args.warmup_sft_steps), "--eval-every", "0",
               "--output-dir", str(out), "--progress", "false", *args.train_args]
    load = os.getloadavg()[0]
    nice, own_session, later = LOADS[case] or (0, False, False)
    busy: list[subprocess.Popen] = []
    if LOADS[case] and not later:
        busy = [spin(nice, own_session) for _ in range(args.busy)]
        time.sleep(1.0)  # spinning before the run starts
    start = time.perf_counter()
    log = open(folder / f"{case}.log", "w")
    try:
        run = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        if LOADS[case] and later:
            metrics = out / "metrics.jsonl"
            while run.poll() is None and not (metrics.is_file() and metrics.read_text().strip()):
                time.sleep(0.05)
            busy = [spin(nice, own_session) for _ in range(args.busy)]
        code = run.wait()
    finally:
        for process in busy:
            process.kill()
            process.wait()
        log.close()
    text = (folder / f"{case}.log").read_text()
    if code != 0:
        raise SystemExit(f"{case}: textrl train exited {code}; its output is in {folder / (case + '.log')}:\n"
                         + text[-3000:])
    seconds = iteration_seconds(out / "metrics.jsonl", args.skip)
    said = ("slower than", "torch thread(s)")  # the run's pace lines (textrl.run.pace)
    hints = [line for line in text.splitlines() if any(s in line for s in said)]
    return {"seconds": statistics.median(seconds), "all": seconds, "load_before": load,
            "wall": time.perf_counter() - start, "hints": hints, "threads": threads_used(text, starting)}


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
    starting = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                                  capture_output=True, text=True, check=True).stdout)
    print(f"{os.cpu_count()} cores, {starting} torch threads at start; textrl train --iterations {args.iterations} --warmup-sft-steps "
          f"{args.warmup_sft_steps} {' '.join(args.train_args)}; env {' '.join(args.env) or '(as is)'}", flush=True)

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_busy_") as tmp:
        for case in cases:
            results[case] = run_case(case, args, env, Path(tmp), starting)
            r = results[case]
            print(f"{case:>15}: {r['seconds']:.3f} s an iteration, threads {r['threads']}, {r['wall']:.1f} s in all "
                  f"(load before {r['load_before']:.2f}; each: {' '.join(f'{s:.2f}' for s in r['all'])})", flush=True)
            for hint in r["hints"]:
                print(f"{'':>17}{hint}")
    alone = results["alone"]
    failed = False
    summary = {"alone_s": alone["seconds"], "alone_threads": alone["threads"], "alone_wall_s": alone["wall"]}
    for case in [c for c in cases if c != "alone"]:
        r = results[case]
        ratio, wall_ratio = r["seconds"] / alone["seconds"], r["wall"] / alone["wall"]
        ok = ratio <= args.max_ratio
        failed |= not ok
        summary |= {f"{case}_s": r["seconds"], f"{case}_ratio": ratio, f"{case}_threads": r["threads"],
                    f"{case}_wall_ratio": wall_ratio}
        print(f"{case} / alone: {ratio:.2f}x an iteration, {wall_ratio:.2f}x in all, threads {r['threads']} "
              f"({'within' if ok else 'OVER'} {args.max_ratio}x)")
    print(json.dumps(summary | {"passed": not failed}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
