"""The PPO update: K epochs of shuffled minibatches, each one optimiser step over its micro-batches.

The loop of CleanRL's ``ppo.py`` (:func:`run_epochs`, on one screen); the backend
(:mod:`textrl.parallel`) does the backward and the step, so it is the same loop on one process,
replicated, FSDP and DeepSpeed. Around it, two named calls: :func:`skip_nonfinite_step` (a step
whose loss or gradient was NaN/inf is skipped and counted) and :func:`rolled_back_if_nonfinite`
(steps that left NaN/inf weights are undone).

An agent's ``loss(mb)`` returns its **named terms** and the stats it logs, ``(terms, stats)``, as
TorchRL's ``ClipPPOLoss`` returns ``loss_objective`` / ``loss_critic`` / ``loss_entropy``:
``terms`` maps a name (``policy``, ``entropy``, ``kl``, ``value``, ...) to a weighted scalar, and
the loss is their sum in the order they were added (:func:`total_loss`), logged as
``loss/total``. A loss that returns the older ``(loss, stats)`` (one tensor) keeps working: that
tensor is the loss. The stats keep the names the metrics have always had (``loss/policy``,
``loss/value``, ``loss/kl``, ``entropy``, ``clip_fraction``, ``ratio/mean``, ...).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDictBase
from torch import Tensor

from textrl.agents.forwards import RolloutForward, with_forward
from textrl.agents.splits import micro_splits, real_tokens
from textrl.functional import kept_mask, kl_penalty, masked_mean, mismatch_stats
from textrl.functional.ppo import explained_variance
from textrl.keys import KEYS

if TYPE_CHECKING:
    from textrl.agents.actor import Actor
    from textrl.agents.learner import Learner


@dataclass(frozen=True)
class Objective:
    """What the update asks of the agent: ``loss(mb) -> (terms, stats)`` (its ``loss``),
    ``micro_weight(sub, sub_mask, mb_tokens, micro, mb_size) -> float`` (a micro-batch's share of
    its minibatch's loss) and whether the actor's kept behaviour forward may serve the one step
    (:func:`textrl.agents.forwards.reuses_rollout_forward`)."""

    loss: Callable[[TensorDictBase], tuple[Any, dict[str, Tensor]]]
    micro_weight: Callable[..., float]
    reuse_forward: bool = False


def update(learner: Learner, actor: Actor, td: TensorDictBase, objective: Objective) -> dict[str, float]:
    """:meth:`PPOAgent.update <textrl.agents.base.PPOAgent.update>` without the refreshes after it
    (the agent's ``after_update``): the rollout's provenance (:func:`provenance_metrics`) and KL
    monitors, then the epochs under the rollback guard unless the rollout itself is not finite, then
    the metrics.

    The loop of CleanRL's ppo.py: for each epoch, for each minibatch, one optimiser step
    (:func:`textrl.agents.update.run_epochs`) over its micro-batches; the backend (:mod:`textrl.parallel`)
    does the backward and the step, so the loop is the same on one process, replicated, FSDP
    and DeepSpeed. The rollout is split into ``num_minibatches`` x
    ``gradient_accumulation_steps`` as evenly as possible (uneven only when
    ``reward_nonfinite='drop'`` removed rows).

    Besides the losses (averaged over minibatches), it reports the three KL monitors,
    each the mean per-token KL(policy || ref) of ``config.kl_kind``: ``kl/collection`` (the
    behaviour log-probs stored in the rollout), ``kl/before_update`` and, with
    ``config.kl_after_update``, ``kl/after_update`` (the policy re-evaluated before and after
    this update; the first is free, the second costs a policy forward).

    Skips, the same on every backend (docs/parallelism.md):

    - ratio threshold (MA-RLHF): a micro-batch whose mean policy ratio, averaged over the
      processes, exceeds ``config.ratio_threshold`` is judged before its backward and left
      out of the step, actor and critic (its samples are stale or broken); the minibatch
      counts once in ``ppo/ratio_threshold_skips``; when all its micro-batches are left out
      nothing steps;
    - numerical faults: a rollout with NaN/inf log-probs, values, rewards or advantages on
      valid tokens is skipped as a whole (one skipped update); a minibatch with a NaN/inf
      loss or gradient on any process is skipped (no optimiser or scheduler step, weights
      untouched) on every process. Both count in ``nonfinite/skipped_updates`` and in
      ``nonfinite_streak`` (consecutive skips, reset by a good step); at
      ``config.max_nonfinite_updates`` the update stops and the trainer stops the run;
    - steps that leave NaN/inf weights (finite gradients, a step too large):
      with ``config.nonfinite_weights='rollback'`` (the default) the whole update is undone
      (:func:`textrl.agents.update.rolled_back_if_nonfinite`) and counts as one skipped update, ``nonfinite/rolled_back`` = 1;
      with ``'stop'`` the weights stay as they are and the trainer's check stops the run.
      ``guard/bytes`` is the size of the rollback's copy on this process (0 with ``'stop'``);
      the host seconds its staging, copy, check and restore took are not a metric (metrics
      are deterministic): ``Backend.rollback_seconds``.

    The agent's ``after_update`` (the reference refresh) runs after this, so it copies checked weights.
    """
    metrics = {**provenance_metrics(learner, td), **kl_monitors(actor, td), **(actor.teacher.monitors(td) if actor.teacher else {})}
    tally = UpdateTally()
    kept = actor.take_kept_forward(td)  # the behaviour forward with its graph, or None
    forward = kept if objective.reuse_forward else None
    poisoned = nonfinite_in_rollout(td)
    if learner.backend.dist.any(poisoned is not None):  # every minibatch would be poisoned: skip all
        tally.skip_nonfinite(learner, poisoned or "the rollout of another process (its log-probs, values or advantages)")
    else:
        with rolled_back_if_nonfinite(learner, tally):
            run_epochs(learner, td, forward, tally, objective)
        learner.backend.zero_grad(learner)  # the last step's gradients: freed before the next rollout, not kept through it
    return {**metrics, **update_metrics(learner, actor, td, tally), **learner.backend.rollback_metrics()}


def run_epochs(learner: Learner, td: TensorDictBase, forward: RolloutForward | None, tally: UpdateTally,
               objective: Objective) -> None:
    """``ppo_epochs`` passes of shuffled minibatches; each minibatch is one optimiser step over
    its ``gradient_accumulation_steps`` micro-batches, each weighed by ``objective.micro_weight`` so
    that they add up to the minibatch's loss. Stops early on the KL early stop or at
    ``max_nonfinite_updates`` consecutive skipped steps. ``forward`` (the kept behaviour forward)
    serves the first micro-batch only: the update is then one step over the whole rollout."""
    cfg, backend = learner.config, learner.backend
    mask = loss_mask(td)  # [B, T]
    row_tokens = real_tokens(td)  # [B]
    for _ in range(cfg.ppo_epochs):
        tally.epochs_run += 1
        private = {} if learner.generator is None else {"generator": learner.generator}  # max_staleness > 0
        order = torch.randperm(td.shape[0], device=td.device, **private)
        for idx in order.tensor_split(cfg.num_minibatches):  # [b] rows of one minibatch
            if idx.numel() == 0:
                continue
            if leaves_tokens_out(td) and not backend.dist.any(bool(mask[idx].any())):
                stats, norms = {}, {}  # every token left out (dynamic sampling, rejection): no loss, nothing to step
            else:
                mb_tokens = mask[idx].sum().clamp(min=1)
                backend.zero_grad(learner)
                micro_stats: dict[str, list[Tensor]] = defaultdict(list)
                micro_weights: list[float] = []  # each micro-batch's share of the minibatch's loss
                backwards = dropped = 0
                seen: list[str] = []  # what of a micro-batch's loss was NaN/inf (micro_batch_loss)
                for sub_idx in micro_splits(idx, row_tokens, cfg, backend.dist):
                    sub = td[sub_idx]
                    weight = objective.micro_weight(sub, mask[sub_idx], mb_tokens, sub_idx.numel(), idx.numel())
                    loss, sub_stats = micro_batch_loss(objective.loss, sub, forward.rows(sub_idx) if forward else None,
                                                       seen=seen)
                    forward = None
                    for k, v in sub_stats.items():
                        micro_stats[k].append(v.detach().float())
                    micro_weights.append(float(weight))
                    if over_ratio_threshold(learner, loss, sub_stats):
                        dropped += 1
                        continue
                    backend.backward(weight * loss)
                    backwards += 1
                stats = backend.dist.mean(combined_micro_stats(micro_stats, micro_weights))
                tally.ratio_threshold_skips += dropped > 0
                norms = backend.step(learner) if backwards else {}  # None: a NaN/inf loss or gradient
                learner.version  # read after each step: the version counts the steps  # noqa: B018
            forward = None
            if norms is None:
                cause = seen[0] if seen else "the gradients (the loss was finite on this process)"
                if skip_nonfinite_step(learner, tally, cause):
                    return
                continue
            learner.nonfinite_streak = 0
            tally.steps += bool(norms)  # {}: every micro-batch was left out, nothing stepped
            tally.add({**stats, **norms})
            if should_stop_early(cfg, tally.stats):
                tally.early_stopped = True
                return


def combined_micro_stats(stats: dict[str, list[Tensor]], weights: list[float]) -> dict[str, float]:
    """A minibatch's stats from its micro-batches', as one pass over the minibatch would give them:
    a ``.../min`` the smallest, a ``.../max`` the largest, any other the mean weighed by each
    micro-batch's share of the loss (``weights``: its tokens under a token mean, its rows under a row
    mean), so that ``gradient_accumulation_steps`` changes no logged number (docs/design.md,
    "micro-batches add up"). A stat a micro-batch did not report is averaged over those that did."""
    out = {}
    for key, values in stats.items():
        v = torch.stack(values).double()  # [m]
        if key.endswith("/min") or key.endswith("_min"):
            out[key] = float(v.min())
        elif key.endswith("/max") or key.endswith("_max"):
            out[key] = float(v.max())
        else:
            w = torch.tensor(weights if len(values) == len(weights) else [1.0] * len(values), dtype=torch.float64)
            total = float(w.sum())
            out[key] = float((v * w).sum() / total) if total > 0 else float(v.mean())
    return out


def loss_mask(td: TensorDictBase) -> Tensor:
    """The tokens the loss counts, bool ``[B, T]``: ``KEYS.loss_mask`` where the estimator
    left rows out (DAPO's dynamic sampling), else the agent mask ``KEYS.mask``; without the
    tokens the rollout correction rejected (``KEYS.correction_weight`` 0), so that they count in
    no term and no micro-batch weight."""
    mask = td.get(KEYS.loss_mask, None)
    mask = td.get(KEYS.mask) if mask is None else mask
    return kept_mask(mask, td.get(KEYS.correction_weight, None))


def leaves_tokens_out(td: TensorDictBase) -> bool:
    """Whether :func:`loss_mask` may leave every token of a minibatch out (dynamic sampling, the
    rollout correction's rejections), which :func:`run_epochs` must then check before a step."""
    keys = td.keys()
    return KEYS.loss_mask in keys or KEYS.correction_weight in keys


class LossTerms(dict):
    """The named terms of a loss, ``name -> []`` tensor (``policy``, ``entropy``, ``kl``,
    ``value``, ...): the loss is their sum in the order they were added (:func:`total_loss`).
    Scaling the terms (``terms * x``, as a wrapper of ``loss`` may do to a loss tensor) scales
    each term."""

    def __mul__(self, scale: Any) -> LossTerms:
        return LossTerms({name: term * scale for name, term in self.items()})

    __rmul__ = __mul__


def total_loss(terms: dict[str, Tensor]) -> Tensor:
    """The sum of a loss's named terms, in the order they were added (``[]``)."""
    values = iter(terms.values())
    total = next(values)
    for term in values:
        total = total + term
    return total


def micro_batch_loss(loss_fn: Callable[[TensorDictBase], tuple[Any, dict[str, Tensor]]], sub: TensorDictBase,
                     forward: RolloutForward | None = None, seen: list[str] | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """``(loss [], stats)`` of a micro-batch: ``loss_fn`` (an agent's ``loss``) on it (with the kept behaviour
    forward ``forward`` in it when given), its named terms summed (:func:`total_loss`, logged as
    ``loss/total``) or, for a loss that returns one tensor, that tensor. A NaN/inf loss is made to
    give NaN gradients too, so that the backend's step skips it whatever caused it."""
    if forward is not None:
        sub = with_forward(sub, forward)
    terms, stats = loss_fn(sub)
    if isinstance(terms, Tensor):  # a loss written before the named terms: (loss, stats)
        loss = terms
    else:
        loss = total_loss(terms)
        stats = {**stats, "loss/total": loss.detach()}
    if not bool(torch.isfinite(loss)):
        if seen is not None:
            seen.append(nonfinite_loss(terms, loss))
        loss = loss * math.nan
    return loss, stats


def nonfinite_loss(terms: Any, loss: Tensor) -> str:
    """What of a NaN/inf loss was not finite, for the stop's message: its named terms that are not
    (``the loss's kl term (inf)``), else the loss itself."""
    if isinstance(terms, dict):
        bad = [f"{name} ({float(term)})" for name, term in terms.items() if not bool(torch.isfinite(term))]
        if bad:
            return f"the loss's {', '.join(bad)} term{'s' if len(bad) > 1 else ''}"
    return f"the loss ({float(loss)})"


def over_ratio_threshold(learner: Learner, loss: Tensor, stats: dict[str, Tensor]) -> bool:
    """Whether a micro-batch stays out of the step: its mean ratio, averaged over processes,
    exceeds ``ratio_threshold`` (MA-RLHF: stale or broken samples) and no process has a
    NaN/inf loss (that one is back-propagated, so that every process skips the step).

    Decided before the backward and alike on every process: DeepSpeed ZeRO-2/3 and FSDP
    reduce inside the backward, so every process must run the same backwards.
    """
    threshold = learner.config.ratio_threshold
    if threshold <= 0 or "ratio/mean" not in stats:
        return False
    shared = learner.backend.dist.mean({"ratio": float(stats["ratio/mean"]), "nonfinite": float(not torch.isfinite(loss))})
    return shared["nonfinite"] == 0 and shared["ratio"] > threshold


def skip_nonfinite_step(learner: Learner, tally: UpdateTally, cause: str = "the loss or gradients") -> bool:
    """A step whose loss or gradient was NaN/inf (``cause`` says which, for the stop's message) is
    skipped: counted in the tally and the learner's streak. True when the streak reached
    ``max_nonfinite_updates``: the update stops there."""
    tally.skip_nonfinite(learner, cause)
    return learner.nonfinite_streak >= learner.config.max_nonfinite_updates


@contextmanager
def rolled_back_if_nonfinite(learner: Learner, tally: UpdateTally) -> Iterator[None]:
    """The steps inside, rolled back when they left NaN/inf weights (``nonfinite_weights='rollback'``).

    Before the steps the backend hands over its copy of what they change
    (``Backend.take_rollback``: this process's part of the trained weights, the optimiser and
    scheduler states, in buffers reused from update to update, where ``config.rollback_copy``
    puts them; staged by ``process_rollout``, made now if nothing was staged or the weights
    changed since); after them, if a step was applied and a weight is NaN/inf on any process
    (a shared decision), every process restores its copy in place and the update counts as one
    skipped update: the streak is the one before it plus one, whatever its minibatches counted.
    With ``nonfinite_weights='stop'`` nothing is copied and the trainer's check stops the run.
    """
    if learner.config.nonfinite_weights != "rollback":
        yield
        return
    snapshot, streak = learner.backend.take_rollback(learner), learner.nonfinite_streak
    yield
    if tally.steps and learner.backend.roll_back_nonfinite(learner, snapshot):
        tally.roll_back(learner, streak)


ROLLOUT_QUANTITIES = {
    KEYS.action_log_prob: "the old policy's log-probs (action_log_prob)",
    KEYS.ref_log_prob: "the reference's log-probs (ref_log_prob)",
    KEYS.state_value: "the critic's values (state_value)",
    KEYS.reward: "the per-token rewards (reward, task reward plus KL shaping)",
    KEYS.advantage: "the advantages",
    KEYS.value_target: "the value targets (returns)",
    KEYS.correction_weight: "the rollout correction's weights",
}
"""The rollout's quantities an update reads, in the order they are made, with what the stop calls them."""


def nonfinite_in_rollout(td: TensorDictBase) -> str | None:
    """None when the rollout's log-probs, values, rewards, advantages and correction weights are
    finite on the agent's tokens; else what is not, for the stop's message: the first quantity (in the
    order :data:`ROLLOUT_QUANTITIES` makes them: an upstream NaN spreads downstream), on how many
    tokens, and the first one (row, position, the token id)."""
    mask = td.get(KEYS.mask)  # [B, T]
    present = set(td.keys(include_nested=True))
    for key, name in ROLLOUT_QUANTITIES.items():
        if key in present:
            x = td.get(key)
            x = x.squeeze(-1) if x.dim() == 3 else x  # [B, T]
            bad = mask & ~torch.isfinite(x)
            if bool(bad.any()):
                row, pos = (int(i) for i in bad.nonzero()[0])
                value = float(x[row, pos])
                return (f"{name}: {value} on {int(bad.sum())} of {int(mask.sum())} agent tokens, first at row {row}, "
                        f"position {pos} (token id {int(td.get(KEYS.action)[row, pos])})")
    return None


def rollout_is_finite(td: TensorDictBase) -> bool:
    """The rollout's log-probs, values, rewards, advantages and correction weights are finite on valid
    tokens (:func:`nonfinite_in_rollout` finds nothing)."""
    return nonfinite_in_rollout(td) is None


def should_stop_early(cfg: Any, stats: dict[str, list[float]]) -> bool:
    """KL early stop on the approximate KL to the behaviour policy of the last minibatch."""
    if cfg.kl_early_stop == "none" or not stats.get("kl/policy_old"):
        return False
    factor = 1.5 if cfg.kl_early_stop == "target" else 2.0
    return stats["kl/policy_old"][-1] > factor * cfg.kl_target


def provenance_metrics(learner: Learner, td: TensorDictBase) -> dict[str, float]:
    """Where the rollout came from, against the learner now: :func:`staleness_metrics`
    (``rollout/staleness``: the updates between the weights that sampled its tokens and the learner's,
    0 when the actor samples with the learner's current weights; the one lag metric, in the unit of
    ``--max-staleness``) and, where the engine computed its log-probs,
    :func:`textrl.functional.mismatch_stats` of them against ``action_log_prob`` over the agent's
    tokens: ``rollout/logprob_gap`` and ``rollout/logprob_gap_max`` (mean and largest absolute
    difference: floating-point noise when both are the same weights, a lag's or an old policy's
    difference otherwise), ``rollout/logprob_kl`` (k3 estimate of KL(engine || learner)) and
    ``rollout/logprob_gap_fraction`` (the share of tokens whose ratio is off by more than 2x); where the
    actor checked the engine's weights (:meth:`textrl.agents.actor.Actor.check_weights`),
    ``rollout/weight_gap`` (the mean gap per token against a prefill of the weights it should hold,
    under its own top-k / top-p) and ``rollout/weight_gap_outside`` (the share of those tokens the
    prefill's filter drops); with a rollout correction, :func:`correction_metrics`."""
    out: dict[str, float] = {}
    if KEYS.policy_iteration in td.keys(include_nested=True):
        out.update(staleness_metrics(learner.iteration, td))
    generated = td.get(KEYS.generation_log_prob, None)
    behaviour = td.get(KEYS.proximal_log_prob, td.get(KEYS.action_log_prob, None))
    if generated is not None and behaviour is not None:
        stats = mismatch_stats(behaviour.float(), generated.float(), td.get(KEYS.mask))
        for name, key in (("abs_gap_mean", "logprob_gap"), ("abs_gap_max", "logprob_gap_max"),
                          ("kl_k3", "logprob_kl"), ("gap_fraction", "logprob_gap_fraction")):
            out[f"rollout/{key}"] = float(stats[name])
    tokens = td.get(KEYS.weight_gap_tokens, None)
    if tokens is not None and int(tokens.sum()):
        out["rollout/weight_gap"] = float(td.get(KEYS.weight_gap_sum).sum()) / int(tokens.sum())
        out["rollout/weight_gap_outside"] = float(td.get(KEYS.weight_gap_outside).sum()) / int(tokens.sum())
    return {**out, **correction_metrics(td)}


def staleness_metrics(iteration: int, td: TensorDictBase) -> dict[str, float]:
    """``rollout/staleness`` (the mean over the agent's tokens of the updates between the weights that
    sampled them, ``KEYS.policy_iteration``, and the learner's, ``iteration`` updates done) and
    ``rollout/staleness_max``; per token with partial rollouts (``KEYS.token_iteration``), else per
    row. 0 in the synchronous loop; at most ``max_staleness`` with asynchronous rollouts."""
    mask = td.get(KEYS.mask)
    per_token = td.get(KEYS.token_iteration, None)
    if per_token is None:
        per_token = td.get(KEYS.policy_iteration).unsqueeze(1).expand_as(mask)
    lag = (iteration - per_token)[mask].float()
    if lag.numel() == 0:
        return {}
    return {"rollout/staleness": float(lag.mean()), "rollout/staleness_max": float(lag.max())}


def correction_metrics(td: TensorDictBase) -> dict[str, float]:
    """With a rollout correction (``KEYS.correction_weight`` ``[B, T]``), over the agent's tokens:
    ``rollout/correction_weight_mean`` (the mean weight of the tokens it keeps) and
    ``rollout/correction_rejected_fraction`` (the share it rejects: weight 0); none without one."""
    weights = td.get(KEYS.correction_weight, None)
    if weights is None:
        return {}
    mask = td.get(KEYS.mask)  # [B, T]
    kept = kept_mask(mask, weights)  # [B, T]
    return {
        "rollout/correction_weight_mean": float(masked_mean(weights.float(), kept)),
        "rollout/correction_rejected_fraction": float(masked_mean((mask & ~kept).float(), mask)),
    }


def kl_monitors(actor: Actor, td: TensorDictBase) -> dict[str, float]:
    """``kl/collection`` (the rollout's behaviour log-probs) and ``kl/before_update`` (the policy
    now); none without a reference (:func:`textrl.agents.build.needs_reference`)."""
    if actor.reference is None or KEYS.ref_log_prob not in td.keys():
        return {}
    kl = kl_penalty(td.get(KEYS.action_log_prob), td.get(KEYS.ref_log_prob), kind=actor.config.kl_kind)
    return {"kl/collection": masked_mean(kl, td.get(KEYS.mask)).item(), "kl/before_update": actor.policy_ref_kl(td)}


def update_metrics(learner: Learner, actor: Actor, td: TensorDictBase, tally: UpdateTally) -> dict[str, float]:
    """The update's metrics: stats averaged over its steps, skip counts, learning rates, KL."""
    metrics: dict[str, float] = {}
    if learner.config.kl_after_update:
        metrics["kl/after_update"] = actor.policy_ref_kl(td)
    if KEYS.value_target in td.keys(include_nested=True) and learner.critic is not None:
        metrics["explained_variance"] = explained_variance(
            td.get(KEYS.state_value).squeeze(-1), td.get(KEYS.value_target).squeeze(-1), td.get(KEYS.mask)
        ).item()
    metrics.update(tally.metrics(learner.nonfinite_streak))
    metrics.update(learner.backend.learning_rates(learner))
    metrics["kl/coef"] = learner.kl_ctl.value
    return metrics


@dataclass
class UpdateTally:
    """What one update did: the stats of its good steps and how many it skipped."""

    stats: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    ratio_threshold_skips: int = 0
    nonfinite_skips: int = 0
    steps: int = 0
    """Optimiser steps applied (a step that left every micro-batch out is not one)."""
    epochs_run: int = 0
    early_stopped: bool = False
    rolled_back: bool = False
    """The update's steps left NaN/inf weights and were undone."""

    def add(self, step_stats: dict[str, float]) -> None:
        """One good step's stats (losses, ratios, gradient norms)."""
        for k, v in step_stats.items():
            self.stats[k].append(v)

    def skip_nonfinite(self, learner: Learner, cause: str) -> None:
        """One update skipped for NaN/inf (``cause``: what was not finite): counted here and in the
        learner's streak, the cause kept for the stop's message (``learner.nonfinite_cause``)."""
        self.nonfinite_skips += 1
        learner.nonfinite_streak += 1
        learner.nonfinite_cause = cause

    def roll_back(self, learner: Learner, streak: int) -> None:
        """The update's steps were undone (they left NaN/inf weights): the whole update counts as one
        skipped update, and the learner's streak is ``streak`` (the one before the update) plus one."""
        self.rolled_back = True
        self.nonfinite_skips = 1
        learner.nonfinite_streak = streak + 1
        learner.nonfinite_cause = "the update's steps left NaN/inf weights (rolled back)"

    def metrics(self, streak: int) -> dict[str, float]:
        """Stats averaged over the good steps (undone ones too: the losses and norms of the steps
        that were rolled back), and the counters."""
        out = {k: float(sum(v) / len(v)) for k, v in self.stats.items() if v}
        out["ppo/ratio_threshold_skips"] = float(self.ratio_threshold_skips)
        out["nonfinite/skipped_updates"] = float(self.nonfinite_skips)
        out["nonfinite/consecutive"] = float(streak)
        out["nonfinite/rolled_back"] = float(self.rolled_back)
        out["ppo/early_stopped"] = float(self.early_stopped)
        out["ppo/epochs_run"] = float(self.epochs_run)
        return out


__all__ = [
    "LossTerms", "Objective", "UpdateTally", "combined_micro_stats", "correction_metrics", "kl_monitors", "leaves_tokens_out", "loss_mask",
    "provenance_metrics", "micro_batch_loss", "nonfinite_in_rollout", "nonfinite_loss", "over_ratio_threshold",
    "rolled_back_if_nonfinite", "rollout_is_finite", "run_epochs", "skip_nonfinite_step", "total_loss", "update",
]
