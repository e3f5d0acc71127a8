"""A supervised stage's model: the causal LM it trains (every weight, or a LoRA adapter on a
frozen, optionally 4-bit NF4 base), loaded in the stage's precision and saved atomically as a full
model or an adapter folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from textrl.core.precision import Precision
from textrl.models.adapters import is_adapter_dir, write_atomically

if TYPE_CHECKING:
    from textrl.stages.stage_config import StageConfig

ADAPTER_META = "textrl_adapter.json"
"""Written next to a policy LoRA adapter: ``{"format": "textrl-lora", "version": 1, "base_model",
"load_in_4bit", "stage"}`` (the base by the name the user gave, e.g. ``tiny``)."""


def resolve_model_path(name: str) -> str:
    """A local folder or hub id for ``name``; ``'tiny'`` is the cached tiny causal LM."""
    from textrl.models.tiny import _resolve

    return _resolve(name, "causal_lm")


def model_record(name: str) -> str:
    """How an output names the model it was trained from: an existing local folder as an
    absolute path (so it resolves from any directory), anything else (``tiny``, a hub id) as is."""
    return str(Path(name).resolve()) if Path(name).exists() else name


def adapter_base(path: str | os.PathLike[str]) -> str:
    """The base model of a LoRA adapter folder as ``textrl_adapter.json`` / ``textrl_reward.json``
    record it (``tiny``, a hub id or an absolute path), else peft's ``base_model_name_or_path``."""
    path = Path(path)
    for meta in (ADAPTER_META, "textrl_reward.json"):
        if (path / meta).is_file():
            return json.loads((path / meta).read_text())["base_model"]
    config = json.loads((path / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{path / 'adapter_config.json'} names no base model; pass the base explicitly")
    return base


def add_lora(model: Any, config: StageConfig) -> Any:
    """``model`` wrapped in a peft model with one trainable LoRA adapter ``"default"``."""
    from peft import get_peft_model

    from textrl.models.adapters import lora_config

    lora = lora_config(r=config.lora_r, alpha=config.lora_alpha, dropout=config.lora_dropout,
                       target_modules=config.lora_target_modules, model=model)
    return get_peft_model(model, lora)


def stage_precision(config: StageConfig, device: torch.device | str) -> Precision:
    """A supervised stage's precision on ``device``: the one place the stages decide it (the
    model they load, :func:`load_policy` and the reward model's scorer, and the loss and
    evaluation :func:`textrl.stages.common.fit` runs), from the config's ``dtype``,
    ``mixed_precision`` and ``attn_implementation`` (:meth:`textrl.core.precision.Precision.of`: the
    same object for the same fields and device)."""
    return Precision.of(config, device)


def load_policy(config: StageConfig, device: torch.device) -> Any:
    """The causal LM a stage trains, in the stage's precision (``dtype``, ``attn_implementation``;
    :func:`stage_precision`): every weight trained, or a LoRA on a (4-bit) base."""
    from textrl.models import load_causal_lm

    precision = stage_precision(config, device)
    if not config.lora:
        return load_causal_lm(config.model, device=device, **precision.model_kwargs())
    from textrl.models.adapters import load_base_model

    base = load_base_model(config.model, load_in_4bit=config.load_in_4bit, device=device, precision=precision)
    return add_lora(base, config)


def load_adapter_model(path: str | os.PathLike[str], *, device: Any = None,
                       load_in_4bit: bool | None = None) -> Any:
    """A policy LoRA adapter folder on its base (``PeftModel``, adapter ``"default"``, eval mode).

    ``load_in_4bit=None`` loads the base as it was trained (``textrl_adapter.json``; else full).
    """
    from peft import PeftModel

    from textrl.models.adapters import load_base_model

    if (Path(path) / "textrl_reward.json").is_file():
        raise ValueError(
            f"{path} is a LoRA reward adapter (textrl rm --lora), not a policy; score with it "
            "through --agent multi_adapter_ppo --reward-adapter, or train a full reward model"
        )
    if load_in_4bit is None:
        meta = Path(path) / ADAPTER_META
        load_in_4bit = meta.is_file() and bool(json.loads(meta.read_text()).get("load_in_4bit"))
    base = load_base_model(adapter_base(path), load_in_4bit=load_in_4bit, device=device)
    return PeftModel.from_pretrained(base, str(path)).eval()


def save_policy(model: Any, tokenizer: Any, path: Path, *, config: StageConfig, stage: str) -> Path:
    """A full model (``save_pretrained``) or a LoRA adapter folder (+ ``textrl_adapter.json``),
    with the tokenizer, written atomically."""
    from textrl.models.adapters import is_peft, save_adapter

    def write(tmp: Path) -> None:
        if is_peft(model):
            save_adapter(model, "default", tmp)
            meta = {"format": "textrl-lora", "version": 1, "base_model": model_record(config.model),
                    "load_in_4bit": config.load_in_4bit, "stage": stage}
            (tmp / ADAPTER_META).write_text(json.dumps(meta, indent=2) + "\n")
        else:
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return write_atomically(path, write)


__all__ = ["ADAPTER_META", "adapter_base", "add_lora", "is_adapter_dir", "load_adapter_model", "load_policy",
           "model_record", "resolve_model_path", "save_policy", "stage_precision"]
