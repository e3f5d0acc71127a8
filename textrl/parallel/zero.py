"""DeepSpeed ZeRO stages 1-3: one engine over every model of the agent (:mod:`textrl.parallel.deepspeed_engine` does the work).

The engine owns one AdamW with a parameter group per trained model (actor, then critic, each
with its learning rate), the way TRL wraps policy and value model together. Stage 1 partitions
the AdamW states, stage 2 the gradients too (reduced inside the backward), stage 3 the weights
too. ``engine.step`` clips the *joint* actor + critic norm (``grad_norm/total``) and skips the
step when a gradient is NaN/inf on any process (DeepSpeed's overflow check).

DeepSpeed writes the weights through ``.data`` (its step's copy of the float32 masters into them,
textrl's loads and stage-3 copies): ``_version`` does not move, so each such write is marked
(:func:`textrl.core.versions.mark_written`; the step's by :meth:`~textrl.parallel.Backend.step`, the
others where they write), and the learner's version, the actor's caches and the engines that hold
their own copy of the weights (the ``vllm`` engines) see it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from textrl.parallel import deepspeed_engine
from textrl.parallel.base import lr_scheduler, param_groups, trained_parameters
from textrl.parallel.fsdp import _prefixed, weights_held
from textrl.parallel.fsdp_sharding import local
from textrl.parallel.replicated import Replicated


class DeepSpeedZero(Replicated):
    """ZeRO ``stage`` (1, 2 or 3); ``zero_section`` adds knobs of a DeepSpeed config's
    ``zero_optimization`` section (bucket sizes, ...)."""

    name = "zero"
    gathers_state = True

    def __init__(self, dist: Any, device: Any, stage: int, zero_section: dict[str, Any] | None = None) -> None:
        super().__init__(dist, device)
        self.stage = stage
        self.zero_section = zero_section
        self.engine: Any = None
        self._backwards_pending = 0

    @property
    def partitions_weights(self) -> bool:  # type: ignore[override]
        """Stage 3 partitions the weights themselves."""
        return self.stage == 3

    def prepare(self, agent: Any) -> None:
        """One engine over the agent's models and one AdamW with a group per trained model
        (after :class:`Replicated`'s broadcast and seeding)."""
        if agent.backend.gathers_state:
            raise RuntimeError(f"{type(agent).__name__} is already sharded or under DeepSpeed")
        super().prepare(agent)
        optimizer = torch.optim.AdamW(param_groups(agent), weight_decay=0.0)
        agent.zero_grad(set_to_none=True)  # DeepSpeed would add leftover gradients (e.g. of a warm-up) to the first step
        models = nn.ModuleDict(dict(agent.named_children()))  # the same modules, in one engine
        hidden = getattr(getattr(agent.policy, "config", None), "hidden_size", None)
        config = deepspeed_engine.deepspeed_config(self.stage, agent.config.max_grad_norm, self.zero_section, hidden_size=hidden)
        self.engine = deepspeed_engine.initialize(models, optimizer, config)
        agent.actor_optimizer, agent.critic_optimizer = optimizer, None  # both groups; DeepSpeed steps it
        agent.optimizers = [optimizer]
        agent.schedulers = [lr_scheduler(agent.config, optimizer, agent.total_updates)]

    def backward(self, loss: Tensor) -> None:
        """``engine.backward`` (stages 2, 3 reduce inside it: every process runs the same backwards)."""
        deepspeed_engine.backward(self.engine, loss)
        self._backwards_pending += 1

    def apply_step(self, agent: Any) -> dict[str, float] | None:
        """One engine step: ``grad_norm/total`` (the joint pre-clip norm), None when DeepSpeed
        skipped it for a NaN/inf gradient (it drops the gradients itself). The engine copies its
        float32 masters into the weights through ``.data``, which autograd's counter does not see:
        :meth:`~textrl.parallel.Backend.step` marks them written after it."""
        self._backwards_pending = 0
        self.engine.step()
        if not self.engine.was_step_applied():
            return None
        for scheduler in agent.schedulers:
            scheduler.step()
        return {"grad_norm/total": float(self.engine.get_global_grad_norm())}

    def learning_rates(self, agent: Any) -> dict[str, float]:
        """The AdamW's groups: the actor's, then the critic's."""
        groups = agent.actor_optimizer.param_groups
        rates = {"lr/actor": groups[0]["lr"]}
        if len(groups) > 1:
            rates["lr/critic"] = groups[1]["lr"]
        return rates

    def gathered(self, model: nn.Module):
        return deepspeed_engine.gathered(model)

    def trained_weights(self, model: nn.Module, keep: bool) -> dict[str, Tensor]:
        if self.stage == 3:
            return deepspeed_engine.trained_weights(model, keep)
        return super().trained_weights(model, keep)

    def copy_weights(self, dst: nn.Module, src: nn.Module) -> None:
        if self.stage == 3:
            deepspeed_engine.copy_weights(dst, src)
        else:
            super().copy_weights(dst, src)

    def model_state(self, agent: Any) -> dict[str, Tensor]:
        """Full CPU tensors on the main process (``{}`` elsewhere); a collective under stage 3."""
        return {f"{name}.{k}": v for name, model in agent.named_children()
                for k, v in deepspeed_engine.full_model_state(model, self.is_main).items()}

    def load_model_state(self, agent: Any, state: dict[str, Tensor], strict: bool = True,
                         assign: bool = False) -> None:
        """Weights and DeepSpeed's float32 master copies of the trained ones."""
        for name, model in agent.named_children():
            deepspeed_engine.load_full_model_state(model, _prefixed(state, name))

    def optimizer_state(self, agent: Any) -> list[dict[str, Any]]:
        """The AdamW state as full CPU tensors keyed by parameter name (a collective)."""
        return [deepspeed_engine.full_optimizer_state(trained_parameters(agent), self.engine, self.is_main)]

    def load_optimizer_state(self, agent: Any, states: list[dict[str, Any]]) -> None:
        deepspeed_engine.load_full_optimizer_state(trained_parameters(agent), self.engine, states[0])

    def optimizer_parameters(self, agent: Any) -> list[list[Tensor]]:
        """The engine's AdamW steps this process's float32 master partitions, one per parameter group
        (stage 3: per sub-group; :func:`textrl.parallel.deepspeed_engine.flat_partitions`), and keys its state by them."""
        return [deepspeed_engine.flat_partitions(self.engine)]

    def updated_tensors(self, agent: Any) -> list[Tensor]:
        """The float32 master partitions, then the weights DeepSpeed copies them into: each full
        weight (stages 1, 2), or this process's partition of it (stage 3). A snapshot of both and
        of the AdamW state restores the engine exactly."""
        return super().updated_tensors(agent) + [local(p) for _, p in trained_parameters(agent)]

    def restore(self, agent: Any, snapshot: Any) -> None:
        """:meth:`Backend.restore` after every gathered copy of a weight is freed (stage 3 keeps the
        small ones gathered from one step to the next; DeepSpeed's ``empty_partition_cache``, local):
        the next forward gathers the restored partitions. Nothing more below stage 3."""
        if self.stage == 3:
            self.engine.empty_partition_cache()
        super().restore(agent, snapshot)

    def end_of_run(self, agent: Any) -> dict[str, Any]:
        """Stage 3: the share of weights held; stages 1, 2: the checksum of the replicated weights."""
        return {"weights_held_per_process": weights_held(agent)} if self.stage == 3 else super().end_of_run(agent)


__all__ = ["DeepSpeedZero"]
