"""Estimators and losses of the 2025 RL-for-LLM papers, over ``[B, T]`` token tensors.

- ``gspo_loss``: sequence-level importance ratio and clip (Zheng et al. 2025, GSPO).
- ``cispo_loss``: clipped, stop-gradient importance weight on a REINFORCE term (MiniMax-M1, CISPO).
- ``token_level_aggregate``, ``overlong_penalty``, ``dynamic_sampling_keep``: DAPO's pieces
  (Yu et al. 2025); clip-higher is ``clipped_policy_loss(..., clip_eps_high=...)``.
- ``dr_grpo_advantage``, ``dr_grpo_aggregate``: Dr. GRPO (Liu et al. 2025).
- ``reinforce_pp_advantages``: REINFORCE++ and REINFORCE++-baseline (Hu 2025).

Every loss takes an optional normaliser (``num_tokens`` or ``num_seqs``): the minibatch's count,
and optional per-token correction ``weights`` (as :func:`~textrl.functional.ppo.clipped_policy_loss`:
the per-token loss times ``w_t``, a token of weight 0 off the mask; None: unchanged).
A caller that splits a minibatch into micro-batches passes the minibatch's count to each call and
sums the micro-batch losses (or their gradients); the result equals the loss of the whole
minibatch, whatever the split. Without it each call normalises by its own count, which is right
only for a call over the whole minibatch.

Masks are bool and may have gaps (a multi-turn episode's observation tokens, docs/design.md,
"Multi-turn episodes"); masked positions may hold NaN/inf and are selected away before any math.
Log-ratios are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp`` so that an
extreme log-ratio gives a finite loss and a finite gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from textrl.functional._validate import (
    check_2d,
    check_float,
    check_mask,
    check_positive,
    check_tensor,
)
from textrl.functional.advantages import _check_1d, _check_group_size
from textrl.functional.masking import masked_mean, masked_sum, masked_whiten
from textrl.functional.ppo import (
    LOG_RATIO_CLAMP,
    _check_normaliser,
    _check_token_inputs,
    _check_weights,
    _compute_dtype,
    _select,
    aggregate_loss,
    kept_mask,
    ratio_extremes,
)


def _check_seq_advantages(advantages: Tensor, logp: Tensor) -> None:
    _check_1d("advantages", advantages)
    check_float("advantages", advantages)
    if advantages.shape[0] != logp.shape[0]:
        raise ValueError(
            f"advantages must be [B] with B={logp.shape[0]} (the rows of logp), got "
            f"{list(advantages.shape)}; GSPO takes one advantage per sequence"
        )


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float = 4e-4,
    num_seqs: float | Tensor | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO clipped surrogate at the sequence level (Zheng et al. 2025, "Group Sequence Policy
    Optimization", arXiv:2507.18071, eqs. 5-7).

    ``s_i = exp(mean_{t valid in row i} (logp - old_logp))`` (the length-normalised sequence
    ratio), ``loss_i = max(-A_i * s_i, -A_i * clip(s_i, 1 - clip_eps_low, 1 + clip_eps_high))``,
    ``loss = sum_i loss_i / num_seqs`` over the rows with at least one valid token. The gradient
    of ``s_i`` is ``s_i * mean_t grad logp_t``: every token of a sequence gets the same weight.
    The defaults are the paper's clip range (3e-4, 4e-4), far narrower than PPO's.

    With ``weights`` the loss is GSPO's token-level form (verl ``compute_policy_loss_gspo``):
    ``s_{i,t} = sg(s_i) * exp(logp_t - sg(logp_t))`` (the value of ``s_i``, the gradient
    ``s_i * grad logp_t``), ``l_{i,t} = max(-A_i s_{i,t}, -A_i clip(s_{i,t}))``, and
    ``loss_i = mean_t w_t * l_{i,t}`` over the row's tokens of nonzero weight (``s_i`` too is
    over those): each token's gradient is weighted, which a per-row factor could not do.

    Args:
        logp: float ``[B, T]``, log-prob of each action under the current policy (with grad).
        old_logp: float ``[B, T]``, behaviour-policy log-prob.
        advantages: float ``[B]``, one per sequence (e.g. ``grpo_advantage``).
        mask: bool ``[B, T]``, the agent's tokens (gaps allowed); an empty row is left out.
        clip_eps_low, clip_eps_high: > 0.
        num_seqs: ``None`` (the non-empty rows of this batch) or > 0, the minibatch's count of
            non-empty rows when this batch is one micro-batch of it.
        weights: ``None`` or float ``[B, T]`` >= 0 on the mask (0: the token is off the mask).

    Returns:
        ``(loss, stats)``; ``loss`` is ``[]``. ``stats`` (detached, over non-empty rows):
        ``clip_fraction`` (share of sequences whose clipped term is the larger),
        ``seq_ratio_mean``, ``seq_ratio_max``, ``seq_ratio_min`` (1 for an empty mask), and
        ``approx_kl`` (token-level k3 of KL(old || new), over valid tokens).
    """
    _check_token_inputs("logp", logp, mask, old_logp=old_logp)
    _check_seq_advantages(advantages, logp)
    check_positive("clip_eps_low", clip_eps_low)
    check_positive("clip_eps_high", clip_eps_high)
    _check_normaliser(num_seqs, "num_seqs")
    _check_weights(weights, "logp", logp, mask)
    mask = kept_mask(mask, weights)  # (B, T)

    dtype = _compute_dtype(logp, old_logp, advantages)
    log_ratio = _select(logp, mask, dtype) - _select(old_logp, mask, dtype)  # (B, T)
    seq_log_ratio = masked_mean(log_ratio, mask, dim=1)  # (B,)
    seq_ratio = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # (B,)
    rows = mask.any(dim=1)  # (B,)
    adv = torch.where(rows, advantages.to(dtype), torch.zeros((), dtype=dtype, device=logp.device))
    loss1 = -adv * seq_ratio  # (B,)
    loss2 = -adv * torch.clamp(seq_ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)  # (B,)
    per_seq = torch.maximum(loss1, loss2)  # (B,)
    if weights is None:
        loss = masked_sum(per_seq, rows) / num_seqs if num_seqs is not None else masked_mean(per_seq, rows)
    else:
        lp = _select(logp, mask, dtype)  # (B, T)
        token_loss = _gspo_token_loss(lp, seq_ratio, adv, clip_eps_low, clip_eps_high)  # (B, T)
        weighted = token_loss * _select(weights.detach(), mask, dtype)  # (B, T)
        loss = aggregate_loss(weighted, mask, "seq_mean", num_seqs)

    with torch.no_grad():
        r = seq_ratio.detach()
        lr = log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        one = torch.ones((), dtype=dtype, device=r.device)
        any_row = rows.any()
        stats = {
            "clip_fraction": masked_mean((loss2 > loss1).to(dtype), rows),
            "seq_ratio_mean": torch.where(any_row, masked_mean(r, rows), one),
            "seq_ratio_max": torch.where(any_row, torch.where(rows, r, -torch.inf).amax(), one),
            "seq_ratio_min": torch.where(any_row, torch.where(rows, r, torch.inf).amin(), one),
            "approx_kl": masked_mean(torch.exp(lr) - 1.0 - lr, mask),
        }
    return loss, stats


def _gspo_token_loss(lp: Tensor, seq_ratio: Tensor, adv: Tensor, clip_eps_low: float, clip_eps_high: float) -> Tensor:
    """GSPO's per-token loss ``[B, T]``: ``s_{i,t} = sg(s_i) * exp(lp_t - sg(lp_t))`` (value ``s_i``,
    gradient ``s_i * grad lp_t``), ``max(-A_i s_{i,t}, -A_i clip(s_{i,t}))``. lp: ``[B, T]``,
    seq_ratio and adv: ``[B]``."""
    token_ratio = seq_ratio.detach()[:, None] * torch.exp(lp - lp.detach())  # (B, T)
    a = adv[:, None]  # (B, 1)
    return torch.maximum(-a * token_ratio, -a * torch.clamp(token_ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high))


def cispo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps_low: float | None = None,
    clip_eps_high: float = 0.28,
    num_tokens: float | Tensor | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: clipped importance-sampling weight policy optimisation (MiniMax 2025, "MiniMax-M1:
    Scaling Test-Time Compute Efficiently with Lightning Attention", arXiv:2506.13585, eq. 4).

    ``w_t = sg(clip(exp(logp - old_logp), 1 - clip_eps_low, 1 + clip_eps_high))``,
    ``loss = -sum_{valid t} w_t * A_t * logp_t / num_tokens``. The weight is detached, so the
    gradient flows through ``logp`` only and no token is dropped (unlike PPO's clip, which zeroes
    the gradient of clipped tokens): ``d loss / d logp_t = -w_t * A_t / num_tokens``.
    MiniMax-M1 tunes only the upper bound; ``clip_eps_low=None`` leaves the weight unbounded
    below. The default ``clip_eps_high=0.28`` is DAPO's upper clip, a starting point (the paper
    does not publish its value).

    Args:
        logp: float ``[B, T]`` (with grad). old_logp: float ``[B, T]``.
        advantages: float ``[B, T]`` (broadcast a sequence advantage with ``A[:, None].expand``).
        mask: bool ``[B, T]`` (gaps allowed).
        clip_eps_low: ``None`` or > 0. clip_eps_high: > 0.
        num_tokens: ``None`` (this batch's valid tokens) or > 0, the minibatch's count of valid
            tokens when this batch is one micro-batch of it.
        weights: ``None`` or float ``[B, T]`` >= 0 on the mask: ``-w_t * sg(clip(r_t)) A_t logp_t``
            (verl ``compute_policy_loss_cispo``'s ``rollout_is_weights``); 0: off the mask.

    Returns:
        ``(loss, stats)``; ``loss`` is ``[]`` (its value is a surrogate: only its gradient is
        meaningful). ``stats`` (detached, over valid tokens): ``clip_fraction`` (share of tokens
        whose weight was clipped), ``ratio_mean``, ``ratio_max``, ``ratio_min`` (1 for an empty
        mask), ``approx_kl`` (k3 of KL(old || new)).
    """
    _check_token_inputs("logp", logp, mask, old_logp=old_logp, advantages=advantages)
    if clip_eps_low is not None:
        check_positive("clip_eps_low", clip_eps_low)
    check_positive("clip_eps_high", clip_eps_high)
    _check_normaliser(num_tokens, "num_tokens")
    _check_weights(weights, "logp", logp, mask)
    mask = kept_mask(mask, weights)  # (B, T)

    dtype = _compute_dtype(logp, old_logp, advantages)
    lp = _select(logp, mask, dtype)  # (B, T)
    adv = _select(advantages, mask, dtype)  # (B, T)
    with torch.no_grad():
        log_ratio = (lp - _select(old_logp, mask, dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)  # (B, T)
        low = None if clip_eps_low is None else 1.0 - clip_eps_low
        weight = torch.clamp(ratio, min=low, max=1.0 + clip_eps_high)  # (B, T)
    token_loss = -weight * adv * lp  # (B, T)
    if weights is not None:
        token_loss = token_loss * _select(weights.detach(), mask, dtype)
    loss = aggregate_loss(token_loss, mask, "token_mean", num_tokens)

    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean((weight != ratio).to(dtype), mask),
            "ratio_mean": masked_mean(ratio, mask),
            **ratio_extremes(ratio, mask),
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask),
        }
    return loss, stats


def token_level_aggregate(
    loss_mat: Tensor, mask: Tensor, num_tokens: float | Tensor | None = None
) -> Tensor:
    """DAPO's token-level policy-gradient loss (Yu et al. 2025, "DAPO: An Open-Source LLM
    Reinforcement Learning System at Scale", arXiv:2503.14476, eq. 8): the sum of ``loss_mat``
    over every valid token of the minibatch divided by the minibatch's count of valid tokens, so
    each token weighs the same whatever the length of its response.

    loss_mat: float ``[B, T]``; mask: bool ``[B, T]`` (gaps allowed); num_tokens: ``None`` (this
    batch's valid tokens) or > 0, the minibatch's count when this batch is a micro-batch -> ``[]``.
    ``aggregate_loss(loss_mat, mask, "token_mean", num_tokens)``.
    """
    return aggregate_loss(loss_mat, mask, "token_mean", num_tokens)


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: must be an int >= 1")


def dr_grpo_aggregate(
    loss_mat: Tensor, mask: Tensor, max_len: int | None = None, num_seqs: int | None = None
) -> Tensor:
    """Dr. GRPO's aggregation (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective", arXiv:2503.20783, eq. 3): ``sum of loss_mat over valid tokens / (num_seqs *
    max_len)``. The denominator is a constant, not a count of tokens, so a response's length
    does not scale its tokens' gradient (the length bias of GRPO's per-response mean).

    loss_mat: float ``[B, T]``; mask: bool ``[B, T]`` (gaps allowed); max_len: the generation
    budget (default ``T``; pass it when micro-batches are padded to different ``T``); num_seqs:
    the minibatch's rows (default ``B``; pass it for a micro-batch) -> ``[]``.
    """
    check_2d("loss_mat", loss_mat)
    max_len = loss_mat.shape[1] if max_len is None else max_len
    num_seqs = loss_mat.shape[0] if num_seqs is None else num_seqs
    _check_count("max_len", max_len)
    _check_count("num_seqs", num_seqs)
    return aggregate_loss(loss_mat, mask, "seq_mean_token_sum", num_seqs * max_len)


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13).

    ``0`` for ``L <= max_len - cache_len``; ``(max_len - cache_len - L) / cache_len`` for
    ``max_len - cache_len < L <= max_len`` (linear from 0 down to -1); ``-1`` for ``L > max_len``.
    Added to the task reward of each response.

    lengths: int or float ``[B]``, each response's length in generated tokens (e.g.
    ``mask.sum(1)``); max_len: int >= 1, the length budget ``L_max``; cache_len: int in
    ``[1, max_len]``, the punishment interval ``L_cache`` -> float32 ``[B]`` (float64 for
    float64 lengths).
    """
    _check_1d("lengths", lengths)
    if lengths.dtype == torch.bool or lengths.is_complex():
        raise ValueError(f"lengths must be an int or float tensor, got dtype {lengths.dtype}")
    _check_count("max_len", max_len)
    _check_count("cache_len", cache_len)
    if cache_len > max_len:
        raise ValueError(f"cache_len={cache_len} must be <= max_len={max_len}")
    length = lengths.to(torch.promote_types(lengths.dtype, torch.float32))
    penalty = ((max_len - cache_len) - length) / cache_len
    return penalty.clamp(min=-1.0, max=0.0)


def dynamic_sampling_keep(group_rewards: Tensor) -> Tensor:
    """DAPO's dynamic sampling filter (Yu et al. 2025, arXiv:2503.14476, eq. 11): keep a group
    only if its rewards are not all equal (all-correct or all-wrong groups have zero group
    advantage and give no gradient).

    group_rewards: float ``[G, k]``, one row per prompt's group (``scores.view(-1, k)``)
    -> bool ``[G]``. A NaN reward raises (it would compare unequal and keep a broken group).
    """
    check_2d("group_rewards", group_rewards)
    check_float("group_rewards", group_rewards)
    if group_rewards.isnan().any():
        raise ValueError("group_rewards has NaN: fix the reward before filtering groups")
    return group_rewards.amax(dim=1) > group_rewards.amin(dim=1)


def dr_grpo_advantage(scores: Tensor, group_size: int) -> Tensor:
    """Dr. GRPO's group advantage ``s_i - mean_g(s)`` without the division by the group's std
    (Liu et al. 2025, arXiv:2503.20783, eq. 3; the std makes easy and hard prompts weigh more).

    scores: float ``[B]`` with ``B = n_groups * group_size``, each group's rows consecutive
    -> ``[B]`` (float32, or float64 for float64 scores). A constant group gives exactly 0.
    """
    _check_1d("scores", scores)
    check_float("scores", scores)
    _check_group_size(scores, group_size, minimum=1)
    s = scores.to(torch.promote_types(scores.dtype, torch.float32)).view(-1, group_size)  # (G, k)
    return (s - s.mean(dim=1, keepdim=True)).view(-1)  # (B,)


def reinforce_pp_advantages(
    scores: Tensor,
    mask: Tensor,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    group_size: int | None = None,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ advantages (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for
    Aligning Large Language Models", arXiv:2501.03262, sec. 3).

    Token reward ``r_t = -kl_coef * kl_t`` at every valid token, plus the sequence score at the
    row's last valid token; return ``G_t = sum_{valid s >= t} r_s`` (gamma = 1, so gaps in the
    mask change nothing); advantage ``(G - mean) / sqrt(var + eps)`` with the mean and (unbiased)
    variance over every valid token of the batch (global normalisation, no critic). With
    ``group_size`` (REINFORCE++-baseline) each score first has its group's mean subtracted.
    Compute it once over the whole rollout batch, before splitting into minibatches.

    Args:
        scores: float ``[B]``, the task reward of each sequence.
        mask: bool ``[B, T]``, the agent's tokens (gaps allowed); a row without one gets 0.
        kl: ``None`` or float ``[B, T]``, per-token KL to the reference (e.g. ``kl_k1``).
        kl_coef: >= 0. group_size: ``None`` or an int >= 1 dividing ``B``. eps: > 0.

    Returns:
        ``(advantages, returns)``, each ``[B, T]``, exactly 0 at masked positions; ``returns``
        are the un-normalised ``G_t``.
    """
    _check_1d("scores", scores)
    check_float("scores", scores)
    check_tensor("mask", mask)
    check_2d("mask", mask)
    if mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"mask must be [B, T] with B={scores.shape[0]} (the rows of scores), got {list(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got dtype {mask.dtype}; pass mask.bool()")
    if isinstance(kl_coef, bool) or not isinstance(kl_coef, (int, float)) or not kl_coef >= 0:
        raise ValueError(f"kl_coef={kl_coef!r}: must be a number >= 0")
    check_positive("eps", eps)
    dtype = torch.promote_types(scores.dtype, torch.float32)
    if kl is not None:
        check_float("kl", kl)
        check_mask("mask", mask, "kl", kl)
        dtype = torch.promote_types(dtype, kl.dtype)

    s = scores.to(dtype)
    if group_size is not None:
        s = dr_grpo_advantage(s, group_size).to(dtype)
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, positions, -1).amax(dim=1) if mask.shape[1] else None  # (B,)
    rewards = torch.zeros(mask.shape, dtype=dtype, device=mask.device)  # (B, T)
    if last is not None:
        is_last = positions[None, :] == last[:, None]  # (B, T); no True in an empty row
        rewards = torch.where(is_last & mask, s[:, None], zero)
    if kl is not None:
        rewards = rewards - kl_coef * _select(kl, mask, dtype)
    rewards = torch.where(mask, rewards, zero)
    returns = rewards.flip(1).cumsum(1).flip(1)  # (B, T): gamma = 1 reverse cumulative sum
    returns = torch.where(mask, returns, zero)
    advantages = masked_whiten(returns, mask, eps=eps)
    return advantages, returns
