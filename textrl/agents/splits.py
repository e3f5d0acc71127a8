"""How a rollout's rows are split for the forwards and the update: the micro-batches of a minibatch
(:func:`micro_splits`: ``gradient_accumulation_steps`` runs, or runs up to ``microbatch_tokens``
real tokens) and of the rollout-time forwards (:func:`prefill_batches`: ``forward_batch_size`` rows,
or the same token runs), as many on every process as the one that needs most, balanced by tokens.
The update (:mod:`textrl.agents.update`) and the actor (:mod:`textrl.agents.actor`) both read them.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase
from torch import Tensor

from textrl.agents.forwards import attended_response
from textrl.keys import KEYS


def real_tokens(td: TensorDictBase) -> Tensor:
    """Each row's real tokens, int64 ``[B]``: its attended prompt and response tokens (what a
    padding-free forward runs)."""
    return td.get(KEYS.prompt_mask).sum(1) + attended_response(td).sum(1)


def micro_splits(idx: Tensor, row_tokens: Tensor, cfg: Any, dist: Any) -> list[Tensor]:
    """The micro-batches of a minibatch's rows ``idx`` ``[b]``: ``gradient_accumulation_steps`` runs of
    near-equal row counts, or with ``microbatch_tokens`` runs of rows in order, as many as filling
    each up to that many real tokens (``row_tokens`` ``[B]``) takes on the process that needs most
    (every process runs as many backwards: ZeRO and FSDP reduce inside them), balanced by tokens
    (:func:`balanced_runs`). Never more micro-batches than rows."""
    budget = getattr(cfg, "microbatch_tokens", None)
    if budget is None:
        return list(idx.tensor_split(min(cfg.gradient_accumulation_steps, idx.numel())))
    bounds = token_run_ends(row_tokens[idx], budget, dist)
    return [idx[start:end] for start, end in zip([0, *bounds], bounds)]


def prefill_batches(row_tokens: Tensor, cfg: Any, dist: Any) -> list[slice]:
    """The micro-batches of the rollout-time forwards without gradient (the actor's behaviour and
    reference log-probs and values, :meth:`textrl.agents.actor.Actor.evaluate`) over a rollout's rows
    in order, each row once: ``forward_batch_size`` rows each, or with ``microbatch_tokens`` runs
    filled up to that many real tokens (``row_tokens`` ``[B]``, :func:`real_tokens`; a longer row
    alone), as many on every process as the one that needs most (a partitioned model's forwards are
    collectives), balanced by tokens: :func:`micro_splits`' runs."""
    n = row_tokens.numel()
    budget = getattr(cfg, "microbatch_tokens", None)
    if budget is None:
        return [slice(start, min(n, start + cfg.forward_batch_size)) for start in range(0, n, cfg.forward_batch_size)]
    bounds = token_run_ends(row_tokens, budget, dist)
    return [slice(start, end) for start, end in zip([0, *bounds], bounds)]


def token_run_ends(row_tokens: Tensor, budget: int, dist: Any) -> list[int]:
    """Where the runs of rows ``row_tokens`` ``[b]`` (their real tokens, in order) end: as many runs as
    filling each up to ``budget`` tokens takes (:func:`filled_runs`) on the process that needs most
    (one gather), never more than rows, balanced by tokens (:func:`balanced_runs`)."""
    tokens = row_tokens.tolist()
    count = len(filled_runs(tokens, budget))
    if getattr(dist, "world_size", 1) > 1:
        count = int(dist.gather(torch.tensor([count], device=row_tokens.device)).max())
    return balanced_runs(tokens, min(count, len(tokens)))


def filled_runs(tokens: list[int], budget: int) -> list[int]:
    """Where runs of rows end (exclusive indices) when each run takes rows in order while their
    ``tokens`` fit ``budget`` (a row over it is a run alone).

    >>> filled_runs([3, 4, 2, 9, 1], 7)
    [2, 3, 4, 5]
    """
    ends, total = [], 0
    for i, n in enumerate(tokens):
        if total and total + n > budget:
            ends.append(i)
            total = 0
        total += n
    return [*ends, len(tokens)] if tokens else []


def balanced_runs(tokens: list[int], count: int) -> list[int]:
    """Where ``count`` runs of rows in order end (exclusive indices), none empty, the largest run's
    tokens as small as it can be (the least budget :func:`filled_runs` fits into ``count`` runs,
    by bisection; the runs then split further where fewer came out).

    >>> balanced_runs([3, 4, 2, 9, 1], 3)  # 9, 9, 1 tokens
    [3, 4, 5]
    >>> balanced_runs([5, 5, 5, 5], 4)
    [1, 2, 3, 4]
    """
    if count <= 1 or not tokens:
        return [len(tokens)] if tokens else []
    low, high = max(tokens), sum(tokens)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if len(filled_runs(tokens, mid)) <= count else (mid + 1, high)
    ends = filled_runs(tokens, low)
    while len(ends) < count:  # split the longest-by-rows run until there are count
        starts = [0, *ends[:-1]]
        widest = max(range(len(ends)), key=lambda k: ends[k] - starts[k])
        ends.insert(widest, starts[widest] + (ends[widest] - starts[widest]) // 2)
    return ends


__all__ = ["balanced_runs", "filled_runs", "micro_splits", "prefill_batches", "real_tokens", "token_run_ends"]
