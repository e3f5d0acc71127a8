"""Try the bad inputs and faults of docs/reliability.md as a user would, and count the outcome.

Each case runs the ``textrl`` command in a subprocess (a tiny, few-second configuration), then
judges it:

- *clear message*: the command ended as the catalogue says (a refusal exits non-zero, an
  accepted change exits 0), with no traceback, and its error is one or two lines starting with
  ``textrl COMMAND:``;
- *nothing lost*: the run folder afterwards is what the catalogue promises (a refusal left every
  byte as it was; an interrupted or resumed run has verifying checkpoints, each iteration once in
  ``metrics.jsonl`` and a ``config.yaml`` that says what ran).

Prints one line per case and the counts ``tried / clear message / nothing lost``. Run:
``python benchmarks/fault_catalogue.py`` (about 5 minutes on 2 CPU cores); ``--only NAME`` runs
the cases whose name contains NAME. It needs no network and writes under a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from textrl.config import TrainConfig

# The cases of benchmarks/faults/*.py register themselves with ``import fault_catalogue`` (one module,
# whether this file runs as a script or is imported).
sys.modules.setdefault("fault_catalogue", sys.modules[__name__])

SMALL = ["--prompts-per-iteration", "4", "--n-samples-per-prompt", "2", "--max-new-tokens", "8",
         "--warmup-sft-steps", "5", "--eval-size", "8", "--eval-every", "0", "--progress", "false",
         "--ppo-epochs", "1", "--num-minibatches", "2"]


@dataclass
class Outcome:
    name: str
    rc: int
    message: list[str]
    traceback: bool
    clear: bool
    kept: bool
    note: str = ""


@dataclass
class Trial:
    root: Path
    env: dict[str, str]
    outcomes: list[Outcome] = field(default_factory=list)

    def textrl(self, *args: str, timeout: float = 300, **popen) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "textrl.cli", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout, **popen)

    def folder(self, name: str) -> Path:
        path = self.root / name
        shutil.rmtree(path, ignore_errors=True)
        return path


def message_lines(stderr: str) -> list[str]:
    """The command's own error: from its last ``textrl NAME:`` line to the end."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.startswith("textrl ")]
    return lines[starts[-1]:] if starts else lines[-3:]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()} \
        if folder.exists() else {}


def unchanged(before: dict[str, bytes], after: dict[str, bytes]) -> bool:
    """Two :func:`snapshot` s hold the same files, byte for byte, the run folder's lock file aside."""
    return {k: v for k, v in after.items() if k != ".textrl.lock"} == \
        {k: v for k, v in before.items() if k != ".textrl.lock"}


def run_folder_sound(folder: Path, iterations: int | None = None) -> bool:
    """Every complete checkpoint verifies, each iteration is in metrics.jsonl once (1..n in order),
    and config.yaml exists."""
    from textrl.run import complete_checkpoints, verify_checkpoint

    try:
        for checkpoint in complete_checkpoints(folder / "checkpoints"):
            verify_checkpoint(checkpoint)
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    except Exception:
        return False
    its = [r["iteration"] for r in rows]
    ok = its == list(range(1, len(its) + 1)) and (folder / "config.yaml").is_file()
    return ok and (iterations is None or len(its) == iterations)


def judge(trial: Trial, name: str, proc: subprocess.CompletedProcess, *, refused: bool, kept: bool,
          expect: str = "", note: str = "") -> None:
    lines = message_lines(proc.stderr) if refused else []
    traceback = "Traceback (most recent call last)" in proc.stderr
    if refused:
        clear = (proc.returncode != 0 and not traceback and 1 <= len(lines) <= 2
                 and lines[0].startswith("textrl ") and expect in " ".join(lines))
    else:
        clear = proc.returncode == 0 and not traceback and expect in proc.stdout + proc.stderr
    trial.outcomes.append(Outcome(name, proc.returncode, lines, traceback, clear, kept, note))


# -- the cases ----------------------------------------------------------------------------------------

Case = Callable[[Trial, Path], None]
CASES: dict[str, Case] = {}


def case(name: str) -> Callable[[Case], Case]:
    def register(fn: Case) -> Case:
        CASES[name] = fn
        return fn
    return register


def _refusal(name: str, args: list[str], expect: str, on_base: bool = False) -> None:
    """A bad input that must be refused with ``expect`` in its message, changing nothing on disk."""

    @case(name)
    def run(trial: Trial, base: Path) -> None:
        out = trial.folder(name)
        if on_base:
            shutil.copytree(base, out)
        before = snapshot(out)
        proc = trial.textrl(*[a.replace("{out}", str(out)).replace("{root}", str(trial.root)) for a in args],
                            "--output-dir", str(out))
        judge(trial, name, proc, refused=True, kept=unchanged(before, snapshot(out)), expect=expect)


def _write(trial: Trial, name: str, text: str | bytes) -> Path:
    path = trial.root / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


RESUME = ["train", *SMALL, "--iterations", "3", "--checkpoint-every", "1", "--resume"]
_refusal("resume: another seed", [*RESUME, "--seed", "1"], "seed: 0 -> 1", on_base=True)
_refusal("resume: another agent", [*RESUME, "--agent", "grpo"], f"agent: {TrainConfig().agent!r} -> 'grpo'",
         on_base=True)
_refusal("resume: another model", [*RESUME, "--model", "{root}/elsewhere"], "model: 'tiny' ->", on_base=True)
_refusal("resume: another dataset", [*RESUME, "--dataset", "{root}/other.jsonl"], "dataset:", on_base=True)
_refusal("resume: without the run's settings", ["train", "--resume"], "--resume cannot change", on_base=True)
_refusal("fresh run over an earlier run", ["train", *SMALL, "--iterations", "1"], "pass --resume", on_base=True)
_refusal("--actor-lr -1e-4", ["train", "--actor-lr", "-1e-4"], "actor_lr=-0.0001: must be > 0")
_refusal("--actor-lr inf", ["train", "--actor-lr", "inf"], "must be a finite number")
_refusal("--iterations 2.5", ["train", "--iterations", "2.5"], "must be an integer")
_refusal("unknown reward", ["train", "--reward", "think_fromat"], "did you mean 'think_format'")
_refusal("agent file missing", ["train", "--agent", "{root}/nope.py:Mine"], "nope.py")
_refusal("--config missing", ["train", "--config", "{root}/nope.yaml"], "no such file")
_refusal("missing prompt file", ["train", "--dataset", "{root}/nope.jsonl"], "does not exist")
_refusal("cuda on a machine without one", ["train", "--device", "cuda"], "cuda")
_refusal("sft: missing data file", ["sft", "--data", "{root}/nope.jsonl", "--steps", "1"], "nope.jsonl")


@case("yaml files")
def yaml_files(trial: Trial, base: Path) -> None:
    for label, text, expect in [
        ("syntax error", "iterations: 3\n  actor_lr: 1\n", "not valid YAML: mapping values are not allowed here at line 2"),
        ("iterations 2.5", "iterations: 2.5\n", "iterations=2.5: must be an integer"),
        ("unknown key", "itterations: 3\n", "itterations"),
        ("nan", "actor_lr: .nan\n", "must be a finite number"),
        ("object recorded", "model: {object: x.Model}\n", "pass the object again"),
    ]:
        path = _write(trial, "bad.yaml", text)
        out = trial.folder("yaml")
        proc = trial.textrl("train", "--config", str(path), "--output-dir", str(out))
        judge(trial, f"yaml: {label}", proc, refused=True, kept=not out.exists(), expect=expect)


@case("prompt files")
def prompt_files(trial: Trial, base: Path) -> None:
    for label, data, expect in [
        ("not JSON", b'{"prompt": "a"}\n{"prompt": \n', ":2: not valid JSON"),
        ("not UTF-8", b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n', ":2: not UTF-8 text"),
        ("no prompt field", b'{"question": "a"}\n', "prompts.jsonl"),
    ]:
        path = _write(trial, "prompts.jsonl", data)
        out = trial.folder("prompts")
        proc = trial.textrl("train", *SMALL, "--dataset", str(path), "--output-dir", str(out))
        judge(trial, f"prompts: {label}", proc, refused=True, kept=not (out / "config.yaml").exists(), expect=expect)


@case("models")
def models(trial: Trial, base: Path) -> None:
    empty = trial.root / "empty_model"
    empty.mkdir(exist_ok=True)
    out = trial.folder("models")
    from textrl.models import tiny_model_path

    gpt2 = tiny_model_path("gpt2", cache_dir=trial.env["TEXTRL_CACHE"])
    long_prompt = _write(trial, "long.jsonl", '{"prompt": "a"}\n' + json.dumps({"prompt": " ".join(str(i) for i in range(600))}) + "\n")
    cases = [("a folder that is not a model", ["--model", str(empty)], str(empty)),
             ("an uncached hub id, offline", ["--model", "nobody-xyz/not-a-model"], "nobody-xyz/not-a-model"),
             ("max_new_tokens past the context", ["--model", str(gpt2), "--max-new-tokens", "5000"],
              "positions of model"),
             # left unset, max_prompt_length is fitted to the context and the long prompt keeps its
             # last tokens (one line says so); given past the context, it is refused naming the levers
             ("a prompt length past the context", ["--model", str(gpt2), "--dataset", str(long_prompt), "--eval-size", "1",
                                                   "--iterations", "1", "--max-prompt-length", "2000", "--reward",
                                                   "think_format"], "lower --max-prompt-length")]
    for label, flags, expect in cases:
        start = time.monotonic()
        proc = trial.textrl("train", *SMALL, *flags, "--output-dir", str(out))
        judge(trial, f"model: {label}", proc, refused=True, kept=not (out / "config.yaml").exists(), expect=expect,
              note=f"{time.monotonic() - start:.0f}s")


@case("resume: applied changes")
def resume_applied(trial: Trial, base: Path) -> None:
    out = trial.folder("applied")
    shutil.copytree(base, out)
    proc = trial.textrl(*RESUME, "--actor-lr", "5e-3", "--kl-coef", "0.5", "--output-dir", str(out))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    import yaml

    recorded = yaml.safe_load((out / "config.yaml").read_text())
    kept = (run_folder_sound(out, 3) and abs(rows[-1]["lr/actor"] - 5e-3) < 1e-12 and recorded["kl_coef"] == 0.5
            and (out / "resumes.jsonl").is_file())
    judge(trial, "resume: lr and kl_coef applied", proc, refused=False, kept=kept, expect="actor_lr 0.0003 -> 0.005")


@case("two runs on one folder")
def two_runs(trial: Trial, base: Path) -> None:
    out = trial.folder("two")
    first = subprocess.Popen([sys.executable, "-m", "textrl.cli", "train", *SMALL, "--iterations", "60",
                              "--checkpoint-every", "5", "--output-dir", str(out)], env=trial.env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / ".textrl.lock").exists() and time.monotonic() < deadline:  # the first holds the folder
        time.sleep(0.05)
    second = trial.textrl("train", *SMALL, "--iterations", "60", "--output-dir", str(out))
    first.communicate(timeout=600)
    judge(trial, "two runs on one folder", second, refused=True,
          kept=first.returncode == 0 and run_folder_sound(out, 60), expect="is in use by process")


def _kill_during_run(trial: Trial, name: str, sig: int, extra: tuple[str, ...] = ()) -> None:
    out = trial.folder(name)
    args = [sys.executable, "-m", "textrl.cli", "train", *SMALL, *extra, "--iterations", "4", "--checkpoint-every", "1",
            "--output-dir", str(out)]
    proc = subprocess.Popen(args, env=trial.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
        if time.monotonic() > deadline or proc.poll() is not None:
            break
        time.sleep(0.02)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    resumed = trial.textrl("train", *SMALL, *extra, "--iterations", "4", "--checkpoint-every", "1", "--resume",
                           "--output-dir", str(out))
    expect = "Resume with: textrl train --config" if sig == signal.SIGTERM else ""
    stopped = subprocess.CompletedProcess(args, proc.returncode, "", err)
    clear_stop = sig == signal.SIGKILL or (expect in err and "Traceback" not in err)
    judge(trial, name, resumed, refused=False, kept=run_folder_sound(out, 4) and clear_stop)
    trial.outcomes[-1].note = f"stop rc={stopped.returncode}"


@case("signals")
def signals(trial: Trial, base: Path) -> None:
    _kill_during_run(trial, "SIGTERM, then --resume", signal.SIGTERM)
    _kill_during_run(trial, "kill -9, then --resume", signal.SIGKILL)


ASYNC = ("--max-staleness", "2")
"""An asynchronous run: its checkpoints hold the rollouts drawn ahead (docs/async.md)."""


@case("asynchronous runs")
def asynchronous(trial: Trial, base: Path) -> None:
    _kill_during_run(trial, "--max-staleness 2: SIGTERM, then --resume", signal.SIGTERM, ASYNC)
    _kill_during_run(trial, "--max-staleness 2: kill -9, then --resume", signal.SIGKILL, ASYNC)
    _disk_full(trial, "--max-staleness 2: disk full during a checkpoint, then --resume", ASYNC)


@case("damaged run folders")
def damaged(trial: Trial, base: Path) -> None:
    # a corrupt newest checkpoint: skipped with a warning, the previous one resumes
    out = trial.folder("corrupt")
    shutil.copytree(base, out)
    state = out / "checkpoints" / "iter_000002" / "trainer_state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    proc = trial.textrl(*RESUME, "--output-dir", str(out))
    judge(trial, "corrupt newest checkpoint, --resume", proc, refused=False, kept=run_folder_sound(out, 3),
          expect="skipping a checkpoint")
    # a torn last line of metrics.jsonl
    out = trial.folder("torn")
    shutil.copytree(base, out)
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"iteration": 3, "rew')
    proc = trial.textrl(*RESUME, "--output-dir", str(out))
    judge(trial, "torn metrics line, --resume", proc, refused=False, kept=run_folder_sound(out, 3), expect="torn")
    # a resume with no checkpoint at all
    out = trial.folder("none")
    proc = trial.textrl("train", *SMALL, "--iterations", "1", "--resume", "--output-dir", str(out))
    judge(trial, "--resume on an empty folder", proc, refused=False, kept=run_folder_sound(out, 1),
          expect="starting from scratch")


@case("read-only folder")
def read_only(trial: Trial, base: Path) -> None:
    if os.geteuid() == 0:
        trial.outcomes.append(Outcome("read-only output folder", 0, [], False, True, True, "skipped: root ignores modes"))
        return
    out = trial.folder("readonly")
    out.mkdir()
    out.chmod(0o500)
    try:
        proc = trial.textrl("train", *SMALL, "--iterations", "1", "--output-dir", str(out))
    finally:
        out.chmod(0o700)
    judge(trial, "read-only output folder", proc, refused=True, kept=True, expect=str(out))


@case("disk full")
def disk_full(trial: Trial, base: Path) -> None:
    _disk_full(trial, "disk full during a checkpoint, then --resume")


def _disk_full(trial: Trial, name: str, extra: tuple[str, ...] = ()) -> None:
    """A real full disk: the run folder on an 8 MiB tmpfs (needs root and mount), then enlarged
    and resumed."""
    mount = trial.root / ("small_disk" + "_async" * bool(extra))
    mount.mkdir(exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        trial.outcomes.append(Outcome(name, 0, [], False, True, True, "skipped: no mount"))
        return
    try:
        out = mount / "run"
        flags = [*SMALL, *extra, "--iterations", "6", "--checkpoint-every", "1", "--keep-checkpoints", "3",
                 "--output-dir", str(out)]
        full = trial.textrl("train", *flags)
        from textrl.run import latest_checkpoint

        intact = latest_checkpoint(out)
        subprocess.run(["mount", "-o", "remount,size=256m", str(mount)], check=True)
        resumed = trial.textrl("train", *flags, "--resume")
        kept = intact is not None and resumed.returncode == 0 and run_folder_sound(out, 6)
        judge(trial, name, full, refused=True, kept=kept,
              expect="is intact", note=f"resume rc={resumed.returncode}")
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


# -- main -----------------------------------------------------------------------------------------------


def load_case_files() -> None:
    """Import every ``benchmarks/faults/*.py``: each registers its cases with ``@case``."""
    import importlib.util

    for path in sorted((Path(__file__).parent / "faults").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"fault_catalogue_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def main() -> int:
    load_case_files()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="textrl_faults_"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TEXTRL_CACHE": str(root / "cache"), "HF_HUB_OFFLINE": "0"}
    env.pop("TEXTRL_DEBUG", None)
    trial = Trial(root, env)
    base = root / "base"
    made = trial.textrl("train", *SMALL, "--iterations", "2", "--checkpoint-every", "1", "--output-dir", str(base))
    if made.returncode != 0:
        print(made.stderr)
        return 1
    for name, run in CASES.items():
        if args.only in name:
            run(trial, base)
    if not trial.outcomes:
        print(f"no case's name contains {args.only!r}; the cases: {', '.join(CASES)}")
        return 1
    width = max(len(o.name) for o in trial.outcomes)
    for o in trial.outcomes:
        verdict = ("clear" if o.clear else "UNCLEAR") + (" kept" if o.kept else " LOST")
        shown = " / ".join(o.message)[:150] if o.message else ""
        print(f"{o.name:<{width}}  rc={o.rc:<4} {verdict:<14} {o.note:<12} {shown}")
    tried = [o for o in trial.outcomes if not o.note.startswith("skipped")]
    print(f"\ntried {len(tried)}, clear message {sum(o.clear for o in tried)}, nothing lost "
          f"{sum(o.kept for o in tried)} (skipped: {len(trial.outcomes) - len(tried)})")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
