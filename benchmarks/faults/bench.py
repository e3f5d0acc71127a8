"""Fault cases of ``textrl bench`` (docs/reliability.md, "The bench"): a failed run, repeated
seeds, deleted outputs, a malformed record and a killed bench, each tried as a user would on a
comparison of one or two agents of one iteration each.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from fault_catalogue import SMALL, Trial, _refusal, case, judge, snapshot

# one iteration per run (a budget of 64 tokens at 8 x 8), no progress bar; --progress is the bench's own
TINY_BENCH = [a for a in SMALL if a not in ("--progress", "false")] + ["--envs", "digits", "--token-budget", "64",
                                                                        "--reps", "50"]
BROKEN_AGENT = '''
from textrl.agents import RLOO


class Broken(RLOO):
    """RLOO whose update fails, as a user's agent with a bug would."""

    def update(self, td):
        raise RuntimeError("broken on purpose")
'''


def _bench(trial: Trial, *args: str, **popen) -> subprocess.CompletedProcess:
    return trial.textrl("bench", *TINY_BENCH, *args, **popen)


def _finished_bench(trial: Trial, name: str) -> Path:
    """A copy of one finished comparison (rloo, seed 0), made once per trial."""
    made = trial.root / "bench_made"
    if not (made / "report.md").is_file():
        shutil.rmtree(made, ignore_errors=True)
        proc = _bench(trial, "--agents", "rloo", "--seeds", "0", "--output-dir", str(made))
        if proc.returncode != 0:
            raise RuntimeError(f"the base comparison failed: {proc.stderr[-2000:]}")
    out = trial.folder(name)
    shutil.copytree(made, out)
    return out


_refusal("bench: repeated seeds", ["bench", "--seeds", "0,0", "--agents", "rloo"], "seed(s) [0] repeated")


@case("bench: a failed run")
def failed_run(trial: Trial, base: Path) -> None:
    out = trial.folder("bench_failed")
    agent = trial.root / "broken_agent.py"
    agent.write_text(BROKEN_AGENT)
    proc = _bench(trial, "--agents", f"rloo,{agent}:Broken", "--seeds", "0", "--output-dir", str(out))
    failed = out / "runs" / "digits" / "Broken" / "seed0"
    kept = ((out / "report.md").is_file() and not (failed / "bench_run.json").exists()
            and "broken on purpose" in (failed / "bench_log.txt").read_text()
            and (out / "runs" / "digits" / "rloo" / "seed0" / "bench_run.json").is_file())
    judge(trial, "bench: a failed run exits 1 naming it", proc, refused=True, kept=kept,
          expect=f"1 of 2 runs failed, left out of the report: {failed} (log {failed / 'bench_log.txt'})")


@case("bench: deleted outputs")
def deleted_outputs(trial: Trial, base: Path) -> None:
    out = _finished_bench(trial, "bench_deleted")
    run = out / "runs" / "digits" / "rloo" / "seed0"
    (run / "metrics.jsonl").unlink()
    proc = _bench(trial, "--agents", "rloo", "--seeds", "0", "--output-dir", str(out))
    kept = (run / "metrics.jsonl").is_file() and json.loads((out / "results.json").read_text())["failed"] is None
    judge(trial, "bench: deleted outputs are rerun", proc, refused=False, kept=kept,
          expect="finished, but its outputs were deleted or changed, rerunning")


@case("bench: malformed record")
def malformed_record(trial: Trial, base: Path) -> None:
    out = _finished_bench(trial, "bench_malformed")
    record = out / "runs" / "digits" / "rloo" / "seed0" / "bench_run.json"
    record.write_text("[]")
    before = snapshot(out)
    proc = _bench(trial, "--agents", "rloo", "--seeds", "0", "--output-dir", str(out))
    after = snapshot(out)
    kept = {k: v for k, v in after.items() if not k.endswith(".lock")} == \
        {k: v for k, v in before.items() if not k.endswith(".lock")}
    judge(trial, "bench: a malformed record", proc, refused=True, kept=kept,
          expect=f"{record} is a JSON list, not a bench record")


def _workers(folder: Path) -> list[int]:
    """Process ids of live ``textrl.bench --worker`` processes of jobs under ``folder``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"--worker" in cmd and any(str(folder).encode() in part for part in cmd) and state != "Z":
            found.append(int(proc.name))
    return found


@case("bench: kill -9")
def killed_bench(trial: Trial, base: Path) -> None:
    if not Path("/proc").is_dir():
        return
    out = trial.folder("bench_killed")
    bench = subprocess.Popen([sys.executable, "-m", "textrl.cli", "bench", *TINY_BENCH, "--agents", "rloo",
                              "--seeds", "0", "--token-budget", "100000", "--output-dir", str(out)],  # a long run
                             env=trial.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not _workers(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    started = _workers(out)
    bench.send_signal(signal.SIGKILL)
    bench.wait()
    deadline = time.monotonic() + 10
    while _workers(out) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _workers(out)
    for pid in left:  # never leave one behind, even when the case fails
        os.kill(pid, signal.SIGKILL)
    proc = _bench(trial, "--agents", "rloo", "--seeds", "0", "--output-dir", str(out))
    kept = bool(started) and not left and (out / "runs" / "digits" / "rloo" / "seed0" / "bench_run.json").is_file()
    judge(trial, "bench: kill -9 leaves no worker; the rerun finishes", proc, refused=False, kept=kept,
          expect="incomplete (killed or failed), rerunning",
          note=f"workers {started}, left after 10 s {left}" + (f"; rerun: {proc.stderr.strip()[-300:]}" if proc.returncode else ""))
