"""The rollout corrections and the bypass objective on rollouts drawn with stale weights (what
``--max-staleness K`` hands the learner, docs/async.md): hypothesis draws how far the learner's
weights moved since the engine drew the tokens (a lag of several updates, a gap of their size), the
correction and its bounds; the weights the learner writes are ``mismatch_weights`` of its own
log-probs now against the stale engine's, and ``old_logprobs='engine'`` makes the stale log-probs the
ratio's denominator."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.agents.test_zoo_agents import hand_rollout, uneven_responses, zoo_agent
from textrl.agents.learner import bypass_recompute
from textrl.config import TrainConfig
from textrl.functional import mismatch_weights
from textrl.keys import KEYS

BOUNDS = {"tis": ("cap", st.floats(1.05, 4.0)), "icepop": ("upper", st.floats(1.05, 6.0)),
          "mis": ("upper", st.floats(1.05, 4.0)), "geo_mean": ("upper", st.floats(1.0005, 1.2))}


def stale_rollout(agent, tok, lag: int, scale: float):
    """The hand rollout with the engine's log-probs of the agent's weights now, then the policy moved
    by ``lag`` perturbations of ``scale`` (the updates since): ``(rollout, stale log-probs [B, T])``."""
    raw = hand_rollout(tok, uneven_responses(tok.eos_token_id))
    with torch.no_grad():
        stale = agent.evaluate(raw.clone()).get(KEYS.action_log_prob)
        mask = raw.get(KEYS.mask)
        raw.set(KEYS.generation_log_prob, torch.where(mask, stale, 0.0))
        gen = torch.Generator().manual_seed(lag)
        for _ in range(lag):
            for p in agent.policy.parameters():
                p.add_(scale * torch.randn(p.shape, generator=gen))
    return raw, stale


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(sorted(BOUNDS)), lag=st.integers(0, 4), scale=st.sampled_from([1e-3, 1e-2, 5e-2]),
       data=st.data())
def test_a_correction_weighs_a_stale_rollout_by_the_learners_log_probs_now_against_the_engines(tok, kind, lag, scale, data):
    name, bounds = BOUNDS[kind]
    value = data.draw(bounds)
    agent = zoo_agent(tok, "grpo", rollout_correction=kind, rollout_correction_upper=value)
    raw, stale = stale_rollout(agent, tok, lag, scale)
    td = agent.process_rollout(raw)
    mask = td.get(KEYS.mask)
    now = td.get(KEYS.action_log_prob)
    assert torch.equal(td.get(KEYS.correction_weight), mismatch_weights(kind, now, td.get(KEYS.generation_log_prob),
                                                                        mask, **{name: value}))
    if lag == 0:
        assert torch.allclose(now[mask], stale[mask], atol=1e-6)
    else:
        assert not torch.allclose(now[mask], stale[mask], atol=1e-6)  # the lag shows as a gap


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(lag=st.integers(1, 4))
def test_the_bypass_objective_takes_the_stale_engines_log_probs_as_the_old_policys(tok, lag):
    agent = zoo_agent(tok, "grpo", old_logprobs="engine")
    raw, stale = stale_rollout(agent, tok, lag, 1e-2)
    td = agent.process_rollout(raw)
    mask = td.get(KEYS.mask)
    assert torch.equal(td.get(KEYS.action_log_prob)[mask], stale[mask])
    proximal = td.get(KEYS.proximal_log_prob)  # the learner's own, kept for the gap metrics
    assert not torch.allclose(proximal[mask], stale[mask], atol=1e-6)
    metrics = agent.update(td)
    assert metrics["rollout/logprob_gap"] > 0.0


def test_the_bypass_refuses_a_rollout_without_the_engines_log_probs(tok):
    with pytest.raises(ValueError, match="old_logprobs='engine'"):
        bypass_recompute(hand_rollout(tok, uneven_responses(tok.eos_token_id)), TrainConfig(old_logprobs="engine"))


def areal_decoupled_loss(logp, proximal, behaviour, advantages, mask, clip_eps, cap=None):
    """AReaL's decoupled PPO objective (``ppo_actor_loss_fn``), written out over ``[B, T]``: the ratio to
    the proximal policy ``r = pi_theta / pi_prox`` clipped as PPO clips it, each token's loss times the
    behaviour weight ``w = pi_prox / pi_behav`` (0 above ``cap`` when one is given), summed over the
    agent's tokens and divided by their count (a rejected token stays in the count)."""
    r = torch.exp(logp - proximal)
    loss = torch.maximum(-advantages * r, -advantages * r.clamp(1 - clip_eps, 1 + clip_eps))
    w = torch.exp(proximal - behaviour)
    kept = mask if cap is None else mask & (w <= cap)
    loss = loss * torch.where(kept, w, torch.zeros_like(w))
    return torch.where(mask, loss, torch.zeros_like(loss)).sum() / mask.sum()


@pytest.mark.parametrize("kind, bounds, cap", [("tis", {"rollout_correction_upper": 1e6}, None),
                                               ("icepop", {"rollout_correction_upper": 1.02,
                                                           "rollout_correction_lower": 1e-6}, 1.02)],
                         ids=["uncapped", "capped"])
def test_the_decoupled_gradient_is_areals_proximal_anchor_times_behaviour_weight(tok, kind, bounds, cap):
    """A rollout drawn 3 updates ago (its engine log-probs pi_behav), evaluated by the learner now (the
    proximal policy), then the policy moved again (r != 1, some tokens clipped): the gradient of the
    agent's policy loss is autograd's of AReaL's formula over the same tokens. Uncapped (tis with a cap
    no weight reaches) they are the same objective; with a cap (icepop keeping [1e-6, cap], AReaL's
    ``behav_imp_weight_cap``) textrl divides by the kept tokens where AReaL divides by all of them
    (docs/training.md, "Rollout corrections"), so the gradients differ by that ratio of counts."""
    from tests.agents.test_zoo_agents import _perturb
    from tests.arithmetic import assert_gradients_close, rollout_rtol
    from textrl.agents import forwards

    agent = zoo_agent(tok, "grpo", rollout_correction=kind, kl_coef=0.0, entropy_coef=0.0, **bounds)
    raw, _ = stale_rollout(agent, tok, lag=3, scale=5e-3)
    td = agent.process_rollout(raw)
    _perturb(agent.policy, seed=4, scale=0.02)  # the policy now: apart from the proximal one
    mask, behaviour, proximal = td.get(KEYS.mask), td.get(KEYS.generation_log_prob), td.get(KEYS.action_log_prob)
    advantages = td.get(KEYS.advantage).squeeze(-1)
    params = {n: p for n, p in agent.policy.named_parameters() if p.requires_grad}

    terms, _ = agent.loss(td)
    got = dict(zip(params, torch.autograd.grad(terms["policy"], list(params.values()), allow_unused=True)))
    input_ids, attention_mask, p = forwards.sequence_inputs(td)
    logp = agent.learner.forwards.logprobs(agent.policy, input_ids, attention_mask, p, td.get(KEYS.action))
    reference = areal_decoupled_loss(logp, proximal, behaviour, advantages, mask, agent.clip_eps, cap)
    want = dict(zip(params, torch.autograd.grad(reference, list(params.values()), allow_unused=True)))

    r = torch.exp(logp.detach() - proximal)[mask]
    assert ((r < 1 - agent.clip_eps) | (r > 1 + agent.clip_eps)).any() and (r != 1).all()  # clipping acts
    w = torch.exp(proximal - behaviour)[mask]
    kept = int(mask.sum()) if cap is None else int((w <= cap).sum())
    if cap is not None:
        assert 0 < kept < int(mask.sum())  # the cap rejects some tokens, not all
    scale = int(mask.sum()) / kept  # textrl's token mean over the kept tokens against AReaL's over all
    want = {n: None if g is None else g * scale for n, g in want.items()}
    assert_gradients_close(got, want, rollout_rtol(agent.policy.config, td), what=f"decoupled {kind}: ")
