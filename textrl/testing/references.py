"""Reference implementations as plain Python loops over rows and positions: GAE, returns, the
GRPO and RLOO group advantages. They are slow and obvious on purpose."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _rows_of(x: Tensor) -> list[list[float]]:
    return x.detach().to(torch.float64).tolist()


def reference_gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016) as a loop over rows and, backwards, over positions.

    rewards, values: float ``[B, T]``; mask: bool ``[B, T]`` (gaps allowed). Only True positions
    are decisions: for a True ``t`` with next True ``t'`` in its row,
    ``delta_t = r_t + gamma * V_{t'} - V_t`` (``V_{t'} = 0`` after the row's last True) and
    ``A_t = delta_t + gamma * lam * A_{t'}``. False positions are never read.

    Returns ``(advantages, returns)``, float64 ``[B, T]``, ``returns = advantages + values``, both
    0 at False positions.
    """
    r, v, m = _rows_of(rewards), _rows_of(values), mask.tolist()
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    ret = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(len(m)):
        next_value, next_adv = 0.0, 0.0
        for j in reversed(range(len(m[i]))):
            if not m[i][j]:
                continue
            delta = r[i][j] + gamma * next_value - v[i][j]
            next_adv = delta + gamma * lam * next_adv
            next_value = v[i][j]
            adv[i, j] = next_adv
            ret[i, j] = next_adv + v[i][j]
    return adv, ret


def reference_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Discounted reward-to-go over the True positions: ``G_t = r_t + gamma * G_{t'}`` with ``t'``
    the row's next True position (``G = 0`` after the last). rewards: float ``[B, T]``; mask: bool
    ``[B, T]`` -> float64 ``[B, T]``, 0 at False positions. Equals GAE's returns with
    ``lam = 1`` and ``V = 0``."""
    r, m = _rows_of(rewards), mask.tolist()
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(len(m)):
        g = 0.0
        for j in reversed(range(len(m[i]))):
            if m[i][j]:
                g = r[i][j] + gamma * g
                out[i, j] = g
    return out


def _groups_of(scores: Tensor, group_size: int) -> list[list[float]]:
    s = scores.detach().to(torch.float64).tolist()
    if group_size < 1 or len(s) % group_size:
        raise ValueError(f"scores has {len(s)} rows, not a multiple of group_size={group_size}")
    return [s[g : g + group_size] for g in range(0, len(s), group_size)]


def reference_grpo_advantages(
    scores: Tensor, group_size: int, eps: float = 1e-6, scale: bool = True
) -> Tensor:
    """GRPO outcome advantage (Shao et al. 2024) per group of ``group_size`` consecutive rows:
    ``(s_i - mean) / (std + eps)`` with the unbiased std (divide by ``k - 1``; 0 for ``k = 1``),
    as ``textrl.functional.grpo_advantage``. ``scale=False`` gives ``s_i - mean`` (Dr. GRPO,
    Liu et al. 2025). scores: float ``[G * k]`` -> float64 ``[G * k]``."""
    out: list[float] = []
    for g in _groups_of(scores, group_size):
        k = len(g)
        mean = sum(g) / k
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / (k - 1)) if k > 1 else 0.0
        out += [(x - mean) / (std + eps) if scale else x - mean for x in g]
    return torch.tensor(out, dtype=torch.float64)


def reference_rloo_advantages(scores: Tensor, group_size: int) -> Tensor:
    """RLOO (Ahmadian et al. 2024): ``s_i - mean_{j != i} s_j`` within each group of
    ``group_size >= 2`` consecutive rows. scores: float ``[G * k]`` -> float64 ``[G * k]``."""
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: RLOO needs at least 2 rows per group")
    out: list[float] = []
    for g in _groups_of(scores, group_size):
        out += [x - sum(g[:i] + g[i + 1 :]) / (len(g) - 1) for i, x in enumerate(g)]
    return torch.tensor(out, dtype=torch.float64)


__all__ = ["reference_gae", "reference_grpo_advantages", "reference_returns", "reference_rloo_advantages"]
