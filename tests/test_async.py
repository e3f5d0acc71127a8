"""``textrl train --max-staleness K``: the actor draws the next rollouts beside the learner's updates
(textrl.training.async_training). Its staleness is exact, a resume reproduces the uninterrupted run, and K=0 is
the synchronous loop."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.runs import SMALL, checkpoint_tensors, metrics
from textrl.cli import main
from textrl.keys import KEYS


def _train(out, *args, iterations=3, resume=False):
    extra = ["--resume"] if resume else []
    assert main(["train", *SMALL, "--iterations", str(iterations), "--output-dir", str(out), *args, *extra]) == 0
    return metrics(out)


def record_updates(monkeypatch):
    """Patch the agent's update to keep, at each call, the rollout it is handed and the policy's weights
    before it (the weights of iteration n: n updates done), copied: ``(rollouts, weights, agents)``."""
    from textrl.agents.base import PPOAgent

    rollouts, weights, agents = [], [], []
    update = PPOAgent.update

    def recording(agent, td):
        rollouts.append(td.clone())
        weights.append({k: v.detach().clone() for k, v in agent.policy.state_dict().items()})
        agents.append(agent)
        return update(agent, td)

    monkeypatch.setattr(PPOAgent, "update", recording)
    return rollouts, weights, agents


def prefill(agent, state, td):
    """The log-probs ``[B, T]`` of the rollout's tokens under a copy of the policy holding ``state``,
    through the run's own forwards (its precision and temperature)."""
    from textrl.agents import forwards

    model = copy.deepcopy(agent.policy)
    model.load_state_dict(state)
    input_ids, attention_mask, p = forwards.sequence_inputs(td)
    with torch.no_grad():
        return agent.learner.forwards.logprobs(model, input_ids, attention_mask, p, td.get(KEYS.action))


@pytest.mark.parametrize("staleness", [1, 2])
def test_each_rollout_is_drawn_exactly_k_updates_behind(tmp_path, monkeypatch, staleness):
    rollouts, weights, agents = record_updates(monkeypatch)
    rows = _train(tmp_path / "run", "--max-staleness", str(staleness), iterations=4)
    # rollout n's engine log-probs are a prefill with the weights of iteration n - K, kept here from the
    # learner (not the producer's tag): within float32 noise of those, off those the learner holds now
    moved = 0
    for n, td in enumerate(rollouts):
        mask, engine = td.get(KEYS.mask), td.get(KEYS.generation_log_prob)
        drawn = prefill(agents[n], weights[max(0, n - staleness)], td)
        assert (engine - drawn)[mask].abs().max() < 2e-5, f"rollout {n}"
        if any(not torch.equal(weights[n][k], v) for k, v in weights[max(0, n - staleness)].items()):
            moved += 1  # the learner moved on since (the first update may change nothing: all rewards 0)
            assert (engine - prefill(agents[n], weights[n], td))[mask].abs().max() > 1e-4, f"rollout {n}"
    assert moved >= 2
    assert [r["rollout/staleness"] for r in rows] == [float(min(i, staleness)) for i in range(4)]
    assert all(r["rollout/staleness_max"] == r["rollout/staleness"] for r in rows)
    assert rows[0]["rollout/logprob_gap"] < 1e-5  # drawn with the weights the learner still has
    assert rows[-1]["rollout/logprob_gap"] > 1e-4  # drawn with weights the learner has moved on from
    assert all(r["time/wait_s"] >= 0 for r in rows)


def test_k_zero_is_the_synchronous_loop(tmp_path):
    rows = _train(tmp_path / "sync", iterations=2)
    assert "time/wait_s" not in rows[0]
    assert all(r["rollout/staleness"] == 0.0 for r in rows)


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
                           if not k.startswith(("time/", "memory/", "eval/")) and k not in ("tokens_per_second", "perf/tokens_per_s")}
    assert [trained(r) for r in a] == [trained(r) for r in b]
    last = sorted((full / "checkpoints").iterdir())[-1].name
    sa, sb = checkpoint_tensors(full / "checkpoints" / last), checkpoint_tensors(part / "checkpoints" / last)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_the_asynchronous_path_adds_nothing_but_the_staleness(tmp_path, monkeypatch, capsys):
    """K=1 with its actor made to draw rollout n from the learner's weights of iteration n (staleness
    0) is the synchronous run, metric for metric and weight for weight: the learner's values, returns,
    reference KL, proximal log-probs, schedules and held-out evaluation are the same on the
    asynchronous path; what K=1 changes is which weights drew the tokens and nothing else. The K=0
    run shuffles its minibatches with the private generator a K >= 1 learner uses (the global RNG
    then carries only the sampling in both). gae_ppo on guess_number: a critic, multi-turn returns."""
    import textrl.agents.async_actor as async_actor
    import textrl.training.set_up as training_set_up
    from textrl.training.async_training import LEARNER_SEED_OFFSET

    options = ["--env", "guess_number", "--eval-every", "2", "--ppo-epochs", "2", "--warmup-sft-steps", "20"]
    sync_source = training_set_up.rollout_source

    def private_generator(config, agent, *args):
        agent.learner.generator = torch.Generator().manual_seed(int(config.seed) + LEARNER_SEED_OFFSET)
        return sync_source(config, agent, *args)

    with monkeypatch.context() as patch:
        patch.setattr(training_set_up, "rollout_source", private_generator)
        sync = _train(tmp_path / "k0", *options, iterations=4)
    assert "without a correction" not in capsys.readouterr().out
    with monkeypatch.context() as patch:
        patch.setattr(async_actor, "behaviour_iteration", lambda n, max_staleness: int(n))
        fresh = _train(tmp_path / "k1", *options, "--max-staleness", "1", iterations=4)
    assert capsys.readouterr().out.count("--max-staleness 1 without a correction") == 1  # said once, at the start
    assert [r["rollout/staleness"] for r in fresh] == [0.0] * 4
    engine_noise = ("rollout/logprob", "rollout/weight_gap")  # the actor's engine against the learner's prefill
    same = lambda row: {k: v for k, v in row.items()  # noqa: E731
                        if not k.startswith(("time/", "memory/", "rollout/staleness", *engine_noise))
                        and k not in ("tokens_per_second", "perf/tokens_per_s")}
    assert [same(r) for r in sync] == [same(r) for r in fresh]
    # it trained: rewards, the critic's loss, the policy's gradient and the reference KL all moved
    assert all(any(r[k] != 0 for r in sync) for k in ("reward/mean", "loss/value", "grad_norm/actor", "kl/collection"))
    assert "eval/sampled/reward/mean" in sync[1]
    a, b = (checkpoint_tensors(sorted((tmp_path / run / "checkpoints").iterdir())[-1]) for run in ("k0", "k1"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("k", [1, 4])
def test_a_stale_run_without_a_correction_says_what_its_objective_is(k):
    from textrl.config import TrainConfig
    from textrl.training.async_training import staleness_note

    note = staleness_note(TrainConfig(max_staleness=k))
    assert note.startswith(f"--max-staleness {k} without a correction") and "\n" not in note
    assert f"up to {k} update" in note and "proximal" in note and "--rollout-correction tis" in note
    for quiet in (TrainConfig(), TrainConfig(max_staleness=k, rollout_correction="tis"),
                  TrainConfig(max_staleness=k, old_logprobs="engine")):
        assert staleness_note(quiet) is None  # synchronous, corrected, or the bypass objective


def test_partial_rollouts_tag_the_turns_with_newer_weights(tmp_path):
    rows = _train(tmp_path / "p", "--max-staleness", "2", "--env", "guess_number", "--partial-rollouts", "continue",
                  iterations=4)
    # rollout 2 (iteration 3): turns drawn with iterations 0, 1, 1, 1 (never 2, the learner's own, which it
    # publishes only when it takes rollout 2), the learner at 2 -> staleness 2, 1, 1, 1
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
    """One step per update (one epoch, one minibatch): its ratio is the first epoch's. With recompute that
    ratio is pi_theta / pi_proximal = 1 on every token (the learner's weights are the proximal policy's);
    with the bypass it is pi_theta / pi_engine = exp(d_t), d_t = the learner's prefill minus the stale
    engine's log-prob, so its largest |log ratio| is the logged rollout/logprob_gap_max."""
    one_step = ["--max-staleness", "1", "--num-minibatches", "1", "--ppo-epochs", "1"]
    recompute = _train(tmp_path / "r", *one_step, iterations=4)
    bypass = _train(tmp_path / "b", *one_step, "--old-logprobs", "engine", iterations=4)
    for row in recompute:
        assert row["ratio/min"] == pytest.approx(1.0, abs=1e-6) and row["ratio/max"] == pytest.approx(1.0, abs=1e-6)
    # iteration 1 draws with the learner's weights in both runs: the same rollout, the same ratio to noise
    assert bypass[0]["ratio/mean"] == pytest.approx(recompute[0]["ratio/mean"], abs=1e-5)
    stale = [row for row in bypass if row["rollout/logprob_gap_max"] > 1e-3]
    assert len(stale) >= 2  # the engine one update behind (the first update may change nothing)
    for row in stale:
        log_ratio = max(abs(math.log(row["ratio/max"])), abs(math.log(row["ratio/min"])))
        assert log_ratio == pytest.approx(row["rollout/logprob_gap_max"], abs=2e-5)
        assert abs(row["ratio/mean"] - 1.0) > 1e-5


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--max-staleness", "-1"], "max_staleness=-1"),
     (["--partial-rollouts", "continue"], "max_staleness=0"),
     (["--partial-rollouts", "continue", "--max-staleness", "1", "--env", "guess_number"],
      "with max_staleness=1 every turn is drawn with those already: it would change nothing"),
     (["--old-logprobs", "engine", "--rollout-correction", "tis"], "drop one of the two")],
)
def test_bad_asynchronous_settings_stop_before_any_model_loads(tmp_path, args, message):
    with pytest.raises(SystemExit, match=message):
        main(["train", *SMALL, "--output-dir", str(tmp_path / "x"), *args])
    assert not (tmp_path / "x").exists()


def test_partial_rollouts_on_a_single_turn_environment_are_refused_before_any_model_loads(tmp_path, monkeypatch):
    """digits has one turn an episode, so 'continue' (a newer turn's weights) would change nothing: one line
    naming the option and why, before the policy is built; guess_number (several turns) takes it."""
    from textrl.agents.base import PPOAgent
    from textrl.envs.registry import check_partial_rollouts, task_environment

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(PPOAgent, "from_config", classmethod(no_model))
    with pytest.raises(SystemExit, match="partial_rollouts='continue' lets a multi-turn episode take newer weights "
                                         "at its next turn, and digits is single-turn") as stop:
        main(["train", *SMALL, "--output-dir", str(tmp_path / "x"), "--env", "digits", "--max-staleness", "2",
              "--partial-rollouts", "continue"])
    assert "\n" not in str(stop.value.code)
    config = type("Config", (), {"partial_rollouts": "continue"})()
    check_partial_rollouts(config, task_environment("guess_number", None, None, None))


def test_resume_with_another_staleness_is_refused(tmp_path):
    _train(tmp_path / "r", "--max-staleness", "1", iterations=1)
    with pytest.raises(SystemExit, match="max_staleness"):
        main(["train", *SMALL, "--iterations", "2", "--output-dir", str(tmp_path / "r"), "--max-staleness", "2",
              "--resume"])


def slow_engine(patch, seconds: float) -> None:
    """The textrl engine, each generation call ``seconds`` longer (a slow server)."""
    import time

    from textrl.generation.base import get_engine

    engine = type(get_engine("textrl"))
    generate = engine.generate_with_logprobs

    def slow(self, *args, **kwargs):
        time.sleep(seconds)
        return generate(self, *args, **kwargs)

    patch.setattr(engine, "generate_with_logprobs", slow)


def test_a_checkpoint_or_evaluation_cancels_the_rollout_in_flight_and_the_run_is_unchanged(tmp_path, monkeypatch):
    """K=2 with a slow engine (4 generation calls a rollout): every checkpoint and evaluation finds the
    actor drawing and cancels it at its next call rather than waiting for up to K rollouts; the
    rollout is drawn again from its start, so the run equals one that never rested."""
    from textrl.agents.async_actor import AsyncRollouts

    cancelled = []
    rest = AsyncRollouts._rest

    def counting(self, n):
        cancelled.append(n)
        return rest(self, n)

    options = ["--max-staleness", "2", "--generation-batch-size", "2"]
    with monkeypatch.context() as patch:
        slow_engine(patch, 0.15)
        patch.setattr(AsyncRollouts, "_rest", counting)
        calm = _train(tmp_path / "calm", *options, "--checkpoint-every", "0", iterations=5)
        calm_cancelled = len(cancelled)
        rested = _train(tmp_path / "rested", *options, "--checkpoint-every", "1", "--eval-every", "1", iterations=5)
    assert len(cancelled) - calm_cancelled >= 3  # the cadence found it drawing (calm: only the last checkpoint)
    trained = lambda row: {k: str(v) for k, v in row.items()  # noqa: E731
                           if not k.startswith(("time/", "memory/", "eval/")) and k not in ("tokens_per_second", "perf/tokens_per_s")}
    assert [trained(r) for r in calm] == [trained(r) for r in rested]
    a = checkpoint_tensors(tmp_path / "calm" / "checkpoints" / "iter_000005")
    b = checkpoint_tensors(tmp_path / "rested" / "checkpoints" / "iter_000005")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_from_a_checkpoint_that_cancelled_a_rollout_is_exact(tmp_path, monkeypatch):
    options = ["--max-staleness", "2", "--generation-batch-size", "2"]
    with monkeypatch.context() as patch:
        slow_engine(patch, 0.15)
        full = _train(tmp_path / "full", *options, iterations=4)
        _train(tmp_path / "part", *options, iterations=2)
        part = _train(tmp_path / "part", *options, iterations=4, resume=True)
    trained = lambda row: {k: str(v) for k, v in row.items()  # noqa: E731
                           if not k.startswith(("time/", "memory/", "eval/")) and k not in ("tokens_per_second", "perf/tokens_per_s")}
    assert [trained(r) for r in full] == [trained(r) for r in part]
