"""PPO losses over ``[B, T]`` token tensors (Schulman et al. 2017, arXiv:1707.06347).

Each loss returns ``(loss, stats)``: ``loss`` is a scalar with grad, ``stats`` a dict of detached
scalar tensors for logging (CleanRL names: ``clip_fraction``, ``approx_kl``, ...).
Inputs are selected with ``torch.where(mask, x, 0)`` before any math, so NaN/inf in masked
positions reach neither the loss nor its gradient.

The policy losses take optional per-token ``weights`` ``[B, T]`` (the rollout / training mismatch
correction, :mod:`textrl.functional.mismatch`): the per-token policy loss is multiplied by them
before aggregation, and a token of weight 0 (rejected) leaves the mask, so it counts in no
denominator and no stat (verl's ``rollout_is_weights`` and rejection mask). ``None`` leaves the
loss exactly as it is without them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from textrl.functional._validate import (
    check_2d,
    check_float,
    check_mask,
    check_positive,
    check_same_shape,
)
from textrl.functional.masking import masked_mean, masked_sum, masked_var

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to ``[-20, 20]`` before ``exp`` (``exp(20)`` ~ 4.9e8: finite in float32 and
far outside any clip range), so an extreme ratio gives a finite loss and gradient."""

LOSS_AGGREGATIONS = ("token_mean", "seq_mean", "seq_mean_token_sum")


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}: must be one of {LOSS_AGGREGATIONS}")


def _check_token_inputs(ref_name: str, ref: Tensor, mask: Tensor, **others: Tensor) -> None:
    check_2d(ref_name, ref)
    check_float(ref_name, ref)
    for name, x in others.items():
        check_same_shape(name, x, ref_name, ref)
        check_float(name, x)
    check_mask("mask", mask, ref_name, ref)


def _select(x: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    # Select before the math: where() after exp() would still backprop NaN from masked slots.
    return torch.where(mask, x.to(dtype), torch.zeros((), dtype=dtype, device=x.device))


def _compute_dtype(*xs: Tensor) -> torch.dtype:
    dtype = torch.float32
    for x in xs:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def _check_weights(weights: Tensor | None, ref_name: str, ref: Tensor, mask: Tensor) -> None:
    """``weights`` is None, or float with the shape of ``ref`` and no negative value on ``mask``."""
    if weights is None:
        return
    check_same_shape("weights", weights, ref_name, ref)
    check_float("weights", weights)
    if bool((torch.where(mask, weights, 0.0) < 0).any()):
        raise ValueError("weights must be >= 0 on the mask (a correction weight; 0 rejects the token)")


def kept_mask(mask: Tensor, weights: Tensor | None) -> Tensor:
    """The tokens a weighted loss counts, bool ``[B, T]``: ``mask`` without the rejected tokens
    (weight 0); ``mask`` itself when ``weights`` is None. mask: bool ``[B, T]``; weights: float
    ``[B, T]`` or None."""
    return mask if weights is None else mask & (weights != 0)


def _check_normaliser(normaliser: float | Tensor | None, name: str = "normaliser") -> None:
    if normaliser is None:
        return
    value = normaliser
    if isinstance(normaliser, Tensor):
        if normaliser.numel() != 1:
            raise ValueError(f"{name} must be a number or a 1-element tensor, got shape {list(normaliser.shape)}")
        value = normaliser.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"{name}={normaliser!r}: must be None or a number > 0 (the minibatch's token or row count)"
        )


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    aggregation: str = "token_mean",
    normaliser: float | Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` over the bool ``mask`` ``[B, T]`` to a scalar ``[]``.

    - ``"token_mean"``: mean over every valid token of the batch; long responses weigh more
      (verl ``token-mean``, TRL/OpenRLHF default, DAPO).
    - ``"seq_mean"``: mean over rows of each row's token-mean; every response weighs the same,
      so a token of a short response weighs more (the original GRPO, verl ``seq-mean-token-mean``).
    - ``"seq_mean_token_sum"``: mean over rows of each row's token-sum; no length normalisation,
      so no length bias in the gradient (Dr.GRPO, Liu et al. 2025; verl ``seq-mean-token-sum``).

    The ``seq_*`` modes average over rows with at least one valid token (an empty row has no
    tokens to weigh); an all-empty mask gives 0 in every mode.

    ``normaliser`` (> 0) replaces the denominator computed from this batch: the count of valid
    tokens (``token_mean``) or of non-empty rows (``seq_*``). Pass the *minibatch's* count when
    ``loss_mat`` is one micro-batch of it: the micro-batch losses then simply add up to the
    minibatch loss, gradients included, however the minibatch is split (DAPO's token-level loss,
    Yu et al. 2025, arXiv:2503.14476, eq. 8, over micro-batches). A constant such as
    ``n_rows * max_len`` gives Dr. GRPO's aggregation (see ``dr_grpo_aggregate``).
    """
    check_2d("loss_mat", loss_mat)
    check_float("loss_mat", loss_mat)
    check_mask("mask", mask, "loss_mat", loss_mat)
    _check_aggregation(aggregation)
    _check_normaliser(normaliser)
    if aggregation == "token_mean":
        if normaliser is not None:
            return masked_sum(loss_mat, mask) / normaliser
        return masked_mean(loss_mat, mask)
    if aggregation == "seq_mean":
        per_row = masked_mean(loss_mat, mask, dim=1)  # (B,)
    else:
        per_row = masked_sum(loss_mat, mask, dim=1)  # (B,)
    if normaliser is not None:
        return masked_sum(per_row, mask.any(dim=1)) / normaliser
    return masked_mean(per_row, mask.any(dim=1))


@torch.no_grad()
def ratio_extremes(ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """``{"ratio_max", "ratio_min"}`` of ``ratio`` ``[B, T]`` over the bool ``mask`` ``[B, T]``,
    each ``[]``; both 1 for an empty mask (the ratio of an unchanged policy)."""
    one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
    any_valid = mask.any()
    return {
        "ratio_max": torch.where(any_valid, torch.where(mask, ratio, -torch.inf).amax(), one),
        "ratio_min": torch.where(any_valid, torch.where(mask, ratio, torch.inf).amin(), one),
    }


def _check_clip_args(
    clip_eps: float,
    clip_eps_high: float | None,
    normaliser: float | Tensor | None,
    dual_clip: float | None,
    aggregation: str,
) -> None:
    """Raise ``ValueError`` on the first bad scalar argument of :func:`clipped_policy_loss`."""
    check_positive("clip_eps", clip_eps)
    if clip_eps_high is not None:
        check_positive("clip_eps_high", clip_eps_high)
    _check_normaliser(normaliser)
    if dual_clip is not None and (
        isinstance(dual_clip, bool) or not isinstance(dual_clip, (int, float)) or not dual_clip > 1
    ):
        raise ValueError(f"dual_clip={dual_clip!r}: must be None or a number > 1")
    _check_aggregation(aggregation)


@torch.no_grad()
def _policy_stats(
    ratio: Tensor,
    log_ratio: Tensor,
    clipped: Tensor,
    dual_active: Tensor | None,
    mask: Tensor,
    dtype: torch.dtype,
) -> dict[str, Tensor]:
    """The detached stats of :func:`clipped_policy_loss`, each ``[]``, over the bool ``mask``.

    ratio, log_ratio: float ``[B, T]``; clipped: bool ``[B, T]`` where ``pg_loss2 > pg_loss1``;
    dual_active: bool ``[B, T]`` where the dual bound was active (None: no dual clip).
    """
    r = ratio.detach()
    one = torch.ones((), dtype=dtype, device=r.device)
    stats = {
        "clip_fraction": masked_mean(clipped.to(dtype), mask),
        "approx_kl": masked_mean((r - 1.0) - log_ratio.detach(), mask),
        "ratio_mean": torch.where(mask.any(), masked_mean(r, mask), one),
        **ratio_extremes(r, mask),
    }
    if dual_active is not None:
        stats["dual_clip_fraction"] = masked_mean(dual_active.to(dtype), mask)
    return {k: v.detach() for k, v in stats.items()}


def clipped_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    dual_clip: float | None = None,
    aggregation: str = "token_mean",
    clip_eps_high: float | None = None,
    normaliser: float | Tensor | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), optionally dual-clipped.

    With ``clip_eps_high`` the clip range is asymmetric, ``[1 - clip_eps, 1 + clip_eps_high]``
    (DAPO's "clip-higher", Yu et al. 2025, arXiv:2503.14476, eq. 10; the paper uses
    ``clip_eps=0.2, clip_eps_high=0.28``); ``None`` keeps it symmetric. ``normaliser`` is passed
    to :func:`aggregate_loss` (the minibatch's count when this is one micro-batch of it).

    ``ratio = exp(logp - old_logp)``, ``pg_loss1 = -A * ratio``,
    ``pg_loss2 = -A * clamp(ratio, 1 - clip_eps, 1 + clip_eps)``,
    ``pg_loss = max(pg_loss1, pg_loss2)``. With ``dual_clip = c > 1`` (Ye et al. 2020,
    "Mastering Complex Control in MOBA Games with Deep RL"), for ``A < 0``:
    ``pg_loss = min(pg_loss, -A * c)`` (bounds the loss when the ratio explodes; verl
    ``compute_policy_loss``). With ``weights``, ``pg_loss * w`` is aggregated over the tokens of
    nonzero weight (verl ``compute_policy_loss_vanilla(rollout_is_weights=...)``).

    Args:
        logp: float ``[B, T]``, log-prob of each action under the current policy (with grad).
        old_logp: float ``[B, T]``, behaviour-policy log-prob (``action_log_prob``).
        advantages: float ``[B, T]``.
        mask: bool ``[B, T]``, the tokens that count.
        clip_eps: > 0, the lower clip (and the upper one unless ``clip_eps_high`` is given).
        dual_clip: ``None`` or > 1. aggregation: one of ``LOSS_AGGREGATIONS``.
        clip_eps_high: ``None`` or > 0. normaliser: ``None`` or > 0, see ``aggregate_loss``.
        weights: ``None`` or float ``[B, T]`` >= 0 on the mask, detached correction weights;
            a token of weight 0 is off the mask.

    Returns:
        ``(loss, stats)``; ``loss`` is ``[]``. ``stats`` (detached, over valid tokens):
        ``clip_fraction`` (share where ``pg_loss2 > pg_loss1``, the clipped term active, as verl),
        ``approx_kl`` (k3 estimator ``(ratio - 1) - log ratio`` of KL(old || new), >= 0, CleanRL),
        ``ratio_mean``, ``ratio_max``, ``ratio_min`` (1 for an empty mask), and with dual clip
        ``dual_clip_fraction`` (share where ``A < 0`` and the dual bound was active).
    """
    _check_token_inputs("logp", logp, mask, old_logp=old_logp, advantages=advantages)
    _check_clip_args(clip_eps, clip_eps_high, normaliser, dual_clip, aggregation)
    _check_weights(weights, "logp", logp, mask)
    mask = kept_mask(mask, weights)  # (B, T)

    dtype = _compute_dtype(logp, old_logp, advantages)
    lp = _select(logp, mask, dtype)  # (B, T)
    old = _select(old_logp, mask, dtype)  # (B, T)
    adv = _select(advantages, mask, dtype)  # (B, T)

    # clamped before exp (as verl does): exp(89) overflows float32, and inf * 0 is NaN
    log_ratio = (lp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    pg_loss1 = -adv * ratio
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    pg_loss2 = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)  # (B, T)
    dual_active: Tensor | None = None
    if dual_clip is not None:
        pg_loss3 = -adv * dual_clip
        dual_active = (adv < 0) & (pg_loss > pg_loss3)  # (B, T)
        pg_loss = torch.where(adv < 0, torch.minimum(pg_loss, pg_loss3), pg_loss)

    if weights is not None:
        pg_loss = pg_loss * _select(weights.detach(), mask, dtype)  # (B, T)
    loss = aggregate_loss(pg_loss, mask, aggregation, normaliser)
    clipped = pg_loss2 > pg_loss1  # (B, T)
    return loss, _policy_stats(ratio, log_ratio, clipped, dual_active, mask, dtype)


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: float | None = 0.2,
    aggregation: str = "token_mean",
    normaliser: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped value loss ``0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)``.

    Source: CleanRL ``ppo.py`` (``clip_vloss``), OpenAI baselines ppo2, verl
    ``compute_value_loss``. ``clip_eps=None`` gives the unclipped ``0.5 * (V - R)^2``
    (``old_values`` is then only shape-checked).

    Args:
        values: float ``[B, T]``, V(s_t) of the current value head (with grad).
        old_values: float ``[B, T]``, V at rollout time. returns: float ``[B, T]``, value targets.
        mask: bool ``[B, T]``. clip_eps: > 0 or ``None``. aggregation, normaliser: see ``aggregate_loss``.

    Returns:
        ``(loss, stats)``; ``loss`` is ``[]``. ``stats`` (detached): ``value_clip_fraction``
        (share of valid tokens where the clipped term was the larger), ``explained_variance``,
        ``value_mean``, ``return_mean``.
    """
    _check_token_inputs("values", values, mask, old_values=old_values, returns=returns)
    if clip_eps is not None:
        check_positive("clip_eps", clip_eps)
    _check_aggregation(aggregation)
    _check_normaliser(normaliser)

    dtype = _compute_dtype(values, old_values, returns)
    v = _select(values, mask, dtype)  # (B, T)
    old = _select(old_values, mask, dtype)  # (B, T)
    ret = _select(returns, mask, dtype)  # (B, T)

    vf_loss1 = (v - ret) ** 2  # (B, T)
    if clip_eps is None:
        vf_loss = 0.5 * vf_loss1
        clipped = torch.zeros_like(mask)
    else:
        v_clipped = old + torch.clamp(v - old, -clip_eps, clip_eps)
        vf_loss2 = (v_clipped - ret) ** 2
        vf_loss = 0.5 * torch.maximum(vf_loss1, vf_loss2)
        clipped = vf_loss2 > vf_loss1
    loss = aggregate_loss(vf_loss, mask, aggregation, normaliser)

    with torch.no_grad():
        vd = v.detach()
        stats = {
            "value_clip_fraction": masked_mean(clipped.to(dtype), mask),
            "explained_variance": explained_variance(vd, ret, mask),
            "value_mean": masked_mean(vd, mask),
            "return_mean": masked_mean(ret, mask),
        }
    return loss, stats


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var[R - V] / Var[R]`` over the valid tokens -> ``[]`` (detached).

    values, returns: float ``[B, T]``; mask: bool ``[B, T]``. 1 is a perfect value head, 0 no
    better than a constant, negative worse. When ``Var[R] == 0`` (constant returns, or fewer
    than 2 valid tokens) it is undefined and NaN is returned, as CleanRL and SB3 do: a logged
    NaN says "undefined" where a 0 would read as "useless value head". Never raises.
    """
    _check_token_inputs("values", values, mask, returns=returns)
    with torch.no_grad():
        dtype = _compute_dtype(values, returns)
        v = _select(values.detach(), mask, dtype)
        ret = _select(returns.detach(), mask, dtype)
        var_r = masked_var(ret, mask, unbiased=False)
        var_res = masked_var(ret - v, mask, unbiased=False)
        nan = torch.full((), torch.nan, dtype=dtype, device=v.device)
        return torch.where(var_r > 0, 1.0 - var_res / torch.where(var_r > 0, var_r, 1.0), nan)
