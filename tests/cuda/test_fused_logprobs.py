"""``logprobs_from_hidden`` on a GPU at Qwen2.5's vocabulary: the fused linear log-softmax's peak
memory against the unfused path's (``F.linear`` to ``[N, V]`` logits, ``logprobs_from_logits``,
``entropy_from_logits``), and their agreement, under bf16 autocast. Imports ``textrl.functional``
only (no agents, so no tensordict / torchrl), and needs a real GPU: ``pytest -m cuda
tests/cuda/test_fused_logprobs.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from textrl.functional import entropy_from_logits, logprobs_from_hidden, logprobs_from_logits

pytestmark = pytest.mark.cuda


def unfused(hidden, weight, tokens):
    logits = F.linear(hidden, weight)[None]  # [1, N, V]
    return logprobs_from_logits(logits, tokens[None])[0], entropy_from_logits(logits)[0]


def fused(hidden, weight, tokens):
    return logprobs_from_hidden(hidden, weight, tokens, entropy="grad")


@pytest.mark.slow
def test_peak_memory_at_qwen_vocabulary_is_under_a_quarter_and_the_results_agree():
    """V=151,936, N=8,192, H=896, bf16 autocast, entropy with grad: fused peak < 0.25x unfused;
    log-probs, entropies and the gradients of hidden and weight equal to bf16 tolerance."""
    n, h, v = 8192, 896, 151_936
    g = torch.Generator(device="cuda").manual_seed(8)
    hidden = torch.randn(n, h, device="cuda", generator=g)
    weight = torch.randn(v, h, device="cuda", generator=g) * 0.02
    tokens = torch.randint(0, v, (n,), device="cuda", generator=g)
    w_lp = torch.randn(n, device="cuda", generator=g)

    def run(fn):
        hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp, ent = fn(hx, wx, tokens)
        ((logp * w_lp).sum() + ent.sum()).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, logp.detach(), ent.detach(), hx.grad, wx.grad

    got, want = run(fused), run(unfused)
    assert got[0] < 0.25 * want[0], f"fused peak {got[0] / 2**20:.0f} MiB, unfused {want[0] / 2**20:.0f} MiB"
    assert got[1].dtype == got[2].dtype == torch.float32
    torch.testing.assert_close(got[1], want[1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[2], want[2], rtol=2e-2, atol=2e-2)
    for mine, theirs in zip(got[3:], want[3:]):
        scale = theirs.abs().max()
        torch.testing.assert_close(mine / scale, theirs / scale, rtol=0, atol=2e-2)
