"""GAEPPO and OneStepPPO on a tiny model: invariants at step 0, one update, hand-computed losses."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.agents.conftest import collect, make_config, record_loss_stats
from tests.agents.conftest import make_agent as build
from textrl.agents import AGENTS, GAEPPO, OneStepPPO, make_agent
from textrl.agents.base import SCORE
from textrl.agents.forwards import forward_policy, forward_values
from textrl.agents.update import total_loss
from textrl.config import TrainConfig
from textrl.core.checks import check_rollout
from textrl.keys import KEYS

NAMES = sorted(AGENTS)


def params(model):
    """Tensor weights of a module (an agent's ``agent_state`` entry is not a tensor)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


@pytest.mark.parametrize("name", NAMES)
def test_processed_rollout_passes_checks_and_kl_is_zero_before_training(tok, name):
    agent = build(tok, name)
    td = collect(agent, tok)
    check_rollout(td)
    assert td.get(KEYS.advantage).shape == (4, td.get(KEYS.action).shape[1], 1)
    if agent.critic is not None:  # grpo / rloo have none
        assert td.get(KEYS.state_value).shape == td.get(KEYS.advantage).shape
    assert torch.equal(td.get(KEYS.action_log_prob), td.get(KEYS.ref_log_prob))
    metrics = agent.update(td)
    assert metrics["kl/collection"] == 0.0
    assert metrics["kl/before_update"] == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_first_minibatch_ratio_is_one_and_nothing_is_clipped(tok, name):
    agent = build(tok, name, ppo_epochs=2)
    td = collect(agent, tok)
    seen = record_loss_stats(agent)
    agent.update(td)
    assert seen[0]["ratio/mean"].item() == 1.0
    assert seen[0]["ratio/max"].item() == 1.0
    assert seen[0]["clip_fraction"].item() == 0.0
    assert seen[0]["kl/policy_old"].item() == 0.0


# MultiAdapterPPO has no separate reference model (the base with adapters disabled): its versions
# of these two checks are in test_multi_adapter.py (frozen weights bit-identical after an update).
SEPARATE_REFERENCE = [n for n in NAMES if n != "multi_adapter_ppo"]


@pytest.mark.parametrize("name", SEPARATE_REFERENCE)
def test_one_update_moves_trainables_and_leaves_reference_identical(tok, name):
    # vapo trains only its critic in its first iterations (critic_warmup_iterations): turned off here
    warmup = {"critic_warmup_iterations": 0} if "critic_warmup_iterations" in AGENTS[name].options else {}
    agent = build(tok, name, actor_lr=1e-2, kl_after_update=True, **warmup)
    td = collect(agent, tok)
    ref_before, pol_before = params(agent.ref_policy), params(agent.policy)
    critic_before = params(agent.critic) if agent.critic is not None else {}
    metrics = agent.update(td)
    assert all(torch.equal(v, agent.ref_policy.state_dict()[k]) for k, v in ref_before.items())
    assert any(not torch.equal(v, agent.policy.state_dict()[k]) for k, v in pol_before.items())
    assert not critic_before or any(not torch.equal(v, agent.critic.state_dict()[k]) for k, v in critic_before.items())
    assert metrics["kl/after_update"] != 0.0
    critic_keys = ("loss/value", "explained_variance") if agent.critic is not None else ()
    for key in ("loss/policy", "clip_fraction", "kl/policy_old", "entropy", *critic_keys):
        assert key in metrics


@pytest.mark.parametrize("name", SEPARATE_REFERENCE)
def test_zero_learning_rate_leaves_parameters_bit_identical(tok, name):
    agent = build(tok, name)
    for opt, sched in zip(agent.optimizers, agent.schedulers):
        sched.base_lrs = [0.0] * len(opt.param_groups)
        for group in opt.param_groups:
            group["lr"] = 0.0
    td = collect(agent, tok)
    before = params(agent)
    agent.update(td)
    assert all(torch.equal(v, agent.state_dict()[k]) for k, v in before.items())
    assert len(before) > (50 if agent.critic is not None else 40)


def test_gae_closed_form_with_gamma_lambda_one(tok):
    agent = build(tok, "gae_ppo", gamma=1.0, lam=1.0, kl_coef=0.0, whiten_advantages=False)
    td = collect(agent, tok)
    mask = td.get(KEYS.mask)
    values = td.get(KEYS.state_value).squeeze(-1)
    expected = td.get(SCORE).unsqueeze(1) - values
    adv = td.get(KEYS.advantage).squeeze(-1)
    assert torch.allclose(adv[mask], expected[mask], atol=1e-6)
    assert torch.equal(adv[~mask], torch.zeros_like(adv[~mask]))


def two_token_batch(tok) -> TensorDict:
    """One prompt, a two-token response, made-up old log-probs, values and advantages."""
    prompt = torch.tensor([[tok.pad_token_id, 30, 31]])
    return TensorDict(
        {
            KEYS.prompt_tokens: prompt,
            KEYS.prompt_mask: prompt != tok.pad_token_id,
            KEYS.action: torch.tensor([[40, tok.eos_token_id]]),
            KEYS.mask: torch.tensor([[True, True]]),
            KEYS.action_log_prob: torch.tensor([[-6.0, -6.5]]),
            KEYS.ref_log_prob: torch.tensor([[-6.2, -6.1]]),
            KEYS.state_value: torch.tensor([[[0.1], [0.3]]]),
            KEYS.advantage: torch.tensor([[[1.0], [-0.5]]]),
            KEYS.value_target: torch.tensor([[[0.9], [0.2]]]),
            SCORE: torch.tensor([0.7]),
        },
        batch_size=[1],
    )


def test_gae_ppo_loss_matches_hand_computation(tok):
    agent = build(tok, "gae_ppo", value_clip_eps=0.05, entropy_coef=0.01, vf_coef=0.5, kl_in="loss", kl_coef=0.2)
    with torch.no_grad():
        agent.critic.value_head.bias.fill_(0.25)
    mb = two_token_batch(tok)
    terms, stats = agent.loss(mb)
    loss = total_loss(terms)
    with torch.no_grad():
        logp, entropy = forward_policy(agent, mb)
        v = forward_values(agent, mb)[0]
    lp, old, ref = logp[0], mb[KEYS.action_log_prob][0], mb[KEYS.ref_log_prob][0]
    adv, old_v, ret = torch.tensor([1.0, -0.5]), torch.tensor([0.1, 0.3]), torch.tensor([0.9, 0.2])
    ratio = torch.exp(lp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
    v_clip = old_v + (v - old_v).clamp(-0.05, 0.05)
    vf = 0.5 * torch.maximum((v - ret) ** 2, (v_clip - ret) ** 2).mean()
    kl = (lp - ref).mean()
    expected = pg + 0.5 * vf - 0.01 * entropy[0].mean() + 0.2 * kl
    assert torch.allclose(loss, expected, atol=1e-6)
    assert torch.allclose(stats["loss/policy"], pg, atol=1e-6)
    assert torch.allclose(stats["loss/value"], vf, atol=1e-6)


def test_one_step_ppo_loss_matches_hand_computation(tok):
    agent = build(tok, "one_step_ppo", vf_coef=0.5, kl_coef=0.2)
    assert agent.clip_eps == 0.1
    with torch.no_grad():
        agent.critic.value_head.bias.fill_(0.25)
    mb = two_token_batch(tok)
    terms, stats = agent.loss(mb)
    loss = total_loss(terms)
    with torch.no_grad():
        logp, _ = forward_policy(agent, mb)
    lp, old, ref = logp[0], mb[KEYS.action_log_prob][0], mb[KEYS.ref_log_prob][0]
    ratio = torch.exp(lp.sum() - old.sum())
    adv = torch.tensor(-0.5)  # the advantage at the last valid token
    pg = -torch.minimum(ratio * adv, ratio.clamp(0.9, 1.1) * adv)
    vf = (torch.tensor(0.25) - 0.7) ** 2  # zero head weight + bias 0.25: V = 0.25 everywhere
    expected = pg + 0.5 * vf + 0.2 * (lp.sum() - ref.sum())
    assert torch.allclose(loss, expected, atol=1e-5)
    assert torch.allclose(stats["loss/value"], vf, atol=1e-6)


def test_one_step_advantage_is_score_minus_last_value(tok):
    agent = build(tok, "one_step_ppo")
    td = collect(agent, tok)
    mask = td.get(KEYS.mask)
    last = mask.sum(1) - 1
    v_last = td.get(KEYS.state_value).squeeze(-1).gather(1, last.unsqueeze(1)).squeeze(1)
    adv = td.get(KEYS.advantage).squeeze(-1)
    assert torch.allclose(adv.gather(1, last.unsqueeze(1)).squeeze(1), td.get(SCORE) - v_last)


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_restores_optimisers_schedulers_and_kl_controller(tok, name):
    agent = build(tok, name, adaptive_kl=True, lr_schedule="cosine", lr_warmup_steps=1)
    agent.update(collect(agent, tok))
    state = agent.state_dict()
    fresh = build(tok, name, adaptive_kl=True, lr_schedule="cosine", lr_warmup_steps=1, seed=1)
    fresh.load_state_dict(state)
    assert fresh.iteration == agent.iteration == 1
    assert fresh.kl_ctl.value == agent.kl_ctl.value != 0.05
    for a, b in zip(agent.schedulers, fresh.schedulers):
        assert a.state_dict()["last_epoch"] == b.state_dict()["last_epoch"]
        assert a.get_last_lr() == b.get_last_lr()
    for a, b in zip(agent.optimizers, fresh.optimizers):
        for sa, sb in zip(a.state.values(), b.state.values()):
            assert torch.equal(sa["exp_avg"], sb["exp_avg"])
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in params(agent).items())


def test_old_policy_snapshot_refreshes_every_n_iterations(tok):
    agent = build(tok, "one_step_ppo", old_policy_refresh_every=2, actor_lr=1e-2)
    agent.update(collect(agent, tok))
    assert not all(torch.equal(v, agent.policy.state_dict()[k]) for k, v in agent.old_policy.state_dict().items())
    agent.update(collect(agent, tok))
    assert all(torch.equal(v, agent.policy.state_dict()[k]) for k, v in agent.old_policy.state_dict().items())


def test_ratio_threshold_skips_the_actor_step(tok):
    agent = build(tok, "gae_ppo", ratio_threshold=1e-3)
    td = collect(agent, tok)
    before = params(agent.policy)
    metrics = agent.update(td)
    assert metrics["ppo/ratio_threshold_skips"] == 1.0
    assert all(torch.equal(v, agent.policy.state_dict()[k]) for k, v in before.items())


def test_make_agent_names_the_choices(tok):
    with pytest.raises(ValueError, match="cispo, dapo, dr_grpo, gae_ppo, grpo, gspo, multi_adapter_ppo, one_step_ppo, "
                                         "reinforce_pp, reinforce_pp_baseline, rloo, vapo"):
        make_agent("nope")
    assert AGENTS["gae_ppo"] is GAEPPO and AGENTS["one_step_ppo"] is OneStepPPO
    assert sorted(AGENTS) == ["cispo", "dapo", "dr_grpo", "gae_ppo", "grpo", "gspo", "multi_adapter_ppo", "one_step_ppo",
                              "reinforce_pp", "reinforce_pp_baseline", "rloo", "vapo"]
    assert make_config().validate()
    assert TrainConfig().agent == "rloo"  # the embedded default (docs/training.md, "The embedded default")


def test_sampling_without_top_k_draws_from_the_whole_vocabulary(tok):
    # A tiny LM head makes the policy near-uniform over the 512 tokens. Hub checkpoints often carry
    # top_k=50 in their generation config: if act() let that default through, at most 50 distinct tokens could
    # appear at the first position, and the log-probs (computed on the full distribution) would not be the sampler's.
    from tests.agents.conftest import make_agent

    agent = make_agent(tok, max_new_tokens=1, generation_batch_size=256, forward_batch_size=256,
                       prompts_per_iteration=256)
    with torch.no_grad():  # distinct but nearly equal logits: near-uniform, and top-k really cuts
        agent.policy.lm_head.weight.normal_(0.0, 1e-3, generator=torch.Generator().manual_seed(0))
    agent.policy.generation_config.top_k = 50  # as in most hub checkpoints
    ids = torch.full((256, 1), tok.bos_token_id)  # one shared context: one top-k set
    torch.manual_seed(0)
    responses = agent.act(ids, torch.ones_like(ids, dtype=torch.bool))
    assert responses[:, 0].unique().numel() > 100  # ~200 expected from 256 uniform draws
