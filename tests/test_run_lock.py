"""One writer per run folder (textrl.run.lock): a second run is refused naming the holder, a
dead holder's lock is taken over, and a refused run writes nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from textrl.config import TrainConfig
from textrl.run import RunFolderBusy, RunFolderLock
from textrl.run.lock import LOCK_FILE
from textrl.stages.sft import SFTConfig, train_sft
from textrl.training.trainer import train

HOLD = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal, whatever the parent ignored
from textrl.run import RunFolderLock
with RunFolderLock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of ``tmp_path / 'run'``; killed at the end."""
    folder = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield folder, proc
    proc.kill()
    proc.wait()


def test_a_second_lock_is_refused_naming_the_holder_and_free_after_release(tmp_path):
    with RunFolderLock(tmp_path / "run"):
        with pytest.raises(RunFolderBusy, match=rf"in use by process {os.getpid()} on .*choose another --output-dir"):
            RunFolderLock(tmp_path / "run").acquire()
    with RunFolderLock(tmp_path / "run"):  # released: free again
        pass


def test_a_lock_left_by_a_killed_process_is_taken_over(holder):
    folder, proc = holder
    with pytest.raises(RunFolderBusy, match=f"process {proc.pid}"):
        RunFolderLock(folder).acquire()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with RunFolderLock(folder):
        assert f'"pid": {os.getpid()}' in (folder / LOCK_FILE).read_text()


def test_textrl_train_on_a_held_folder_is_refused_and_writes_nothing(holder):
    folder, proc = holder
    config = TrainConfig(output_dir=str(folder), iterations=1, warmup_sft_steps=0, progress=False)
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(RunFolderBusy, match=f"process {proc.pid}"):
        train(config)
    assert sorted(p.name for p in folder.iterdir()) == before == [LOCK_FILE]


def test_a_busy_folder_is_named_before_its_checkpoints_and_the_probe_writes_nothing(holder):
    """A second run on a folder whose live run has checkpoints hears that the folder is in use
    (not that it holds an earlier run's checkpoints); the probe leaves the holder's record."""
    from textrl.run import refuse_busy_folder
    from textrl.training.run_checks import check_run

    folder, proc = holder
    (folder / "checkpoints" / "iter_000001").mkdir(parents=True)
    (folder / "checkpoints" / "iter_000001" / "manifest.json").write_text("{}")
    record = (folder / LOCK_FILE).read_bytes()
    with pytest.raises(RunFolderBusy, match=f"process {proc.pid}"):
        check_run(TrainConfig(output_dir=str(folder)))
    with pytest.raises(RunFolderBusy, match=f"process {proc.pid}"):
        refuse_busy_folder(folder)
    assert (folder / LOCK_FILE).read_bytes() == record
    proc.kill()
    proc.wait()
    refuse_busy_folder(folder)  # free: no complaint
    refuse_busy_folder(folder / "never_made")


def test_a_stage_on_a_held_folder_is_refused_and_writes_nothing(holder):
    folder, proc = holder
    with pytest.raises(RunFolderBusy, match=f"process {proc.pid}"):
        train_sft(SFTConfig(output_dir=str(folder), steps=1, progress=False))
    assert sorted(p.name for p in folder.iterdir()) == [LOCK_FILE]


@pytest.mark.slow
def test_two_textrl_train_commands_on_one_folder(tmp_path):
    """The command line: the second run (fresh or --resume) exits at once with the one-line
    message while the first runs; the first then stops on SIGTERM with its checkpoint, and its
    metrics hold each iteration once."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "textrl.cli", "train", "--output-dir", str(out), "--iterations", "1000",
            "--warmup-sft-steps", "0", "--eval-every", "0", "--progress", "false",
            "--prompts-per-iteration", "4", "--n-samples-per-prompt", "2", "--max-new-tokens", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        for extra in ([], ["--resume"]):
            second = subprocess.run(args + extra, env=env, capture_output=True, text=True, timeout=120)
            assert second.returncode != 0
            assert f"in use by process {first.pid}" in second.stderr, second.stderr[-2000:]
            assert "Traceback" not in second.stderr
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=300) == 128 + signal.SIGTERM, first.stderr.read()[-2000:]
    finally:
        first.kill()
    rows = [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, len(rows) + 1))


def test_a_lock_released_by_its_run_leaves_no_lock_file(tmp_path):
    """A run that ends (here by an error) removes ``.textrl.lock`` as it lets go; the folder is
    free for the next run, which removes its own file when it ends."""
    from textrl.run.lock import holds_run_folder, take_run_folder

    class Config:
        output_dir = str(tmp_path / "run")

    @holds_run_folder
    def run(config, fail):
        take_run_folder(config.output_dir)
        assert (tmp_path / "run" / LOCK_FILE).is_file()
        if fail:
            raise RuntimeError("a bad row")
        return "done"

    with pytest.raises(RuntimeError, match="a bad row"):
        run(Config(), fail=True)
    assert not (tmp_path / "run" / LOCK_FILE).exists()
    assert run(Config(), fail=False) == "done"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []


def test_a_run_stopped_by_a_signal_removes_its_lock_file(holder):
    """Ctrl-C (SIGINT): the holder's ``with`` block ends by the exception and removes the file."""
    folder, proc = holder
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) != 0
    assert not (folder / LOCK_FILE).exists()


def test_a_lock_file_left_by_kill_9_is_taken_over_and_then_removed(holder):
    folder, proc = holder
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (folder / LOCK_FILE).is_file()  # kill -9: nothing ran to remove it
    from textrl.run import refuse_busy_folder

    refuse_busy_folder(folder)  # not in use: the probe says nothing
    with RunFolderLock(folder):
        assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (folder / LOCK_FILE).exists()


def test_a_taker_that_locked_a_removed_lock_file_locks_the_path_again(tmp_path, monkeypatch):
    """The race of removing a lock file: B opens the file just before its holder A removes it and
    lets go, then C takes the path's new file. B's flock on the removed file is granted, but B sees
    it is not the path's file any more and tries again: C holds the path, so B is refused (without
    the check, B and C would both believe they hold the folder)."""
    import textrl.run.lock as lock_module

    folder = tmp_path / "run"
    a = RunFolderLock(folder)
    a.acquire()
    stale = os.open(folder / LOCK_FILE, os.O_RDWR)  # B's open, before A removes the file
    a.release()
    assert not (folder / LOCK_FILE).exists()
    c = RunFolderLock(folder)
    c.acquire()
    real_open, opened = os.open, []

    def b_open(path, flags, mode=0o777):
        opened.append(path)
        return stale if len(opened) == 1 else real_open(path, flags, mode)

    monkeypatch.setattr(lock_module.os, "open", b_open)
    with pytest.raises(RunFolderBusy, match=f"in use by process {os.getpid()}"):
        RunFolderLock(folder).acquire()
    assert len(opened) == 2  # the removed file, then the path's
    c.release()
    # with nobody at the path, B's second try creates the file anew and holds it
    stale = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    os.unlink(folder / LOCK_FILE)
    opened.clear()
    b = RunFolderLock(folder)
    b.acquire()
    assert len(opened) == 2 and (folder / LOCK_FILE).is_file()
    monkeypatch.undo()
    with pytest.raises(RunFolderBusy):
        RunFolderLock(folder).acquire()
    b.release()  # (B closed the removed file's descriptor when it tried again)
    assert not (folder / LOCK_FILE).exists()
