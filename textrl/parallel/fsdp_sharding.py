"""Fully sharded data parallelism (FSDP2, ``torch.distributed.fsdp.fully_shard``) for the agents.

With ``--fsdp`` (or an ``accelerate`` config with ``distributed_type: FSDP``) every model of the
agent (policy, reference, critic, old-policy snapshot) is split over the processes by the
backend :class:`textrl.parallel.fsdp.FSDP`, with the functions here: each decoder layer is one
FSDP unit whose parameters are all-gathered for its forward / backward and freed after, and
gradients are reduce-scattered (averaged), so each process holds ``1/N`` of every weight,
gradient and AdamW state. Everything else is the data-parallel loop; what changes:

- generation runs ``generate(synced_gpus=True)``: a process whose rows all ended keeps stepping
  until every process is done, since each forward is a collective;
- every process runs the held-out evaluation (its forwards are collectives too); the main
  process writes;
- generation gathers the policy once (:func:`gathered`) rather than each layer per token;
- checkpoints gather the full state to the main process (every process takes part), which writes
  the usual files: a full Hugging Face policy and ``trainer_state.pt`` with full tensors, so a
  sharded run resumes with any number of processes.

CPU (gloo) and CUDA (NCCL) both work. Not with ``multi_adapter_ppo`` or a 4-bit base.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn


def _env_flag(name: str) -> bool:
    """An environment variable accelerate sets to true / false (unset = false)."""
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def accelerate_wants_fsdp() -> bool:
    """Whether ``accelerate launch`` was given an FSDP config (it exports ``ACCELERATE_USE_FSDP``)."""
    return _env_flag("ACCELERATE_USE_FSDP")


def accelerate_fsdp_options() -> dict[str, bool]:
    """The options of an accelerate FSDP config that textrl reads (``fsdp_reshard_after_forward``);
    ``ValueError`` for those it cannot honour (parameter offload, activation checkpointing)."""
    env = os.environ
    for name, what in (("FSDP_OFFLOAD_PARAMS", "fsdp_offload_params"),
                       ("FSDP_ACTIVATION_CHECKPOINTING", "fsdp_activation_checkpointing")):
        if _env_flag(name):
            raise ValueError(f"the accelerate FSDP config sets {what}: true, which textrl train does not "
                             "support; set it to false (the decoder layers are the FSDP units)")
    # FSDP2 configs say true / false; FSDP1-style ones name a strategy (SHARD_GRAD_OP = keep)
    value = (env.get("FSDP_RESHARD_AFTER_FORWARD") or env.get("FSDP_SHARDING_STRATEGY") or "true").lower()
    return {"fsdp_reshard_after_forward": value not in ("false", "0", "no", "shard_grad_op", "2")}


def is_sharded(param: Tensor) -> bool:
    """Whether ``param`` is an FSDP2 shard (a ``DTensor``)."""
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def local(param: Tensor) -> Tensor:
    """This process's shard of ``param``: an FSDP ``DTensor``'s local part, a DeepSpeed ZeRO-3
    parameter's partition (``ds_tensor``), or ``param`` itself when not sharded."""
    if hasattr(param, "ds_tensor"):
        return param.ds_tensor
    return param.to_local() if is_sharded(param) else param


def held_numel(param: Tensor) -> int:
    """Elements of ``param`` this process keeps between uses: its shard, or the whole parameter
    when DeepSpeed ZeRO-3 persists it (parameters under ``stage3_param_persistence_threshold``)."""
    if getattr(param, "ds_persist", False):
        return full_numel(param)
    return local(param).numel()


def full_numel(param: Tensor) -> int:
    """Elements of the whole ``param``, however it is sharded (ZeRO-3 keeps an empty ``data``)."""
    return int(getattr(param, "ds_numel", param.numel()))


def to_float(value: Tensor) -> float:
    """A scalar, sharded (e.g. ``clip_grad_norm_`` over DTensor grads) or not, as a float."""
    return float(value.full_tensor()) if is_sharded(value) else float(value)


def unit_classes(model: nn.Module) -> set[str]:
    """Class names that form one FSDP unit each: every submodule's HF ``_no_split_modules``."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def shard_model(model: nn.Module, mesh: Any, reshard_after_forward: bool = True) -> nn.Module:
    """``fully_shard`` each decoder layer of ``model`` (HF ``_no_split_modules``), then the rest.

    In place; the model's parameters become ``DTensor`` shards (new ``nn.Parameter`` objects, so
    optimisers must be built afterwards). ``reshard_after_forward=False`` keeps a layer's gathered
    weights from its forward to its backward (ZeRO-2-like: faster, more memory).
    """
    from torch.distributed.fsdp import fully_shard

    classes = unit_classes(model)
    if not classes:
        raise ValueError(
            f"{type(model).__name__} names no decoder-layer class (_no_split_modules); FSDP needs "
            "a Hugging Face transformer (or a model that sets _no_split_modules)"
        )
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in classes:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def device_mesh(device: torch.device, world_size: int) -> Any:
    """The 1-D mesh over every process (``cpu`` with gloo, ``cuda`` with NCCL)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size,))


@contextmanager
def gathered(model: nn.Module, reshard_after_forward: bool) -> Iterator[None]:
    """Every FSDP unit of ``model`` unsharded for the block, resharded after.

    For generation: one all-gather per layer for the whole block instead of one per layer and
    generated token (the full model is held meanwhile, as a replicated run holds it always).
    ``reshard_after_forward`` is the units' setting to restore (the root's stays False).
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    model.set_reshard_after_forward(False, recurse=True)
    model.unshard()
    try:
        yield
    finally:
        model.set_reshard_after_forward(reshard_after_forward, recurse=True)
        model.set_reshard_after_forward(False, recurse=False)  # the root keeps its weights, as fully_shard sets it
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def reshard(model: nn.Module) -> None:
    """Free every gathered FSDP unit of ``model`` (the root keeps its weights after a forward), so
    that its next forward gathers the shards again: after the shards were written in place (a
    rollback), no stale full copy is used. Local: no collective; a no-op on an unsharded model."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _options(cpu_offload: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)


def trained_weights(model: nn.Module, keep: bool) -> dict[str, Tensor]:
    """``model``'s trained weights whole, copied to the CPU where ``keep`` (``{}`` elsewhere): each
    shard's ``full_tensor()`` in turn (a collective every process joins, in the parameters' order)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            whole = p.full_tensor() if is_sharded(p) else p
            if keep:
                out[name] = whole.detach().to("cpu", copy=True)
    return out


def full_model_state(model: nn.Module) -> dict[str, Tensor]:
    """Every full tensor of ``model`` on the CPU, on the main process only (the others get ``{}``;
    a collective: all must call). Tensors are gathered one at a time, so no process ever holds
    more than the main process's copy plus one tensor."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def load_full_model_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy full tensors into (sharded) ``model``; every process passes the same ``state``."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options())


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state with full CPU tensors, keyed by parameter name, on the main process
    only (a collective)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Restore :func:`full_optimizer_state`'s output into the (sharded) ``optimizer``."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=_options())


__all__ = [
    "accelerate_fsdp_options",
    "gathered",
    "accelerate_wants_fsdp",
    "device_mesh",
    "full_model_state",
    "full_optimizer_state",
    "is_sharded",
    "load_full_model_state",
    "load_full_optimizer_state",
    "full_numel",
    "held_numel",
    "local",
    "reshard",
    "shard_model",
    "to_float",
    "unit_classes",
]
