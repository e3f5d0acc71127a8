"""Per-token KL estimators between the policy and the reference, and KL-shaped rewards.

The estimators take the log-probs of the *sampled* tokens, ``logp = log pi(a)`` and
``ref_logp = log pi_ref(a)`` with ``a ~ pi``, and estimate ``KL(pi || pi_ref)`` per token
(J. Schulman, "Approximating KL Divergence", 2020, http://joschu.net/blog/kl-approx.html).
All compute in float32 (float64 stays float64) and return that dtype. ``kl_shaped_rewards``
places a sequence score; ``shaped_token_rewards`` takes rewards already placed per token (the
per-turn rewards of a multi-turn episode).
"""

from __future__ import annotations

import torch
from torch import Tensor

from textrl.functional._validate import (
    check_2d,
    check_float,
    check_mask,
    check_same_shape,
    check_tensor,
)
from textrl.functional.masking import last_true_index

KL_KINDS = ("k1", "k2", "k3", "abs")

K3_LOG_RATIO_BOUND = 20.0
"""``kl_k3`` clamps ``ref_logp - logp`` to ``[-20, 20]`` before ``exp`` (exp(20) ~ 4.9e8)."""


def _log_ratio(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """``logp - ref_logp`` in float32 (or float64), after checking dtypes and shapes."""
    check_tensor("logp", logp)
    check_float("logp", logp)
    check_tensor("ref_logp", ref_logp)
    check_float("ref_logp", ref_logp)
    check_same_shape("ref_logp", ref_logp, "logp", logp)
    cdt = torch.promote_types(torch.promote_types(logp.dtype, ref_logp.dtype), torch.float32)
    return logp.to(cdt) - ref_logp.to(cdt)


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log(pi / pi_ref) = logp - ref_logp: unbiased, high variance, can be < 0.

    logp, ref_logp: float ``[B, T]`` (same shape) -> float32 ``[B, T]``.
    Source: Schulman, "Approximating KL Divergence" (k1).
    """
    return _log_ratio(logp, ref_logp)


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = 0.5 * (logp - ref_logp)^2: biased, low variance, >= 0.

    logp, ref_logp: float ``[B, T]`` (same shape) -> float32 ``[B, T]``.
    Source: Schulman, "Approximating KL Divergence" (k2).
    """
    d = _log_ratio(logp, ref_logp)
    return 0.5 * d * d


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = (r - 1) - log r with r = pi_ref / pi: unbiased, low variance, >= 0.

    logp, ref_logp: float ``[B, T]`` (same shape) -> float32 ``[B, T]``.
    ``log r = ref_logp - logp`` is computed in float32 and clamped to
    ``[-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND]`` = [-20, 20] before ``exp``, so the result is
    finite for any finite inputs of any float dtype (the gradient is 0 outside the bound).
    Source: Schulman, "Approximating KL Divergence" (k3); GRPO (Shao et al., 2024) eq. 4.
    """
    log_r = (-_log_ratio(logp, ref_logp)).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return torch.expm1(log_r) - log_r


def kl_abs(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """|logp - ref_logp|: biased, >= 0.

    logp, ref_logp: float ``[B, T]`` (same shape) -> float32 ``[B, T]``.
    Source: TRL / OpenRLHF ``kl_penalty == "abs"``.
    """
    return _log_ratio(logp, ref_logp).abs()


_KL_FUNCS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "abs": kl_abs}


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k1") -> Tensor:
    """Per-token KL estimate of ``kind`` in ``KL_KINDS`` = ("k1", "k2", "k3", "abs").

    logp, ref_logp: float ``[B, T]`` (same shape) -> float32 ``[B, T]``.
    Source: TRL ``PPOTrainer``/``_kl_penalty`` and Schulman, "Approximating KL Divergence".
    """
    if kind not in _KL_FUNCS:
        raise ValueError(f"kind={kind!r}: must be one of {KL_KINDS}")
    return _KL_FUNCS[kind](logp, ref_logp)


def _check_kl_coef(kl_coef: float) -> None:
    if not isinstance(kl_coef, (int, float)) or isinstance(kl_coef, bool) or not kl_coef >= 0:
        raise ValueError(f"kl_coef={kl_coef!r}: must be a number >= 0")


def kl_shaped_rewards(
    score: Tensor, kl: Tensor, mask: Tensor, kl_coef: float, placement: str = "last"
) -> Tensor:
    """Per-token rewards: the KL penalty on every valid token plus the sequence score.

    score: float ``[B]`` task reward per sequence; kl: float ``[B, T]`` per-token KL (e.g. from
    ``kl_penalty``); mask: bool ``[B, T]``, the agent's tokens (a prefix from ``response_mask``
    for a single turn; gaps allowed, docs/design.md, "Multi-turn episodes"); kl_coef >= 0.
    Returns float32 ``[B, T]``: ``r_t = -kl_coef * kl_t`` on valid tokens, plus

    * ``placement="last"``: ``score`` at the row's last True position (``mask.sum(1) - 1`` for
      a prefix mask; Ziegler et al. 2019; Ouyang et al. 2022; TRL ``PPOTrainer``);
    * ``placement="uniform"``: ``score / T_valid`` on each valid token (the Actor-Critic PPO
      seed), so each row's rewards still sum to ``score - kl_coef * sum(kl)``.

    Masked positions are exactly 0 (selected, so NaN/inf in masked ``kl`` does not leak).
    Raises ``ValueError`` for a row with no valid token: it has nowhere to put its score.
    """
    check_2d("kl", kl)
    check_float("kl", kl)
    check_mask("mask", mask, "kl", kl)
    check_tensor("score", score)
    check_float("score", score)
    b, _ = kl.shape
    if score.shape != (b,):
        hint = " (call .squeeze(-1))" if score.shape == (b, 1) else ""
        raise ValueError(
            f"score must be [B] = [{b}] to match kl [B, T], got shape {list(score.shape)}{hint}"
        )
    _check_kl_coef(kl_coef)
    if placement not in ("last", "uniform"):
        raise ValueError(f"placement={placement!r}: must be one of ('last', 'uniform')")
    lengths = mask.sum(dim=1)  # [B]
    if bool((lengths == 0).any()):
        rows = torch.nonzero(lengths == 0).flatten().tolist()
        raise ValueError(
            f"mask has rows with no valid token {rows[:10]}: each row needs at least one "
            "valid token to receive its score"
        )

    cdt = torch.promote_types(torch.promote_types(kl.dtype, score.dtype), torch.float32)
    zero = torch.zeros((), dtype=cdt, device=kl.device)
    rewards = torch.where(mask, -kl_coef * kl.to(cdt), zero)  # [B, T]
    score = score.to(cdt)
    if placement == "last":
        last = last_true_index(mask).unsqueeze(1)  # [B, 1]
        rewards = rewards.scatter_add(1, last, score.unsqueeze(1))
    else:
        per_token = score / lengths.to(cdt)  # [B]
        rewards = rewards + torch.where(mask, per_token.unsqueeze(1), zero)
    return rewards


def shaped_token_rewards(task_rewards: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """Per-token rewards from per-token task rewards: ``where(mask, task_rewards - kl_coef * kl, 0)``.

    task_rewards: float ``[B, T]``, the environment's reward already placed on tokens (each
    turn's reward on its last agent token, docs/design.md, "Multi-turn episodes"); kl: float
    ``[B, T]``; mask: bool ``[B, T]``, the agent's tokens (gaps allowed); kl_coef >= 0.
    Returns float32 ``[B, T]`` (float64 if an input is), exactly 0 at masked positions (a task
    reward there is dropped, NaN/inf there does not leak).

    Computed as ``-kl_coef * kl + task_rewards``, the float operations of
    :func:`kl_shaped_rewards`: with ``task_rewards = kl_shaped_rewards(score, 0, mask, 0,
    placement)`` (the score placed) both give the same numbers (up to the sign of a zero).
    """
    check_2d("task_rewards", task_rewards)
    check_float("task_rewards", task_rewards)
    check_same_shape("kl", kl, "task_rewards", task_rewards)
    check_float("kl", kl)
    check_mask("mask", mask, "task_rewards", task_rewards)
    _check_kl_coef(kl_coef)
    cdt = torch.promote_types(torch.promote_types(kl.dtype, task_rewards.dtype), torch.float32)
    zero = torch.zeros((), dtype=cdt, device=kl.device)
    return torch.where(mask, -kl_coef * kl.to(cdt) + task_rewards.to(cdt), zero)
