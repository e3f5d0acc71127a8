"""One-step updates reuse the behaviour forward (textrl.agents.forwards.reuses_rollout_forward).

With 1 epoch, 1 minibatch and no accumulation, process_rollout keeps the policy / critic
forward with its graph and the update back-propagates through it. The result must be the update
the agent makes without the reuse: same losses, same weights (up to float summation order).
"""

from __future__ import annotations

import pytest
import torch

from tests.agents.conftest import collect, make_agent
from tests.arithmetic import assert_gradients_close, rollout_rtol
from textrl.agents import AGENTS
from textrl.agents.forwards import own_behaviour_logprobs, reuses_rollout_forward
from textrl.parallel.base import trained_parameters
from textrl.testing import unit_roundoff

FUSABLE = ["gae_ppo", "grpo", "rloo", "multi_adapter_ppo"]


def reuses(agent) -> bool:
    """Whether ``agent``'s update reuses the behaviour forward (:func:`reuses_rollout_forward` of its parts)."""
    return reuses_rollout_forward(agent.config, agent.reuse_rollout_forward, own_behaviour_logprobs(type(agent)))


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
    td = collect(agent, tok)
    return agent, agent.update(td), grads, rollout_rtol(agent.policy.config, td)


def first_step_gradients(agent) -> dict[str, tuple[torch.Tensor, float, float]]:
    """``(clipped gradient, peak lr, eps)`` of each trained weight's one AdamW step, by state_dict
    name, from the optimiser's first moment: ``(1 - beta1) x`` the clipped gradient after one step."""
    out = {}
    for opt in agent.optimizers:
        for group in opt.param_groups:
            ids = {id(p) for p in group["params"]}
            for name, p in trained_parameters(agent):
                if id(p) in ids and p in opt.state:
                    g = opt.state[p]["exp_avg"] / (1 - group["betas"][0])
                    out[name] = (g, group.get("initial_lr", group["lr"]), group["eps"])
    return out


def adam_first_step_tolerance(g_a, g_b, lr: float, eps: float, rtol: float, w) -> torch.Tensor:
    """How far apart one AdamW step (no weight decay) may put a weight from two gradients that agree
    to ``rtol`` by norm. The step moves ``w`` by ``-lr g / (|g| + eps)``: two gradients within ``d``
    of each other move it within ``lr d / (min |g| + eps)``, never more than ``2 lr`` apart (where a
    gradient cancels to ~0, Adam turns its float noise into a step of up to ``lr``). ``d = 2 rtol ||g||``:
    the gradients' bound, and that of the clipping factors (their norms agree to ``rtol`` too). Plus
    each side's rounding of the update and of ``w``."""
    d = 2 * rtol * float(g_b.norm())
    moved = lr * d / (torch.minimum(g_a.abs(), g_b.abs()) + eps)
    u = unit_roundoff()
    return moved.clamp(max=2 * lr) + 2 * u * w.abs() + 4 * u * lr


@pytest.mark.parametrize("name", FUSABLE)
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_reused_forward_gives_the_same_update(tok, name, entropy_coef):
    fused, m_fused, g_fused, rtol = run_once(tok, name, True, entropy_coef=entropy_coef)
    plain, m_plain, g_plain, _ = run_once(tok, name, False, entropy_coef=entropy_coef)
    assert reuses(fused) and not reuses(plain)
    # the same forward (one model, one batch, the same kernels): its losses and statistics equal
    for key in ("loss/policy", "loss/total", "entropy", "ratio/mean", "clip_fraction"):
        assert m_fused[key] == pytest.approx(m_plain[key], rel=1e-5, abs=1e-7), key
    # the backward through a kept graph sums in another order (tests/arithmetic.py): the gradients
    # agree by their norm to rtol, and so does their norm (| ||a|| - ||b|| | <= ||a - b||)
    assert m_fused["grad_norm/actor"] == pytest.approx(m_plain["grad_norm/actor"], rel=rtol, abs=0)
    w_fused, w_plain = weights(fused), weights(plain)
    assert w_fused.keys() == w_plain.keys()
    torch.manual_seed(0)
    start = weights(make_agent(tok, name))
    moved = [k for k in w_plain if not torch.equal(w_plain[k], start[k])]
    assert moved, "the update moved nothing: the comparison would be vacuous"
    assert g_fused.keys() == g_plain.keys() and len(g_plain) >= 8  # LoRA agents: q_proj, v_proj adapters of 2 layers
    assert_gradients_close(g_fused, g_plain, rtol)
    # the weights after one AdamW step, within what the gradients' tolerance lets that step move them
    steps_fused, steps_plain = first_step_gradients(fused), first_step_gradients(plain)
    assert steps_fused.keys() == steps_plain.keys() and steps_plain.keys() <= w_plain.keys()
    for key in w_fused:
        if key not in steps_plain:  # not trained: untouched in both
            assert torch.equal(w_fused[key], w_plain[key]), key
            continue
        (g_a, lr, eps), (g_b, _, _) = steps_fused[key], steps_plain[key]
        tol = adam_first_step_tolerance(g_a, g_b, lr, eps, rtol, w_plain[key])
        excess = float(((w_fused[key] - w_plain[key]).abs() - tol).max())
        assert excess <= 0, f"{key}: the weights differ by {excess:.3e} beyond the tolerance"


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
    assert not reuses(agent)
    assert count_prefill_forwards(tok, reuse=True, **overrides) > 1


def test_no_reuse_with_an_old_policy_snapshot(tok):
    assert not reuses(make_agent(tok, "one_step_ppo"))


def test_a_kept_forward_is_dropped_when_weights_changed_since(tok):
    agent = make_agent(tok, "gae_ppo", actor_lr=1e-2)
    td = collect(agent, tok)
    assert agent.actor.kept is not None
    with torch.no_grad():  # someone edits the policy between the prefill and the update
        next(agent.policy.parameters()).add_(1e-3)
    calls = []
    handle = agent.policy.register_forward_hook(lambda *_: calls.append(1))
    agent.update(td)
    handle.remove()
    assert calls, "the update reused a forward of weights that no longer exist"
    assert agent.actor.kept is None


def test_a_kept_forward_is_not_used_for_another_rollout(tok):
    agent = make_agent(tok, "gae_ppo")
    first = collect(agent, tok, seed=0)
    second = collect(agent, tok, seed=1)  # keeps the second rollout's forward
    calls = []
    handle = agent.policy.register_forward_hook(lambda *_: calls.append(1))
    agent.update(first)
    handle.remove()
    assert calls and agent.actor.kept is None
    assert second is not first
