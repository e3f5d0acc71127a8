"""``rollout_correction`` on every agent: the weights are computed once per rollout from the engine's
log-probs, change the update, leave it bit for bit as it was with ``none`` (and with weights of 1),
add up over micro-batches with rejected tokens and rows, are logged, and are refused where they
cannot apply (no engine log-probs, a bad kind or band, a token-level kind for one_step_ppo)."""

from __future__ import annotations

import argparse
import unittest.mock

import pytest
import torch

from tests.agents.test_zoo_agents import _perturb, hand_rollout, uneven_responses, zoo_agent
from tests.arithmetic import assert_gradients_close, rollout_rtol
from textrl.agents import AGENTS, agent_names
from textrl.agents.base import UpdateTally
from textrl.agents.update import Objective, run_epochs
from textrl.config import AGENT_OPTIONS, TrainConfig
from textrl.functional import MISMATCH_KINDS, mismatch_weights
from textrl.keys import KEYS

SHIFT = torch.tensor([
    [0.05] * 6,                            # row 0 (2 tokens): a small gap
    [1.0] * 6,                             # row 1 (6 tokens): rho = e on every token
    [0.3, -0.3, 0.3, -0.3, 0.0, 0.0],      # row 2 (4 tokens): gaps that cancel over the row
    [-0.2] * 6,                            # row 3 (1 token)
    [2.0, 0.1, 0.1, 0.1, 0.1, 0.1],        # row 4 (5 tokens): one token at rho = e^2 = 7.4
    [0.0] * 6,                             # row 5 (3 tokens): the engine's log-probs are the learner's
])
"""``logp_learner - logp_engine`` of the hand rollout's tokens: tis caps row 1 at 2, icepop rejects
row 4's first token, mis rejects rows 1 and 4 (and keeps the others), geo_mean rejects every row
but 2 and 5 (rows 0 and 1, the first of three micro-batches, wholly)."""
CORRECTIONS = [(name, kind, {}) for name in agent_names() for kind in MISMATCH_KINDS[1:]
               if kind in AGENTS[name].rollout_corrections] + [
    ("grpo", "geo_mean", {"loss_aggregation": "seq_mean"}),  # whole rows rejected from a mean over rows
    ("grpo", "icepop", {"loss_aggregation": "seq_mean"}),
    ("rloo", "mis", {"loss_aggregation": "seq_mean_token_sum"}),
    ("gae_ppo", "geo_mean", {"loss_aggregation": "seq_mean"}),
]


def learner_logp(tok, name: str):
    """The hand rollout and its behaviour log-probs ``[B, T]`` under a fresh tiny ``name`` agent."""
    raw = hand_rollout(tok, uneven_responses(tok.eos_token_id))
    with torch.no_grad():
        return raw, zoo_agent(tok, name).evaluate(raw.clone()).get(KEYS.action_log_prob)


def with_engine(raw, logp, shift=SHIFT):
    """``raw`` with the engine's log-probs ``logp - shift`` on the agent's tokens (0 elsewhere)."""
    td = raw.clone()
    mask = td.get(KEYS.mask)
    td.set(KEYS.generation_log_prob, torch.where(mask, logp - shift[:, : mask.shape[1]], 0.0))
    return td


def updated(tok, name: str, td, **overrides):
    """The trained weights (policy, critic) after one update (two epochs) of a fresh ``name`` agent
    on ``td``, the processed rollout and the metrics."""
    torch.manual_seed(0)  # multi_adapter_ppo's LoRA initialisation draws from the global generator
    if name == "vapo":  # its first iterations train only the critic, whose loss no correction weighs
        overrides = {"critic_warmup_iterations": 0, **overrides}
    agent = zoo_agent(tok, name, actor_lr=1e-2, ppo_epochs=2, **overrides)
    td = agent.process_rollout(td.clone())
    torch.manual_seed(1)  # the minibatch order
    metrics = agent.update(td)
    return {k: v.detach().clone() for k, v in agent.learner.named_parameters()}, td, metrics


def same_weights(a, b) -> bool:
    assert a and a.keys() == b.keys()
    return all(torch.equal(a[k], b[k]) for k in a)


# 1. the update: changed by a correction, unchanged by none and by weights of 1 ----------------------
@pytest.mark.parametrize("name", agent_names())
def test_none_is_the_update_without_engine_log_probs_and_a_correction_changes_it(tok, name):
    raw, logp = learner_logp(tok, name)
    none, td, metrics = updated(tok, name, with_engine(raw, logp))
    assert KEYS.correction_weight not in td.keys()
    assert not any(k.startswith("rollout/correction") for k in metrics)
    plain, _, _ = updated(tok, name, raw)
    assert same_weights(none, plain)  # the engine's log-probs alone change nothing
    for kind in AGENTS[name].rollout_corrections[1:]:
        corrected, td, metrics = updated(tok, name, with_engine(raw, logp), rollout_correction=kind)
        assert KEYS.correction_weight in td.keys(), kind
        assert not same_weights(corrected, none), f"{name}: rollout_correction={kind!r} changed nothing"
        assert metrics["nonfinite/skipped_updates"] == 0.0


@pytest.mark.parametrize("name", agent_names())
def test_a_correction_whose_weights_are_1_is_the_update_without_one(tok, name):
    raw, logp = learner_logp(tok, name)
    none, _, _ = updated(tok, name, raw)
    kind = "tis" if "tis" in AGENTS[name].rollout_corrections else "mis"
    ones, td, metrics = updated(tok, name, with_engine(raw, logp, torch.zeros_like(SHIFT)), rollout_correction=kind)
    mask = td.get(KEYS.mask)
    assert torch.equal(td.get(KEYS.correction_weight), mask.float())
    assert metrics["rollout/correction_weight_mean"] == 1.0 and metrics["rollout/correction_rejected_fraction"] == 0.0
    if name == "gspo":  # its weighted loss is GSPO's token-level form: the same gradient, summed in another order
        for k in none:
            torch.testing.assert_close(ones[k], none[k], rtol=1e-5, atol=1e-6)
    else:
        assert same_weights(ones, none)


# 2. the weights, once per rollout, and their metrics ---------------------------------------------------
@pytest.mark.parametrize("kind", MISMATCH_KINDS[1:])
def test_the_rollout_carries_the_kinds_weights_and_the_update_logs_them(tok, kind):
    raw, logp = learner_logp(tok, "grpo")
    bounds = {"rollout_correction_upper": 3.0} if kind != "icepop" else {"rollout_correction_lower": 0.4}
    _, td, metrics = updated(tok, "grpo", with_engine(raw, logp), rollout_correction=kind, **bounds)
    mask = td.get(KEYS.mask)
    kwargs = {"cap": 3.0} if kind == "tis" else {"lower": 0.4} if kind == "icepop" else {"upper": 3.0}
    want = mismatch_weights(kind, td.get(KEYS.action_log_prob), td.get(KEYS.generation_log_prob), mask, **kwargs)
    assert torch.equal(td.get(KEYS.correction_weight), want)
    kept = mask & (want != 0)
    assert metrics["rollout/correction_weight_mean"] == pytest.approx(float(want[kept].mean()))
    assert metrics["rollout/correction_rejected_fraction"] == pytest.approx(float((mask & ~kept).sum() / mask.sum()))


def test_the_hand_shift_rejects_the_tokens_and_rows_it_says(tok):
    raw, logp = learner_logp(tok, "grpo")
    rejected = {}
    for kind in MISMATCH_KINDS[1:]:
        _, td, _ = updated(tok, "grpo", with_engine(raw, logp), rollout_correction=kind)
        mask, w = td.get(KEYS.mask), td.get(KEYS.correction_weight)
        rejected[kind] = (mask & (w == 0)).any(1).nonzero().flatten().tolist()
        if kind == "tis":
            assert w[1][mask[1]].eq(2.0).all()
    assert rejected == {"tis": [], "icepop": [4], "mis": [1, 4], "geo_mean": [0, 1, 3, 4]}


def test_a_correction_that_rejects_nearly_everything_says_so_once(tok, recwarn):
    """icepop in [0.99, 1.01] against the hand shift rejects every token but row 5's (18 of 21, 86%: under
    the 90% that counts): no warning however long; with the engine off by 0.5 on every token, the third
    rollout in a row warns once, and the fourth and fifth say nothing more."""
    from textrl.functional.mismatch import REJECTION_WARNING_ITERATIONS

    raw, logp = learner_logp(tok, "grpo")
    agent = zoo_agent(tok, "grpo", rollout_correction="icepop", rollout_correction_upper=1.01,
                      rollout_correction_lower=0.99)
    for _ in range(REJECTION_WARNING_ITERATIONS + 1):
        agent.process_rollout(with_engine(raw, logp))
    assert not [w for w in recwarn if "rollout_correction" in str(w.message)]
    said = []
    for _ in range(REJECTION_WARNING_ITERATIONS + 2):
        td = agent.process_rollout(with_engine(raw, logp, shift=torch.full_like(SHIFT, 0.5)))
        said.append([str(w.message) for w in recwarn if "rollout_correction" in str(w.message)])
        recwarn.clear()
    assert float(td.get(KEYS.correction_weight).abs().sum()) == 0.0
    assert [len(s) for s in said] == [0] * (REJECTION_WARNING_ITERATIONS - 1) + [1, 0, 0]
    message = said[REJECTION_WARNING_ITERATIONS - 1][0]
    assert message.startswith("rollout_correction='icepop' rejected 100% or more of the agent's tokens in each of "
                              f"the last {REJECTION_WARNING_ITERATIONS} iterations (it keeps a token whose "
                              "p_learner / p_engine lies in [0.99, 1.01])")


def test_a_rollout_without_engine_log_probs_is_refused_naming_the_option(tok):
    agent = zoo_agent(tok, "grpo", rollout_correction="icepop")
    with pytest.raises(ValueError, match=r"^rollout_correction='icepop' compares the engine's log-probs with the "
                                         r"learner's, and this rollout has none \(generation_engine='auto'.*"
                                         r"--rollout-correction none$"):
        agent.process_rollout(hand_rollout(tok, uneven_responses(tok.eos_token_id)))


# 3. micro-batches add up with rejected tokens and rows -------------------------------------------------
def corrected_gradient(tok, name: str, kind: str, steps: int, raw, logp, **overrides):
    """The accumulated gradient of the whole six-row rollout as one minibatch in ``steps`` micro-batches,
    every term of the loss on (KL in the loss and an entropy bonus where the agent has them)."""
    if "kl_in" in AGENTS[name].options:
        overrides = {"kl_in": "loss", "entropy_coef": 0.01, **overrides}
    torch.manual_seed(0)
    agent = zoo_agent(tok, name, gradient_accumulation_steps=steps, rollout_correction=kind, **overrides)
    _perturb(agent.ref_policy)
    td = agent.process_rollout(with_engine(raw, logp))
    _perturb(agent.policy, seed=4, scale=0.02)  # ratios != 1
    agent.backend.step = lambda agent: {}  # record, do not step
    with unittest.mock.patch("torch.randperm", lambda n, device=None: torch.arange(n, device=device)):
        run_epochs(agent.learner, td, None, UpdateTally(), Objective(agent.loss, agent.micro_weight))
    grads = {n: p.grad.clone() for n, p in agent.named_parameters() if p.grad is not None}
    return grads, rollout_rtol(agent.policy.config, td)


@pytest.mark.parametrize("name, kind, overrides", CORRECTIONS,
                         ids=[f"{n}-{k}{''.join('-' + v for v in o.values())}" for n, k, o in CORRECTIONS])
def test_the_corrected_gradient_does_not_depend_on_the_micro_batch_split(tok, name, kind, overrides):
    raw, logp = learner_logp(tok, name)
    runs = {steps: corrected_gradient(tok, name, kind, steps, raw, logp, **overrides) for steps in (1, 2, 3)}
    grads, rtol = {steps: g for steps, (g, _) in runs.items()}, runs[1][1]
    assert grads[1] and any(g.abs().max() > 0 for g in grads[1].values())
    for steps in (2, 3):
        assert_gradients_close(grads[steps], grads[1], rtol, what=f"{name} {kind}, {steps} micro-batches: ")


def test_a_rejected_row_is_a_row_off_the_loss(tok):
    """geo_mean rejects rows 0, 1, 3 and 4 whole: the token-mean gradient is the one of rows 2 and 5
    alone (their tokens weigh 1), every term of the loss included."""
    raw, logp = learner_logp(tok, "grpo")
    corrected, _ = corrected_gradient(tok, "grpo", "geo_mean", 1, raw, logp)
    raw_kept = raw.clone()
    mask = raw_kept.get(KEYS.mask)
    kept_rows = torch.tensor([False, False, True, False, False, True])
    torch.manual_seed(0)
    agent = zoo_agent(tok, "grpo", kl_in="loss", entropy_coef=0.01)
    _perturb(agent.ref_policy)
    td = agent.process_rollout(raw_kept)
    td.set(KEYS.loss_mask, mask & kept_rows[:, None])  # the rows left out as dynamic sampling leaves them
    _perturb(agent.policy, seed=4, scale=0.02)
    agent.backend.step = lambda agent: {}
    with unittest.mock.patch("torch.randperm", lambda n, device=None: torch.arange(n, device=device)):
        run_epochs(agent.learner, td, None, UpdateTally(), Objective(agent.loss, agent.micro_weight))
    plain = {n: p.grad.clone() for n, p in agent.named_parameters() if p.grad is not None}
    assert_gradients_close(corrected, plain, rollout_rtol(agent.policy.config, td), what="rejected rows: ")


# 4. the options ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    ({"rollout_correction": "is"}, r"^rollout_correction='is': must be one of none, tis, mis, geo_mean, icepop$"),
    ({"rollout_correction_upper": 2.0}, r"^rollout_correction_upper / rollout_correction_lower are bounds of a "
                                        r"correction, and rollout_correction='none': choose"),
    ({"rollout_correction": "tis", "rollout_correction_lower": 0.5}, r"^rollout_correction_lower=0.5: tis truncates "
                                                                     r"from above only .*drop --rollout-correction-lower$"),
    ({"rollout_correction": "mis", "rollout_correction_upper": 0.5}, r"^rollout_correction='mis' keeps ratios in "
                                                                     r"\[lower, upper\] = \[2, 0.5\], which is empty"),
    ({"rollout_correction": "icepop", "rollout_correction_upper": 0.4}, r"\[0.5, 0.4\], which is empty"),
    ({"rollout_correction": "geo_mean", "rollout_correction_lower": 0.0}, r"^rollout_correction_lower=0.0: must be > 0$"),
    ({"agent": "one_step_ppo", "rollout_correction": "tis"},
     r"^rollout_correction='tis': one_step_ppo applies none, mis, geo_mean only; choose one of them, or another --agent$"),
])
def test_a_bad_correction_setting_is_refused_in_one_line(overrides, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**overrides).validate()


def test_the_options_are_objective_fields_every_agent_reads_and_flags_of_train():
    names = {"rollout_correction", "rollout_correction_upper", "rollout_correction_lower"}
    assert names <= TrainConfig.RESUME_RULES.fixed and names <= AGENT_OPTIONS
    assert all(names <= AGENTS[name].options for name in agent_names())
    for kind in MISMATCH_KINDS:
        TrainConfig(agent="grpo", rollout_correction=kind).validate()
    from textrl.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    text = " ".join(sub.choices["train"].format_help().split())
    assert all(f"--{flag}" in text for flag in ("rollout-correction", "rollout-correction-upper",
                                                 "rollout-correction-lower"))
    assert "none | tis" in text


@pytest.mark.parametrize("overrides, bounds", [
    ({"rollout_correction": "tis"}, {}),
    ({"rollout_correction": "tis", "rollout_correction_upper": 3.0}, {"cap": 3.0}),
    ({"rollout_correction": "mis", "rollout_correction_upper": 3.0}, {"upper": 3.0}),
    ({"rollout_correction": "icepop", "rollout_correction_lower": 0.25, "rollout_correction_upper": 4.0},
     {"upper": 4.0, "lower": 0.25}),
])
def test_the_bounds_reach_the_weights_as_the_kinds_arguments(overrides, bounds):
    assert TrainConfig(**overrides).validate().rollout_correction_bounds() == bounds
