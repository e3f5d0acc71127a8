"""Gradient checkpointing of the trained models (``--gradient-checkpointing``, TRL's name).

Each transformer layer of a model keeps only its input in the forward and runs again in the
backward (transformers' ``gradient_checkpointing_enable``, non-reentrant ``torch.utils.checkpoint``):
the activations of one layer at a time instead of every layer's, for about a third more compute
of the forwards with gradients.

transformers checkpoints a layer only while that layer is in training mode, and textrl keeps its
models in eval mode (dropout off: PPO's ratios must be exactly 1 before the first step). So each
checkpointed layer's own ``training`` flag is set to whether gradients are being recorded, and
nothing else: its submodules (dropout, attention) stay in eval mode, and a forward without
gradients (generation, log-probs of the rollout) runs as it did, with its KV cache. The flag is
set by a forward pre-hook on every model that holds the layers (the transformers model, its body,
a wrapper), before any layer is called: transformers before 5.2x decides to checkpoint in the
layer's ``__call__``, before the layer's own hooks run, so a hook on the layer alone came one call
late, and the first forward with gradients after one without (every update's first micro-batch,
the policy's pass of a shared critic) kept every activation. The backward's recompute of a layer runs on the attention kernels its forward could
use (:func:`_same_attention_kernels`). Gradients are the same with and without
(tests/test_memory_options.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn


def _layer_types() -> tuple[type, ...]:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - transformers before 4.52
        return ()
    return (GradientCheckpointingLayer,)


def _same_attention_kernels() -> tuple[Any, Any]:
    """``context_fn`` of the checkpoint: the backward's recompute of a layer may use exactly the
    scaled dot-product attention kernels its forward could (textrl's training forwards allow flash,
    memory-efficient and math on CUDA, never cuDNN: :func:`textrl.core.precision.training_sdpa_backends`),
    though it runs outside the forward's ``sdpa_kernel`` context. Another kernel saves other tensors
    (torch's checkpoint then stops with a CheckpointError) and could be the one with NaN gradients."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    flags = ((SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled()),
             (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled()),
             (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled()),
             (SDPBackend.CUDNN_ATTENTION, torch.backends.cuda.cudnn_sdp_enabled()))
    return contextlib.nullcontext(), sdpa_kernel([backend for backend, enabled in flags if enabled])


def _follow_grad_mode(module: nn.Module, args: Any) -> None:
    """Pre-hook of a layer: it checkpoints exactly when its forward records gradients."""
    module.training = torch.is_grad_enabled()


class _LayersFollowGradMode:
    """Pre-hook of a model holding checkpointed ``layers``: sets each layer's ``training`` flag to
    whether the forward records gradients, before the first layer's ``__call__`` reads it."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers

    def __call__(self, module: nn.Module, args: Any) -> None:
        grad = torch.is_grad_enabled()
        for layer in self.layers:
            layer.training = grad


def _reached(model: nn.Module) -> list[nn.Module]:
    """Every module ``model`` runs: its own, and those of a shared base it holds as a plain object
    (a LoRA view's ``stack.model``, a value head's shared body)."""
    seen: dict[int, nn.Module] = {}
    for module in model.modules():
        seen.setdefault(id(module), module)
        for held in (getattr(getattr(module, "stack", None), "model", None), module.__dict__.get("_body")):
            if isinstance(held, nn.Module):
                for inner in held.modules():
                    seen.setdefault(id(inner), inner)
    return list(seen.values())


CHECKPOINT_KWARGS = {"use_reentrant": False, "context_fn": _same_attention_kernels}
"""``torch.utils.checkpoint.checkpoint``'s arguments for every checkpointed layer."""


def enable_gradient_checkpointing(model: nn.Module, name: str) -> int:
    """Checkpoint every transformer layer of ``model`` (a transformers model, or a module holding
    one: a value model, a peft wrapper) in forwards with gradients; ``name`` is how messages name it
    (``policy``, ``critic``). Returns how many layers are checkpointed. ``ValueError`` names the model
    and the flag when it has no transformers model that supports gradient checkpointing."""
    from transformers import PreTrainedModel

    enabled: list[nn.Module] = []
    for module in _reached(model):
        if isinstance(module, PreTrainedModel) and not any(module in set(m.modules()) for m in enabled):
            if not getattr(module, "supports_gradient_checkpointing", False):
                raise ValueError(f"gradient_checkpointing=True: the {name} ({type(module).__name__}) does not support "
                                 "gradient checkpointing; drop --gradient-checkpointing")
            enable = getattr(module, "activation_checkpointing_enable", None)  # transformers >= 5.2x's name
            if enable is not None:
                enable(activation_checkpointing_kwargs=CHECKPOINT_KWARGS)
            else:
                module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CHECKPOINT_KWARGS)
            enabled.append(module)
    layers = [m for m in _reached(model) if isinstance(m, _layer_types()) and getattr(m, "gradient_checkpointing", False)]
    if not layers:
        raise ValueError(f"gradient_checkpointing=True: the {name} ({type(model).__name__}) has no transformers layers "
                         "to checkpoint; drop --gradient-checkpointing")
    for layer in layers:
        if not getattr(layer, "_textrl_follows_grad_mode", False):
            layer.register_forward_pre_hook(_follow_grad_mode)
            layer._textrl_follows_grad_mode = True
    checkpointed = set(layers)
    for holder in _reached(model):  # the modules that call the layers: their hooks run first
        held = [m for m in holder.modules() if m in checkpointed and m is not holder]
        if held and not getattr(holder, "_textrl_layers_follow_grad_mode", False):
            holder.register_forward_pre_hook(_LayersFollowGradMode(held))
            holder._textrl_layers_follow_grad_mode = True
    return len(layers)


__all__ = ["enable_gradient_checkpointing"]
