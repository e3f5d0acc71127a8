"""Advantage estimators over ``[B, T]`` token tensors and ``[B]`` sequence scores.

- ``gae``: Generalized Advantage Estimation (Schulman et al. 2016), token level, for PPO.
- ``one_step_advantage``: sequence score minus V at the last valid token (MiniMind).
- ``last_valid`` / ``next_valid``: the value at a row's last valid token / at the next valid one.
- ``grpo_advantage``: group-normalised score (Shao et al. 2024, DeepSeekMath GRPO).
- ``rloo_advantage``: REINFORCE leave-one-out baseline (Ahmadian et al. 2024, RLOO).

Masked positions may hold NaN/inf: they are selected away with ``torch.where`` before any math.
Masks may have gaps (a multi-turn episode's observation tokens, docs/design.md, "Multi-turn
episodes"): only True positions are steps, in order.
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
from textrl.functional.masking import compact, compaction_index, last_true_index, uncompact


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


def _discounted_reverse_cumsum(x: Tensor, decay: float | Tensor) -> Tensor:
    """``y_t = x_t + decay * y_{t+1}`` (``y_T = 0``) along dim 1 of ``x`` ``[B, T]`` -> ``[B, T]``;
    ``decay`` a float, or one per row ``[B]``.

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
    per_row = isinstance(decay, Tensor)
    if per_row:
        base = decay.to(x.dtype).view(b, 1, 1)  # (B, 1, 1)
    else:
        base = torch.full((), decay, dtype=x.dtype, device=x.device)
    weights = torch.where(lag >= 0, base.pow(lag.clamp(min=0).to(x.dtype)), 0.0)  # (C, C) or (B, C, C)
    local = (blocks.unsqueeze(-1) * (weights.unsqueeze(1) if per_row else weights)).sum(dim=-2)  # (B, N, C)
    tail = base.pow((c - idx).to(x.dtype))  # decay^(C - t): (C,) or (B, 1, C)
    carry = torch.empty(b, n_blocks, dtype=x.dtype, device=x.device)  # y at the next block's start
    running = torch.zeros(b, dtype=x.dtype, device=x.device)
    decay_c = base.view(b).pow(c) if per_row else decay**c  # (B,) or a float
    for k in range(n_blocks - 1, -1, -1):
        carry[:, k] = running
        running = local[:, k, 0] + decay_c * running
    return (local + carry.unsqueeze(-1) * tail).reshape(b, n_blocks * c)[:, :t]


def _gae_prefix(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float | Tensor
) -> tuple[Tensor, Tensor]:
    """GAE over a prefix ``mask`` (inputs checked by :func:`gae` or ``gae_row_lambda``), ``lam``
    a float or one per row ``[B]``: ``(advantages, returns)`` ``[B, T]``."""
    dtype = torch.promote_types(_compute_dtype(rewards), _compute_dtype(values))
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    r = torch.where(mask, rewards.to(dtype), zero)  # (B, T)
    v = torch.where(mask, values.to(dtype), zero)  # (B, T)
    # V_{t+1}: v shifted left; the prefix mask already zeroes it after the last valid token.
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)  # (B, T)
    delta = torch.where(mask, r + gamma * next_v - v, zero)  # (B, T)

    decay = gamma * (lam.to(dtype) if isinstance(lam, Tensor) else lam)  # a float or (B,)
    advantages = torch.where(mask, _discounted_reverse_cumsum(delta, decay), zero)  # (B, T)
    returns = torch.where(mask, advantages + v, zero)  # (B, T)
    return advantages, returns


def _prefix_of(mask: Tensor) -> Tensor:
    """The prefix mask with each row's count of Trues: ``arange(T) < mask.sum(1)``. ``[B, T]``."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    return positions.unsqueeze(0) < mask.sum(dim=1, keepdim=True)


def check_gae_inputs(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float) -> None:
    """``ValueError`` naming the argument unless rewards and values are float ``[B, T]``, mask a bool
    ``[B, T]`` and gamma in [0, 1] (the inputs of :func:`gae` and its variants)."""
    check_2d("rewards", rewards)
    check_float("rewards", rewards)
    check_same_shape("values", values, "rewards", rewards)
    check_float("values", values)
    check_mask("mask", mask, "rewards", rewards)
    check_probability("gamma", gamma)


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438, eq. 16).

    Only the True positions of ``mask`` are decisions (the agent's tokens). For a True position
    ``t`` let ``t'`` be the row's next True position: ``delta_t = r_t + gamma * V_{t'} - V_t``
    with ``V_{t'} = 0`` after the row's last True (the episode ends there: done and terminated),
    and ``A_t = delta_t + gamma * lam * A_{t'}``; ``returns = A + V`` (the value target, CleanRL
    ``returns = advantages + values``). False positions between Trues (a multi-turn episode's
    observation tokens, docs/design.md, "Multi-turn episodes") are skipped: they neither
    discount nor carry reward, so GAE on a gapped mask equals GAE on the compacted Trues
    (:func:`~textrl.functional.masking.compact`), scattered back. For a prefix mask the
    compaction is the identity and ``t' = t + 1``.

    The plain loop this vectorises, row by row and position by position, is
    :func:`textrl.testing.reference_gae` (the property tests compare the two).

    Args:
        rewards: float ``[B, T]``, per-token reward.
        values: float ``[B, T]``, V(s_t) of the old value head.
        mask: bool ``[B, T]``, the decisions (a prefix of Trues for a single turn; gaps allowed).
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        ``(advantages, returns)``, each ``[B, T]`` in float32 (float64 if the inputs are),
        exactly 0 at masked positions. Equals TorchRL's ``generalized_advantage_estimate`` on
        the compacted ``[B, T, 1]`` tensors with ``done`` at each row's last True.
    """
    check_gae_inputs(rewards, values, mask, gamma)
    check_probability("lam", lam)

    index = compaction_index(mask)  # (B, T): identity for a prefix mask
    advantages, returns = _gae_prefix(
        compact(rewards, index), compact(values, index), _prefix_of(mask), gamma, lam
    )
    return uncompact(advantages, index), uncompact(returns, index)


def last_valid(x: Tensor, mask: Tensor) -> Tensor:
    """``x[b, t_b]`` with ``t_b`` the last True position of ``mask[b]``: the value at each row's
    last valid token (``mask.sum(1) - 1`` for a prefix mask).

    x: ``[B, T]``; mask: bool ``[B, T]`` (gaps allowed) with at least one True per row -> ``[B]``.
    """
    check_2d("x", x)
    check_mask("mask", mask, "x", x)
    last = last_true_index(mask)  # (B,)
    if (last < 0).any():
        rows = torch.nonzero(last < 0).flatten().tolist()
        raise ValueError(f"mask has empty rows {rows[:10]}: each row needs a valid token")
    return x.gather(1, last.unsqueeze(1)).squeeze(1)  # (B,)


def next_valid(x: Tensor, mask: Tensor) -> Tensor:
    """At each True position ``t``: ``x`` at the row's next True position, 0 after its last. ``[B, T]``.

    x: ``[B, T]``; mask: bool ``[B, T]`` (gaps allowed) -> ``[B, T]`` of ``x``'s dtype, exactly 0
    at False positions. With ``x = V`` this is ``V(s_{t+1})`` of the token MDP: in a multi-turn
    episode the state after a turn's last agent token is the one before the next turn's first
    agent token (docs/design.md, "Multi-turn episodes"); for a prefix mask it is ``x[:, t + 1]``
    where ``t + 1`` is valid.
    """
    check_2d("x", x)
    check_mask("mask", mask, "x", x)
    index = compaction_index(mask)
    valid = _prefix_of(mask)  # (B, T): the compacted mask
    shifted = torch.cat([compact(x, index)[:, 1:], torch.zeros_like(x[:, :1])], dim=1)  # (B, T)
    next_is_valid = torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1)  # (B, T)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return uncompact(torch.where(next_is_valid, shifted, zero), index)


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
