"""Advantage estimators over ``[B, T]`` token tensors and ``[B]`` sequence scores.

- ``gae``: Generalized Advantage Estimation (Schulman et al. 2016), token level, for PPO.
- ``one_step_advantage``: sequence score minus V at the last valid token (MiniMind).
- ``grpo_advantage``: group-normalised score (Shao et al. 2024, DeepSeekMath GRPO).
- ``rloo_advantage``: REINFORCE leave-one-out baseline (Ahmadian et al. 2024, RLOO).

Masked positions may hold NaN/inf: they are selected away with ``torch.where`` before any math.
"""

from __future__ import annotations

import torch
from torch import Tensor

from textrl.functional._validate import (
    check_2d,
    check_float,
    check_mask,
    check_probability,
    check_same_shape,
    check_tensor,
)


def _check_1d(name: str, x: Tensor) -> None:
    check_tensor(name, x)
    if x.dim() != 1:
        hint = (
            " (a [B, 1] tensor: call .squeeze(-1) first)"
            if x.dim() == 2 and x.shape[-1] == 1
            else ""
        )
        raise ValueError(f"{name} must be [B], got shape {list(x.shape)}{hint}")


def _check_group_size(scores: Tensor, group_size: int, minimum: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < minimum:
        raise ValueError(f"group_size={group_size!r}: must be an int >= {minimum}")
    if scores.shape[0] % group_size != 0:
        raise ValueError(
            f"scores has {scores.shape[0]} rows, not divisible by group_size={group_size}; "
            "scores must hold n_groups * group_size rows, each group's rows consecutive"
        )


def _compute_dtype(x: Tensor) -> torch.dtype:
    # bf16/fp16 are upcast to float32; float64 stays float64 (references in tests use it).
    return torch.promote_types(x.dtype, torch.float32)


_SCAN_BLOCK = 32


def _discounted_reverse_cumsum(x: Tensor, decay: float) -> Tensor:
    """``y_t = x_t + decay * y_{t+1}`` (``y_T = 0``) along dim 1 of ``x`` ``[B, T]`` -> ``[B, T]``.

    Blocked scan: inside each block of ``C`` steps ``y = x @ W`` with ``W[s, t] = decay^(s - t)``
    for ``s >= t``, done as a broadcast multiply-sum (exact float math, unaffected by TF32 matmul
    settings; ``B * T * C`` temporaries); then a reverse loop over the ``T / C`` blocks carries
    each block's first value back. ``T / C`` Python steps instead of ``T``.
    """
    b, t = x.shape
    c = max(1, min(_SCAN_BLOCK, t))
    n_blocks = -(-t // c)
    blocks = torch.nn.functional.pad(x, (0, n_blocks * c - t)).view(b, n_blocks, c)  # (B, N, C)
    idx = torch.arange(c, device=x.device)
    lag = idx[:, None] - idx[None, :]  # (C, C): s - t
    base = torch.full((), decay, dtype=x.dtype, device=x.device)
    weights = torch.where(lag >= 0, base.pow(lag.clamp(min=0).to(x.dtype)), 0.0)  # (C, C)
    local = (blocks.unsqueeze(-1) * weights).sum(dim=-2)  # (B, N, C): scan within each block
    tail = base.pow((c - idx).to(x.dtype))  # (C,): decay^(C - t)
    carry = torch.empty(b, n_blocks, dtype=x.dtype, device=x.device)  # y at the next block's start
    running = torch.zeros(b, dtype=x.dtype, device=x.device)
    decay_c = decay**c
    for k in range(n_blocks - 1, -1, -1):
        carry[:, k] = running
        running = local[:, k, 0] + decay_c * running
    return (local + carry.unsqueeze(-1) * tail).reshape(b, n_blocks * c)[:, :t]


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438, eq. 16).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V_{t+1} = 0`` after the last valid token
    (the response ends there: done and terminated), and ``A_t = delta_t + gamma * lam * A_{t+1}``;
    ``returns = A + V`` (the value target, CleanRL ``returns = advantages + values``).

    Args:
        rewards: float ``[B, T]``, per-token reward.
        values: float ``[B, T]``, V(s_t) of the old value head.
        mask: bool ``[B, T]``, a prefix of Trues per row (valid response tokens).
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        ``(advantages, returns)``, each ``[B, T]`` in float32 (float64 if the inputs are),
        exactly 0 at masked positions. Equals TorchRL's ``generalized_advantage_estimate`` on
        ``[B, T, 1]`` tensors with ``done`` at each row's last valid token.
    """
    check_2d("rewards", rewards)
    check_float("rewards", rewards)
    check_same_shape("values", values, "rewards", rewards)
    check_float("values", values)
    check_mask("mask", mask, "rewards", rewards, prefix=True)
    check_probability("gamma", gamma)
    check_probability("lam", lam)

    dtype = torch.promote_types(_compute_dtype(rewards), _compute_dtype(values))
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    r = torch.where(mask, rewards.to(dtype), zero)  # (B, T)
    v = torch.where(mask, values.to(dtype), zero)  # (B, T)
    # V_{t+1}: v shifted left; the prefix mask already zeroes it after the last valid token.
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)  # (B, T)
    delta = torch.where(mask, r + gamma * next_v - v, zero)  # (B, T)

    advantages = torch.where(mask, _discounted_reverse_cumsum(delta, gamma * lam), zero)  # (B, T)
    returns = torch.where(mask, advantages + v, zero)  # (B, T)
    return advantages, returns


def last_valid(x: Tensor, mask: Tensor) -> Tensor:
    """``x[b, L_b - 1]`` with ``L_b = mask[b].sum()``: the value at each row's last valid token.

    x: float ``[B, T]``; mask: bool prefix ``[B, T]`` with at least one True per row -> ``[B]``.
    """
    check_2d("x", x)
    check_mask("mask", mask, "x", x, prefix=True)
    lengths = mask.sum(dim=1)  # (B,)
    if (lengths == 0).any():
        rows = torch.nonzero(lengths == 0).flatten().tolist()
        raise ValueError(f"mask has empty rows {rows[:10]}: each row needs a valid token")
    return x.gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)  # (B,)


def one_step_advantage(score: Tensor, values_last: Tensor) -> Tensor:
    """Sequence-level advantage ``score - V(s_last)`` (MiniMind's PPO): one step, gamma irrelevant.

    score: float ``[B]``, the response's scalar reward; values_last: float ``[B]``, V at the last
    valid token (``last_valid(values, mask)``) -> ``[B]``.
    """
    _check_1d("score", score)
    check_float("score", score)
    check_same_shape("values_last", values_last, "score", score)
    check_float("values_last", values_last)
    return score - values_last


def grpo_advantage(scores: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantage ``(s - mean_g) / (std_g + eps)`` (Shao et al. 2024, DeepSeekMath).

    scores: float ``[B]`` with ``B = n_groups * group_size``, each group's rows consecutive
    -> ``[B]``. The std is unbiased (``torch.std``, as verl ``compute_grpo_outcome_advantage``);
    a group of one has std 0. A constant group gives exactly 0 (numerator is 0, denominator eps).
    """
    _check_1d("scores", scores)
    check_float("scores", scores)
    _check_group_size(scores, group_size, minimum=1)
    if not eps > 0:
        raise ValueError(f"eps={eps!r}: must be > 0 (keeps a constant group finite)")
    s = scores.to(_compute_dtype(scores)).view(-1, group_size)  # (G, k)
    mean = s.mean(dim=1, keepdim=True)  # (G, 1)
    std = s.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)  # (G, 1)
    return ((s - mean) / (std + eps)).view(-1)  # (B,)


def rloo_advantage(scores: Tensor, group_size: int) -> Tensor:
    """RLOO advantage ``s_i - mean_{j != i} s_j`` within each group (Ahmadian et al. 2024).

    scores: float ``[B]`` with ``B = n_groups * group_size``, each group's rows consecutive,
    ``group_size >= 2`` -> ``[B]``. Equals ``k / (k - 1) * (s_i - mean_g)``.
    """
    _check_1d("scores", scores)
    check_float("scores", scores)
    _check_group_size(scores, group_size, minimum=2)
    s = scores.to(_compute_dtype(scores)).view(-1, group_size)  # (G, k)
    baseline = (s.sum(dim=1, keepdim=True) - s) / (group_size - 1)  # (G, k)
    return (s - baseline).view(-1)  # (B,)
