"""GPU runs of the agents (bf16 autocast on CUDA); skipped without a GPU (tests/conftest.py)."""

from __future__ import annotations

import math

import pytest

from tests.agents.conftest import collect, make_agent


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gae_ppo", "one_step_ppo"])
def test_update_on_cuda_under_bf16_autocast(tok, name):
    agent = make_agent(tok, name, kl_after_update=True).to("cuda")
    td = collect(agent, tok)
    assert td.device.type == "cuda"
    before = {k: v.clone() for k, v in agent.ref_policy.state_dict().items()}
    metrics = agent.update(td)
    for key in ("loss/policy", "loss/value", "kl/after_update", "grad_norm/actor"):
        assert math.isfinite(metrics[key]), key
    after = agent.ref_policy.state_dict()
    assert all((before[k] == after[k]).all() for k in before)


@pytest.mark.cuda
def test_a_rollback_on_cuda_keeps_its_copy_on_the_cpu(tok):
    import torch

    from tests.agents.conftest import poison_next_step, same

    agent = make_agent(tok, actor_lr=1e-2).to("cuda")
    agent.update(collect(agent, tok))
    before = {k: v.detach().clone() for k, v in agent.state_dict().items() if torch.is_tensor(v)}
    snapshot = agent.backend.snapshot(agent)
    assert all(t.device.type == "cpu" for t in snapshot.tensors)
    poison_next_step(agent.actor_optimizer)
    metrics = agent.update(collect(agent, tok, seed=1))
    assert metrics["nonfinite/rolled_back"] == 1.0
    after = {k: v for k, v in agent.state_dict().items() if torch.is_tensor(v)}
    assert all(v.device.type == "cuda" for v in after.values()) and same(after, before)
