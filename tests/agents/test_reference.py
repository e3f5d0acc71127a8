"""No reference model where nothing reads it: at kl_coef 0 (no adaptive KL, no kl/after_update
monitor) an agent builds, loads and runs no reference, and logs no KL monitors; kl_coef > 0
keeps one. Checkpoints of either kind resume into the other."""

from __future__ import annotations

import pytest
import torch

from tests.agents.conftest import collect, make_agent
from textrl.agents import agent_class, forwards
from textrl.config import TrainConfig
from textrl.keys import KEYS

AGENTS = ["gae_ppo", "grpo", "one_step_ppo", "reinforce_pp", "multi_adapter_ppo"]
MONITORS = ("kl/collection", "kl/before_update")


@pytest.mark.parametrize("name", AGENTS)
def test_kl_coef_0_builds_no_reference_and_trains(tok, name):
    agent = make_agent(tok, name, kl_coef=0.0, kl_in="loss" if name == "grpo" else "reward")
    assert agent.ref_policy is None
    assert not [k for k in agent.state_dict() if k.startswith("ref_policy.")]
    before = {n: p.detach().clone() for n, p in agent.policy.named_parameters()}
    td = collect(agent, tok)
    assert KEYS.ref_log_prob not in td.keys()
    metrics = agent.update(td)
    assert not set(MONITORS) & set(metrics) and "kl/after_update" not in metrics
    assert metrics["kl/coef"] == 0.0 and metrics["nonfinite/skipped_updates"] == 0.0
    assert any(not torch.equal(before[n], p) for n, p in agent.policy.named_parameters())


@pytest.mark.parametrize("name", AGENTS)
def test_kl_coef_above_0_keeps_its_reference(tok, name):
    agent = make_agent(tok, name, kl_coef=0.05)
    assert agent.ref_policy is not None
    td = collect(agent, tok)
    assert KEYS.ref_log_prob in td.keys()
    assert set(MONITORS) <= set(agent.update(td))


@pytest.mark.parametrize("overrides", [dict(adaptive_kl=True), dict(kl_after_update=True)])
def test_what_reads_the_reference_at_kl_coef_0_keeps_it(tok, overrides):
    agent = make_agent(tok, "gae_ppo", kl_coef=0.0, **overrides)
    assert agent.ref_policy is not None
    assert "kl/before_update" in agent.update(collect(agent, tok))


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_no_reference_forward_runs_at_kl_coef_0(tok, kl_coef, monkeypatch):
    agent = make_agent(tok, "multi_adapter_ppo", kl_coef=kl_coef)  # the reference: the base, adapters off
    models, logprobs = [], forwards.Forwards.logprobs

    def spy(shared, model, *args):
        models.append(model)
        return logprobs(shared, model, *args)

    monkeypatch.setattr(forwards.Forwards, "logprobs", spy)
    collect(agent, tok)
    others = [m for m in models if m is not agent.policy]
    assert (others == []) if kl_coef == 0 else (others == [agent.ref_policy])


def test_from_config_at_kl_coef_0_loads_no_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path))
    config = TrainConfig(agent="rloo", kl_coef=0.0, prompts_per_iteration=2, n_samples_per_prompt=2,
                         warmup_sft_steps=0, max_new_tokens=4)
    agent = agent_class("rloo").from_config(config, "cpu", log=lambda *a: None)
    assert agent.ref_policy is None
    policy_weights = sum(p.numel() for p in agent.policy.parameters())
    assert sum(p.numel() for p in agent.parameters()) == policy_weights  # no copy of the policy


def test_refreshing_a_reference_that_is_not_built_is_refused():
    with pytest.raises(ValueError, match=r"ref_refresh_every=5 refreshes the reference model, which kl_coef=0 does "
                                         r"not build \(nothing reads it\): drop --ref-refresh-every"):
        TrainConfig(agent="gae_ppo", kl_coef=0.0, ref_refresh_every=5).validate()


def test_checkpoints_load_across_kl_coef_0(tok):
    with_ref = make_agent(tok, "gae_ppo", kl_coef=0.05)
    without = make_agent(tok, "gae_ppo", seed=1, kl_coef=0.0)
    without.update(collect(without, tok))
    # a kl_coef 0 checkpoint resumed with kl_coef > 0: the reference stays the one built (the start)
    start = {k: v.clone() for k, v in with_ref.ref_policy.state_dict().items()}
    with_ref.load_state_dict(without.state_dict())
    assert all(torch.equal(v, without.policy.state_dict()[k]) for k, v in with_ref.policy.state_dict().items())
    assert all(torch.equal(v, with_ref.ref_policy.state_dict()[k]) for k, v in start.items())
    # and back: a checkpoint with a reference resumed with kl_coef 0 leaves it out
    fresh = make_agent(tok, "gae_ppo", seed=2, kl_coef=0.0)
    fresh.load_state_dict(with_ref.state_dict())
    assert all(torch.equal(v, fresh.policy.state_dict()[k]) for k, v in with_ref.policy.state_dict().items())
    assert fresh.ref_policy is None
