"""One-step updates reuse the behaviour forward (textrl.agents.forwards.reuses_rollout_forward).

With 1 epoch, 1 minibatch and no accumulation, process_rollout keeps the policy / critic
forward with its graph and the update back-propagates through it. The result must be the update
the agent makes without the reuse: same losses, same weights (up to float summation order).
"""

from __future__ import annotations

import pytest
import torch

from tests.agents.conftest import collect, make_agent
from textrl.agents import AGENTS
from textrl.agents.forwards import reuses_rollout_forward

FUSABLE = ["gae_ppo", "grpo", "rloo", "multi_adapter_ppo"]


def weights(agent) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in agent.state_dict().items() if torch.is_tensor(v)}


def run_once(tok, name: str, reuse: bool, **overrides):
    torch.manual_seed(0)  # multi_adapter_ppo's LoRA weights start from the global generator
    critic_lr = {"critic_lr": 1e-2} if AGENTS[name].needs_critic else {}  # a critic-free agent reads none
    agent = make_agent(tok, name, actor_lr=1e-2, **critic_lr, **overrides)
    agent.reuse_rollout_forward = reuse
    grads, step = {}, agent.backend.step
    # the policy's and critic's own parameter lists (multi_adapter_ppo's LoRA weights live in a
    # shared base that the agent module does not own)
    trainable = [(f"{role}.{n}", q) for role, model in (("policy", agent.policy), ("critic", agent.critic))
                 if model is not None for n, q in model.named_parameters()]

    def spy(agent):  # the gradient the optimiser is about to use
        grads.update({n: q.grad.clone() for n, q in trainable if q.grad is not None})
        return step(agent)

    agent.backend.step = spy
    metrics = agent.update(collect(agent, tok))
    return agent, metrics, grads


@pytest.mark.parametrize("name", FUSABLE)
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_reused_forward_gives_the_same_update(tok, name, entropy_coef):
    fused, m_fused, g_fused = run_once(tok, name, True, entropy_coef=entropy_coef)
    plain, m_plain, g_plain = run_once(tok, name, False, entropy_coef=entropy_coef)
    assert reuses_rollout_forward(fused) and not reuses_rollout_forward(plain)
    for key in ("loss/policy", "loss/total", "entropy", "ratio/mean", "clip_fraction", "grad_norm/actor"):
        assert m_fused[key] == pytest.approx(m_plain[key], rel=1e-5, abs=1e-7), key
    w_fused, w_plain = weights(fused), weights(plain)
    assert w_fused.keys() == w_plain.keys()
    torch.manual_seed(0)
    start = weights(make_agent(tok, name))
    moved = [k for k in w_plain if not torch.equal(w_plain[k], start[k])]
    assert moved, "the update moved nothing: the comparison would be vacuous"
    assert g_fused.keys() == g_plain.keys() and len(g_plain) >= 8  # LoRA agents: q_proj, v_proj adapters of 2 layers
    for key in g_plain:
        torch.testing.assert_close(g_fused[key], g_plain[key], rtol=1e-4, atol=1e-7, msg=key)
    # Adam's first step is ~lr * sign(grad): float noise on near-zero gradients moves a weight by
    # at most a small fraction of lr (1e-2)
    for key in w_fused:
        torch.testing.assert_close(w_fused[key], w_plain[key], rtol=0, atol=1e-4, msg=key)


def count_prefill_forwards(tok, reuse: bool, **overrides) -> int:
    """Policy forwards after generation (prefill of the whole sequence: more than one position)."""
    agent = make_agent(tok, "gae_ppo", **overrides)
    agent.reuse_rollout_forward = reuse
    calls = []

    def hook(_module, _args, kwargs, _out):
        ids = kwargs.get("input_ids")
        if ids is not None and kwargs.get("use_cache") is False:
            calls.append(ids.shape)

    handle = agent.policy.register_forward_hook(hook, with_kwargs=True)
    td = collect(agent, tok)
    agent.update(td)
    handle.remove()
    return len(calls)


def test_the_reuse_saves_one_policy_forward(tok):
    assert count_prefill_forwards(tok, reuse=False) == 2  # behaviour log-probs + the step's forward
    assert count_prefill_forwards(tok, reuse=True) == 1


@pytest.mark.parametrize("overrides", [
    dict(ppo_epochs=2), dict(num_minibatches=2), dict(gradient_accumulation_steps=2),
])
def test_no_reuse_when_the_update_takes_several_forwards(tok, overrides):
    agent = make_agent(tok, "gae_ppo", **overrides)
    assert not reuses_rollout_forward(agent)
    assert count_prefill_forwards(tok, reuse=True, **overrides) > 1


def test_no_reuse_with_an_old_policy_snapshot(tok):
    assert not reuses_rollout_forward(make_agent(tok, "one_step_ppo"))


def test_a_kept_forward_is_dropped_when_weights_changed_since(tok):
    agent = make_agent(tok, "gae_ppo", actor_lr=1e-2)
    td = collect(agent, tok)
    assert agent._rollout_forward is not None
    with torch.no_grad():  # someone edits the policy between the prefill and the update
        next(agent.policy.parameters()).add_(1e-3)
    calls = []
    handle = agent.policy.register_forward_hook(lambda *_: calls.append(1))
    agent.update(td)
    handle.remove()
    assert calls, "the update reused a forward of weights that no longer exist"
    assert agent._rollout_forward is None


def test_a_kept_forward_is_not_used_for_another_rollout(tok):
    agent = make_agent(tok, "gae_ppo")
    first = collect(agent, tok, seed=0)
    second = collect(agent, tok, seed=1)  # keeps the second rollout's forward
    calls = []
    handle = agent.policy.register_forward_hook(lambda *_: calls.append(1))
    agent.update(first)
    handle.remove()
    assert calls and agent._rollout_forward is None
    assert second is not first
