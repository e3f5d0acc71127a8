"""What a token drawn under top-k / top-p contributes to the ratio, the KL and the corrections
(docs/training.md, "Sampling settings and the log-probs").

The learner's, the old policy's and the reference's log-probs are the policy's at the temperature;
the engine's are of the truncated, renormalised distribution it drew from. Closed forms:

- engine - learner = -log(mass of the nucleus) >= 0 on every drawn token, for the same weights;
- the PPO ratio at the first step is exactly 1 (both sides unfiltered), whatever the filter;
- the KL to a reference stays finite for a token outside the reference's nucleus, where a filtered
  reference would give +inf (the old behaviour, which skipped every update at ``--top-p 0.9``);
- tis weighs a drawn token by the nucleus's mass, the importance weight pi / mu.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from textrl.functional import (
    clipped_policy_loss,
    kl_penalty,
    logprobs_from_logits,
    sampling_filter,
    tis_weights,
)

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def truncated(draw):
    """Logits ``[B, T, V]``, a temperature, a filter that keeps at least 2 tokens somewhere, and tokens
    drawn from the filtered distribution."""
    b, t, v = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(4, 40))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.5, 2.0, 4.0]))
    temperature = draw(st.sampled_from([0.6, 1.0, 1.3]))
    top_k = draw(st.sampled_from([0, 2, 5, 20]))
    top_p = draw(st.sampled_from([1.0, 0.95, 0.9, 0.5]))
    filtered = sampling_filter(logits / temperature, top_k, top_p)  # [B, T, V]
    tokens = torch.multinomial(filtered.softmax(-1).reshape(-1, v), 1, generator=g).reshape(b, t)
    return logits, temperature, top_k, top_p, filtered, tokens


def gathered(logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@SETTINGS
@given(truncated())
def test_the_engine_exceeds_the_learner_by_the_nucleus_log_mass(case):
    logits, temperature, _, _, filtered, tokens = case
    engine = gathered(filtered.log_softmax(-1), tokens)  # mu(a): what the engine reports
    learner = logprobs_from_logits(logits, tokens, temperature=temperature)  # pi(a) at the temperature
    nucleus = torch.isfinite(filtered)
    mass = torch.where(nucleus, (logits / temperature).softmax(-1), 0.0).sum(-1)  # [B, T]
    torch.testing.assert_close(engine - learner, -mass.log(), rtol=1e-9, atol=1e-9)
    assert bool(torch.isfinite(learner).all()) and bool((engine >= learner - 1e-12).all())
    # tis's weight is pi / mu = the nucleus's mass, at most 1: the truncation is corrected like any gap
    mask = torch.ones_like(tokens, dtype=torch.bool)
    torch.testing.assert_close(tis_weights(learner, engine, mask, cap=2.0), mass, rtol=1e-9, atol=1e-9)


@SETTINGS
@given(truncated())
def test_the_first_ratio_is_one_whatever_the_filter(case):
    logits, temperature, _, _, _, tokens = case
    logits = logits.float().requires_grad_()
    new = logprobs_from_logits(logits, tokens, temperature=temperature)
    old = logprobs_from_logits(logits.detach(), tokens, temperature=temperature)
    adv = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens, dtype=torch.bool)
    loss, stats = clipped_policy_loss(new, old, adv, mask, clip_eps=0.2)
    assert math.isfinite(float(loss)) and float(stats["clip_fraction"]) == 0.0
    loss.backward()
    assert bool(torch.isfinite(logits.grad).all())


def test_a_token_outside_the_references_nucleus_keeps_a_finite_kl():
    # the policy's nucleus (top-p 0.5) holds token 1; the reference's holds only token 0
    policy = torch.tensor([[[2.0, 2.1, -1.0, -1.0]]])
    reference = torch.tensor([[[4.0, 1.0, -1.0, -1.0]]])
    token = torch.tensor([[1]])
    assert bool(torch.isfinite(sampling_filter(policy, 0, 0.5)[0, 0, 1]))  # it can be drawn
    filtered_ref = gathered(sampling_filter(reference, 0, 0.5).log_softmax(-1), token)
    filtered_pol = gathered(sampling_filter(policy, 0, 0.5).log_softmax(-1), token)
    assert math.isinf(float(kl_penalty(filtered_pol, filtered_ref, kind="k1")))  # what stopped --top-p runs
    for kind in ("k1", "k2", "k3", "abs"):
        kl = kl_penalty(logprobs_from_logits(policy, token), logprobs_from_logits(reference, token), kind=kind)
        assert math.isfinite(float(kl)), kind
