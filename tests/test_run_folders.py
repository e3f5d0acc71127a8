"""Runs kept around, moved and come back to (issue 42): a moved or copied run folder resumes itself,
a relative reward file is found from another working folder, ``--resume`` loads the warmed-up
start instead of running the warm-up again, and a refusal names the YAML file a value came from."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.runs import SMALL, checkpoint_tensors, metrics
from textrl.cli import main
from textrl.config.io import name_config_sources
from textrl.run import warmup

REWARD_FILE = '''
def digits_seen(completions, **kwargs):
    return [float(sum(c.isdigit() for c in text)) for text in completions]
'''


def _train(*args: str) -> int:
    return main(["train", *SMALL, *args])


@pytest.fixture
def finished_run(tmp_path: Path, monkeypatch) -> Path:
    """A two-iteration run in ``tmp_path/proj/runs/a``, started in ``tmp_path/proj`` with a relative
    ``--output-dir`` and a relative ``--reward badrew.py:digits_seen``; the working folder is
    ``tmp_path/proj`` afterwards."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "badrew.py").write_text(REWARD_FILE)
    monkeypatch.chdir(proj)
    assert _train("--iterations", "2", "--output-dir", "runs/a", "--reward", "badrew.py:digits_seen",
                  "--checkpoint-every", "1") == 0
    return proj / "runs" / "a"


def test_the_record_names_the_reward_file_by_its_absolute_path(finished_run):
    record = yaml.safe_load((finished_run / "config.yaml").read_text())
    assert record["reward"] == f"{finished_run.parents[1] / 'badrew.py'}:digits_seen"
    assert list(json.loads((finished_run / "user_code.json").read_text())) == [str(finished_run.parents[1] / "badrew.py")]


def test_a_moved_run_folder_resumes_itself(finished_run, capsys):
    moved = finished_run.with_name("b")
    shutil.move(finished_run, moved)
    before = sorted(p.name for p in (moved / "checkpoints").iterdir())
    assert _train("--config", str(moved / "config.yaml"), "--resume", "--iterations", "3") == 0
    out = capsys.readouterr().out
    assert "resuming it there" in out and "starting from scratch" not in out
    assert not finished_run.exists()  # nothing written at the recorded path
    assert [r["iteration"] for r in metrics(moved)] == [1, 2, 3]
    assert "resumed from" in out and before[-1] in out


def test_a_copied_run_folder_resumes_the_copy_and_leaves_the_original(finished_run):
    copy = finished_run.with_name("c")
    shutil.copytree(finished_run, copy)
    original = {p: p.read_bytes() for p in finished_run.rglob("*") if p.is_file() and p.name != ".textrl.lock"}
    assert _train("--config", str(copy / "config.yaml"), "--resume", "--iterations", "3") == 0
    assert [r["iteration"] for r in metrics(copy)] == [1, 2, 3]
    assert {p: p.read_bytes() for p in original} == original
    assert [r["iteration"] for r in metrics(finished_run)] == [1, 2]


def test_a_fresh_run_from_a_moved_record_is_refused_naming_both_folders(finished_run, capsys):
    moved = finished_run.with_name("b")
    shutil.move(finished_run, moved)
    with pytest.raises(SystemExit) as err:
        _train("--config", str(moved / "config.yaml"))
    message = str(err.value)
    assert str(moved) in message and "'runs/a'" in message and "--resume" in message
    assert not finished_run.exists()


def test_resume_from_another_working_folder_finds_the_relative_reward_file(finished_run, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert _train("--config", str(finished_run / "config.yaml"), "--resume", "--iterations", "3") == 0
    assert [r["iteration"] for r in metrics(finished_run)] == [1, 2, 3]
    assert not (elsewhere / "runs").exists()


def test_resume_loads_the_kept_warm_up_and_stays_bit_exact(tmp_path, monkeypatch, capsys):
    full, part = tmp_path / "full", tmp_path / "part"
    args = ["--warmup-sft-steps", "6"]
    assert _train("--iterations", "3", "--output-dir", str(full), *args) == 0
    assert _train("--iterations", "2", "--output-dir", str(part), *args) == 0
    assert (part / warmup.KEPT_WARMUP / "policy.pt").is_file()

    def no_second_warm_up(*a, **k):
        raise AssertionError("the warm-up ran again on --resume")

    monkeypatch.setattr(warmup, "sft_warmup", no_second_warm_up)
    capsys.readouterr()
    assert _train("--iterations", "3", "--output-dir", str(part), "--resume", *args) == 0
    assert "warm-up: loaded from" in capsys.readouterr().out
    a, b = metrics(full), metrics(part)
    for key in ("reward/mean", "loss/policy", "loss/value", "kl/collection"):
        assert a[2][key] == b[2][key], key
    sa = checkpoint_tensors(sorted((full / "checkpoints").iterdir())[-1])
    sb = checkpoint_tensors(sorted((part / "checkpoints").iterdir())[-1])
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)  # the reference among them
    summary = json.loads((part / "summary.json").read_text())
    assert summary["warmup"]["ran_steps"] == 6 and summary["warmup"]["loaded"] is True


def test_a_corrupt_kept_warm_up_runs_the_warm_up_again(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train("--iterations", "1", "--output-dir", str(out)) == 0
    kept = out / warmup.KEPT_WARMUP / "policy.pt"
    data = bytearray(kept.read_bytes())
    data[-10] ^= 0xFF
    kept.write_bytes(bytes(data))
    capsys.readouterr()
    assert _train("--iterations", "2", "--output-dir", str(out), "--resume") == 0
    log = capsys.readouterr().out
    assert "is not used (policy.pt is missing or corrupt" in log and "SFT steps on the format" in log
    assert [r["iteration"] for r in metrics(out)] == [1, 2]


def test_the_warm_up_settings_decide_whether_the_kept_start_is_used(tmp_path):
    model = torch.nn.Linear(2, 2)
    pairs = [("q", "a")]
    settings = warmup.warmup_settings("m", pairs, steps=1, lr=0.1, batch_size=1, seed=0, dtype="torch.float32")
    stats = {"loss_first": 1.0, "loss_last": 0.5, "steps": 1.0, "seconds": 0.1}
    warmup._keep(model, tmp_path / "warmup", settings, stats)
    other = torch.nn.Linear(2, 2)
    lines: list[str] = []
    changed = {**settings, "seed": 1}
    assert warmup._load_kept(other, tmp_path / "warmup", changed, lines.append) is None
    assert "its settings differ" in lines[0]
    assert warmup._load_kept(other, tmp_path / "warmup", settings, lines.append)["loaded"] == 1.0
    assert torch.equal(other.weight, model.weight)


def test_a_refusal_names_the_yaml_file_a_value_came_from(tmp_path):
    config = tmp_path / "exp.yaml"
    config.write_text("agent: rloo\ncritic: lora\n")
    with pytest.raises(SystemExit) as err:
        main(["train", "--config", str(config), "--output-dir", str(tmp_path / "x")])
    message = str(err.value)
    assert "drop --critic" not in message and f"remove critic: from {config}" in message
    with pytest.raises(SystemExit) as err:  # the same value given as a flag keeps the flag's wording
        main(["train", "--config", str(config), "--critic", "lora", "--output-dir", str(tmp_path / "x")])
    assert "drop --critic" in str(err.value)


def test_name_config_sources_rewords_only_the_flags_of_file_values():
    message = "rloo does not read critic='lora'; drop --critic or choose --agent gae_ppo; see --critic-type"
    out = name_config_sources(message, {"critic": "exp.yaml"})
    assert out == ("rloo does not read critic='lora'; remove critic: from exp.yaml or choose --agent gae_ppo; "
                   "see --critic-type")
    assert name_config_sources("set --kl-coef > 0", {"kl_coef": "a.yaml"}) == "set --kl-coef (kl_coef: is set in a.yaml) > 0"
    assert name_config_sources(message, {}) == message


def test_relative_paths_become_absolute_only_for_local_files(tmp_path, monkeypatch):
    from textrl.core.user_files import absolute_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.py").write_text("")
    (tmp_path / "data.jsonl").write_text("")
    values = {"reward": "think_format:2, r.py:fn:0.5,missing.py:fn", "dataset": "data.jsonl", "model": "tiny",
              "env": "digits", "output_dir": "runs/x", "seed": 1}
    out = absolute_paths(values)
    assert out["reward"] == f"think_format:2,{tmp_path / 'r.py'}:fn:0.5,missing.py:fn"
    assert out["dataset"] == str(tmp_path / "data.jsonl")
    assert {k: out[k] for k in ("model", "env", "output_dir", "seed")} == {
        "model": "tiny", "env": "digits", "output_dir": "runs/x", "seed": 1}
    assert os.path.isabs(out["dataset"])


# -- what ran is recorded ---------------------------------------------------------------------------


def test_summary_and_the_first_lines_say_the_engine_the_precision_and_the_device(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train("--iterations", "1", "--output-dir", str(out), "--generation-engine", "auto") == 0
    log = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["generation_engine"] == {"asked": "auto", "ran": "textrl"}
    assert summary["device"] == "cpu" and summary["precision"]["dtype"] == "float32"
    assert "running on cpu: generation engine textrl (--generation-engine auto); precision: weights float32" in log
    assert log.index("running on cpu") < log.index("held-out metric")  # said at the start


def test_a_run_with_its_environments_reward_prints_and_records_the_share_of_the_gap_closed(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train("--iterations", "1", "--output-dir", str(out), "--agent", "rloo") == 0
    summary = json.loads((out / "summary.json").read_text())
    gap = summary["gap_closed"]
    before, after = summary["before"]["eval/sampled/reward/mean"], summary["after"]["eval/sampled/reward/mean"]
    assert gap["max_reward"] == 2.5 and gap["share"] == pytest.approx((after - before) / (2.5 - before))
    assert f"closed {round(gap['share'] * 100)}% of the gap" in capsys.readouterr().out  # never "-0%"


def test_gap_closed_is_unknown_without_a_maximum_or_room_to_close():
    from textrl.training.records import gap_closed

    key = "eval/sampled/reward/mean"
    assert gap_closed({key: 1.0}, {key: 2.0}, None) is None
    assert gap_closed({key: 2.5}, {key: 2.5}, 2.5) is None
    assert gap_closed({key: 1.0}, {key: 0.5}, 2.0)["share"] == pytest.approx(-0.5)
    assert gap_closed(None, {key: 2.0}, 2.0) is None


def test_a_refusal_keeps_the_flags_of_what_the_command_asks(finished_run):
    """``--resume`` and ``--output-dir`` describe the command, not a setting of the file: a refusal
    that names them keeps the flags, though the run's config.yaml records both."""
    moved = finished_run.with_name("b")
    shutil.move(finished_run, moved)
    with pytest.raises(SystemExit) as err:
        _train("--config", str(moved / "config.yaml"))
    assert "pass --resume to continue" in str(err.value) and "is set in" not in str(err.value)
