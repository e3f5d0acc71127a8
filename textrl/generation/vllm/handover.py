"""The weights vLLM takes from the policy: which they are (:func:`base_state_dict`, a LoRA policy's
base without its adapter; :func:`merged_state_dict`, the adapter merged in, what a server samples a
LoRA policy with), the model folder vLLM starts on (:func:`write_model_folder`), and the load of a
bucket of them in vLLM's worker (:func:`reload_weights`, vLLM's layerwise reload watched by
:class:`~textrl.generation.weight_sync.LoadWatch`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from textrl.generation.weight_sync import LoadWatch


def lora_of(model: nn.Module) -> tuple[Any, str] | None:
    """``(peft model, adapter name)`` of a LoRA policy: a peft ``PeftModel`` (its active adapter) or
    textrl's view of one adapter of a shared one (:class:`textrl.agents.adapter_views.AdapterPolicy`,
    ``--lora-r``); None for any other model."""
    stack = getattr(model, "stack", None)
    if stack is not None and hasattr(getattr(stack, "model", None), "peft_config") and getattr(model, "adapter", None):
        return stack.model, model.adapter
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        return model, model.active_adapter
    return None


def lora_base(model: nn.Module) -> nn.Module | None:
    """The base model of a LoRA policy (:func:`lora_of`), None for any other model."""
    lora = lora_of(model)
    return None if lora is None else lora[0].get_base_model()


def is_lora_name(name: str) -> bool:
    """A LoRA weight's name (peft's ``...lora_A.<adapter>.weight``, textrl's ``...__lora_A__<adapter>__weight``)."""
    return "lora_" in name


def base_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The weights of the model vLLM loads, named as in its transformers folder: the policy's own,
    or for a LoRA policy its base's with the adapter left out (``lora_*`` dropped, peft's
    ``.base_layer`` taken out of the names)."""
    base = lora_base(model)
    if base is None:
        return dict(model.state_dict())
    return {name.replace(".base_layer", ""): value for name, value in base.state_dict().items() if not is_lora_name(name)}


def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """:func:`base_state_dict` with a LoRA policy's adapters merged in (``W + scaling B A`` of the
    policy's adapter computed in float32, then cast once to ``W``'s dtype:
    :func:`textrl.models.adapters.merged_weight`; new tensors: the policy is untouched), what a vLLM
    server without the adapter samples the policy with; the policy's own for any other model."""
    from textrl.models.adapters import lora_delta, merged_weight

    weights = base_state_dict(model)
    base = lora_base(model)
    if base is None:
        return weights
    adapter = lora_of(model)[1]
    with torch.no_grad():
        for name, module in base.named_modules():
            if hasattr(module, "base_layer") and adapter in getattr(module, "lora_A", {}):
                key = f"{name}.weight"
                weights[key] = merged_weight(weights[key], lora_delta(module, adapter))
    return weights


def write_model_folder(config: Any, weights: dict[str, Tensor], path: Path) -> None:
    """The model folder vLLM starts on, written by this process: ``config.json`` and ``weights`` in one
    safetensors file (transformers' ``save_pretrained`` writes on rank 0 alone under a process group,
    and every process's vLLM needs its own); a weight sharing another's storage (tied embeddings)
    written once, under its first name, as ``save_pretrained`` writes it."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    seen: set[tuple[int, int]] = set()
    unique = {}
    for name, tensor in weights.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key not in seen:
            seen.add(key)
            unique[name] = tensor.detach().contiguous().cpu()
    save_file(unique, str(path / "model.safetensors"), metadata={"format": "pt"})




def reload_weights(worker: Any, weights: list[tuple[str, Tensor]], first: bool = True,
                   last: bool = True) -> dict[str, Any] | None:
    """Run in vLLM's worker (``LLM.collective_rpc``): load one bucket of ``weights`` (transformers
    names; moved to the model's device here, one bucket at a time) into its model through vLLM's
    layerwise reload, which re-does the processing vLLM applied after loading. ``first``: the
    hand-over's first bucket (the reload begins), ``last``: its last (the reload ends); returns the
    :meth:`LoadWatch.report` of what the hand-over's loads took after the last, else None."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    model = worker.get_model()
    if first:
        model._textrl_reload_watch = LoadWatch(model)
        model._textrl_reload_device = next(model.parameters()).device  # the reload's parameters are meta until loaded
        initialize_layerwise_reload(model)
    staged = [(name, tensor.to(model._textrl_reload_device, non_blocking=True)) for name, tensor in weights]
    model._textrl_reload_watch.load(model.load_weights, iter(staged))
    if not last:
        return None
    finalize_layerwise_reload(model, worker.model_config)
    return model._textrl_reload_watch.report()



__all__ = ["base_state_dict", "is_lora_name", "lora_base", "lora_of", "merged_state_dict", "reload_weights",
           "write_model_folder"]
