"""Refusals a launch of several processes (torchrun, ``accelerate launch``) meets before any model
loads: ``--max-staleness K`` >= 1 with ``WORLD_SIZE`` > 1 (textrl.training.run_checks.refuse_async_processes),
and such a refusal said by the first process of a machine, not by every process
(textrl.errors.alike_in_every_process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

import textrl.errors
from textrl.cli import main
from textrl.config import TrainConfig
from textrl.errors import ALIKE_ERROR_WAIT_S, alike_in_every_process, reports_alike_errors
from textrl.training.run_checks import check_run, launched_processes

STALENESS = ("textrl train: --max-staleness 1 runs an actor beside the learner in each of the 2 training processes, "
             "and under --fsdp none holds the policy's weights whole; serve the rollouts (--vllm-server: one actor on "
             "the main process), train data parallel (no --fsdp, --zero-stage 0 to 2), or drop --max-staleness")


def _launched(monkeypatch, rank: int, world: int = 2) -> None:
    """This process as torchrun starts process ``rank`` of ``world`` on one machine."""
    for name, value in {"WORLD_SIZE": world, "RANK": rank, "LOCAL_RANK": rank}.items():
        monkeypatch.setenv(name, str(value))


def _no_training(config):
    pytest.fail("the run started: the refusal came after the checks")


@pytest.mark.parametrize("value, processes", [("4", 4), ("1", 1), ("", 1), ("two", 1), (None, 1)])
def test_launched_processes_reads_world_size(value, processes, monkeypatch):
    if value is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", value)
    assert launched_processes() == processes


def test_max_staleness_under_several_processes_is_refused_before_any_model_loads(monkeypatch, tmp_path):
    _launched(monkeypatch, 0)
    monkeypatch.setattr("textrl.training.trainer.train", _no_training)
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--max-staleness", "1", "--fsdp", "--output-dir", str(tmp_path / "run")])
    assert stopped.value.code == STALENESS
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("world, staleness", [(None, 1), ("1", 2), ("2", 0), ("2", 1)])
def test_max_staleness_in_one_process_or_data_parallel_passes_the_checks(world, staleness, monkeypatch, tmp_path):
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    check_run(TrainConfig(max_staleness=staleness, output_dir=str(tmp_path / "run")))


def test_sharded_learners_with_served_rollouts_pass_the_checks_and_a_frozen_base_is_refused(monkeypatch, tmp_path):
    """--max-staleness under --fsdp / --zero-stage 3 with --vllm-server: one actor handed the weights
    whole (passes); with a LoRA policy its actor would keep the frozen base whole (refused in one line)."""
    from textrl.training.run_checks import refuse_async_processes

    monkeypatch.setenv("WORLD_SIZE", "2")
    served = {"max_staleness": 1, "vllm_server": "http://127.0.0.1:1"}
    refuse_async_processes(TrainConfig(**served, fsdp=True))
    refuse_async_processes(TrainConfig(**served, zero_stage=3))
    with pytest.raises(ValueError, match=r"^--max-staleness 1 under --zero-stage 3 hands the actor the learner's weights "
                                         r"whole, and with --lora-r the actor keeps a copy of the policy's frozen base"):
        refuse_async_processes(TrainConfig(**served, zero_stage=3, lora_r=4))
    with pytest.raises(ValueError, match="none holds the policy's weights whole; serve the rollouts"):
        refuse_async_processes(TrainConfig(max_staleness=1, zero_stage=3))


@pytest.mark.parametrize("environ, says", [
    ({}, True),
    ({"LOCAL_RANK": "1"}, True),  # no launch of several processes
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, True),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, False),
    ({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0"}, True),  # the second machine's first process
    ({"WORLD_SIZE": "2", "RANK": "1"}, False),
])
def test_the_first_process_of_each_machine_says_an_error_all_meet(environ, says):
    assert reports_alike_errors(environ) is says


@pytest.mark.parametrize("rank, debug, waits", [(0, False, []), (1, False, [ALIKE_ERROR_WAIT_S]), (1, True, [])])
def test_another_process_waits_to_be_ended_before_it_raises(rank, debug, waits, monkeypatch):
    monkeypatch.delenv("TEXTRL_DEBUG", raising=False)
    _launched(monkeypatch, rank)
    waited: list[float] = []
    with pytest.raises(ValueError, match="refused"), alike_in_every_process(debug, wait=waited.append):
        raise ValueError("refused")
    assert waited == waits


def test_a_later_process_not_ended_says_the_refusal_itself(monkeypatch, tmp_path):
    """Process 1 meets the refusal, nobody ends it (the first got past the checks): it says it."""
    _launched(monkeypatch, 1)
    monkeypatch.setattr(textrl.errors, "ALIKE_ERROR_WAIT_S", 0.2)
    monkeypatch.setattr("textrl.training.trainer.train", _no_training)
    start = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--max-staleness", "1", "--fsdp", "--output-dir", str(tmp_path / "run")])
    assert stopped.value.code == STALENESS and time.monotonic() - start >= 0.2


def test_an_error_once_the_run_started_is_said_by_every_process_at_once(monkeypatch, tmp_path):
    _launched(monkeypatch, 1)

    def fails(config):
        raise ValueError("this process's engine stopped")

    monkeypatch.setattr("textrl.training.trainer.train", fails)
    start = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--output-dir", str(tmp_path / "run")])
    assert "this process's engine stopped" in stopped.value.code
    assert time.monotonic() - start < ALIKE_ERROR_WAIT_S / 2


@pytest.mark.slow
def test_under_torchrun_a_refusal_is_said_once_and_the_first_process_is_the_root_cause(tmp_path):
    env = {**os.environ, "TEXTRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "textrl.cli",
           "train", "--max-staleness", "1", "--fsdp", "--output-dir", str(tmp_path / "run")]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and output.count(STALENESS) == 1, output[-3000:]
    cause = output.split("Root Cause")[1]  # torchrun's report: the first process exited on the refusal
    assert re.search(r"local_rank: 0\)\s+exitcode\s*:\s*1\b", cause), output[-3000:]
    assert not (tmp_path / "run").exists()
