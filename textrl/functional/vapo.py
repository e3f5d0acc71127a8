"""VAPO's advantage pieces (Yue et al. 2025, "VAPO: Efficient and Reliable Reinforcement Learning
for Advanced Reasoning Tasks", arXiv:2504.05118, sec. 3-4), over ``[B, T]`` token tensors.

- ``length_adaptive_lambda``: the policy's GAE lambda of each response, ``1 - 1/(alpha * l)``.
- ``gae_row_lambda``: GAE with one lambda per row (``gae`` takes one float for the batch).

The decoupled GAE of VAPO is two calls: the critic's value targets from ``gae(..., lam=1.0)``,
the policy's advantages from ``gae_row_lambda(..., length_adaptive_lambda(lengths, alpha))``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from textrl.functional._validate import (
    check_float,
)
from textrl.functional.advantages import _check_1d, _gae_prefix, _prefix_of, check_gae_inputs
from textrl.functional.masking import compact, compaction_index, uncompact


def length_adaptive_lambda(lengths: Tensor, alpha: float) -> Tensor:
    """VAPO's length-adaptive GAE lambda of the policy (arXiv:2504.05118, eq. 8):
    ``lam_i = 1 - 1 / (alpha * l_i)``, clamped to ``[0, 1]``.

    The paper chooses ``sum_t lam^t ~ 1 / (1 - lam) = alpha * l``: the effective horizon of the
    advantage grows with the response, so a long response's early tokens still see its reward
    (a fixed lambda < 1 decays it away). The paper uses ``alpha = 0.05``. A response shorter
    than ``1 / alpha`` tokens would get a negative lambda; it gets 0 (one-step TD), as does an
    empty row.

    lengths: int or float ``[B]``, each response's length in agent tokens (``mask.sum(1)``);
    alpha: > 0 -> float32 ``[B]`` (float64 for float64 lengths) in ``[0, 1]``.
    """
    _check_1d("lengths", lengths)
    if lengths.dtype == torch.bool or lengths.is_complex():
        raise ValueError(f"lengths must be an int or float tensor, got dtype {lengths.dtype}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"alpha={alpha!r}: must be a number > 0 (VAPO uses 0.05)")
    length = lengths.to(torch.promote_types(lengths.dtype, torch.float32))
    horizon = alpha * length  # (B,)
    lam = 1.0 - 1.0 / torch.where(horizon > 0, horizon, torch.ones_like(horizon))
    return torch.where(horizon > 0, lam, torch.zeros_like(lam)).clamp(0.0, 1.0)


def _check_row_lambda(lam: Tensor, rows: int) -> None:
    _check_1d("lam", lam)
    check_float("lam", lam)
    if lam.shape[0] != rows:
        raise ValueError(f"lam must be [B] with B={rows} (the rows of rewards), got {list(lam.shape)}")
    if not bool(((lam >= 0) & (lam <= 1)).all()):
        raise ValueError("lam must lie in [0, 1] in every row (e.g. length_adaptive_lambda's output)")


def gae_row_lambda(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: Tensor
) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016, arXiv:1506.02438, eq. 16) with one lambda per row: row ``b``
    uses ``lam[b]``, so ``A_t = delta_t + gamma * lam[b] * A_{t'}`` (VAPO's length-adaptive
    policy lambda, arXiv:2504.05118, sec. 4). Everything else is :func:`textrl.functional.gae`'s:
    ``delta_t = r_t + gamma * V_{t'} - V_t`` with ``t'`` the row's next True position of
    ``mask`` (observation gaps skipped), ``V = 0`` after the last; ``returns = A + V``. A row's
    result equals ``gae`` of that row alone with the float ``lam[b]``.

    Args:
        rewards: float ``[B, T]``. values: float ``[B, T]``, V(s_t) of the old value head.
        mask: bool ``[B, T]`` (gaps allowed). gamma: in [0, 1]. lam: float ``[B]`` in [0, 1].

    Returns:
        ``(advantages, returns)``, each ``[B, T]`` in float32 (float64 if the inputs are),
        exactly 0 at masked positions.
    """
    check_gae_inputs(rewards, values, mask, gamma)
    _check_row_lambda(lam, rewards.shape[0])

    index = compaction_index(mask)  # (B, T): identity for a prefix mask
    advantages, returns = _gae_prefix(compact(rewards, index), compact(values, index), _prefix_of(mask), gamma, lam)
    return uncompact(advantages, index), uncompact(returns, index)


__all__ = ["gae_row_lambda", "length_adaptive_lambda"]
