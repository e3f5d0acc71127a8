"""The config every supervised stage (``textrl sft``, ``rm``, ``dpo``) builds on, and its command line.

:class:`StageConfig` holds the fields every stage has (run, model, precision, LoRA / 4-bit,
optimisation, evaluation), documented where declared; the fields it shares with ``textrl train``
come from :class:`textrl.config.SharedFields`. Each stage's config derives from it and adds its
own. Flags, YAML and value checks are :mod:`textrl.config.io`'s, as for ``textrl train``.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from textrl.config import shared
from textrl.config.io import (
    ResumeRules,
    add_config_arguments,
    check_at_least,
    check_bitsandbytes,
    check_in_range,
    check_output_dir,
    check_positive,
    check_values,
    field_docs,
)
from textrl.core.precision import check_precision
from textrl.models.adapters import is_adapter_dir


@dataclass
class StageConfig:
    """Fields shared by ``textrl sft``, ``rm`` and ``dpo``. Defaults run the built-in demo."""

    output_dir: str = "runs/stage"
    """Where config.yaml, metrics.jsonl, tb/, summary.json, checkpoints/ and model/ go."""
    seed: int = 0
    """Seed of every random generator (initialisation, batch order, held-out split)."""
    device: str = shared("device")
    model: str = "tiny"
    """Starting model: a local path or hub id of a causal LM; 'tiny' is the offline tiny model."""
    dtype: str = "float32"
    """The trained weights' dtype: float32 | bfloat16 (TRL's dtype / torch_dtype)."""
    mixed_precision: str = "auto"
    """Autocast of every forward: bf16 | no | auto (bf16 on a CUDA device that has it, else no)."""
    attn_implementation: str | None = None
    """Attention kernels: sdpa | eager | flash_attention_2 (needs flash-attn and CUDA); None: the
    model's default."""
    data: str = "builtin:case"
    """Training data: 'builtin:NAME' or a .jsonl file (see the stage's description)."""
    steps: int = 200
    """Optimiser steps."""
    batch_size: int = 32
    """Examples (or preference pairs) per step."""
    lr: float = 1e-3
    """AdamW learning rate (constant, no weight decay)."""
    max_grad_norm: float = shared("max_grad_norm")
    max_length: int = 256
    """Longest sequence in tokens (prompt + response)."""
    eval_size: int = 32
    """Held-out rows, split off the data with the seed; evaluated before, during and after."""
    eval_every: int = 50
    """Held-out evaluation every N steps (0 = only before and after)."""
    checkpoint_every: int = 0
    """Save a resumable checkpoints/iter_NNNNNN every N steps (0 = only on SIGINT/SIGTERM)."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk."""
    resume: bool = False
    """Continue from the newest verified checkpoint in output_dir (same model, LoRA and data)."""
    lora: bool = False
    """Train a LoRA adapter on a frozen base instead of every weight."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: int = shared("lora_alpha")
    lora_dropout: float = 0.0
    """Dropout inside LoRA layers."""
    lora_target_modules: str = shared("lora_target_modules")
    load_in_4bit: bool = False
    """Quantise the frozen base to 4-bit NF4 with bitsandbytes (needs lora=true)."""
    progress: bool = shared("progress")

    RESUME_RULES: ClassVar[ResumeRules] = ResumeRules(
        applied=frozenset({"device", "steps", "eval_every", "checkpoint_every", "keep_checkpoints",
                           "mixed_precision", "attn_implementation"}))
    """What ``--resume`` may change: the length and cadences; every other field (model, data, seed,
    learning rate, batch, LoRA, the stage's own) is fixed (docs/reliability.md)."""

    def validate(self) -> StageConfig:
        """Check every field; raise ``ValueError`` naming the field, its value and what is allowed."""
        check_values(self, skip=("model", "dataset"))
        check_output_dir(self.output_dir)
        for name in ("steps", "batch_size", "max_length", "keep_checkpoints", "lora_r", "lora_alpha"):
            check_at_least(name, getattr(self, name), 1)
        for name in ("eval_size", "eval_every", "checkpoint_every", "max_grad_norm"):
            check_at_least(name, getattr(self, name), 0)
        check_positive("lr", self.lr)
        check_in_range("lora_dropout", self.lora_dropout, 0.0, 1.0)
        check_precision(self)
        if not self.model.strip():
            raise ValueError("model='': pass --model PATH (a causal LM folder or hub id) or 'tiny'")
        if not self.data.strip():
            raise ValueError("data='': pass --data FILE.jsonl or 'builtin:case'")
        if self.load_in_4bit and not self.lora:
            raise ValueError(
                "load_in_4bit=True needs lora=True: a 4-bit base is frozen, only a LoRA adapter "
                "on it can be trained (add --lora, or drop --load-in-4bit)"
            )
        if self.load_in_4bit:
            check_bitsandbytes("load_in_4bit")
        if self.lora and not self.lora_target_modules.strip():
            raise ValueError("lora_target_modules='': name modules (e.g. q_proj,v_proj), 'auto' or 'all-linear'")
        if is_adapter_dir(self.model):
            raise ValueError(
                f"model={self.model!r} is a LoRA adapter folder; merge it into its base first "
                f"(`textrl merge --adapter {self.model} --output-dir MERGED`) and pass MERGED"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def all_field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass and of its dataclass bases, a subclass's winning
    (:func:`textrl.config.io.field_docs`, kept under this name for the stages' callers)."""
    return field_docs(cls)


def add_stage_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """``--config`` plus one option per field of ``cls`` (:func:`textrl.config.io.add_config_arguments`:
    help text for the fields ``cls`` inherits from :class:`StageConfig` too)."""
    parser.add_argument("--config", default=None, help="YAML file of options (flags override it)")
    add_config_arguments(parser, cls)


__all__ = ["StageConfig", "add_stage_arguments", "all_field_docs"]
