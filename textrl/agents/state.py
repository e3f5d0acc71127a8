"""An agent's state beyond what ``nn.Module`` holds, for checkpoints and resume: the learner's
optimisers, schedulers, KL controller and counters (:func:`agent_state` / :func:`load_agent_state`),
the weights with the reference following this run's settings (:func:`load_weights`), and the
settings a resume changed (:func:`take_changed_settings`). :class:`~textrl.agents.base.PPOAgent`'s
``state_dict`` / ``load_state_dict`` / ``load_weights_state`` call these with its learner
(:class:`textrl.agents.learner.Learner`) or its models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from textrl.parallel.base import param_groups

if TYPE_CHECKING:
    from textrl.agents.learner import Learner

SCHEDULE_SETTINGS = frozenset({"actor_lr", "critic_lr", "lr_schedule", "lr_warmup_steps", "iterations",
                               "ppo_epochs", "num_minibatches"})
"""Settings the learning-rate schedule is built from (its length counts optimiser steps)."""


def agent_state(learner: Learner) -> dict[str, Any]:
    """Everything but model weights: optimisers (full tensors, as the backend saves them),
    schedulers, KL controller, counters. A collective where the backend gathers."""
    return {
        "optimizers": learner.backend.optimizer_state(learner),
        "schedulers": [s.state_dict() for s in learner.schedulers],
        "kl_ctl": learner.kl_ctl.state_dict(),
        "iteration": learner.iteration,
    }


def load_agent_state(learner: Learner, state: dict[str, Any]) -> None:
    """Restore :func:`agent_state`'s output."""
    learner.backend.invalidate_rollback()
    learner.backend.load_optimizer_state(learner, state["optimizers"])
    for sch, s in zip(learner.schedulers, state["schedulers"]):
        sch.load_state_dict(s)
    learner.kl_ctl.load_state_dict(state["kl_ctl"])
    learner.iteration = int(state["iteration"])


def take_changed_settings(learner: Learner, names: set[str]) -> None:
    """After a resume that changed the settings ``names``: the restored state holds the
    checkpoint's learning rates and KL coefficient, so set the config's (each learning rate
    where the schedule puts it at this step; the KL controller, adaptive or not, continues
    from the new ``kl_coef``). Every other setting is read from the config where it is used."""
    learner.backend.invalidate_rollback()
    if names & SCHEDULE_SETTINGS:
        rates = iter(group["lr"] for group in param_groups(learner))  # the actor's, then the critic's
        for scheduler in learner.schedulers:  # one per optimiser, or one over both groups (ZeRO)
            scheduler.base_lrs = [next(rates) for _ in scheduler.optimizer.param_groups]
            for group, lr, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs,
                                         scheduler.lr_lambdas):
                group["initial_lr"] = lr
                group["lr"] = lr * factor(scheduler.last_epoch)
    if "kl_coef" in names:
        learner.kl_ctl.value = float(learner.config.kl_coef)


def load_weights(models: nn.Module, backend: Any, state: dict[str, Tensor], *, keeps_reference: bool,
                 strict: bool = True, assign: bool = False) -> Any:
    """Restore ``weights_state``'s output into ``models`` (the agent's models: policy, ``ref_policy``,
    critic, snapshots) through ``backend`` (every process passes the same ``state``).

    The reference follows this run's settings (:func:`textrl.agents.build.needs_reference`): a
    checkpoint's reference is left out when the agent keeps none (resumed with ``kl_coef`` 0), and
    an agent that keeps one keeps the one it built, the starting policy, when the checkpoint holds
    none (its run had ``kl_coef`` 0 and kept no reference)."""
    backend.invalidate_rollback()
    prefix = "ref_policy."
    if not keeps_reference:
        state = {k: v for k, v in state.items() if not k.startswith(prefix)}
    elif state and not any(k.startswith(prefix) for k in state):
        own = [k for k in nn.Module.state_dict(models) if k.startswith(prefix)]
        if own and backend.gathers_state:
            raise ValueError("the checkpoint holds no reference model (its run had kl_coef=0) and this "
                             f"{backend.name} run cannot rebuild one from sharded weights: resume with "
                             "--kl-coef 0, or without sharding")
        state = {**state, **{k: v for k, v in nn.Module.state_dict(models).items() if k.startswith(prefix)}}
    return backend.load_model_state(models, state, strict=strict, assign=assign)


__all__ = ["SCHEDULE_SETTINGS", "agent_state", "load_agent_state", "load_weights", "take_changed_settings"]
