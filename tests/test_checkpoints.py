"""Atomic checkpoints: manifest, partial and corrupt folders, a full disk, rotation, every RNG."""

from __future__ import annotations

import errno
import json
import random

import numpy as np
import pytest
import torch

from tests.agents.conftest import make_agent
from textrl.config import TrainConfig
from textrl.envs import PromptSampler
from textrl.models import build_tiny_tokenizer
from textrl.run import (
    CHECKPOINT_MARKER,
    CheckpointError,
    checkpoints,
    latest_checkpoint,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from textrl.training.run_checks import check_run


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def run(tok):
    agent = make_agent(tok)
    sampler = PromptSampler("builtin:digits", tok, prompts_per_batch=2, seed=0)
    return agent, sampler


def _save(tmp_path, run, iteration, keep=5):
    return save_checkpoint(tmp_path, iteration, *run, keep=keep)


def _tensors(agent):
    return {k: v.clone() for k, v in agent.state_dict().items() if torch.is_tensor(v)}


def test_manifest_lists_every_file_and_nothing_temporary_is_left(tmp_path, run):
    path = _save(tmp_path, run, 1)
    manifest = json.loads((path / CHECKPOINT_MARKER).read_text())
    files = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {CHECKPOINT_MARKER}
    assert set(manifest["files"]) == files and "trainer_state.pt" in files
    assert all(len(meta["sha256"]) == 64 for meta in manifest["files"].values())
    assert verify_checkpoint(path)["iteration"] == 1
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["iter_000001"]


def test_partial_folders_are_ignored_and_rotation_keeps_the_newest(tmp_path, run):
    for iteration in (1, 2, 3):
        _save(tmp_path, run, iteration, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["iter_000002", "iter_000003"]
    (root / "iter_000009").mkdir()  # a save that died before its manifest
    (root / "iter_000009" / "trainer_state.pt").write_bytes(b"half")
    assert latest_checkpoint(tmp_path) == root / "iter_000003"
    with pytest.raises(CheckpointError, match=r"iter_000009 is incomplete"):
        verify_checkpoint(root / "iter_000009")


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_corrupt_file_is_named_and_resume_falls_back_to_the_previous_checkpoint(tmp_path, run, damage):
    first, second = _save(tmp_path, run, 1), _save(tmp_path, run, 2)
    state = second / "trainer_state.pt"
    data = bytearray(state.read_bytes())
    if damage == "truncate":
        state.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0xFF
        state.write_bytes(bytes(data))
    what = "truncated or corrupt" if damage == "truncate" else "sha256"
    with pytest.raises(CheckpointError, match=rf"iter_000002/trainer_state.pt .*{what}"):
        verify_checkpoint(second)
    with pytest.raises(CheckpointError, match="iter_000002/trainer_state.pt"):
        load_checkpoint(second, *run)
    with pytest.warns(UserWarning, match="skipping a checkpoint.*iter_000002/trainer_state.pt"):
        assert latest_checkpoint(tmp_path) == first


def test_an_unreadable_state_file_is_named_even_without_verification(tmp_path, run):
    path = _save(tmp_path, run, 1)
    (path / "trainer_state.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"iter_000001/trainer_state.pt cannot be read"):
        load_checkpoint(path, *run, verify=False)


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path, run, monkeypatch):
    agent, sampler = run
    previous = _save(tmp_path, run, 1, keep=1)
    saved = _tensors(agent)
    real_save = torch.save

    def full_disk(obj, path, *args, **kwargs):
        real_save(obj, path, *args, **kwargs)
        with open(path, "r+b") as f:  # the write got half way
            f.truncate(100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoints.torch, "save", full_disk)
    with pytest.raises(OSError, match=r"could not write checkpoint .*iter_000002 \(No space left") as err:
        _save(tmp_path, run, 2, keep=1)
    monkeypatch.undo()
    assert err.value.errno == errno.ENOSPC
    assert f"{previous} is intact" in str(err.value) and "--resume" in str(err.value)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["iter_000001"]  # no temp folder
    with torch.no_grad():
        for p in agent.parameters():
            p.add_(1.0)
    assert latest_checkpoint(tmp_path) == previous
    assert load_checkpoint(previous, agent, sampler) == 1
    assert all(torch.equal(v, agent.state_dict()[k]) for k, v in saved.items())


@pytest.mark.parametrize("failure", ["torch", "safetensors", "read-only", "other"])
def test_every_library_write_failure_gets_the_documented_message(tmp_path, run, monkeypatch, failure):
    """torch reports a full disk as a RuntimeError of its writer, safetensors as SafetensorError,
    a read-only folder as EACCES: each ends in one message with the earlier checkpoint intact (and
    the right advice); any other RuntimeError is not disguised as a disk fault."""
    from safetensors import SafetensorError

    previous = _save(tmp_path, run, 1, keep=2)
    raised = {
        "torch": RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 5376 vs 5264"),
        "safetensors": SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })"),
        "read-only": PermissionError(errno.EACCES, "Permission denied"),
        "other": RuntimeError("a bug in a state_dict"),
    }[failure]

    def failing_save(obj, path, *args, **kwargs):
        raise raised

    monkeypatch.setattr(checkpoints.torch, "save", failing_save)
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda path: type("U", (), {"free": 2**20})())
    if failure == "other":
        with pytest.raises(RuntimeError, match="a bug in a state_dict"):
            _save(tmp_path, run, 2, keep=2)
    else:
        with pytest.raises(OSError, match=r"could not write checkpoint .*iter_000002") as err:
            _save(tmp_path, run, 2, keep=2)
        message = str(err.value)
        assert f"{previous} is intact" in message and "resume with --resume" in message
        if failure == "read-only":
            assert err.value.errno == errno.EACCES and "writable" in message
        else:  # 1 MiB free: the library's error is a full disk
            assert err.value.errno == errno.ENOSPC and "Free disk space (1 MiB free there)" in message
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["iter_000001"]
    assert latest_checkpoint(tmp_path) == previous


def test_an_interrupted_save_leaves_no_partial_folder(tmp_path, run, monkeypatch):
    _save(tmp_path, run, 1)

    def interrupted(folder, iteration):
        raise KeyboardInterrupt  # a second Ctrl-C while files are being flushed

    monkeypatch.setattr(checkpoints, "_write_manifest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, run, 2)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["iter_000001"]


def test_a_stale_temporary_folder_of_a_killed_run_is_cleaned_up(tmp_path, run):
    stale = tmp_path / "checkpoints" / ".tmp_iter_000007_99999"
    stale.mkdir(parents=True)
    _save(tmp_path, run, 8)
    assert not stale.exists()


def test_every_rng_the_sampler_and_the_agent_come_back(tmp_path, run):
    agent, sampler = run
    sampler.next_batch()
    agent.kl_ctl.value = 0.123
    path = _save(tmp_path, run, 4)
    expected = (random.random(), np.random.rand(), torch.rand(3), sampler.next_batch().prompt_index)  # noqa: NPY002
    weights = _tensors(agent)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)  # noqa: NPY002
    sampler.next_batch()
    agent.kl_ctl.value = 9.0
    with torch.no_grad():
        for p in agent.parameters():
            p.mul_(0.5)
    assert load_checkpoint(path, agent, sampler) == 4
    got = (random.random(), np.random.rand(), torch.rand(3), sampler.next_batch().prompt_index)  # noqa: NPY002
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
    assert got[3] == expected[3]
    assert agent.kl_ctl.value == 0.123
    assert all(torch.equal(v, agent.state_dict()[k]) for k, v in weights.items())


def test_a_fresh_run_refuses_to_overwrite_an_earlier_runs_checkpoints(tmp_path, run):
    _save(tmp_path, run, 3)
    with pytest.raises(ValueError, match=r"holds checkpoints of an earlier run \(newest: iter_000003\); pass --resume"):
        check_run(TrainConfig(output_dir=str(tmp_path)))
    check_run(TrainConfig(output_dir=str(tmp_path), resume=True))


def test_resume_with_only_corrupt_checkpoints_fails_instead_of_starting_over(tmp_path, run):
    path = _save(tmp_path, run, 1)
    (path / "trainer_state.pt").write_bytes(b"")
    config = TrainConfig(output_dir=str(tmp_path), resume=True)
    with pytest.warns(UserWarning, match="trainer_state.pt is truncated"), pytest.raises(
        CheckpointError, match="no checkpoint in .* verifies"
    ):
        resume_checkpoint(config)
    logged = []
    assert resume_checkpoint(TrainConfig(output_dir=str(tmp_path / "new"), resume=True), logged.append) is None
    assert "starting from scratch" in logged[0]
