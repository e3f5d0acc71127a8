"""``--resume`` of ``textrl sft`` / ``rm`` / ``dpo``: exact continuation after a crash or a signal,
and the errors of a folder that holds (or lacks) checkpoints."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

from textrl.cli import main
from textrl.run import CHECKPOINT_MARKER, MetricsLog, TrainingStopped, latest_checkpoint
from textrl.run.warmup import _batch_order
from textrl.stages import sft
from textrl.stages.common import BatchOrder
from textrl.stages.dpo import DPOConfig, train_dpo
from textrl.stages.sft import SFTConfig, train_sft

TINY = {"steps": 6, "batch_size": 4, "eval_size": 4, "eval_every": 2, "checkpoint_every": 2,
        "keep_checkpoints": 5, "progress": False}
STAGES = {"sft": (SFTConfig, train_sft, {}), "dpo-lora": (DPOConfig, train_dpo, {"lora": True, "lr": 1e-2})}


class Crash(RuntimeError):
    """Stands in for a kill: the run dies after writing a metrics row."""


def _metrics(out) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def _weights(out) -> dict[str, torch.Tensor]:
    files = sorted((out / "model").glob("*.safetensors"))
    assert files, f"no weights in {out / 'model'}"
    return {f"{f.name}:{k}": v for f in files for k, v in load_file(f).items()}


def _assert_same_run(a, b) -> None:
    assert _metrics(a) == _metrics(b)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (json.loads((out / "summary.json").read_text()) for out in (a, b))
    assert (sa["before"], sa["after"]) == (sb["before"], sb["after"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each stage of STAGES run to the end without a break: its output folder."""
    outs = {}
    for stage, (config_cls, run, options) in STAGES.items():
        outs[stage] = tmp_path_factory.mktemp(stage)
        run(config_cls(output_dir=str(outs[stage]), **TINY, **options))
    return outs


def _crash_after_row(monkeypatch, iteration: int) -> None:
    write = MetricsLog.write

    def write_then_crash(self, row):
        write(self, row)
        if row["iteration"] == iteration:
            raise Crash(f"killed after step {iteration}")

    monkeypatch.setattr(MetricsLog, "write", write_then_crash)


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_run_killed_after_a_checkpoint_resumes_to_the_same_weights_and_metrics(
    stage, uninterrupted, tmp_path, monkeypatch
):
    config_cls, run, options = STAGES[stage]
    with monkeypatch.context() as patch:
        _crash_after_row(patch, 5)  # checkpoints at 2 and 4; row 5 is written, then lost
        with pytest.raises(Crash):
            run(config_cls(output_dir=str(tmp_path), **TINY, **options))
    assert [r["iteration"] for r in _metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert latest_checkpoint(tmp_path).name == "iter_000004"
    assert not (tmp_path / "model").exists()

    run(config_cls(output_dir=str(tmp_path), resume=True, **TINY, **options))
    _assert_same_run(uninterrupted[stage], tmp_path)


def test_sigterm_finishes_the_step_saves_and_resume_from_the_command_line_matches(
    uninterrupted, tmp_path, monkeypatch, capsys
):
    loss = sft.completion_loss
    calls = []
    handler = signal.getsignal(signal.SIGTERM)

    def sigterm_in_step_3(model, batch):
        if model.training:
            calls.append(1)
            if len(calls) == 3:  # not a checkpoint step: the signal itself must save one
                os.kill(os.getpid(), signal.SIGTERM)
        return loss(model, batch)

    with monkeypatch.context() as patch:
        patch.setattr(sft, "completion_loss", sigterm_in_step_3)
        with pytest.raises(TrainingStopped, match="textrl sft: stopped by SIGTERM after step 3 of 6") as stop:
            train_sft(SFTConfig(output_dir=str(tmp_path), **TINY))
    assert stop.value.code == 128 + signal.SIGTERM
    resume = f"Resume with: textrl sft --config {tmp_path / 'config.yaml'} --resume"
    assert resume in str(stop.value) and resume in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is handler  # the previous handler is back
    assert [r["iteration"] for r in _metrics(tmp_path)] == [1, 2, 3]
    assert latest_checkpoint(tmp_path).name == "iter_000003"

    assert main(["sft", "--config", str(tmp_path / "config.yaml"), "--resume"]) == 0
    _assert_same_run(uninterrupted["sft"], tmp_path)


def test_resume_refuses_another_model_other_data_or_no_steps_left(uninterrupted, tmp_path):
    checkpoint = tmp_path / "checkpoints" / "iter_000004"
    shutil.copytree(uninterrupted["sft"] / "checkpoints" / checkpoint.name, checkpoint)
    resume = ["sft", "--output-dir", str(tmp_path), "--resume", *_flags(TINY)]
    # the settings the checkpoint holds are compared first, each changed field named with both values
    with pytest.raises(SystemExit, match=r"--resume cannot change what defines the run \(lora: False -> True\): "
                       rf"{re.escape(str(checkpoint))} was trained with the settings in .*config.yaml; resume "
                       r"with `textrl sft --config .*config.yaml --resume`"):
        main([*resume, "--lora"])
    with pytest.raises(SystemExit, match=r"\(eval_size: 4 -> 8\)"):
        main([*resume, "--eval-size", "8"])
    with pytest.raises(SystemExit, match=r"iter_000004 is at step 4 and steps=4; pass --steps above 4"):
        main([*resume, "--steps", "4"])


def _flags(options: dict) -> list[str]:
    return [x for k, v in options.items() for x in (f"--{k.replace('_', '-')}", str(v).lower())]


def _fake_checkpoint(out, step: int, files: dict | None = None):
    path = out / "checkpoints" / f"iter_{step:06d}"
    path.mkdir(parents=True)
    (path / CHECKPOINT_MARKER).write_text(json.dumps({"iteration": step, "files": files or {}}))
    return path


@pytest.mark.parametrize("command", ["sft", "rm", "dpo"])
def test_a_fresh_run_into_a_folder_with_checkpoints_is_refused_before_any_model_loads(
    command, tmp_path, monkeypatch
):
    monkeypatch.setattr("textrl.models.load_tokenizer", _no_model)
    _fake_checkpoint(tmp_path, 3)
    with pytest.raises(SystemExit, match=rf"textrl {command}: output_dir='{re.escape(str(tmp_path))}' holds checkpoints "
                       r"of an earlier run \(newest: iter_000003\); pass --resume to continue it, or "
                       "choose another --output-dir"):
        main([command, "--output-dir", str(tmp_path)])


def test_resume_without_a_checkpoint_names_the_folder(tmp_path, monkeypatch):
    monkeypatch.setattr("textrl.models.load_tokenizer", _no_model)
    with pytest.raises(SystemExit, match=rf"textrl rm: --resume: no checkpoint in {re.escape(str(tmp_path))}"
                       r"/new/checkpoints .*run without --resume to start"):
        main(["rm", "--output-dir", str(tmp_path / "new"), "--resume"])
    assert not (tmp_path / "new").exists()
    _fake_checkpoint(tmp_path, 2, {"trainer_state.pt": {"size": 1, "sha256": "0"}})
    with pytest.warns(UserWarning, match="trainer_state.pt is missing"), pytest.raises(
        SystemExit, match=r"textrl dpo: --resume: no checkpoint in .* verifies"
    ):
        main(["dpo", "--output-dir", str(tmp_path), "--resume"])


def _no_model(*args, **kwargs):
    raise AssertionError("a model was loaded before the output folder was checked")


@pytest.mark.parametrize(("n", "steps", "batch_size"), [(7, 5, 3), (4, 3, 4), (10, 2, 25)])
def test_batch_order_draws_the_batches_of_the_warmup_order_and_resumes_mid_epoch(n, steps, batch_size):
    expected = [b.tolist() for b in _batch_order(n, steps, batch_size, torch.Generator().manual_seed(3))]
    order = BatchOrder(list(range(n)), seed=3)
    assert [order.next_batch(batch_size) for _ in range(steps)] == expected
    first = BatchOrder(list(range(n)), seed=3)
    head = [first.next_batch(batch_size) for _ in range(steps // 2)]
    resumed = BatchOrder(list(range(n)), seed=99)
    resumed.load_state_dict(first.state_dict())
    assert head + [resumed.next_batch(batch_size) for _ in range(steps - steps // 2)] == expected
    with pytest.raises(ValueError, match="other training rows"):
        BatchOrder(list(range(n + 1)), seed=3).load_state_dict(first.state_dict())


def test_a_pipeline_refuses_a_folder_where_a_signal_left_a_stage_checkpoint(tmp_path):
    from textrl.stages.pipeline import PipelineConfig

    _fake_checkpoint(tmp_path / "sft", 7)
    with pytest.raises(ValueError, match=r"holds an earlier pipeline run; continue it with .* --resume"):
        PipelineConfig(output_dir=str(tmp_path)).validate()
