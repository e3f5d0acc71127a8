"""Records stay true: the user's code files in the resume check, an earlier
run's records set aside by a fresh run, no shorter ``--iterations`` on resume; and stop signals
that stop within one step of the warm-up, an evaluation batch or a stage."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal

import pytest
import yaml

from tests.runs import SMALL
from tests.runs import metrics as _metrics
from textrl.cli import main
from textrl.config import TrainConfig
from textrl.run import StopSignals
from textrl.run.records import EARLIER_RUNS, set_aside_earlier_records
from textrl.run.resume import ResumeRefused, check_user_code
from textrl.run.signals import StopRequested, until_stopped
from textrl.run.user_code import USER_CODE_FILE, user_code_digest, user_code_json, user_code_paths


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- the user's code in the record -------------------------------------------------------------------


def test_user_code_paths_are_every_py_file_the_config_names(tmp_path):
    config = TrainConfig(env="envs/mine.py:Env", agent="my_agent.py:Mine", output_dir=str(tmp_path),
                         reward="think_format:0.5,rewards.py:plus:2, rewards.py:minus")
    assert user_code_paths(config) == ["my_agent.py", "envs/mine.py", "rewards.py"]
    assert user_code_paths(TrainConfig(output_dir=str(tmp_path))) == []  # built-ins only: nothing to digest
    (tmp_path / "rewards.py").write_text("x = 1\n")
    digest = user_code_digest({"reward": f"{tmp_path / 'rewards.py'}:f", "env": str(tmp_path / "gone.py") + ":E"})
    assert digest[str(tmp_path / "rewards.py")] == hashlib.sha256(b"x = 1\n").hexdigest()
    assert digest[str(tmp_path / "gone.py")] is None


@pytest.mark.parametrize("field", ["env", "agent"])
def test_an_edited_env_or_agent_file_refuses_the_resume(tmp_path, field):
    code = tmp_path / "mine.py"
    code.write_text("class Mine: pass\n")
    config = TrainConfig(output_dir=str(tmp_path / "run"), **{field: f"{code}:Mine"})
    checkpoint = tmp_path / "run" / "checkpoints" / "iter_000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / USER_CODE_FILE).write_text(user_code_json(user_code_digest(config)))
    check_user_code(config, checkpoint, "train")  # unchanged: accepted
    code.write_text("class Mine:\n    changed = True\n")
    with pytest.raises(ResumeRefused, match=rf"{code}: edited \(sha256 [0-9a-f]{{8}} -> [0-9a-f]{{8}}\)"):
        check_user_code(config, checkpoint, "train")
    code.unlink()
    with pytest.raises(ResumeRefused, match=r"gone \(sha256 [0-9a-f]{8} -> missing\)"):
        check_user_code(config, checkpoint, "train")


RUN = [*SMALL, "--checkpoint-every", "1"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished two-iteration run scored by a reward function in a file of the user's own."""
    root = tmp_path_factory.mktemp("finished")
    reward = root / "my_reward.py"
    reward.write_text("def plus(completions, **kwargs):\n    return [1.0 for _ in completions]\n")
    out = root / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TEXTRL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        assert main(["train", "--output-dir", str(out), *RUN, "--iterations", "2", "--reward", f"{reward}:plus"]) == 0
    return out, reward


def _copy(finished, tmp_path):
    out, reward = finished
    shutil.copytree(out, tmp_path / "run")
    shutil.copy(reward, tmp_path / "my_reward.py")
    return tmp_path / "run", ["--reward", f"{reward}:plus"]


def test_the_reward_files_digest_is_in_each_checkpoint_and_an_edit_refuses_the_resume(finished, tmp_path):
    out, reward = finished
    recorded = json.loads((out / "checkpoints" / "iter_000002" / USER_CODE_FILE).read_text())
    assert recorded == user_code_digest({"reward": f"{reward}:plus"}) and len(recorded[str(reward)]) == 64
    assert json.loads((out / USER_CODE_FILE).read_text()) == recorded
    out = shutil.copytree(out, tmp_path / "run")
    before, text = _files(out), reward.read_text()
    try:
        reward.write_text(text.replace("1.0", "-100.0"))  # rewards +1 -> -100 under the same path
        with pytest.raises(SystemExit) as refused:
            main(["train", "--output-dir", str(out), *RUN, "--iterations", "3", "--resume", "--reward",
                  f"{reward}:plus"])
        message = str(refused.value.code)
        assert message.startswith(f"textrl train: --resume cannot run other code than the run's ({reward}: edited")
        assert "restore it" in message and "\n" not in message
        assert _files(out) == before  # nothing written
    finally:
        reward.write_text(text)
    # the file as it was: the resume runs
    assert main(["train", "--output-dir", str(out), *RUN, "--iterations", "3", "--resume", "--reward",
                 f"{reward}:plus"]) == 0
    assert [row["iteration"] for row in _metrics(out)] == [1, 2, 3]


def test_resume_with_fewer_iterations_is_refused_and_config_yaml_stays_true(finished, tmp_path):
    out, reward = finished
    out = shutil.copytree(out, tmp_path / "run")
    before = _files(out)
    with pytest.raises(SystemExit) as refused:
        main(["train", "--output-dir", str(out), *RUN, "--iterations", "1", "--resume", "--reward", f"{reward}:plus"])
    assert str(refused.value.code) == (
        f"textrl train: --resume: {out / 'checkpoints' / 'iter_000002'} is at iteration 2, past iterations=1; "
        "the run already trained 2 iterations: pass --iterations 2 (nothing more to train) or more to continue "
        "it, or start a new run in another --output-dir for a shorter one")
    assert _files(out) == before
    assert yaml.safe_load((out / "config.yaml").read_text())["iterations"] == 2


def test_a_fresh_run_after_deleting_checkpoints_sets_the_earlier_records_aside(finished, tmp_path, capsys):
    out, reward = finished
    out = shutil.copytree(out, tmp_path / "run")
    (out / "resumes.jsonl").write_text('{"resumed_after": 1, "changed": {}}\n')  # as a resume leaves it
    earlier = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "resumes.jsonl", "summary.json")}
    events = sorted(p.name for p in (out / "tb").iterdir())
    shutil.rmtree(out / "checkpoints")  # the refusal's own advice to start over
    assert main(["train", "--output-dir", str(out), *RUN, "--iterations", "1", "--reward", f"{reward}:plus"]) == 0
    assert "the earlier run's records" in capsys.readouterr().out
    (aside,) = (out / EARLIER_RUNS).iterdir()
    assert {name: (aside / name).read_bytes() for name in earlier} == earlier  # kept whole, elsewhere
    assert sorted(p.name for p in (aside / "tb").iterdir()) == events
    assert [row["iteration"] for row in _metrics(out)] == [1]  # this run's alone
    assert not (out / "resumes.jsonl").exists()
    assert not set(events) & {p.name for p in (out / "tb").iterdir()}  # TensorBoard shows one run


def test_set_aside_moves_only_the_records_it_knows(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "model").mkdir()
    target = set_aside_earlier_records(tmp_path, log=lambda *a: None)
    assert sorted(p.name for p in target.iterdir()) == ["metrics.jsonl", "model"]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert set_aside_earlier_records(tmp_path, log=lambda *a: None) is None  # nothing left to move


# -- stops that stop -------------------------------------------------------------------------------------


def test_until_stopped_ends_between_steps_only_inside_a_run_and_when_it_may():
    assert list(until_stopped([1, 2], "x")) == [1, 2]  # outside a run: everything
    with StopSignals() as signals:
        seen = []
        with pytest.raises(StopRequested, match=r"stopped by SIGTERM during the warm-up \(after step 2 of 5\)"):
            for item in until_stopped(range(5), "the warm-up"):
                seen.append(item)
                if item == 1:
                    signals.received = signal.SIGTERM
        assert seen == [0, 1]
        signals.stoppable = False  # the last iteration's evaluation runs whole
        assert list(until_stopped(range(3), "x")) == [0, 1, 2]


def _sigterm_on_call(monkeypatch, target: str, call: int) -> None:
    """``target`` (module.attr) sends this process SIGTERM on its ``call``-th call, then runs."""
    module, _, name = target.rpartition(".")
    import importlib

    original = getattr(importlib.import_module(module), name)
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    monkeypatch.setattr(target, wrapped)


def test_sigterm_in_the_warm_up_stops_at_the_next_step_and_the_same_command_starts_over(
        tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = ["train", "--output-dir", str(out), *RUN, "--iterations", "1", "--warmup-sft-steps", "40"]
    _sigterm_on_call(monkeypatch, "textrl.run.warmup.build_sft_batch", 3)  # during step 3
    with pytest.raises(SystemExit) as stopped:
        main(args)
    err = capsys.readouterr().err
    assert "SIGTERM: finishing the current warm-up step, then stopping before the first iteration" in err
    assert stopped.value.code == 128 + signal.SIGTERM
    assert ("textrl train: stopped by SIGTERM during the supervised warm-up (after step 3 of 40) before "
            "iteration 1; nothing was saved") in err
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    monkeypatch.undo()
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path.parent / "cache"))
    assert main([*args, "--resume"]) == 0  # the same command (with --resume too) starts over
    assert [row["iteration"] for row in _metrics(out)] == [1]


def test_sigterm_in_an_evaluation_stops_at_the_next_batch_with_a_checkpoint_then_resumes(
        tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = ["train", "--output-dir", str(out), *RUN, "--iterations", "3", "--eval-every", "1",
            "--generation-batch-size", "2"]  # 8 held-out prompts: 4 batches, twice (greedy, sampled)
    # evaluate_prompts: the before-evaluation calls it twice; iteration 1's first call is the 3rd
    import textrl.run.rollout as rollout

    original, calls = rollout.evaluate_prompts, {"n": 0}

    def evaluate_prompts(agent, batches, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            def signalled():
                for i, batch in enumerate(batches):
                    yield batch
                    if i == 0:
                        os.kill(os.getpid(), signal.SIGTERM)
            return original(agent, signalled(), *a, **k)
        return original(agent, batches, *a, **k)

    monkeypatch.setattr(rollout, "evaluate_prompts", evaluate_prompts)
    with pytest.raises(SystemExit) as stopped:
        main(args)
    err = capsys.readouterr().err
    assert stopped.value.code == 128 + signal.SIGTERM
    assert "SIGTERM: finishing the current evaluation batch, then saving a checkpoint" in err
    assert "stopped by SIGTERM after iteration 1 of 3; checkpoint saved in" in err
    assert "(the held-out evaluation (after batch 1 of 4) was cut short: the row of iteration 1 has no eval/" in err
    (row,) = _metrics(out)
    assert not [key for key in row if key.startswith("eval/")]
    assert {json.loads(line)["iteration"] for line in (out / "samples.jsonl").read_text().splitlines()} == {0}
    monkeypatch.undo()
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path.parent / "cache"))
    assert main([*args, "--resume"]) == 0
    rows = _metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2, 3] and "eval/greedy/reward/mean" in rows[2]


def test_sigterm_in_a_stages_evaluation_before_step_1_stops_there(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sft"
    _sigterm_on_call(monkeypatch, "textrl.stages.sft.completion_loss", 1)  # the first held-out batch
    with pytest.raises(SystemExit) as stopped:
        main(["sft", "--output-dir", str(out), "--steps", "3", "--progress", "false", "--batch-size", "2"])
    err = capsys.readouterr().err
    assert stopped.value.code == 128 + signal.SIGTERM
    assert "SIGTERM: finishing the current batch of the held-out evaluation before step 1" in err
    assert "textrl sft: stopped by SIGTERM during the held-out evaluation (after batch 1 of" in err
    assert "before step 1; nothing was saved" in err
    assert not (out / "checkpoints").exists() and not (out / "model").exists()
