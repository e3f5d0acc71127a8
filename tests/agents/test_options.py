"""GAEPPO's TrainConfig options on a tiny model: early stop, reference refresh, KL placement,
adaptive KL, uniform reward placement, dual clip, and a critic initialised from a reward model."""

from __future__ import annotations

import math

import pytest
import torch

from tests.agents.conftest import PROMPTS, collect, make_agent, target_reward
from tests.arithmetic import assert_gradients_close, rollout_rtol
from textrl.agents.base import SCORE
from textrl.envs import rollout_from_responses
from textrl.keys import KEYS
from textrl.models import ValueModel, build_tiny_reward_model


def placement(td, where: str = "last") -> torch.Tensor:
    """The task score alone, placed by hand: ``[B, T]`` (no KL term)."""
    mask = td.get(KEYS.mask)
    score = td.get(SCORE).float()
    lengths = mask.sum(1)
    out = torch.zeros(mask.shape, dtype=torch.float32)
    for b in range(mask.shape[0]):
        n = int(lengths[b])
        if where == "last":
            out[b, n - 1] = score[b]
        else:
            out[b, :n] = score[b] / n
    return out


def k1(td) -> torch.Tensor:
    """Per-token k1 KL of the rollout ``[B, T]`` (logp - ref_logp), 0 on masked positions."""
    kl = td.get(KEYS.action_log_prob) - td.get(KEYS.ref_log_prob)
    return torch.where(td.get(KEYS.mask), kl, 0.0)


def rewards(td) -> torch.Tensor:
    return td.get(KEYS.reward).squeeze(-1)


def trained(tok, **overrides):
    """An agent after one update (policy != reference) and a fresh rollout collected from it."""
    agent = make_agent(tok, actor_lr=1e-2, **overrides)
    agent.update(collect(agent, tok, seed=0))
    return agent, collect(agent, tok, seed=1)


# 1. kl_early_stop ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["target", "beta_target"])
def test_kl_early_stop_stops_before_all_epochs(tok, mode):
    agent = make_agent(tok, kl_early_stop=mode, kl_target=1e-9, actor_lr=1e-2, ppo_epochs=3, num_minibatches=2)
    metrics = agent.update(collect(agent, tok))
    assert metrics["ppo/early_stopped"] == 1.0
    assert metrics["ppo/epochs_run"] < 3


def test_kl_early_stop_none_runs_every_epoch(tok):
    agent = make_agent(tok, kl_early_stop="none", kl_target=1e-9, actor_lr=1e-2, ppo_epochs=3, num_minibatches=2)
    metrics = agent.update(collect(agent, tok))
    assert metrics["ppo/early_stopped"] == 0.0
    assert metrics["ppo/epochs_run"] == 3.0


# 2. ref_refresh_every ----------------------------------------------------------------------------
def _ref_equals_policy(agent) -> bool:
    pol, ref = agent.policy.state_dict(), agent.ref_policy.state_dict()
    assert pol.keys() == ref.keys()
    return all(torch.equal(pol[k], ref[k]) for k in pol)


@pytest.mark.parametrize("every, equal", [(1, True), (0, False)])
def test_ref_refresh_every(tok, every, equal):
    agent = make_agent(tok, ref_refresh_every=every, actor_lr=1e-2)
    agent.update(collect(agent, tok))
    assert _ref_equals_policy(agent) is equal
    if equal:  # a copy of the weights, not the same tensors: the next update moves only the policy
        agent.update(collect(agent, tok, seed=1))
        assert agent.ref_policy.training is False
        assert all(not p.requires_grad for p in agent.ref_policy.parameters())


def test_ref_refresh_every_two_waits_for_the_second_update(tok):
    agent = make_agent(tok, ref_refresh_every=2, actor_lr=1e-2)
    agent.update(collect(agent, tok))
    assert not _ref_equals_policy(agent)
    agent.update(collect(agent, tok, seed=1))
    assert _ref_equals_policy(agent)


# 3. kl_in ------------------------------------------------------------------------------------
def test_kl_in_loss_keeps_the_kl_out_of_the_reward(tok):
    agent, td = trained(tok, kl_in="loss", kl_coef=0.5)
    assert k1(td).abs().max() > 0  # there is a KL that could have leaked in
    torch.testing.assert_close(rewards(td), placement(td), rtol=0, atol=0)
    metrics = agent.update(td)
    assert "loss/kl" in metrics and math.isfinite(metrics["loss/kl"])


def test_kl_in_reward_adds_minus_beta_kl(tok):
    agent, td = trained(tok, kl_in="reward", kl_coef=0.5)
    assert k1(td).abs().max() > 0
    assert not torch.allclose(rewards(td), placement(td))
    torch.testing.assert_close(rewards(td), placement(td) - 0.5 * k1(td), rtol=1e-5, atol=1e-6)
    assert "loss/kl" not in agent.update(td)


# 4. adaptive_kl -------------------------------------------------------------------------------
def _seq_kl(td) -> float:
    return k1(td).sum(1).mean().item()


@pytest.mark.parametrize("adaptive", [True, False])
def test_adaptive_kl_moves_the_coefficient(tok, adaptive):
    agent = make_agent(tok, adaptive_kl=adaptive, kl_target=1e-9, kl_horizon=8, kl_coef=0.1, actor_lr=1e-2)
    td = collect(agent, tok)  # KL = 0 < target: beta shrinks by (1 - 0.2 * 4 / 8)
    first = agent.update(td)["kl/coef"]
    td = collect(agent, tok, seed=1)
    kl = _seq_kl(td)
    assert kl != 0.0
    second = agent.update(td)["kl/coef"]
    if not adaptive:
        assert first == second == pytest.approx(0.1)
        return
    assert first == pytest.approx(0.1 * (1 - 0.2 * 4 / 8))
    error = 0.2 if kl / 1e-9 - 1 > 0 else max(kl / 1e-9 - 1, -0.2)
    assert second == pytest.approx(first * (1 + error * 4 / 8))
    assert second != first


# 5. reward_placement --------------------------------------------------------------------------
def test_uniform_placement_spreads_the_score_equally(tok):
    agent, td = trained(tok, reward_placement="uniform", kl_coef=0.3)
    mask = td.get(KEYS.mask)
    task = torch.where(mask, rewards(td) + 0.3 * k1(td), 0.0)  # shaped reward minus (-beta * KL)
    torch.testing.assert_close(task.sum(1), td.get(SCORE).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(task, placement(td, "uniform"), rtol=1e-5, atol=1e-5)
    assert torch.all(rewards(td)[~mask] == 0)


def test_last_placement_puts_the_score_on_the_last_valid_token(tok):
    agent, td = trained(tok, reward_placement="last", kl_coef=0.3)
    task = torch.where(td.get(KEYS.mask), rewards(td) + 0.3 * k1(td), 0.0)
    torch.testing.assert_close(task, placement(td, "last"), rtol=1e-5, atol=1e-5)


# 6. dual_clip ---------------------------------------------------------------------------------
def test_dual_clip_update_is_finite_and_reports_its_fraction(tok):
    agent = make_agent(tok, dual_clip=3.0, actor_lr=1e-2, ppo_epochs=3, num_minibatches=2)
    metrics = agent.update(collect(agent, tok))
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert "dual_clip_fraction" in metrics
    assert 0.0 <= metrics["dual_clip_fraction"] <= 1.0


def test_no_dual_clip_fraction_without_dual_clip(tok):
    agent = make_agent(tok)
    assert "dual_clip_fraction" not in agent.update(collect(agent, tok))


# 7. ValueModel.from_reward_model ---------------------------------------------------------------
def test_value_model_from_reward_model_matches_its_score(tok):
    rm = build_tiny_reward_model(tok, seed=0).eval()
    before = {k: v.clone() for k, v in rm.state_dict().items()}
    critic = ValueModel.from_reward_model(rm).eval()
    assert torch.equal(critic.value_head.weight, rm.score.weight)
    if rm.score.bias is None:
        assert torch.all(critic.value_head.bias == 0)
    else:
        assert torch.equal(critic.value_head.bias, rm.score.bias)
    ids = tok(["Count to 3"], return_tensors="pt")["input_ids"]
    mask = torch.ones_like(ids)
    with torch.no_grad():
        values = critic(input_ids=ids, attention_mask=mask)  # [1, L]
        logit = rm(input_ids=ids, attention_mask=mask).logits  # [1, 1]
    assert values.shape == ids.shape
    torch.testing.assert_close(values[0, -1], logit[0, 0].float(), rtol=0, atol=1e-5)
    # deep copies: training the critic leaves the reward model untouched
    critic.value_head.weight.data.add_(1.0)
    next(critic.backbone.parameters()).data.add_(1.0)
    assert all(torch.equal(before[k], v) for k, v in rm.state_dict().items())


def uneven_rollout(tok):
    """Four scripted responses of 2, 6 (truncated), 4 and 1 valid tokens, scored by target_reward."""
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    eos = tok.eos_token_id
    responses = torch.tensor(
        [[40, eos, 0, 0, 0, 0], [41, 42, 300, 44, 45, 46], [200, 48, 49, eos, 0, 0], [eos, 0, 0, 0, 0, 0]]
    )
    return rollout_from_responses(
        enc["input_ids"], enc["attention_mask"].bool(), responses, tokenizer=tok, reward_fn=target_reward,
        eos_token_id=eos, pad_token_id=tok.pad_token_id, max_new_tokens=6,
    )


@pytest.mark.parametrize("name", ["gae_ppo", "one_step_ppo"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_gradient_accumulation_equals_the_full_minibatch_gradient(tok, name, aggregation):
    """Micro-batches of uneven response lengths, weighted by ``micro_weight``, sum to the
    gradient of the whole minibatch (the step itself is replaced by a recorder)."""
    grads = {}
    for steps in (1, 2, 4):
        # one_step_ppo reads no loss_aggregation (its loss is a mean over responses): left at its default
        reads = {"loss_aggregation": aggregation} if name != "one_step_ppo" else {}
        agent = make_agent(tok, name, gradient_accumulation_steps=steps, **reads)
        td = agent.process_rollout(uneven_rollout(tok))
        assert td.get(KEYS.mask).sum(1).tolist() == [2, 6, 4, 1]

        def record(agent, steps=steps):
            grads[steps] = {
                n: p.grad.clone() for n, p in agent.named_parameters() if p.grad is not None
            }
            return {}

        agent.backend.step = record
        torch.manual_seed(5)  # the same minibatch order in every run
        agent.update(td)
    assert grads[1].keys() == grads[2].keys() == grads[4].keys() and grads[1]
    # the micro-batches sum each gradient in another order: equal by norm (tests/arithmetic.py); a
    # micro-batch weighted wrong or left out is off by far more than rtol
    rtol = rollout_rtol(agent.policy.config, td)
    for steps in (2, 4):
        assert_gradients_close(grads[steps], grads[1], rtol, what=f"{steps} micro-batches: ")
