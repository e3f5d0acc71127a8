"""The prefill forwards do no work they do not need: response-only logits, kl/before_update reused."""

from __future__ import annotations

import torch
from torch import nn

from tests.agents.conftest import collect, make_agent
from tests.arithmetic import model_rtol
from textrl.agents.base import position_ids_for, sequence_inputs
from textrl.keys import KEYS
from textrl.models.forward import leading_padding, rotate_rows
from textrl.testing import assert_close_normwise


class NoLogitsToKeep(nn.Module):
    """A wrapper whose forward takes ``**kwargs`` (as adapter wrappers do): no logits_to_keep is passed."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.seen: list[dict] = []

    def forward(self, **kwargs):
        self.seen.append(kwargs)
        return self.model(**kwargs)


def test_response_logits_skip_the_prompt_and_match_the_full_forward(tok):
    agent = make_agent(tok)
    td = collect(agent, tok)
    input_ids, mask, p = sequence_inputs(td)
    t = td.get(KEYS.action).shape[1]
    shift = leading_padding(mask)
    assert shift.any()  # the prompts are left-padded: the forwards left-align them first
    with torch.no_grad():
        left_padded = agent.policy(input_ids=input_ids, attention_mask=mask.long(),
                                   position_ids=position_ids_for(mask)).logits[:, p - 1 : -1]  # [B, T, V]
        aligned_mask = rotate_rows(mask, shift)  # each row's tokens from column 0, padding after them
        aligned = agent.policy(input_ids=rotate_rows(input_ids, shift), attention_mask=aligned_mask.long(),
                               position_ids=position_ids_for(aligned_mask)).logits
        full = rotate_rows(aligned, -shift)[:, p - 1 : -1]  # the same full forward, in the caller's layout
        kept = agent.learner.forwards.response_logits(agent.policy, input_ids, mask, p)
        wrapper = NoLogitsToKeep(agent.policy)
        fallback = agent.learner.forwards.response_logits(wrapper, input_ids, mask, p)
    assert kept.shape == full.shape == (4, t, len(tok))
    # the head on the kept positions only, the attention over another layout: other sums, equal by
    # norm (tests/arithmetic.py); left-aligning changes no logit beyond rounding
    rtol = model_rtol(agent.policy.config, input_ids.numel())
    assert_close_normwise(kept, full, rtol=rtol, name="kept logits")
    assert torch.equal(fallback, full)
    assert_close_normwise(full, left_padded, rtol=rtol, name="left-aligned logits")
    assert "logits_to_keep" not in wrapper.seen[0]


def count_policy_forwards(agent) -> list[int]:
    calls = [0]
    forward = agent.policy.forward

    def counting(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    agent.policy.forward = counting
    return calls


def test_kl_before_update_reuses_the_rollout_log_probs_while_they_are_current(tok):
    agent = make_agent(tok, kl_coef=0.0, kl_after_update=True)  # the monitor keeps a reference
    td = collect(agent, tok)
    calls = count_policy_forwards(agent)
    cached = agent.actor.policy_ref_kl(td)
    assert calls[0] == 0  # the policy and the rollout's log-probs are unchanged: no forward
    agent.actor.own_logp = None
    assert agent.actor.policy_ref_kl(td) == cached and calls[0] == 1  # recomputed: the same number

    td = collect(agent, tok, seed=1)
    td.get(KEYS.action_log_prob)[0, 0] += 1.0  # edited in place: not the policy's own any more
    calls[0] = 0
    agent.actor.policy_ref_kl(td)
    assert calls[0] == 1

    td = collect(agent, tok, seed=2)
    with torch.no_grad():
        next(agent.policy.parameters()).add_(1e-3)  # a weight changed: recompute
    calls[0] = 0
    agent.actor.policy_ref_kl(td)
    assert calls[0] == 1


def test_one_step_ppo_never_reuses_its_old_policy_log_probs(tok):
    agent = make_agent(tok, "one_step_ppo")
    td = collect(agent, tok)
    calls = count_policy_forwards(agent)
    agent.actor.policy_ref_kl(td)
    assert calls[0] == 1
