"""The jobs of ``textrl bench``: fingerprints, resumability, parallel worker processes, run figures.

A job (a warm-up or a training run) owns a folder. It is described by a JSON-ready dict (its
config), whose :func:`fingerprint` is stored in the folder's :data:`RECORD` by the worker when, and
only when, the job has finished. :func:`job_state` reads the folder: ``"done"`` (a complete record
for the same fingerprint: reused), ``"changed"`` (a record of another config), ``"incomplete"``
(a folder without a record: killed, or failed) or ``"new"``. :func:`run_jobs` runs the jobs that
are not done, ``jobs`` at a time, each as ``python -m textrl.bench --worker JOB.json`` in its own
process (its console output in ``bench_log.txt``), and reports each failure without stopping the
others. This module trains nothing and imports no environment or agent.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

RECORD = "bench_run.json"
"""A finished job's record in its folder: ``{"fingerprint", "wall_s", "peak_rss_mib", ...}``."""
JOB_FILE = "bench_config.json"
"""The job's description, written before it starts (what the worker reads): ``{"kind", "config",
"fingerprint", "threads"}``."""
LOG_FILE = "bench_log.txt"


def fingerprint(config: dict[str, Any]) -> str:
    """A short stable hash of a JSON-ready config (key order does not matter)."""
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_record(folder: str | Path) -> dict[str, Any]:
    """A finished job's :data:`RECORD` in ``folder``; ``OSError`` when there is none, ``ValueError``
    when it does not parse."""
    return json.loads((Path(folder) / RECORD).read_text())


def job_state(folder: str | Path, print_: str) -> str:
    """``"done"``, ``"changed"``, ``"incomplete"`` or ``"new"`` for a job of fingerprint ``print_``
    in ``folder`` (see the module docstring)."""
    folder = Path(folder)
    if (folder / RECORD).is_file():
        try:
            found = read_record(folder).get("fingerprint")
        except ValueError:
            return "incomplete"
        return "done" if found == print_ else "changed"
    return "incomplete" if folder.exists() else "new"


STATE_WORDS = {"changed": "its config changed, rerunning", "incomplete": "incomplete (killed or failed), rerunning",
               "new": "new", "done": "done with the same config, reused"}


def peak_rss_mib() -> float:
    """This process's resident-set high-water mark in MiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def write_record(folder: str | Path, print_: str, **figures: Any) -> dict[str, Any]:
    """Mark a job finished: its fingerprint and ``figures``, written atomically to :data:`RECORD`."""
    record = {"fingerprint": print_, **figures}
    path = Path(folder) / RECORD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    return record


def prepare(folder: str | Path, job: dict[str, Any]) -> Path:
    """Empty ``folder`` and write the job's description into it; the job file's path."""
    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    path = folder / JOB_FILE
    path.write_text(json.dumps(job, default=str))
    return path


def run_worker(job_file: Path) -> str | None:
    """Run one job in a fresh ``python -m textrl.bench --worker`` process; None on success, else
    the error (exit status and the log's last line)."""
    folder = job_file.parent
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with (folder / LOG_FILE).open("w") as log:
        proc = subprocess.run([sys.executable, "-m", "textrl.bench", "--worker", str(job_file)],
                              stdout=log, stderr=subprocess.STDOUT, check=False, env=env)
    if proc.returncode == 0 and (folder / RECORD).is_file():
        return None
    lines = (folder / LOG_FILE).read_text(errors="replace").strip().splitlines()
    return f"exit {proc.returncode}: {lines[-1] if lines else 'no output'} (see {folder / LOG_FILE})"


def run_jobs(job_files: Sequence[Path], jobs: int, execute: Callable[[Path], str | None] = run_worker,
             log: Callable[..., Any] = print) -> dict[Path, str | None]:
    """Run every job, ``jobs`` at a time (threads that each wait on a worker process); returns
    ``{job file: error or None}``. ``execute`` runs one job (default :func:`run_worker`)."""

    def one(path: Path) -> str | None:
        try:
            error = execute(path)
        except Exception as err:  # noqa: BLE001 - a failed job is reported, the others go on
            error = f"{type(err).__name__}: {err}"
        log(f"  {'failed' if error else 'finished'}: {path.parent}" + (f": {error}" if error else ""))
        return error

    if jobs <= 1:
        return {path: one(path) for path in job_files}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return dict(zip(job_files, pool.map(one, job_files), strict=True))


def read_run(output_dir: str | Path) -> dict[str, Any]:
    """A finished run's figures from its ``metrics.jsonl`` and ``summary.json``.

    Scalars: ``reward`` / ``accuracy`` / ``response_length`` (held-out, sampled, at the end),
    ``reward_start`` (held-out before training), ``kl`` (``kl/before_update`` of the last
    iteration), ``seconds_per_iteration`` (median, evaluation time excluded), ``tokens_per_second``
    and ``tokens`` (generated, in total). Curves, one value per iteration: ``iterations``,
    ``train_reward`` (the rollout's task score), ``tokens_so_far`` (generated tokens up to and
    including it) and ``elapsed_s`` (cumulative training seconds, evaluations included).
    """
    out = Path(output_dir)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{out / 'metrics.jsonl'} is empty: the run logged no iteration")
    summary = json.loads((out / "summary.json").read_text())
    after, before = summary.get("after") or {}, summary.get("before") or {}
    nan = math.nan
    train_s = [r["time/iteration_s"] - r.get("time/eval_s", 0.0) for r in rows]
    elapsed, tokens, total_s, total_tokens = [], [], 0.0, 0
    for r in rows:
        total_s += r["time/iteration_s"]
        total_tokens += r["tokens"]
        elapsed.append(total_s)
        tokens.append(total_tokens)
    return {
        "reward": after.get("eval/sampled/reward/mean", nan),
        "reward_start": before.get("eval/sampled/reward/mean", nan),
        "accuracy": after.get("eval/sampled/accuracy", nan),
        "response_length": after.get("eval/sampled/response_length/mean", nan),
        "kl": rows[-1].get("kl/before_update", nan),
        "seconds_per_iteration": statistics.median(train_s),
        "tokens_per_second": total_tokens / sum(train_s),
        "tokens": total_tokens,
        "iterations": [r["iteration"] for r in rows],
        "train_reward": [r["reward/mean"] for r in rows],
        "tokens_so_far": tokens,
        "elapsed_s": elapsed,
    }


__all__ = ["JOB_FILE", "LOG_FILE", "RECORD", "STATE_WORDS", "fingerprint", "job_state", "peak_rss_mib", "prepare",
           "read_record", "read_run", "run_jobs", "run_worker", "write_record"]
