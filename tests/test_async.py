"""``textrl train --max-staleness K``: the actor draws the next rollouts beside the learner's updates
(textrl.async_training). Its staleness is exact, a resume reproduces the uninterrupted run, and K=0 is
the synchronous loop."""

from __future__ import annotations

import pytest
import torch

from tests.runs import SMALL, checkpoint_tensors, metrics
from textrl.cli import main


def _train(out, *args, iterations=3, resume=False):
    extra = ["--resume"] if resume else []
    assert main(["train", *SMALL, "--iterations", str(iterations), "--output-dir", str(out), *args, *extra]) == 0
    return metrics(out)


@pytest.mark.parametrize("staleness", [1, 2])
def test_each_rollout_is_drawn_exactly_k_updates_behind(tmp_path, staleness):
    rows = _train(tmp_path / "run", "--max-staleness", str(staleness), iterations=4)
    assert [r["rollout/staleness"] for r in rows] == [float(min(i, staleness)) for i in range(4)]
    assert all(r["rollout/staleness_max"] == r["rollout/staleness"] for r in rows)
    assert rows[0]["rollout/logprob_gap"] < 1e-5  # drawn with the weights the learner still has
    assert rows[-1]["rollout/logprob_gap"] > 1e-4  # drawn with weights the learner has moved on from
    assert all(r["time/wait_s"] >= 0 for r in rows)


def test_k_zero_is_the_synchronous_loop(tmp_path):
    rows = _train(tmp_path / "sync", iterations=2)
    assert "rollout/staleness" not in rows[0] and "time/wait_s" not in rows[0]
    assert all(r["rollout/policy_lag"] == 0.0 for r in rows)


@pytest.mark.parametrize(
    "options",
    [["--max-staleness", "1", "--eval-every", "2"],
     ["--max-staleness", "2", "--env", "guess_number", "--partial-rollouts", "continue"]],
    ids=["k1-digits", "k2-partial-multiturn"],
)
def test_resume_reproduces_an_uninterrupted_asynchronous_run(tmp_path, options):
    full, part = tmp_path / "full", tmp_path / "part"
    a = _train(full, *options, iterations=4)
    _train(part, *options, iterations=2)
    b = _train(part, *options, iterations=4, resume=True)
    assert [r["iteration"] for r in b] == [1, 2, 3, 4]
    # every training metric (the short run's last iteration evaluated, a NaN is equal to itself)
    trained = lambda row: {k: str(v) for k, v in row.items()  # noqa: E731
                           if not k.startswith(("time/", "memory/", "eval/")) and k != "tokens_per_second"}
    assert [trained(r) for r in a] == [trained(r) for r in b]
    last = sorted((full / "checkpoints").iterdir())[-1].name
    sa, sb = checkpoint_tensors(full / "checkpoints" / last), checkpoint_tensors(part / "checkpoints" / last)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_partial_rollouts_tag_the_turns_with_newer_weights(tmp_path):
    rows = _train(tmp_path / "p", "--max-staleness", "2", "--env", "guess_number", "--partial-rollouts", "continue",
                  iterations=4)
    # rollout 2 (iteration 3): turns drawn with iterations 0, 1, 2, 2, the learner at 2 -> staleness 2, 1, 0, 0
    assert rows[2]["rollout/staleness_max"] == 2.0
    assert 0.0 < rows[2]["rollout/staleness"] < 2.0
    finished = _train(tmp_path / "f", "--max-staleness", "2", "--env", "guess_number", iterations=3)
    assert finished[2]["rollout/staleness"] == 2.0  # 'finish': every turn with the episode's first weights


@pytest.mark.parametrize("correction", ["tis", "icepop"])
def test_the_corrections_weigh_stale_rollouts(tmp_path, correction):
    rows = _train(tmp_path / correction, "--max-staleness", "2", "--rollout-correction", correction,
                  "--rollout-correction-upper", "1.01", *(["--rollout-correction-lower", "0.99"] if correction == "icepop" else []),
                  iterations=4)
    assert rows[0]["rollout/correction_rejected_fraction"] == 0.0
    if correction == "icepop":  # 2 updates behind, some tokens' ratios leave [0.99, 1.01]
        assert rows[-1]["rollout/correction_rejected_fraction"] > 0.0
    else:
        assert rows[-1]["rollout/correction_weight_mean"] != pytest.approx(1.0, abs=1e-6)


def test_the_bypass_objective_takes_the_engines_logprobs(tmp_path):
    rows = _train(tmp_path / "b", "--max-staleness", "1", "--old-logprobs", "engine", iterations=3)
    assert rows[-1]["rollout/logprob_gap"] > 1e-4  # the learner's prefill against the stale engine's, logged
    assert all(r["loss/policy"] == r["loss/policy"] for r in rows)


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--max-staleness", "-1"], "max_staleness=-1"),
     (["--partial-rollouts", "continue"], "max_staleness=0"),
     (["--old-logprobs", "engine", "--rollout-correction", "tis"], "drop one of the two")],
)
def test_bad_asynchronous_settings_stop_before_any_model_loads(tmp_path, args, message):
    with pytest.raises(SystemExit, match=message):
        main(["train", *SMALL, "--output-dir", str(tmp_path / "x"), *args])
    assert not (tmp_path / "x").exists()


def test_resume_with_another_staleness_is_refused(tmp_path):
    _train(tmp_path / "r", "--max-staleness", "1", iterations=1)
    with pytest.raises(SystemExit, match="max_staleness"):
        main(["train", *SMALL, "--iterations", "2", "--output-dir", str(tmp_path / "r"), "--max-staleness", "2",
              "--resume"])
