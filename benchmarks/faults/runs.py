"""Runs, records, errors and signals (docs/reliability.md, "Found by the trials of 2026-11")."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from fault_catalogue import (
    RESUME,
    SMALL,
    Trial,
    _refusal,
    _write,
    case,
    judge,
    run_folder_sound,
    snapshot,
    unchanged,
)

_refusal("runs: --resume --iterations 1 after 2", [*RESUME, "--iterations", "1"], "past iterations=1", on_base=True)
_refusal("runs: --config is a folder", ["train", "--config", "{root}"], "is a folder, not a file")
_refusal("runs: prompt file is a folder", ["train", "--dataset", "{root}"], "is a folder, not a file")


@case("runs: a key twice in --config")
def duplicate_key(trial: Trial, base: Path) -> None:
    config = _write(trial, "twice.yaml", "iterations: 3\nactor_lr: 1e-4\niterations: 30\n")
    out = trial.folder("twice")
    proc = trial.textrl("train", "--config", str(config), "--output-dir", str(out))
    judge(trial, "runs: a key twice in --config", proc, refused=True, kept=not out.exists(),
          expect="'iterations' is given twice (lines 1 and 3)")


@case("runs: --output-dir '' and a file")
def output_dirs(trial: Trial, base: Path) -> None:
    here = trial.folder("cwd")
    here.mkdir()
    proc = trial.textrl("train", "--output-dir", "", cwd=here)
    judge(trial, "runs: --output-dir ''", proc, refused=True, kept=not any(here.iterdir()),
          expect="empty folder name")
    taken = _write(trial, "taken", "a file")
    proc = trial.textrl("train", "--output-dir", str(taken))
    judge(trial, "runs: --output-dir is a file", proc, refused=True, kept=taken.read_text() == "a file",
          expect="is a file, not a folder")


@case("runs: the reward file edited, then --resume")
def edited_reward(trial: Trial, base: Path) -> None:
    reward = _write(trial, "plus_reward.py", "def plus(completions, **kwargs):\n    return [1.0 for _ in completions]\n")
    out = trial.folder("edited")
    flags = [*SMALL, "--checkpoint-every", "1", "--reward", f"{reward}:plus", "--output-dir", str(out)]
    trial.textrl("train", *flags, "--iterations", "1")
    reward.write_text(reward.read_text().replace("1.0", "-100.0"))
    before = snapshot(out)
    proc = trial.textrl("train", *flags, "--iterations", "2", "--resume")
    judge(trial, "runs: the reward file edited, then --resume", proc, refused=True,
          kept=unchanged(before, snapshot(out)), expect="plus_reward.py: edited (sha256")


@case("runs: a fresh run after deleting checkpoints/")
def fresh_after_delete(trial: Trial, base: Path) -> None:
    out = trial.folder("fresh_again")
    shutil.copytree(base, out)
    shutil.rmtree(out / "checkpoints")
    earlier = (out / "metrics.jsonl").read_bytes()
    proc = trial.textrl("train", *SMALL, "--iterations", "1", "--output-dir", str(out))
    kept = run_folder_sound(out, 1) and [p.joinpath("metrics.jsonl").read_bytes()
                                         for p in (out / "earlier_runs").iterdir()] == [earlier]
    judge(trial, "runs: a fresh run after deleting checkpoints/", proc, refused=False, kept=kept,
          expect="the earlier run's records")


@case("runs: an error raised in a user's environment")
def foreign_error(trial: Trial, base: Path) -> None:
    env = _write(trial, "broken_env.py", "from textrl.envs import Environment\n\nclass Broken(Environment):\n"
                 "    def __init__(self, **kwargs):\n        raise KeyError('max_n')\n")
    out = trial.folder("foreign")
    proc = trial.textrl("train", *SMALL, "--iterations", "1", "--env", f"{env}:Broken", "--output-dir", str(out))
    judge(trial, "runs: an error raised in a user's environment", proc, refused=True,
          kept=not (out / "checkpoints").exists(), expect="KeyError")


@case("runs: a damaged model cache")
def damaged_cache(trial: Trial, base: Path) -> None:
    cache = trial.root / "cache_damaged"
    shutil.rmtree(cache, ignore_errors=True)
    shutil.copytree(trial.root / "cache", cache)
    for weights in cache.glob("tiny-causal_lm-*/model.safetensors"):
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    shared = trial.env
    trial.env = {**shared, "TEXTRL_CACHE": str(cache)}
    try:
        proc = trial.textrl("generate", "--max-new-tokens", "2")
    finally:
        trial.env = shared
    judge(trial, "runs: a damaged model cache", proc, refused=True, kept=True, expect="delete its folder there")


@case("runs: SIGTERM in the warm-up")
def sigterm_in_warmup(trial: Trial, base: Path) -> None:
    out = trial.folder("warmup_stop")
    args = [sys.executable, "-m", "textrl.cli", "train", *SMALL, "--iterations", "1", "--warmup-sft-steps", "3000",
            "--output-dir", str(out)]
    proc = subprocess.Popen(args, env=trial.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(15)  # the models load, the warm-up (minutes long) starts
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    took = time.monotonic() - sent
    stopped = subprocess.CompletedProcess(args, proc.returncode, "", err)
    again = trial.textrl("train", *SMALL, "--iterations", "1", "--output-dir", str(out))  # starts over
    judge(trial, "runs: SIGTERM in the warm-up", stopped, refused=True,
          kept=again.returncode == 0 and run_folder_sound(out, 1), expect="during the supervised warm-up",
          note=f"stopped in {took:.1f}s")
