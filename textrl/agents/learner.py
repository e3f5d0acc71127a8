"""The learner: what an update changes.

A :class:`Learner` owns the trained weights (the policy and the critic), the optimisers and their
schedules, the KL controller the estimator feeds, the counters (iterations, the streak of skipped
updates) and the weights' version (:class:`textrl.core.versions.VersionCounter`: it moves with every
optimiser step). The agent's ``estimate`` and ``loss`` (the hooks a subclass writes) are its
objective: :func:`process_rollout` runs the estimator over a rollout the actor evaluated, and
:func:`textrl.agents.update.update` the epochs of the loss. How the backward, the step and the
rollback run over processes is the backend's (:mod:`textrl.parallel`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import Tensor, nn

from textrl.agents.forwards import Forwards
from textrl.core.timing import timed
from textrl.core.versions import VersionCounter
from textrl.functional import masked_sum, mismatch_weights, next_valid
from textrl.functional.mismatch import (
    REJECTION_WARNING_ITERATIONS,
    rejected_share,
    rejection_warning,
)
from textrl.keys import KEYS
from textrl.parallel.base import build_optimizers, trained_parameters
from textrl.parallel.fsdp_sharding import local


@dataclass
class Learner:
    """What an update changes (see the module docstring). ``policy`` and ``critic`` (None without one)
    are the trained models, ``forwards`` the run's forwards under its precision (a loss's), ``backend``
    the run's processes, ``kl_ctl`` the KL controller, ``total_updates`` the optimiser steps the
    learning-rate schedules span. The optimisers are built over the weights as they are
    (:func:`textrl.parallel.base.build_optimizers`); a backend that replaces the weights builds
    them again."""

    config: Any
    policy: nn.Module
    critic: nn.Module | None
    forwards: Forwards
    backend: Any
    kl_ctl: Any
    total_updates: int
    iteration: int = 0
    """Updates done (the reference and old-policy refreshes count them)."""
    nonfinite_streak: int = 0
    """Consecutive skipped (NaN/inf) updates; the trainer stops at ``max_nonfinite_updates``."""
    nonfinite_cause: str | None = None
    """What the last skipped update saw not finite (:func:`textrl.agents.update.nonfinite_in_rollout`,
    :func:`~textrl.agents.update.nonfinite_loss`): the stop's message names it."""
    rejected_shares: list[float] = field(default_factory=list, repr=False)
    """The rollout correction's rejected share of the agent's tokens in the last rollouts, oldest
    first (:func:`watch_rejections`)."""
    rejection_warned: bool = False
    """Whether the correction said it rejects nearly everything (once a run: nothing is counted after)."""
    actor_optimizer: Any = field(default=None, repr=False)
    critic_optimizer: Any = field(default=None, repr=False)
    optimizers: list[Any] = field(default_factory=list, repr=False)
    schedulers: list[Any] = field(default_factory=list, repr=False)
    generator: torch.Generator | None = field(default=None, repr=False)
    """The minibatch shuffles' generator: None, the global RNG (the synchronous loop); a private one
    with ``max_staleness`` > 0, whose actor draws from the global RNG in its own thread."""

    def __post_init__(self) -> None:
        self._version = VersionCounter(lambda: [local(p) for _, p in trained_parameters(self)])
        build_optimizers(self)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, weight)`` of the models it trains, named as in the agent's ``state_dict``
        (``policy.*``, ``critic.*``), as ``nn.Module.named_parameters`` gives them (a backend's step
        reads the gradients through it)."""
        for role, model in (("policy", self.policy), ("critic", self.critic)):
            if model is not None:
                for name, param in model.named_parameters():
                    yield f"{role}.{name}", param

    def parameters(self) -> Iterator[nn.Parameter]:
        """The weights of :meth:`named_parameters`."""
        return (param for _, param in self.named_parameters())

    @property
    def version(self) -> int:
        """The trained weights' version now: it moves with each optimiser step (the update reads it
        after each), a restore and a load (:class:`textrl.core.versions.VersionCounter`)."""
        return self._version.now()

    @property
    def device(self) -> torch.device:
        return self.forwards.precision.device


def learner_attribute(name: str, doc: str) -> property:
    """A property of the agent that reads and writes its learner's ``name`` (the optimisers, counters
    and KL controller a backend or a checkpoint sets through the agent)."""
    return property(lambda agent: getattr(agent.learner, name),
                    lambda agent, value: setattr(agent.learner, name, value), doc=doc)


Estimate = Callable[[TensorDictBase], None]
"""An agent's estimator: writes ``("next","reward")``, ``advantage`` and ``value_target`` into a rollout."""
ReferenceKL = Callable[..., Tensor]
"""An agent's per-token KL to the reference, ``(logp [B, T], td, kind=) -> [B, T]``."""


@torch.no_grad()
def process_rollout(actor: Any, learner: Learner, td: TensorDictBase, *, estimate: Estimate,
                    reference_kl: ReferenceKL, keep_graph: bool = False,
                    timings: dict[str, float] | None = None) -> TensorDictBase:
    """:meth:`PPOAgent.process_rollout <textrl.agents.base.PPOAgent.process_rollout>`: the actor's
    forwards (behaviour and reference log-probs, values), the rollout correction's weights
    (:func:`correct_rollout`), then the estimator and the KL controller."""
    learner.backend.stage_rollback(learner)  # the update's rollback copy, overlapping the forwards on CUDA
    if KEYS.task_reward not in td.keys(include_nested=True):
        td.set(KEYS.task_reward, td.get(KEYS.reward).clone())
    if KEYS.score not in td.keys():
        td.set(KEYS.score, td.get(KEYS.reward).squeeze(-1).sum(1).float())
    with timed(timings, "forward", learner.device):
        td.update(actor.evaluate(td, keep_graph=keep_graph))
    if learner.config.old_logprobs == "engine":
        bypass_recompute(td, learner.config)
    correct_rollout(td, learner.config)
    watch_rejections(learner, td)
    with timed(timings, "advantages", learner.device):
        mask = td.get(KEYS.mask)
        if actor.critic is not None:
            state_values = torch.where(mask, td.get(KEYS.state_value).squeeze(-1), 0.0)  # [B, T]
            next_values = next_valid(state_values, mask)  # V(s_t+1): at the next agent token, 0 after the last
            td.set(KEYS.state_value, state_values.unsqueeze(-1))
            td.set(KEYS.next_state_value, next_values.unsqueeze(-1))
        estimate(td)
        if actor.reference is not None:  # without one the coefficient is a fixed 0
            kl = reference_kl(td.get(KEYS.action_log_prob), td, kind="k1")
            dist = learner.backend.dist
            seq_kl = dist.mean({"kl": masked_sum(kl, mask, dim=1).mean().item()})["kl"]
            learner.kl_ctl.update(seq_kl, td.shape[0] * dist.world_size)
    return td


def engine_logprobs(td: TensorDictBase, config: Any, reads: str, instead: str) -> Tensor:
    """The engine's log-probs of the rollout (``KEYS.generation_log_prob`` ``[B, T]``) that the setting
    ``reads`` (its text, e.g. ``"rollout_correction='tis' compares ..."``) needs; a rollout without them
    is refused, naming ``instead`` (the setting that needs none): nothing is skipped in silence."""
    engine = td.get(KEYS.generation_log_prob, None)
    if engine is None:
        raise ValueError(
            f"{reads}, and this rollout has none (generation_engine={config.generation_engine!r} computed none): "
            f"sample with an engine that computes them (every built-in one does), or use {instead}"
        )
    return engine


def bypass_recompute(td: TensorDictBase, config: Any) -> None:
    """``old_logprobs='engine'`` (the bypass objective): the engine's log-probs of the weights that drew
    the tokens (``KEYS.generation_log_prob``) become the ratio's denominator (``KEYS.action_log_prob``);
    the learner's prefill stays as ``KEYS.proximal_log_prob`` for the mismatch metrics. A rollout
    without the engine's log-probs is refused (:func:`engine_logprobs`)."""
    engine = engine_logprobs(td, config, "old_logprobs='engine' takes the engine's log-probs as the behaviour "
                             "policy's", "--old-logprobs recompute")
    td.set(KEYS.proximal_log_prob, td.get(KEYS.action_log_prob))
    td.set(KEYS.action_log_prob, engine.clone())


def correct_rollout(td: TensorDictBase, config: Any) -> None:
    """Write the rollout correction's weights ``KEYS.correction_weight`` float ``[B, T]``, once per
    rollout: :func:`textrl.functional.mismatch_weights` of ``config.rollout_correction`` (bounds
    ``config.rollout_correction_bounds()``) from the learner's behaviour log-probs
    (``KEYS.action_log_prob``) against the engine's (``KEYS.generation_log_prob``) over the agent's
    tokens. Nothing with ``'none'`` (a stale weight is dropped). A rollout without the engine's
    log-probs is refused: the correction is never skipped in silence."""
    kind = config.rollout_correction
    if kind == "none":
        td.pop(KEYS.correction_weight, None)
        return
    engine = engine_logprobs(td, config, f"rollout_correction={kind!r} compares the engine's log-probs with the "
                             "learner's", "--rollout-correction none")  # [B, T]
    weights = mismatch_weights(kind, td.get(KEYS.action_log_prob), engine, td.get(KEYS.mask),
                               **config.rollout_correction_bounds())
    td.set(KEYS.correction_weight, weights)


def watch_rejections(learner: Learner, td: TensorDictBase) -> None:
    """With a rollout correction, warn once in one line when it rejected nearly every agent token in
    several consecutive rollouts (:func:`textrl.functional.mismatch.rejection_warning`); the share is
    averaged over the processes (one collective per rollout until it has warned)."""
    weights = td.get(KEYS.correction_weight, None)  # [B, T], None without a correction
    if weights is None or learner.rejection_warned:
        return
    share = float(rejected_share(weights, td.get(KEYS.mask)))
    share = learner.backend.dist.mean({"rejected": share})["rejected"]
    learner.rejected_shares = [*learner.rejected_shares, share][-REJECTION_WARNING_ITERATIONS:]
    config = learner.config
    message = rejection_warning(config.rollout_correction, config.rollout_correction_bounds(), learner.rejected_shares)
    if message is not None:
        learner.rejection_warned = True
        warnings.warn(message, stacklevel=2)


__all__ = ["Estimate", "Learner", "ReferenceKL", "bypass_recompute", "correct_rollout", "engine_logprobs", "learner_attribute", "process_rollout", "watch_rejections"]
