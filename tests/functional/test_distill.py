"""On-policy distillation's per-token reward against a closed form (textrl.functional.distill)."""

from __future__ import annotations

import pytest
import torch

from textrl.functional import reverse_kl_reward


def test_expected_reward_is_minus_the_reverse_kl():
    """E_{y ~ p}[r(y)] over a whole vocabulary = -coef * KL(p || q), in closed form."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(7, generator=g, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(7, generator=g, dtype=torch.float64), 0)
    # each "row" samples one vocabulary entry: the reward of every entry, weighed by p
    logp, logq = p.log()[None, :], q.log()[None, :]  # [1, V] as [B, T]
    r = reverse_kl_reward(logp, logq, torch.ones(1, 7, dtype=torch.bool), coef=0.5)
    kl = float((p * (p.log() - q.log())).sum())
    assert float((p * r[0]).sum()) == pytest.approx(-0.5 * kl, rel=1e-12)
    assert kl > 0.05


def test_reward_per_token_masked_and_zero_for_the_student_itself():
    logp = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -0.25, -3.0]])
    teacher = torch.tensor([[-1.5, -1.0, 7.0], [-0.5, -1.25, float("inf")]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    r = reverse_kl_reward(logp, teacher, mask, coef=2.0)
    assert r.dtype == torch.float32
    assert torch.equal(r, torch.tensor([[-1.0, 2.0, 0.0], [0.0, -2.0, 0.0]]))
    assert torch.equal(reverse_kl_reward(teacher.nan_to_num(0, 0, 0), teacher.nan_to_num(0, 0, 0), mask),
                       torch.zeros(2, 3))


def test_reward_refuses_bad_inputs():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="coef"):
        reverse_kl_reward(x, x, x.bool(), coef=-1.0)
    with pytest.raises(ValueError, match="teacher_logp"):
        reverse_kl_reward(x, torch.zeros(2, 4), x.bool())

