"""The backend interface: how one run spreads an agent's training over its processes.

An agent (:class:`textrl.agents.base.PPOAgent`) computes losses; its :class:`Backend` owns the
rest of a training step, so the agent's update loop is the same on every backend:

- :meth:`Backend.prepare` makes an agent train under the backend: the same initial weights on
  every process, this process's sampling seed, the models wrapped (sharded, in an engine) and
  the optimisers built over what the backend trains;
- :meth:`Backend.backward` back-propagates one micro-batch's weighted loss (gradients
  accumulate until the step);
- :meth:`Backend.step` synchronises the gradients, clips them, steps every optimiser and
  scheduler and returns the pre-clip gradient norms; it returns ``None`` and steps nothing
  (gradients dropped) when a gradient is NaN/inf on any process; after a step it marks the
  weights written (:func:`textrl.core.versions.mark_written`), however the optimiser wrote them;
- :meth:`Backend.gathered` holds a model's full weights for a block (generation),
  :meth:`Backend.copy_weights` copies one model's weights into another (reference and
  old-policy refreshes);
- :meth:`Backend.model_state` / :meth:`Backend.load_model_state` and
  :meth:`Backend.optimizer_state` / :meth:`Backend.load_optimizer_state` save and restore
  full tensors (a collective where the backend gathers), so a checkpoint resumes under any
  backend of the same kind and any number of processes;
- :meth:`Backend.snapshot` / :meth:`Backend.restore` copy what one update changes on this
  process (its part of the trained weights, the optimiser and scheduler states) and put it back
  in place: an update whose steps left NaN/inf weights is rolled back. The agent's update copies
  into reused buffers instead (:meth:`Backend.stage_rollback` when the rollout is processed,
  :meth:`Backend.take_rollback` before the steps, :meth:`Backend.roll_back_nonfinite` after
  them; :meth:`Backend.rollback_metrics`, :meth:`Backend.rollback_seconds` what it costs;
  :mod:`textrl.parallel.rollback`);
- :meth:`Backend.weights_finite` and :meth:`Backend.end_of_run` are the trainer's checks.

Decisions that change control flow are taken on values shared by every process
(:class:`textrl.parallel.distributed.Distributed`), so every process runs the same collectives.

Implementations: :class:`textrl.parallel.single.SingleProcess`,
:class:`textrl.parallel.replicated.Replicated` (data parallel, gradients all-reduced),
:class:`textrl.parallel.fsdp.FSDP` (FSDP2) and :class:`textrl.parallel.zero.DeepSpeedZero`
(ZeRO stages 1-3). :func:`textrl.parallel.setup.setup_backend` picks one from the config.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any

import torch
from torch import Tensor, nn

from textrl.core.versions import mark_written
from textrl.parallel.distributed import Distributed
from textrl.parallel.fsdp_sharding import local
from textrl.parallel.rollback import OptimizerCopy, RollbackCopy, UpdateSnapshot, update_state


def trained_models(learner: Any) -> list[tuple[str, nn.Module]]:
    """``(role, model)`` of every model an optimiser steps: ``actor`` (the policy), ``critic``.
    ``learner``: what holds the trained models (:class:`textrl.agents.learner.Learner`, or an agent,
    whose ``policy`` and ``critic`` are its learner's)."""
    return [(role, model) for role, model in (("actor", learner.policy), ("critic", learner.critic)) if model is not None]


def trained_parameters(learner: Any) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every trained weight of ``learner``'s models, named as in the agent's ``state_dict``."""
    return [(f"{name}.{k}", p) for name, model in (("policy", learner.policy), ("critic", learner.critic))
            if model is not None for k, p in model.named_parameters() if p.requires_grad]


def param_groups(learner: Any) -> list[dict[str, Any]]:
    """The trained weights by model, each with its learning rate (``learner.config``): the actor's, then the critic's."""
    config = learner.config
    groups = [{"params": [p for p in learner.policy.parameters() if p.requires_grad], "lr": config.actor_lr}]
    if learner.critic is not None:
        groups.append({"params": [p for p in learner.critic.parameters() if p.requires_grad], "lr": config.critic_lr})
    return groups


def build_optimizers(learner: Any) -> None:
    """One AdamW (``config.optim``, :mod:`textrl.core.optim`; no weight decay) per trained model of
    ``learner`` (:class:`textrl.agents.learner.Learner`; an agent sets its learner's), over its weights
    as they are now (a backend that replaces the weights, e.g. by shards, calls this again), and their
    schedules: sets its ``actor_optimizer``, ``critic_optimizer`` (None without a critic),
    ``optimizers`` (those that exist) and ``schedulers``."""
    from textrl.core.optim import make_optimizer

    optim = getattr(learner.config, "optim", "adamw_torch")
    actor, *critic = (make_optimizer(optim, [group]) for group in param_groups(learner))
    learner.actor_optimizer = actor
    learner.critic_optimizer = critic[0] if critic else None
    learner.optimizers = [o for o in (learner.actor_optimizer, learner.critic_optimizer) if o is not None]
    learner.schedulers = [lr_scheduler(learner.config, opt, learner.total_updates) for opt in learner.optimizers]


def stepped_weights(learner: Any) -> list[Tensor]:
    """The trained weights as their readers hold them: each parameter (what the engines read) and,
    where it is another tensor, its local part (an FSDP shard, a ZeRO-3 partition: what the
    learner's version reads)."""
    out = []
    for _, param in trained_parameters(learner):
        part = local(param)
        out += [param] if part is param else [param, part]
    return out


def lr_scheduler(config: Any, optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning-rate schedule of ``optimizer`` over ``total_steps`` optimiser steps: linear
    warm-up over ``config.lr_warmup_steps``, then constant or cosine (``config.lr_schedule``)."""
    warmup = config.lr_warmup_steps
    cosine = config.lr_schedule == "cosine"

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if not cosine:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def restore_optimizer(optimizer: torch.optim.Optimizer, params: list[Tensor], saved: OptimizerCopy) -> None:
    """Put an :class:`OptimizerCopy` ``saved`` back into ``optimizer`` (state keyed by ``params``),
    tensors in place (their local part: FSDP's states are shards); a state created since is
    dropped, as before a first step."""
    for group, hyper in zip(optimizer.param_groups, saved.groups):
        group.update(copy.deepcopy(hyper))
    if len(params) != len(saved.state):
        raise ValueError(f"the snapshot holds the state of {len(saved.state)} parameters, the optimiser has "
                         f"{len(params)}; restore a snapshot into the agent it was taken from")
    for param, entry in zip(params, saved.state):
        if entry is None:
            optimizer.state.pop(param, None)
            continue
        own = optimizer.state[param]
        for key, value in entry.items():
            if isinstance(value, Tensor):
                local(own[key]).copy_(value)
            else:
                own[key] = copy.deepcopy(value)


def all_finite(tensors: list[Tensor]) -> bool:
    """Whether every value of ``tensors`` (on one device) is finite, with one host sync: the sum of
    each tensor (at least float32) is NaN/inf when one of its values is. Only when a sum is not
    finite (a NaN/inf value, or finite values so large that their sum overflows) is every value
    looked at, with a second sync."""
    if not tensors:
        return True
    sums = [t.sum(dtype=torch.promote_types(t.dtype, torch.float32)) for t in tensors]
    if bool(torch.stack(sums).isfinite().all()):
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


class Backend:
    """One run's way of training an agent over its processes (see the module docstring).

    Subclasses set ``name`` and override what differs; this base holds what every backend
    shares (learning rates, scheduler steps, the finite-weights query).
    """

    name = "single"
    partitions_weights = False
    """Each process holds a part of every weight: every forward is a collective, so every process
    takes part in generation and evaluation."""
    gathers_state = False
    """:meth:`model_state` is a collective: every process calls it, the main process writes."""

    def __init__(self, dist: Distributed | None = None, device: torch.device | str = "cpu") -> None:
        self.dist = dist or Distributed(device)
        self.device = torch.device(device)
        self.rollback_copy = RollbackCopy()
        """The buffers an update's rollback copies into, reused from one update to the next."""

    @property
    def is_main(self) -> bool:
        """This process writes files and logs (rank 0)."""
        return self.dist.is_main

    # -- preparing ------------------------------------------------------------------------------
    def prepare(self, agent: Any) -> None:
        """Train ``agent`` under this backend (on every process, once, before training): the agent
        checks it can (``check_backend``), then takes it (``agent.backend = self``; the trainer then
        builds the agent's actor for it, where the generation engine is chosen)."""
        agent.check_backend(self)
        self.invalidate_rollback()
        agent.backend = self

    # -- one optimiser step -----------------------------------------------------------------------
    def backward(self, loss: Tensor) -> None:
        """Back-propagate a micro-batch's (weighted) ``loss``; gradients accumulate until :meth:`step`."""
        loss.backward()

    def step(self, agent: Any) -> dict[str, float] | None:
        """Clip and apply the accumulated gradients (:meth:`apply_step`); return ``grad_norm/<role>``
        (pre-clip), or None when nothing was stepped (a NaN/inf gradient).

        After a step it applied, the weights it wrote are marked written
        (:func:`textrl.core.versions.mark_written` of :func:`stepped_weights`): whatever wrote them
        (torch's AdamW in place, DeepSpeed through ``.data``, bitsandbytes' kernels through their
        memory), every reader of their version (the learner's, the actor's caches, an engine's own
        copy) sees the step. The one place a step is stated; a subclass overrides :meth:`apply_step`.
        """
        norms = self.apply_step(agent)
        if norms is not None:
            mark_written(stepped_weights(agent))
        return norms

    def apply_step(self, agent: Any) -> dict[str, float] | None:
        """:meth:`step`'s work: synchronise the gradients, clip them per model, step every optimiser
        and scheduler; ``grad_norm/<role>`` (pre-clip). Returns None, steps nothing and drops the
        gradients when a norm is NaN/inf (the norms are of synchronised gradients, so every process
        decides alike)."""
        self.sync_gradients(agent)
        max_norm = agent.config.max_grad_norm if agent.config.max_grad_norm > 0 else math.inf
        norms = {}
        for role, model in trained_models(agent):
            params = [p for p in model.parameters() if p.grad is not None]
            if params:
                norms[f"grad_norm/{role}"] = self.norm_value(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if not all(math.isfinite(v) for v in norms.values()):
            self.zero_grad(agent)
            return None
        for optimizer, scheduler in zip(agent.optimizers, agent.schedulers):
            optimizer.step()
            scheduler.step()
        return norms

    def sync_gradients(self, agent: Any) -> None:
        """Make every process's accumulated gradients the same (nothing to do in one process)."""

    def norm_value(self, norm: Tensor) -> float:
        """A norm ``clip_grad_norm_`` returned, as a float."""
        return float(norm)

    def zero_grad(self, agent: Any) -> None:
        """Drop the accumulated gradients (before a minibatch, and after a skipped step)."""
        for optimizer in agent.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def learning_rates(self, agent: Any) -> dict[str, float]:
        """``lr/actor`` (and ``lr/critic``) as the schedulers set them now."""
        rates = {"lr/actor": agent.actor_optimizer.param_groups[0]["lr"]}
        if agent.critic_optimizer is not None:
            rates["lr/critic"] = agent.critic_optimizer.param_groups[0]["lr"]
        return rates

    # -- weights for generation and copies ----------------------------------------------------------
    def gathered(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """``model``'s full weights on this process for the block (generation); a no-op when held."""
        return contextlib.nullcontext()

    def copy_weights(self, dst: nn.Module, src: nn.Module) -> None:
        """``dst`` takes ``src``'s weights (same architecture): reference / old-policy refresh."""
        dst.load_state_dict(src.state_dict())

    def trained_weights(self, model: nn.Module, keep: bool) -> dict[str, Tensor]:
        """``model``'s trained weights (``requires_grad``) whole, as detached copies on the CPU where
        ``keep``, ``{}`` elsewhere; every process calls where the backend partitions them (a gather
        per tensor, one tensor whole at a time). What an actor handed the weights whole samples with
        (:class:`textrl.training.async_training.DealtRollouts`)."""
        if not keep:
            return {}
        return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters() if p.requires_grad}

    # -- full state: save and restore -------------------------------------------------------------
    def model_state(self, agent: Any) -> dict[str, Tensor]:
        """Every weight of the agent's models (policy, reference, critic, snapshots), full tensors."""
        return nn.Module.state_dict(agent)

    def load_model_state(self, agent: Any, state: dict[str, Tensor], strict: bool = True,
                         assign: bool = False) -> Any:
        """Copy :meth:`model_state`'s output into the agent's models; ``nn.Module``'s result."""
        return nn.Module.load_state_dict(agent, state, strict=strict, assign=assign)

    def optimizer_state(self, agent: Any) -> list[dict[str, Any]]:
        """Each optimiser's state (a collective where the backend gathers)."""
        return [optimizer.state_dict() for optimizer in agent.optimizers]

    def load_optimizer_state(self, agent: Any, states: list[dict[str, Any]]) -> None:
        """Restore :meth:`optimizer_state`'s output."""
        for optimizer, state in zip(agent.optimizers, states):
            optimizer.load_state_dict(state)

    # -- rolling an update back --------------------------------------------------------------------
    def optimizer_parameters(self, agent: Any) -> list[list[Tensor]]:
        """What each optimiser of ``agent`` steps and keys its state by: its parameters (the trained
        weights; FSDP: their shards, as ``DTensor``), in order."""
        return [[p for group in optimizer.param_groups for p in group["params"]] for optimizer in agent.optimizers]

    def updated_tensors(self, agent: Any) -> list[Tensor]:
        """Every tensor an optimiser step writes on this process, besides the optimisers' state: the
        local part of each of :meth:`optimizer_parameters`."""
        return [local(p) for params in self.optimizer_parameters(agent) for p in params]

    def snapshot(self, agent: Any, device: torch.device | str = "cpu") -> UpdateSnapshot:
        """A copy, in new tensors on ``device``, of what an update changes on this process:
        :meth:`updated_tensors`, every optimiser's state and hyperparameters, every scheduler's
        state. Local: no collective; complete when it returns.

        Costs a copy of the trained weights and of the optimiser state (AdamW: two moments), this
        process's part of them. The KL controller is not in it (it moves at collection, not in the
        update), nor the frozen reference and old-policy snapshot (refreshed after the update,
        from checked weights). The agent's update does not call this: it reuses the buffers of
        :attr:`rollback_copy` (:meth:`stage_rollback`, :meth:`take_rollback`).
        """
        with torch.no_grad():
            state = update_state(self, agent)
            return state.snapshot_of([t.to(device, copy=True) for t in state.tensors])

    def restore(self, agent: Any, snapshot: UpdateSnapshot) -> None:
        """Put :meth:`snapshot`'s (or :meth:`take_rollback`'s) copy back, in place: the weights,
        optimiser and scheduler states are bit for bit those of the copy. Every process restores
        its own (the decision to is shared). A copy staged for the next update is stale after it."""
        self.rollback_copy.invalidate()
        with torch.no_grad():
            tensors = self.updated_tensors(agent)
            if [t.shape for t in tensors] != [t.shape for t in snapshot.tensors]:
                raise ValueError("the snapshot's tensors do not match the agent's trained weights; "
                                 "restore a snapshot into the agent it was taken from")
            for tensor, saved in zip(tensors, snapshot.tensors):
                tensor.copy_(saved)
            for optimizer, params, saved in zip(agent.optimizers, self.optimizer_parameters(agent), snapshot.optimizers):
                restore_optimizer(optimizer, params, saved)
        for scheduler, state in zip(agent.schedulers, snapshot.schedulers):
            scheduler.load_state_dict(copy.deepcopy(state))

    # -- the update's rollback guard (nonfinite_weights='rollback') ---------------------------------
    def stage_rollback(self, agent: Any) -> None:
        """Start the rollback's copy for ``agent``'s next update (``nonfinite_weights='rollback'``;
        nothing otherwise): the agent calls it when it processes a rollout, so that on CUDA the
        copy overlaps the rollout's forwards (:class:`textrl.parallel.rollback.RollbackCopy`)."""
        if agent.config.nonfinite_weights == "rollback":
            self.rollback_copy.stage(self, agent)

    def take_rollback(self, agent: Any) -> UpdateSnapshot:
        """The copy the update about to run rolls back to: the staged one if nothing it copies
        changed since :meth:`stage_rollback`, else one made now, in the reused buffers of
        :attr:`rollback_copy` (valid until the next :meth:`stage_rollback`). On CUDA the current
        stream waits for it on the device (no host sync) before anything queued after."""
        return self.rollback_copy.take(self, agent)

    def roll_back_nonfinite(self, agent: Any, snapshot: UpdateSnapshot) -> bool:
        """After an update's steps: when a trained weight is NaN/inf on any process (a shared
        decision), :meth:`restore` ``snapshot`` on this one and return True."""
        with self.rollback_copy.timed():
            if self.weights_finite(agent):
                return False
            self.restore(agent, snapshot)
            return True

    def invalidate_rollback(self) -> None:
        """The weights or optimiser state were replaced or loaded: a staged copy is stale."""
        self.rollback_copy.invalidate()

    def rollback_metrics(self) -> dict[str, float]:
        """``guard/bytes``: bytes the rollback's copy holds on this process (0 with
        ``nonfinite_weights='stop'``). Deterministic, like every update metric; the guard's
        seconds are :meth:`rollback_seconds`."""
        return {"guard/bytes": float(self.rollback_copy.nbytes)}

    def rollback_seconds(self) -> float:
        """Host wall-clock seconds the rollback guard's calls took since the last call of this:
        staging, taking the copy, the finiteness check after the steps, a restore (on CUDA that
        check's one sync also waits for the steps still queued)."""
        guard = self.rollback_copy
        seconds, guard.seconds = guard.seconds, 0.0
        return seconds

    # -- the trainer's checks -----------------------------------------------------------------------
    def weights_finite(self, agent: Any) -> bool:
        """Every trained weight is finite on every process (its own shards where partitioned), read
        back with one host sync for all of them (:func:`all_finite`). The frozen models need no
        look: the reference and old-policy snapshots only ever take copies of weights checked
        here, so checking after each update costs one pass over the trained weights, not every
        model's."""
        finite = all_finite([local(p).detach() for _, p in trained_parameters(agent)])
        return not self.dist.any(not finite)

    def end_of_run(self, agent: Any) -> dict[str, Any]:
        """Summary entries that check the run's parallelism (none in one process)."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(processes={self.dist.world_size}, device={self.device})"


__all__ = ["Backend", "OptimizerCopy", "RollbackCopy", "UpdateSnapshot", "all_finite", "build_optimizers", "lr_scheduler",
           "param_groups", "restore_optimizer", "stepped_weights", "trained_models", "trained_parameters"]
