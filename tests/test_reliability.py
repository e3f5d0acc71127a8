"""Fault injection on `textrl train`: signals, NaN updates, NaN rewards and invalid configs."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.agents.conftest import poison_next_step, same
from tests.runs import SMALL
from tests.runs import checkpoint_tensors as _state
from tests.runs import metrics as _metrics
from textrl.agents import GAEPPO
from textrl.cli import main
from textrl.config import TrainConfig
from textrl.envs import rollout_from_responses
from textrl.keys import KEYS
from textrl.models import build_tiny_tokenizer
from textrl.parallel import Backend
from textrl.rewards import RewardError
from textrl.run import TrainingStopped, checkpoints, latest_checkpoint
from textrl.training.run_checks import check_run


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))


# -- SIGINT / SIGTERM ------------------------------------------------------------------------------


def _cli(*args):
    return [sys.executable, "-m", "textrl.cli", "train", *SMALL, "--iterations", "4", *args]


@pytest.mark.slow
@pytest.mark.parametrize("options", [[], ["--max-staleness", "2"]], ids=["sync", "async-k2"])
def test_sigterm_then_resume_matches_an_uninterrupted_run(tmp_path, options):
    """With --max-staleness the checkpoint holds the actor's rollouts drawn ahead (docs/async.md)."""
    full, part = tmp_path / "full", tmp_path / "part"
    # one thread: two OpenMP threads on a busy 2-core machine make each run many times slower
    env = {**os.environ, "TEXTRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    subprocess.run(_cli("--output-dir", str(full), *options), env=env, check=True, capture_output=True)

    proc = subprocess.Popen(_cli("--output-dir", str(part), *options), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not ((part / "metrics.jsonl").exists() and (part / "metrics.jsonl").read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, "the run never wrote an iteration"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    stopped_at = len(_metrics(part))
    assert stopped_at < 4, "the run finished before the signal arrived"
    assert f"stopped by SIGTERM after iteration {stopped_at} of 4" in err
    assert f"--config {part / 'config.yaml'} --resume" in err
    assert latest_checkpoint(part).name == f"iter_{stopped_at:06d}"

    subprocess.run(_cli("--output-dir", str(part), "--resume", *options), env=env, check=True, capture_output=True)
    untimed = lambda row: {k: v for k, v in row.items() if not k.startswith(("time/", "memory/")) and k not in ("tokens_per_second", "perf/tokens_per_s")}  # noqa: E731
    assert [untimed(r) for r in _metrics(part)] == [untimed(r) for r in _metrics(full)]
    a, b = _state(latest_checkpoint(full)), _state(latest_checkpoint(part))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sigint_stops_after_the_iteration_and_a_second_one_aborts_without_a_partial_folder(
    tmp_path, monkeypatch, capsys
):
    update = GAEPPO.update

    def interrupted_update(self, td):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of iteration 1
        return update(self, td)

    monkeypatch.setattr(GAEPPO, "update", interrupted_update)
    # the handler in place before the run, whatever the suite's own is (under nohup, or in a
    # background job, SIGINT is ignored, and a run leaves an ignored signal ignored)
    outer = signal.signal(signal.SIGINT, _before_the_run)
    try:
        _sigint_stops_then_aborts(tmp_path, monkeypatch, capsys)
    finally:
        signal.signal(signal.SIGINT, outer)


def _before_the_run(signum, frame):  # a handler of the caller's that the run must give back
    raise KeyboardInterrupt


def _sigint_stops_then_aborts(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped, match="stopped by SIGINT after iteration 1 of 3") as stop:
        main(["train", "--iterations", "3", "--output-dir", str(out), *SMALL])
    assert stop.value.code == 128 + signal.SIGINT
    assert "--resume" in capsys.readouterr().err
    assert [r["iteration"] for r in _metrics(out)] == [1]
    assert latest_checkpoint(out).name == "iter_000001"
    assert signal.getsignal(signal.SIGINT) is _before_the_run  # the caller's handler is back

    write_manifest = checkpoints._write_manifest

    def second_ctrl_c(folder, iteration):
        os.kill(os.getpid(), signal.SIGINT)  # while the checkpoint of the first one is written
        write_manifest(folder, iteration)

    monkeypatch.setattr(checkpoints, "_write_manifest", second_ctrl_c)
    with pytest.raises(SystemExit) as aborted:  # the second Ctrl-C: exit 130 (a traceback with --debug)
        main(["train", "--iterations", "3", "--output-dir", str(out), "--resume", *SMALL])
    assert aborted.value.code == 130
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter_000001"]


def test_stop_signals_give_back_the_previous_handlers_and_leave_an_ignored_signal_ignored():
    from textrl.run import StopSignals

    outer = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job of a script
    try:
        with StopSignals():
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL  # taken over
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        signal.signal(signal.SIGINT, _before_the_run)
        with StopSignals():
            assert signal.getsignal(signal.SIGINT) is not _before_the_run
        assert signal.getsignal(signal.SIGINT) is _before_the_run
    finally:
        signal.signal(signal.SIGINT, outer)


# -- numerical faults ------------------------------------------------------------------------------


def test_consecutive_nonfinite_updates_stop_the_run_with_the_last_good_weights(tmp_path, monkeypatch, capsys):
    loss = GAEPPO.loss

    def nan_from_iteration_2(self, mb):
        value, stats = loss(self, mb)
        return (value * math.nan if self.iteration >= 1 else value), stats

    monkeypatch.setattr(GAEPPO, "loss", nan_from_iteration_2)
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped, match="2 consecutive updates were skipped for NaN/inf") as stop:
        main(["train", "--iterations", "5", "--output-dir", str(out), "--checkpoint-every", "1",
              "--keep-checkpoints", "5", "--max-nonfinite-updates", "2", *SMALL])
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert "weights of the last good update are saved in" in err
    assert "the last one saw the loss's policy (nan)" in err  # what it saw, term by term
    rows = _metrics(out)
    assert [r["nonfinite/skipped_updates"] for r in rows] == [0.0, 2.0]
    assert latest_checkpoint(out).name == "iter_000002"
    good, last = _state(out / "checkpoints" / "iter_000001"), _state(out / "checkpoints" / "iter_000002")
    assert all(torch.equal(good[k], last[k]) for k in good)


def poison_updates(monkeypatch, when) -> None:
    """Every optimiser step of an update for which ``when(agent)`` holds (before it) writes inf into a
    policy weight: a step that overflows, from finite gradients."""
    step = Backend.step

    def stepping(self, agent):
        if not when(agent):
            return step(self, agent)
        poison_next_step(agent.actor_optimizer)
        try:
            return step(self, agent)
        finally:  # a step skipped for a NaN gradient never called the optimiser: nothing left armed
            vars(agent.actor_optimizer).pop("step", None)

    monkeypatch.setattr(Backend, "step", stepping)


def _all_finite(checkpoint) -> bool:
    return all(torch.isfinite(v).all() for v in _state(checkpoint).values() if v.is_floating_point())


def _agent_state(checkpoint) -> dict:
    """The optimisers, schedulers and KL controller saved in ``checkpoint`` (its counters left out)."""
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)["agent"]["agent_state"]
    return {k: v for k, v in state.items() if k != "iteration"}


def test_an_update_that_leaves_nonfinite_weights_is_rolled_back_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """Iteration 2's steps write inf into a weight: its update is undone (weights, AdamW moments,
    schedules bit for bit as after iteration 1), counted as one skipped update, evaluated and
    checkpointed finite, and the run finishes."""
    poison_updates(monkeypatch, lambda agent: agent.iteration == 1)  # counts updates done: iteration 2
    out = tmp_path / "run"
    main(["train", *SMALL, "--iterations", "4", "--output-dir", str(out), "--checkpoint-every", "1",
          "--keep-checkpoints", "4", "--eval-every", "1"])
    rows = _metrics(out)
    assert [r["nonfinite/rolled_back"] for r in rows] == [0.0, 1.0, 0.0, 0.0]
    assert [r["nonfinite/skipped_updates"] for r in rows] == [0.0, 1.0, 0.0, 0.0]
    assert [r["nonfinite/consecutive"] for r in rows] == [0.0, 1.0, 0.0, 0.0]
    assert all(math.isfinite(r["eval/greedy/reward/mean"]) for r in rows)
    assert "iteration 2: its update left NaN/inf weights and was rolled back (1 of at most 3" in capsys.readouterr().out
    folders = sorted((out / "checkpoints").iterdir())
    assert [p.name for p in folders] == [f"iter_{i:06d}" for i in range(1, 5)] and (out / "summary.json").is_file()
    assert all(_all_finite(folder) for folder in folders)
    one, two, three = (_state(folder) for folder in folders[:3])
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert same(_agent_state(folders[0]), _agent_state(folders[1]))  # AdamW moments and step counts too
    assert any(not torch.equal(two[k], three[k]) for k in two if k.startswith("policy."))  # iteration 3 trained


def test_the_stop_names_the_quantity_and_the_tokens_it_saw_not_a_learning_rate(tmp_path, monkeypatch, capsys):
    """A reference that gives one token probability 0 (what a top-p filter on the reference's log-probs
    did to every --top-p run): the stop names ref_log_prob, the tokens and a cause that fits."""
    from textrl.agents.actor import Actor

    logprobs = Actor.logprobs

    def zero_probability_under_the_reference(self, model, *args):
        out = logprobs(self, model, *args)
        if model is self.reference:
            out = out.clone()
            out[0, 0] = -math.inf
        return out

    monkeypatch.setattr(Actor, "logprobs", zero_probability_under_the_reference)
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped) as stop:
        main(["train", *SMALL, "--iterations", "4", "--output-dir", str(out), "--max-nonfinite-updates", "2"])
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert re.search(r"the last one saw the reference's log-probs \(ref_log_prob\): -inf on 1 of \d+ agent tokens, "
                     r"first at row 0, position 0 \(token id \d+\)", err), err
    assert "probability 0" in err and "learning rate" not in err


def test_consecutive_rolled_back_updates_stop_the_run_with_a_checkpoint_of_finite_weights(tmp_path, monkeypatch, capsys):
    poison_updates(monkeypatch, lambda agent: agent.iteration >= 1)
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped, match=r"stopped after iteration 3: 2 consecutive updates were skipped "
                       r"for NaN/inf; the last one saw the update's steps left NaN/inf weights \(rolled back\).*; "
                       r"the weights of the last good update are saved in .*iter_000003") as stop:
        main(["train", *SMALL, "--iterations", "5", "--output-dir", str(out), "--checkpoint-every", "1",
              "--keep-checkpoints", "5", "--max-nonfinite-updates", "2"])
    assert stop.value.code == 1
    assert "iter_000003" in capsys.readouterr().err
    assert [r["nonfinite/rolled_back"] for r in _metrics(out)] == [0.0, 1.0, 1.0]
    assert [r["nonfinite/consecutive"] for r in _metrics(out)] == [0.0, 1.0, 2.0]
    folders = sorted((out / "checkpoints").iterdir())
    assert [p.name for p in folders] == ["iter_000001", "iter_000002", "iter_000003"]
    assert all(_all_finite(folder) for folder in folders)
    good, last = _state(folders[0]), _state(folders[-1])
    assert all(torch.equal(good[k], last[k]) for k in good)
    assert same(_agent_state(folders[0]), _agent_state(folders[-1]))


@pytest.mark.parametrize("mode", ["stop", "rollback"])
def test_an_update_that_leaves_nonfinite_weights_stops_the_run_without_a_checkpoint(tmp_path, monkeypatch, mode):
    """Weights poisoned by iteration 2's update and not rolled back: with nonfinite_weights='stop'
    (a step's inf stays), or in any mode when they turn NaN/inf outside the agent's update (the
    trainer's own check after it). The run stops after it, with no evaluation from them and no
    checkpoint of them; the newest checkpoint is iteration 1's, every weight finite."""
    if mode == "stop":
        poison_updates(monkeypatch, lambda agent: agent.iteration == 1)
    else:
        update = GAEPPO.update

        def poison_after_iteration_2(self, td):
            metrics = update(self, td)
            if self.iteration == 2:
                with torch.no_grad():
                    next(self.policy.parameters()).fill_(math.nan)
            return metrics

        monkeypatch.setattr(GAEPPO, "update", poison_after_iteration_2)
    out = tmp_path / "run"
    hint = "With nonfinite_weights='rollback' \\(the default\\) the update is undone" if mode == "stop" else "Usual"
    with pytest.raises(TrainingStopped, match=r"stopped after iteration 2: its update left NaN/inf weights, so "
                       r"no checkpoint was written; the newest good one is .*iter_000001\. " + hint) as stop:
        main(["train", *SMALL, "--iterations", "6", "--output-dir", str(out), "--checkpoint-every", "1",
              "--keep-checkpoints", "6", "--eval-every", "1", "--nonfinite-weights", mode])
    assert stop.value.code == 1
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter_000001"]
    assert _all_finite(out / "checkpoints" / "iter_000001")
    assert [("eval/greedy/reward/mean" in row) for row in _metrics(out)] == [True, False]
    assert [row["nonfinite/rolled_back"] for row in _metrics(out)] == [0.0, 0.0]


def _nan_on_first_row(prompts, completions, **kwargs):
    scores = torch.ones(len(completions))
    scores[0] = math.nan
    return scores


@pytest.mark.parametrize(("policy", "mean"), [("raise", None), ("zero", 7 / 8), ("drop", 1.0)])
def test_nonfinite_reward_follows_the_configured_policy(tmp_path, policy, mean):
    reward_file = tmp_path / "nan_reward.py"
    reward_file.write_text(
        "import math, torch\n\n"
        "def nan_first(prompts, completions, **kwargs):\n"
        "    scores = torch.ones(len(completions))\n"
        "    scores[0] = math.nan\n"
        "    return scores\n"
    )
    out = tmp_path / "run"
    args = ["train", "--iterations", "1", "--output-dir", str(out), "--reward", f"{reward_file}:nan_first",
            "--reward-nonfinite", policy, *SMALL]
    if policy == "raise":
        with pytest.raises(SystemExit, match=r"^textrl train: reward 'nan_first' returned non-finite scores "
                           r"\[nan\] in rows \[0\]; return a finite score"):  # one line, no traceback
            main(args)
        with pytest.raises(RewardError):  # --debug: the exception itself, with its traceback
            main([*args, "--debug", "--output-dir", str(tmp_path / "debug")])
        return
    assert main(args) == 0
    row = _metrics(out)[0]
    assert row["reward/nonfinite_rows"] == 1.0
    assert row["reward/mean"] == pytest.approx(mean)  # the NaN row counts as 0, or not at all
    assert math.isfinite(row["loss/policy"]) and row["nonfinite/skipped_updates"] == 0.0


def test_fast_path_zeroes_or_drops_a_nonfinite_reward_row():
    tok = build_tiny_tokenizer()
    eos = tok.eos_token_id
    ids = torch.tensor([[5, 6], [5, 7], [5, 8]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    responses = torch.tensor([[9, eos], [10, eos], [11, eos]])
    kwargs = dict(tokenizer=tok, reward_fn=_nan_on_first_row, eos_token_id=eos,
                  pad_token_id=tok.pad_token_id, max_new_tokens=2)
    with pytest.raises(RewardError, match="non-finite"):
        rollout_from_responses(ids, mask, responses, **kwargs)
    zero = rollout_from_responses(ids, mask, responses, reward_nonfinite="zero", **kwargs)
    assert zero.get(KEYS.reward).squeeze(-1).sum(1).tolist() == [0.0, 1.0, 1.0]
    assert zero.get(KEYS.reward_nonfinite).tolist() == [True, False, False]
    drop = rollout_from_responses(ids, mask, responses, reward_nonfinite="drop", **kwargs)
    assert drop.shape == (2,) and drop.get(KEYS.action)[:, 0].tolist() == [10, 11]
    with pytest.raises(RewardError, match="every one of the 1 rows"):
        rollout_from_responses(ids[:1], mask[:1], responses[:1], reward_nonfinite="drop", **kwargs)


# -- invalid configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"clip_eps": 0.0}, r"clip_eps=0.0: must be > 0"),
        ({"clip_eps": -0.2}, r"clip_eps=-0.2: must be > 0"),
        ({"gamma": 1.01}, r"gamma=1.01: must lie in \[0.0, 1.0\]"),
        ({"lam": -0.5}, r"lam=-0.5: must lie in \[0.0, 1.0\]"),
        ({"max_new_tokens": 0}, r"max_new_tokens=0: must be a number >= 1"),
        ({"num_minibatches": 3}, r"num_minibatches=3: the rollout batch of 64 rows .* choose a divisor of 64"),
        ({"kl_kind": "k4"}, r"kl_kind='k4': must be one of k1, k2, k3, abs"),
        ({"agent": "dqn"}, r"agent='dqn': must be one of"),
        ({"reward": "think_fromat"}, r"unknown reward 'think_fromat' \(did you mean 'think_format'\?\)"),
        ({"reward": "tag_count:x"}, r"bad weight 'x'"),
        ({"reward_model": "/no/such/model"}, r"/no/such/model does not exist"),
        ({"reward_nonfinite": "ignore"}, r"reward_nonfinite='ignore': must be one of raise, zero, drop"),
        ({"max_nonfinite_updates": 0}, r"max_nonfinite_updates=0: must be a number >= 1"),
    ],
)
def test_invalid_config_is_named_with_value_and_allowed_range(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        check_run(TrainConfig(output_dir=str(tmp_path / "x"), **overrides))


def test_4bit_without_bitsandbytes_is_named(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"load_in_4bit=True needs bitsandbytes .*pip install bitsandbytes"):
        TrainConfig(load_in_4bit=True).validate()


def test_a_bad_reward_name_fails_before_any_model_loads(tmp_path, monkeypatch):
    def no_models(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr("textrl.training.set_up.build_agent", no_models)
    with pytest.raises(SystemExit, match="unknown reward 'nope'"):
        main(["train", "--reward", "nope", "--output-dir", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
