"""FSDP2: every model of the agent split over the processes (:mod:`textrl.parallel.fsdp_sharding` does the work).

Each decoder layer is one ``fully_shard`` unit: its weights are all-gathered for its forward and
backward and freed after, and gradients are reduce-scattered (averaged) inside the backward, so
each process holds ``1/N`` of every weight, gradient and AdamW state. The step clips the norms of
the sharded gradients (global norms); generation gathers the policy once per block; checkpoints
gather full tensors to the main process.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from textrl.parallel import fsdp_sharding
from textrl.parallel.base import build_optimizers, trained_models
from textrl.parallel.replicated import Replicated


class FSDP(Replicated):
    """FSDP2 over every process; ``reshard_after_forward=False`` keeps gathered layers from the
    forward to the backward (ZeRO-2-like: faster, more memory). The step's gradient sync is
    :class:`Replicated`'s, which leaves the shards alone (the backward reduce-scattered them)."""

    name = "fsdp"
    partitions_weights = True
    gathers_state = True

    def __init__(self, dist: Any, device: Any, reshard_after_forward: bool = True) -> None:
        super().__init__(dist, device)
        self.reshard_after_forward = reshard_after_forward

    def prepare(self, agent: Any) -> None:
        """Shard every model of ``agent`` (after :class:`Replicated`'s broadcast and seeding) and
        rebuild its optimisers over the shards."""
        if agent.backend.gathers_state:
            raise RuntimeError(f"{type(agent).__name__} is already sharded or under DeepSpeed")
        super().prepare(agent)
        mesh = fsdp_sharding.device_mesh(self.device, self.dist.world_size)
        for _, model in agent.named_children():
            fsdp_sharding.shard_model(model, mesh, self.reshard_after_forward)
        build_optimizers(agent)

    def norm_value(self, norm: Tensor) -> float:
        """The global norm of sharded gradients (a ``DTensor``) as a float."""
        return fsdp_sharding.to_float(norm)

    def gathered(self, model: nn.Module):
        return fsdp_sharding.gathered(model, self.reshard_after_forward)

    def trained_weights(self, model: nn.Module, keep: bool) -> dict[str, Tensor]:
        return fsdp_sharding.trained_weights(model, keep)

    def model_state(self, agent: Any) -> dict[str, Tensor]:
        """Full CPU tensors on the main process (``{}`` elsewhere); every process must call."""
        return {f"{name}.{k}": v for name, model in agent.named_children()
                for k, v in fsdp_sharding.full_model_state(model).items()}

    def load_model_state(self, agent: Any, state: dict[str, Tensor], strict: bool = True,
                         assign: bool = False) -> None:
        for name, model in agent.named_children():
            fsdp_sharding.load_full_model_state(model, _prefixed(state, name))

    def optimizer_state(self, agent: Any) -> list[dict[str, Any]]:
        """Full CPU tensors keyed by parameter name, on the main process (a collective)."""
        return [fsdp_sharding.full_optimizer_state(model, optimizer)
                for (_, model), optimizer in zip(trained_models(agent), agent.optimizers)]

    def load_optimizer_state(self, agent: Any, states: list[dict[str, Any]]) -> None:
        for ((_, model), optimizer), state in zip(zip(trained_models(agent), agent.optimizers), states):
            fsdp_sharding.load_full_optimizer_state(model, optimizer, state)

    def restore(self, agent: Any, snapshot: Any) -> None:
        """:meth:`Backend.restore` into this process's shards (the optimisers hold the shards), after
        freeing every gathered unit of a trained model, whose full copy would still hold the rolled-back
        weights (the frozen models' are unchanged)."""
        for _, model in trained_models(agent):
            fsdp_sharding.reshard(model)
        super().restore(agent, snapshot)

    def end_of_run(self, agent: Any) -> dict[str, Any]:
        return {"weights_held_per_process": weights_held(agent)}


def _prefixed(state: dict[str, Tensor], name: str) -> dict[str, Tensor]:
    """The entries of ``state`` under ``name.``, without the prefix."""
    return {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + ".")}


def weights_held(module: nn.Module) -> float:
    """The share of ``module``'s weights (an agent's: every model's) this process holds (1 / processes,
    up to rounding)."""
    params = list(module.parameters())
    return sum(map(fsdp_sharding.held_numel, params)) / sum(map(fsdp_sharding.full_numel, params))


__all__ = ["FSDP", "weights_held"]
