"""The jobs of ``textrl bench``: fingerprints, resumability, parallel worker processes, run figures.

A job (a warm-up or a training run) owns a folder. It is described by a JSON-ready dict (its
config), whose :func:`fingerprint` is stored in the folder's :data:`RECORD` by the worker when, and
only when, the job has finished, with the size of each output file the bench reads back.
:func:`job_state` reads the folder: ``"done"`` (a complete record for the same fingerprint whose
outputs are all there: reused), ``"changed"`` (a record of another config), ``"outputs_gone"`` (a
record whose outputs were deleted or changed size), ``"incomplete"`` (a folder without a record:
killed, or failed) or ``"new"``. A record that is not a JSON object with a fingerprint is an
error naming the file (:func:`read_record`). :func:`run_jobs` runs the jobs that are not done,
``jobs`` at a time, each as ``python -m textrl.bench --worker JOB.json`` in its own process (its
console output in ``bench_log.txt``), and reports each failure without stopping the others.

One writer per job folder: a worker holds the folder's :class:`JobLock` for its whole life, and on
Linux dies with the bench that started it (:func:`die_with_parent`), so a ``kill -9`` of
``textrl bench`` leaves no worker training on; a rerun that still finds a live holder waits a
little, then refuses naming it (:func:`refuse_busy_jobs`). This module trains nothing and imports
no environment or agent.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import math
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from textrl.run import atomic
from textrl.run.metrics import read_rows

RECORD = "bench_run.json"
"""A finished job's record in its folder: ``{"fingerprint", "wall_s", "peak_rss_mib", ...}``."""
JOB_FILE = "bench_config.json"
"""The job's description, written before it starts (what the worker reads): ``{"kind", "config",
"fingerprint", "threads"}``."""
LOG_FILE = "bench_log.txt"
LOCK_FILE = ".bench_job.lock"
"""The job folder's lock (kept when the folder is emptied for a rerun)."""
PARENT_ENV = "TEXTRL_BENCH_PARENT"
"""Environment variable with the process id of the bench that started a worker."""
RUN_OUTPUTS = ("metrics.jsonl", "summary.json")
"""The files of a training run that the bench reads back (:func:`read_run`)."""


def fingerprint(config: dict[str, Any]) -> str:
    """A short stable hash of a JSON-ready config (key order does not matter)."""
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_record(folder: str | Path) -> dict[str, Any]:
    """A finished job's :data:`RECORD` in ``folder``; ``OSError`` when there is none, ``ValueError``
    naming the file and the fix when it is not a JSON object with a string ``fingerprint``."""
    path = Path(folder) / RECORD
    text = path.read_text()
    try:
        record = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); delete it (or pass --fresh) to rerun that job") from None
    if not isinstance(record, dict) or not isinstance(record.get("fingerprint"), str):
        what = f"a JSON {type(record).__name__}" if not isinstance(record, dict) else "an object without a fingerprint"
        raise ValueError(f"{path} is {what}, not a bench record (an object with a fingerprint); delete it "
                         "(or pass --fresh) to rerun that job")
    return record


def job_state(folder: str | Path, print_: str, required: Iterable[str] = ()) -> str:
    """``"done"``, ``"changed"``, ``"outputs_gone"``, ``"incomplete"`` or ``"new"`` for a job of
    fingerprint ``print_`` in ``folder`` (see the module docstring). ``required``: output files
    that must exist besides those the record lists (for records that list none). ``ValueError``
    for a malformed record (:func:`read_record`)."""
    folder = Path(folder)
    if (folder / RECORD).is_file():
        record = read_record(folder)
        if record["fingerprint"] != print_:
            return "changed"
        return "done" if not missing_outputs(folder, record, required) else "outputs_gone"
    return "incomplete" if folder.exists() else "new"


def missing_outputs(folder: Path, record: dict[str, Any], required: Iterable[str] = ()) -> list[str]:
    """The output files of a finished job that are gone or changed size: those its record lists
    (``{"outputs": {name: size}}``) and ``required``."""
    listed = record.get("outputs") if isinstance(record.get("outputs"), dict) else {}
    expected = {**{name: None for name in required}, **listed}
    gone = []
    for name, size in expected.items():
        path = folder / name
        if not path.is_file() or (isinstance(size, int) and path.stat().st_size != size):
            gone.append(name)
    return gone


def output_sizes(folder: str | Path, names: Iterable[str] | None = None) -> dict[str, int]:
    """``{name: size in bytes}`` of ``names`` in ``folder`` (default: every file of the folder,
    in sub-folders too, but the bench's own files): what a record lists as the job's outputs."""
    folder = Path(folder)
    if names is None:
        own = {RECORD, JOB_FILE, LOG_FILE, LOCK_FILE, Path(RECORD).with_suffix(".tmp").name}
        names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                       if p.is_file() and p.name not in own and not atomic.is_temporary(p.name, RECORD))
    return {name: (folder / name).stat().st_size for name in names if (folder / name).is_file()}


STATE_WORDS = {"changed": "its config changed, rerunning", "incomplete": "incomplete (killed or failed), rerunning",
               "outputs_gone": "finished, but its outputs were deleted or changed, rerunning",
               "warmup_rerun": "its warm-up was rerun, rerunning",
               "new": "new", "done": "done with the same config, reused"}


def peak_rss_mib() -> float:
    """This process's resident-set high-water mark in MiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def write_record(folder: str | Path, print_: str, **figures: Any) -> dict[str, Any]:
    """Mark a job finished: its fingerprint and ``figures``, written atomically to :data:`RECORD`."""
    record = {"fingerprint": print_, **figures}
    atomic.write_json(Path(folder) / RECORD, record)
    return record


def prepare(folder: str | Path, job: dict[str, Any]) -> Path:
    """Empty ``folder`` (but its lock file) under its :class:`JobLock` and write the job's
    description into it; the job file's path. :class:`JobBusy` when a live process holds it."""
    folder = Path(folder)
    with JobLock(folder):
        for entry in folder.iterdir():
            if entry.name == LOCK_FILE:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        path = folder / JOB_FILE
        path.write_text(json.dumps(job, default=str))
    return path


# -- one writer per job folder -------------------------------------------------------------------


class JobBusy(ValueError):
    """A live process (a worker of an earlier bench) still writes in a job folder."""


class JobLock:
    """``with JobLock(folder):`` an exclusive ``flock`` on ``folder/.bench_job.lock`` for the
    block, naming the holder in the file; :class:`JobBusy` when another live process holds it
    (after waiting up to ``wait_s`` seconds for it to end). The kernel drops it when the holder
    dies, however it dies."""

    def __init__(self, folder: str | Path, wait_s: float = 0.0) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.wait_s = wait_s
        self._fd: int | None = None

    def __enter__(self) -> JobLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise JobBusy(self.busy_message()) from None
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "command": " ".join(sys.argv)}).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def busy_message(self) -> str:
        try:
            pid = json.loads(self.path.read_text())["pid"]
            who, fix = f"process {pid}", f"stop it (kill {pid}) or wait for it to end"
        except (OSError, ValueError, KeyError, TypeError):
            who, fix = "another process", "stop it or wait for it to end"
        return (f"job folder {str(self.folder)!r} is in use by {who} (a worker of an earlier textrl bench "
                f"still running there); {fix}, then rerun")


def refuse_busy_jobs(folders: Iterable[str | Path], wait_s: float = 10.0) -> None:
    """:class:`JobBusy` naming the first of ``folders`` (existing ones) that a live process still
    holds after ``wait_s`` seconds (a worker of a killed bench dies with it, within moments)."""
    deadline = time.monotonic() + wait_s
    for folder in folders:
        if (Path(folder) / LOCK_FILE).is_file():
            with JobLock(folder, wait_s=max(0.0, deadline - time.monotonic())):
                pass


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when the process (thread) that started it ends
    (``prctl(PR_SET_PDEATHSIG)``), and exit at once when that parent is already gone; a no-op
    elsewhere (the :class:`JobLock` still keeps a second writer out)."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the bench died before the request took effect
        os._exit(1)


def run_worker(job_file: Path) -> str | None:
    """Run one job in a fresh ``python -m textrl.bench --worker`` process that dies with this one
    (:func:`die_with_parent`); None on success, else the error (exit status and the log's last
    line)."""
    folder = job_file.parent
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", PARENT_ENV: str(os.getpid())}
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

    ``engine`` and ``precision``: the generation engine and the weights' dtype that ran. Scalars:
    ``reward`` / ``accuracy`` / ``response_length`` (held-out, sampled, at the end),
    ``reward_start`` (held-out before training), ``kl`` (``kl/before_update`` of the last
    iteration), ``seconds_per_iteration`` (median, evaluation time excluded), ``tokens_per_second``
    and ``tokens`` (generated, in total), ``perf_tokens_per_s`` (the median over the iterations of
    ``perf/tokens_per_s``: prompt and response tokens a second and process) and ``padding_fraction``
    (the mean of ``perf/padding_fraction``), NaN for a run that did not log them (an older textrl). Curves, one value per iteration: ``iterations``,
    ``train_reward`` (the rollout's task score), ``tokens_so_far`` (generated tokens up to and
    including it) and ``elapsed_s`` (cumulative training seconds, evaluations included). ``reward_s``:
    the seconds the loop waited for rewards, summed over the iterations (``time/reward_s``);
    ``reward_calls_s``: the seconds background reward calls ran (``time/reward_calls_s``: an async or
    ``does_io`` reward), NaN where none ran.
    """
    out = Path(output_dir)
    rows = read_rows(out / "metrics.jsonl")  # a null (a non-finite value) read as NaN
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
        "engine": (summary.get("generation_engine") or {}).get("ran"),  # None: a run of an older textrl
        "precision": (summary.get("precision") or {}).get("dtype"),
        "reward": after.get("eval/sampled/reward/mean", nan),
        "reward_start": before.get("eval/sampled/reward/mean", nan),
        "accuracy": after.get("eval/sampled/accuracy", nan),
        "response_length": after.get("eval/sampled/response_length/mean", nan),
        "kl": rows[-1].get("kl/before_update", nan),
        "seconds_per_iteration": statistics.median(train_s),
        "tokens_per_second": total_tokens / sum(train_s),
        "tokens": total_tokens,
        "perf_tokens_per_s": _logged(rows, "perf/tokens_per_s", statistics.median),
        "padding_fraction": _logged(rows, "perf/padding_fraction", statistics.fmean),
        "reward_s": _logged(rows, "time/reward_s", math.fsum),
        "reward_calls_s": _logged(rows, "time/reward_calls_s", math.fsum),
        "iterations": [r["iteration"] for r in rows],
        "train_reward": [r["reward/mean"] for r in rows],
        "tokens_so_far": tokens,
        "elapsed_s": elapsed,
    }


def _logged(rows: list[dict[str, Any]], key: str, summary: Callable[[list[float]], float]) -> float:
    """``summary`` of ``key``'s finite values over the metrics rows that log it; NaN when none does."""
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return summary(values) if values else math.nan


__all__ = ["JOB_FILE", "LOCK_FILE", "LOG_FILE", "PARENT_ENV", "RECORD", "RUN_OUTPUTS", "STATE_WORDS", "JobBusy",
           "JobLock", "die_with_parent", "fingerprint", "job_state", "missing_outputs", "output_sizes", "peak_rss_mib",
           "prepare", "read_record", "read_run", "refuse_busy_jobs", "run_jobs", "run_worker", "write_record"]
