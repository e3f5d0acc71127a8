"""Whether the engine samples with the weights the actor claims (docs/training.md, "Does the engine
have the learner's weights?").

After every weight hand-over the actor prefills a few of the rollout's rows with the model it holds
(the learner's weights at K=0, the snapshot of the claimed iteration at K >= 1) under the very
distribution the engine draws from (temperature, top-k, top-p) and compares those log-probs with the
ones the engine reported for its own draws. With the same weights the two differ by the arithmetic's
noise only; an engine that missed an update differs by what the update changed. Past the bound of the
run's precision (:data:`WEIGHT_GAP_BOUNDS`, or ``--max-weight-gap``; 0 turns the check off) the run stops in one line
(:class:`WeightGapError`).

The functions here are pure: :func:`weight_gap` the per-row statistics, :func:`weight_gap_bound` the
bound of a run, :func:`weight_gap_error` the stop's message.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

WEIGHT_CHECK_ROWS = 8
"""Rows of each rollout the actor prefills for the check (the first ones): enough tokens to see an
update's difference, a small forward beside the rollout's."""

WEIGHT_GAP_BOUNDS = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 1e-2}
"""The bound of the mean absolute gap ``|logp_engine - logp_prefill|`` per token, by the dtype the
forwards compute in (the autocast's, else the weights'). Set from the ``textrl``, ``hf`` and
``static`` engines on the CPU (``benchmarks/weight_gap.py``; the figures: docs/benchmarks.md,
"Weight check: an engine's log-probs against a prefill"): in float32, 1e-3 sits thousands of times
above the noise and a few times below the gap of an engine one update stale; bfloat16 autocast
noise is larger, and larger still with a GPU's kernels (not measured), so its bound is 2e-2: an engine that
never receives the updates is stopped once the weights drifted that far, one stale update at a small
learning rate is not seen."""


class WeightGapError(ValueError):
    """The engine's log-probs of its own tokens disagree with a prefill of the weights it should hold."""


def weight_gap(engine_logp: Tensor, prefill_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row statistics of the engine's log-probs against a prefill's, over the tokens of ``mask``.

    Args:
        engine_logp: float ``[B, T]``, the engine's log-prob of each token it drew (``KEYS.generation_log_prob``).
        prefill_logp: float ``[B, T]``, the same tokens' log-probs under the filtered distribution of the
            weights the engine should hold (``-inf`` on a token the prefill's filter drops).
        mask: bool ``[B, T]``, the tokens to compare (the agent's tokens drawn with those weights).

    Returns:
        ``(gap_sum [B], tokens [B], outside [B])``: the sum of ``|engine - prefill|`` over the tokens
        where both are finite, how many such tokens, and how many tokens of ``mask`` the prefill's
        filter drops (a draw the prefill's top-k / top-p says the engine could not have made).
    """
    if engine_logp.shape != prefill_logp.shape or engine_logp.shape != mask.shape:
        raise ValueError(f"weight_gap: engine_logp {tuple(engine_logp.shape)}, prefill_logp "
                         f"{tuple(prefill_logp.shape)} and mask {tuple(mask.shape)} must have one shape [B, T]")
    engine, prefill, mask = engine_logp.double(), prefill_logp.double(), mask.bool()
    both = mask & torch.isfinite(engine) & torch.isfinite(prefill)
    diff = torch.where(both, (engine - prefill).abs(), torch.zeros((), dtype=engine.dtype, device=engine.device))
    outside = mask & torch.isneginf(prefill)
    return diff.sum(1), both.sum(1), outside.sum(1)


def weight_gap_bound(config: Any, compute_dtype: torch.dtype) -> float:
    """The run's bound of the mean gap: ``config.max_weight_gap`` when set (0: no check, read as
    ``inf``), else :data:`WEIGHT_GAP_BOUNDS` of ``compute_dtype``."""
    chosen = getattr(config, "max_weight_gap", None)
    if chosen is not None:
        return float(chosen) if chosen > 0 else math.inf
    return WEIGHT_GAP_BOUNDS[str(compute_dtype).removeprefix("torch.")]


def weight_gap_error(*, engine: str, updates: int, gap: float, tokens: int, outside: int, bound: float,
                     dtype: torch.dtype) -> WeightGapError | None:
    """The one-line stop when the mean gap ``gap`` over ``tokens`` tokens exceeds ``bound`` (None
    otherwise). ``updates``: the learner's updates behind the weights the engine should hold."""
    if not gap > bound or tokens == 0:
        return None
    share = f"; {outside} of its tokens lie outside the prefill's top-k / top-p" if outside else ""
    return WeightGapError(
        f"the {engine!r} engine does not sample with the weights after update {updates}: its log-probs of its "
        f"own tokens differ from a prefill of those weights by {gap:.3g} on average over {tokens} tokens "
        f"(bound {bound:g} for {str(dtype).removeprefix('torch.')} forwards{share}). A weight update did not "
        "reach the engine (check its weight sync); --max-weight-gap X raises the bound (0: no check)")


def mean_gap(gap_sum: float, tokens: float) -> float:
    """The mean gap per token, ``gap_sum / tokens`` (``nan`` with no token)."""
    return float(gap_sum) / float(tokens) if tokens else math.nan


__all__ = ["WEIGHT_CHECK_ROWS", "WEIGHT_GAP_BOUNDS", "WeightGapError", "mean_gap", "weight_gap",
           "weight_gap_bound", "weight_gap_error"]
