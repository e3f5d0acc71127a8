"""Rollout / training mismatch correction over ``[B, T]`` token tensors.

The generation engine (vLLM, bf16 kernels, another batch shape) draws each agent token with a
log-prob ``logp_engine`` (``KEYS.generation_log_prob``) that drifts from the learner's recomputed
``logp_learner`` (``KEYS.action_log_prob``): the rollout is slightly off-policy. Each function here
returns detached per-token weights ``[B, T]`` to multiply into the policy-gradient loss (0 where a
token or a whole row is rejected and off the mask), from the log-ratio
``log rho_t = logp_learner_t - logp_engine_t`` (training over rollout):

- ``tis_weights``: token-level truncated IS, ``min(rho_t, cap)`` (Yao et al. 2025, "Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training"; verl's ``rollout_is="token"``).
- ``mis_weights``: sequence-level masked IS, the row's ``prod_t rho_t`` kept inside
  ``[lower, upper]``, else 0 (Liu, Li et al. 2025, "When Speed Kills Stability"; verl's
  ``rollout_is_level="sequence", rollout_is_mode="mask"``).
- ``geo_mean_weights``: geometric-mean rejection, 1 for a row whose ``exp(mean_t log rho_t)`` is in
  ``[lower, upper]``, else 0 (verl's Geo-RS, ``rollout_rs="geometric"``).
- ``icepop_weights``: token-level, ``rho_t`` inside ``[lower, upper]``, else 0 (Ring-1T, "Every
  Step Evolves", arXiv:2510.18855, IcePop; OpenRLHF's ``icepop``).
- ``none_weights``: 1 on the mask.

``mismatch_weights(kind, ...)`` dispatches on ``MISMATCH_KINDS``; ``mismatch_stats`` gives the gap
statistics peers log; ``rejected_share`` and ``rejection_warning`` say when a correction rejects
nearly every token, iteration after iteration (the trainer warns once, in one line).

Default bounds, one rule: each kind takes the defaults of the peer whose arithmetic it is, and a
lower bound left unset is ``1 / upper`` (the band symmetric in log space) except where that peer fixes
it: tis cap 2 and mis ``[1/2, 2]`` (verl's ``rollout_is_threshold=2.0``), geo_mean ``[1/1.001, 1.001]``
(verl's geometric preset), icepop ``[0.5, 5]`` (OpenRLHF's ``vllm_is_truncated_threshold``). The numbers differ
because the quantity bounded differs: per token (tis, icepop: ``|log rho_t|`` up to ~0.7, icepop
lets a token's ratio rise to 5), over the whole row's sum (mis: ``|sum_t log rho_t| <= log 2``, so a
long row with a small per-token gap is rejected) or its mean (geo_mean: ``|mean_t log rho_t| <= 1e-3``,
a bound on the per-token gap that does not grow with length). Masked positions may hold NaN/inf and are selected away before any math;
log-ratios are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` (20, verl's ``SAFETY_BOUND``)
before ``exp``. Bounds are inclusive (``lower <= rho <= upper`` is kept), as in verl and OpenRLHF.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from textrl.functional._validate import check_positive
from textrl.functional.masking import masked_mean, masked_sum
from textrl.functional.ppo import LOG_RATIO_CLAMP, _check_token_inputs, _compute_dtype, _select

MISMATCH_KINDS = ("none", "tis", "mis", "geo_mean", "icepop")


def _log_ratio(logp_learner: Tensor, logp_engine: Tensor, mask: Tensor) -> Tensor:
    """Validated, detached ``logp_learner - logp_engine`` in the compute dtype, 0 off the mask."""
    _check_token_inputs("logp_learner", logp_learner, mask, logp_engine=logp_engine)
    dtype = _compute_dtype(logp_learner, logp_engine)
    return _select(logp_learner.detach(), mask, dtype) - _select(logp_engine.detach(), mask, dtype)


def _bounds(lower: float | None, upper: float) -> tuple[float, float]:
    """``(lower, upper)`` with ``lower=None`` read as ``1 / upper`` (verl's default)."""
    check_positive("upper", upper)
    if lower is None:
        return 1.0 / upper, upper
    check_positive("lower", lower)
    if lower > upper:
        raise ValueError(f"lower={lower!r}: must be <= upper={upper!r}")
    return float(lower), float(upper)


def _on_mask(keep: Tensor, values: Tensor) -> Tensor:
    return torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _exp(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def none_weights(logp_learner: Tensor, logp_engine: Tensor, mask: Tensor) -> Tensor:
    """No correction: 1 on the mask, 0 off it -> float ``[B, T]`` (the inputs are validated only).

    Args: as :func:`tis_weights`.
    """
    lr = _log_ratio(logp_learner, logp_engine, mask)
    return mask.to(lr.dtype)


def tis_weights(logp_learner: Tensor, logp_engine: Tensor, mask: Tensor, cap: float = 2.0) -> Tensor:
    """Token-level truncated importance sampling (TIS): ``w_t = min(rho_t, cap)`` on the mask.

    ``rho_t = exp(clamp(logp_learner_t - logp_engine_t, -20, 20))``. Sources: Yao, Liu et al. 2025,
    "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (cap 2); verl
    ``compute_rollout_correction_weights(rollout_is="token")``, whose arithmetic this is (only an
    upper cap: a ratio below 1 is kept as is). OpenRLHF's ``tis`` also clamps from below.

    Args:
        logp_learner: float ``[B, T]``, the learner's log-prob of each agent token
            (``KEYS.action_log_prob``); detached here.
        logp_engine: float ``[B, T]``, the generation engine's (``KEYS.generation_log_prob``).
        mask: bool ``[B, T]``, the agent's tokens (gaps allowed).
        cap: > 0, the truncation ``C``.

    Returns:
        float ``[B, T]`` (float32 or wider), detached, 0 off the mask.
    """
    check_positive("cap", cap)
    lr = _log_ratio(logp_learner, logp_engine, mask)
    return _on_mask(mask, _exp(lr).clamp(max=cap))


def mis_weights(
    logp_learner: Tensor,
    logp_engine: Tensor,
    mask: Tensor,
    upper: float = 2.0,
    lower: float | None = None,
) -> Tensor:
    """Sequence-level masked importance sampling (MIS): the row's ratio
    ``rho_i = exp(clamp(sum_{t in mask_i} (logp_learner - logp_engine), -20, 20))`` on each of its
    tokens when ``lower <= rho_i <= upper``, else 0 for the whole row.

    Sources: Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
    Training-Inference Mismatch" (Seq-MIS: ``rho_i`` if ``rho_i <= C`` else 0); verl
    ``mismatch_helper.compute_rollout_importance_weights(rollout_is_level="sequence",
    rollout_is_mode="mask")``, whose arithmetic this is, veto off. Following verl, a kept row
    weighs its ratio (not 1) and the band has a lower bound too, ``1 / upper`` unless given;
    pass a tiny ``lower`` for the paper's one-sided mask. An empty row has ratio 1 (weights 0).

    Args:
        logp_learner, logp_engine, mask: as :func:`tis_weights`.
        upper: > 0, ``C``. lower: ``None`` (``1 / upper``) or in ``(0, upper]``.

    Returns:
        float ``[B, T]``, detached, 0 off the mask and on rejected rows.
    """
    lo, hi = _bounds(lower, upper)
    lr = _log_ratio(logp_learner, logp_engine, mask)
    rho = _exp(masked_sum(lr, mask, dim=1)).unsqueeze(1).expand_as(lr)  # (B, T)
    return _on_mask(mask & (rho >= lo) & (rho <= hi), rho)


def geo_mean_weights(
    logp_learner: Tensor,
    logp_engine: Tensor,
    mask: Tensor,
    upper: float = 1.001,
    lower: float | None = None,
) -> Tensor:
    """Geometric-mean rejection (Geo-RS): 1 on each token of a row whose
    ``exp(clamp(mean_{t in mask_i} (logp_learner - logp_engine), -20, 20))`` lies in
    ``[lower, upper]``, else 0 for the whole row. No importance weight: pure rejection.

    Source: verl ``rollout_corr_helper.compute_rollout_rejection_mask(rollout_rs="geometric")``
    (and its ``decoupled_geo_rs`` preset: upper 1.001, lower ``1 / upper``), whose arithmetic this
    is; "When Speed Kills Stability", part 3 (the length trap). The mean is over the row's mask
    (verl divides by ``count + 1e-8``, here by ``count``; an empty row has mean 0, weights 0).

    Args:
        logp_learner, logp_engine, mask: as :func:`tis_weights`.
        upper: > 0. lower: ``None`` (``1 / upper``) or in ``(0, upper]``.

    Returns:
        float ``[B, T]``, detached, 1 on kept rows' tokens, else 0.
    """
    lo, hi = _bounds(lower, upper)
    lr = _log_ratio(logp_learner, logp_engine, mask)
    geo = _exp(masked_mean(lr, mask, dim=1)).unsqueeze(1)  # (B, 1)
    keep = mask & (geo >= lo) & (geo <= hi)
    return keep.to(lr.dtype)


def icepop_weights(
    logp_learner: Tensor,
    logp_engine: Tensor,
    mask: Tensor,
    lower: float = 0.5,
    upper: float = 5.0,
) -> Tensor:
    """IcePop: token-level ``w_t = rho_t`` if ``lower <= rho_t <= upper`` else 0, on the mask.

    ``rho_t = exp(clamp(logp_learner_t - logp_engine_t, -20, 20))``. Sources: Ling Team 2025,
    "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model"
    (Ring-1T, arXiv:2510.18855), the masking function ``M(k; alpha, beta)``; OpenRLHF
    ``PolicyLoss.forward``, ``vllm_is_correction_type="icepop"``, whose arithmetic and defaults
    (0.5, 5.0) this is. A rejected token gets an exact 0 (selected, not ``inf * 0``).

    Args:
        logp_learner, logp_engine, mask: as :func:`tis_weights`.
        lower: > 0, ``alpha``. upper: >= lower, ``beta``.

    Returns:
        float ``[B, T]``, detached, 0 off the mask and on rejected tokens.
    """
    lo, hi = _bounds(lower, upper)
    lr = _log_ratio(logp_learner, logp_engine, mask)
    rho = _exp(lr)
    return _on_mask(mask & (rho >= lo) & (rho <= hi), rho)


_WEIGHTS = {
    "none": (none_weights, ()),
    "tis": (tis_weights, ("cap",)),
    "mis": (mis_weights, ("upper", "lower")),
    "geo_mean": (geo_mean_weights, ("upper", "lower")),
    "icepop": (icepop_weights, ("lower", "upper")),
}


def _check_kind(kind: str) -> None:
    if kind not in _WEIGHTS:
        raise ValueError(f"kind={kind!r}: must be one of {', '.join(MISMATCH_KINDS)}")


def mismatch_bounds(kind: str) -> dict[str, float | None]:
    """The bounds ``kind`` (one of ``MISMATCH_KINDS``) takes, each with its default (``None``:
    ``1 / upper``): ``{"cap": 2.0}`` for ``tis``, ``{}`` for ``none``."""
    _check_kind(kind)
    fn, names = _WEIGHTS[kind]
    args = fn.__code__.co_varnames[: fn.__code__.co_argcount]  # the positional parameters; the bounds last
    defaults = dict(zip(args[len(args) - len(fn.__defaults__ or ()):], fn.__defaults__ or (), strict=True))
    return {name: defaults[name] for name in names}


def resolved_bounds(kind: str, **given: float | None) -> dict[str, float]:
    """The bounds ``kind`` applies: ``given`` (None or absent: the default of :func:`mismatch_bounds`),
    an unset ``lower`` read as ``1 / upper``. ``{}`` for ``none``."""
    out = mismatch_bounds(kind)
    out.update({name: value for name, value in given.items() if value is not None and name in out})
    if out.get("lower", 0.0) is None:
        out["lower"] = 1.0 / out["upper"]
    return out


REJECTION_WARNING_SHARE = 0.9
"""The share of the agent's tokens a correction rejects above which an iteration counts toward
:func:`rejection_warning`."""
REJECTION_WARNING_ITERATIONS = 3
"""Consecutive iterations past :data:`REJECTION_WARNING_SHARE` before the correction says so."""

_BOUNDED = {
    "tis": "caps each token's ratio p_learner / p_engine at {cap:g}",
    "mis": "keeps a row whose product of p_learner / p_engine lies in [{lower:g}, {upper:g}]",
    "geo_mean": "keeps a row whose geometric mean of p_learner / p_engine lies in [{lower:g}, {upper:g}]",
    "icepop": "keeps a token whose p_learner / p_engine lies in [{lower:g}, {upper:g}]",
}


def rejected_share(weights: Tensor, mask: Tensor) -> Tensor:
    """The share of the agent's tokens a correction rejected (weight 0) -> float ``[]`` (0 for an empty
    mask). weights: float ``[B, T]`` (:func:`mismatch_weights`); mask: bool ``[B, T]``."""
    return masked_mean((weights == 0).to(torch.float32), mask)


def rejection_warning(
    kind: str,
    bounds: dict[str, float | None],
    shares: list[float],
    *,
    share: float = REJECTION_WARNING_SHARE,
    iterations: int = REJECTION_WARNING_ITERATIONS,
) -> str | None:
    """The one-line warning when ``kind`` rejected more than ``share`` of the agent's tokens in each of
    the last ``iterations`` consecutive iterations (``shares``: one :func:`rejected_share` per iteration,
    oldest first); None otherwise. ``bounds`` as :func:`mismatch_weights` takes them (unset: the kind's
    defaults). It names the correction, its bounds, the share and what to do."""
    recent = shares[-iterations:]
    if len(recent) < iterations or not all(s > share for s in recent):
        return None
    what = _BOUNDED[kind].format(**resolved_bounds(kind, **bounds))
    return (f"rollout_correction={kind!r} rejected {min(recent):.0%} or more of the agent's tokens in each of "
            f"the last {iterations} iterations (it {what}), so the updates learn from almost nothing: widen "
            "the bounds (--rollout-correction-upper / --rollout-correction-lower), or check that the engine "
            "samples with the learner's weights at the learner's precision (rollout/logprob_gap should be "
            "near 0 at --max-staleness 0)")


def mismatch_weights(
    kind: str, logp_learner: Tensor, logp_engine: Tensor, mask: Tensor, **bounds: float | None
) -> Tensor:
    """The weights of ``kind`` (one of ``MISMATCH_KINDS``) -> float ``[B, T]``, detached.

    ``bounds`` are the keyword arguments of that kind's function, each defaulting as there:
    ``tis``: ``cap``; ``mis``, ``geo_mean``, ``icepop``: ``upper``, ``lower``; ``none``: none.
    An unknown kind or a bound the kind does not take raises ``ValueError`` naming it.
    """
    _check_kind(kind)
    fn, allowed = _WEIGHTS[kind]
    extra = sorted(set(bounds) - set(allowed))
    if extra:
        takes = ", ".join(allowed) if allowed else "no bounds"
        raise ValueError(f"{', '.join(extra)}: not a bound of kind={kind!r} (it takes {takes})")
    return fn(logp_learner, logp_engine, mask, **bounds)


def mismatch_stats(
    logp_learner: Tensor, logp_engine: Tensor, mask: Tensor, threshold: float = math.log(2.0)
) -> dict[str, Tensor]:
    """The gap between the learner's and the engine's log-probs of the agent tokens, as peers log it.

    With ``d_t = logp_learner_t - logp_engine_t`` over the mask (all ``[]``, detached; 0 for an
    empty mask):

    - ``abs_gap_mean``: ``mean_t |d_t|``; ``abs_gap_max``: ``max_t |d_t|``.
    - ``kl_k3``: ``mean_t (exp(d_t) - d_t - 1)``, the k3 estimator of ``KL(engine || learner)``
      from the engine's own samples (the tokens were drawn by the engine; ``d_t`` clamped to
      ``[-20, 20]`` before ``exp``). verl logs it as ``k3_kl``
      (``rollout_corr_helper.compute_offpolicy_metrics``), "KL(pi_rollout || pi_training)".
    - ``gap_fraction``: the share of agent tokens with ``|d_t| > threshold`` (strict);
      the default ``log 2`` counts tokens whose ratio is off by more than a factor 2.

    Args:
        logp_learner, logp_engine, mask: as :func:`tis_weights`.
        threshold: >= 0, on ``|d_t|`` (nats).
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
        raise ValueError(f"threshold={threshold!r}: must be a number >= 0 (a log-prob gap, in nats)")
    d = _log_ratio(logp_learner, logp_engine, mask)
    gap = d.abs()
    dc = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    zero = torch.zeros((), dtype=d.dtype, device=d.device)
    return {
        "abs_gap_mean": masked_mean(gap, mask),
        "abs_gap_max": torch.where(mask, gap, zero).amax() if d.numel() else zero,
        "kl_k3": masked_mean(torch.exp(dc) - dc - 1.0, mask),
        "gap_fraction": masked_mean((gap > threshold).to(d.dtype), mask),
    }
