"""What the supervised stages (``textrl sft``, ``rm``, ``dpo``) share.

- :class:`StageConfig`: the fields every stage has (run, model, LoRA / 4-bit, optimisation,
  evaluation), documented where declared and exposed on the command line by
  :func:`add_stage_arguments` (the trainer's config machinery; help text for inherited fields too).
- :func:`load_policy` / :func:`save_policy`: a causal LM, fully trainable or with a LoRA adapter
  (optionally on a 4-bit NF4 base), saved atomically as a full model or an adapter folder.
- :func:`fit`: the loop every stage runs: AdamW steps over shuffled batches, evaluation before,
  every ``eval_every`` steps and at the end, ``metrics.jsonl`` / TensorBoard through the
  trainer's :class:`~textrl.trainer.MetricsLog`, optional checkpoints, the final model.

Every stage writes to ``output_dir``: ``config.yaml`` (resolved config), ``metrics.jsonl``,
``tb/``, ``summary.json`` (held-out metrics before and after) and ``model/`` (the result).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from textrl.config import (
    _at_least,
    _in_range,
    _positive,
    add_config_arguments,
    check_bitsandbytes,
    field_docs,
    save_config,
)
from textrl.models.adapters import write_atomically

ADAPTER_META = "textrl_adapter.json"
"""Written next to a policy LoRA adapter: ``{"format": "textrl-lora", "version": 1, "base_model",
"load_in_4bit", "stage"}`` (the base by the name the user gave, e.g. ``tiny``)."""
MODEL_DIR = "model"
"""Subfolder of ``output_dir`` holding a stage's result."""


@dataclass
class StageConfig:
    """Fields shared by ``textrl sft``, ``rm`` and ``dpo``. Defaults run the built-in demo."""

    output_dir: str = "runs/stage"
    """Where config.yaml, metrics.jsonl, tb/, summary.json, checkpoints/ and model/ go."""
    seed: int = 0
    """Seed of every random generator (initialisation, batch order, held-out split)."""
    device: str = "auto"
    """'auto' (CUDA when available, else CPU), 'cpu', 'cuda' or 'cuda:N'."""
    model: str = "tiny"
    """Starting model: a local path or hub id of a causal LM; 'tiny' is the offline tiny model."""
    data: str = "builtin:case"
    """Training data: 'builtin:NAME' or a .jsonl file (see the stage's description)."""
    steps: int = 200
    """Optimiser steps."""
    batch_size: int = 32
    """Examples (or preference pairs) per step."""
    lr: float = 1e-3
    """AdamW learning rate (constant, no weight decay)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 = off)."""
    max_length: int = 256
    """Longest sequence in tokens (prompt + response)."""
    eval_size: int = 32
    """Held-out rows, split off the data with the seed; evaluated before, during and after."""
    eval_every: int = 50
    """Held-out evaluation every N steps (0 = only before and after)."""
    checkpoint_every: int = 0
    """Save the model to checkpoints/step_NNNNNN every N steps (0 = only the final model/)."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk."""
    lora: bool = False
    """Train a LoRA adapter on a frozen base instead of every weight."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: int = 16
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_r)."""
    lora_dropout: float = 0.0
    """Dropout inside LoRA layers."""
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj"
    """Comma-separated module names LoRA wraps, or 'all-linear'."""
    load_in_4bit: bool = False
    """Quantise the frozen base to 4-bit NF4 with bitsandbytes (needs lora=true)."""
    progress: bool = True
    """Show a progress bar."""

    def validate(self) -> StageConfig:
        """Check every field; raise ``ValueError`` naming the field, its value and what is allowed."""
        for name in ("steps", "batch_size", "max_length", "keep_checkpoints", "lora_r", "lora_alpha"):
            _at_least(name, getattr(self, name), 1)
        for name in ("eval_size", "eval_every", "checkpoint_every", "max_grad_norm"):
            _at_least(name, getattr(self, name), 0)
        _positive("lr", self.lr)
        _in_range("lora_dropout", self.lora_dropout, 0.0, 1.0)
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
            raise ValueError("lora_target_modules='': name modules (e.g. q_proj,v_proj) or 'all-linear'")
        if is_adapter_dir(self.model):
            raise ValueError(
                f"model={self.model!r} is a LoRA adapter folder; merge it into its base first "
                f"(`textrl merge --adapter {self.model} --output-dir MERGED`) and pass MERGED"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- command line -----------------------------------------------------------------------------------


def all_field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass and of its dataclass bases (a subclass's win)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(field_docs(klass))
    return docs


def add_stage_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """``--config`` plus one option per field (``add_config_arguments``), with inherited help."""
    parser.add_argument("--config", default=None, help="YAML file of options (flags override it)")
    add_config_arguments(parser, cls)
    docs = all_field_docs(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for action in parser._actions:
        if action.dest in docs:
            action.help = f"{docs[action.dest]} (default: {defaults[action.dest]!r})"


# -- models -----------------------------------------------------------------------------------------


def is_adapter_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder holding a peft adapter (``adapter_config.json``)."""
    return (Path(path) / "adapter_config.json").is_file()


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
                       target_modules=config.lora_target_modules)
    return get_peft_model(model, lora)


def load_policy(config: StageConfig, device: torch.device) -> Any:
    """The causal LM a stage trains: every weight in float32, or a LoRA on a (4-bit) base."""
    from textrl.models import load_causal_lm

    if not config.lora:
        return load_causal_lm(config.model, device=device).float()
    from textrl.models.adapters import load_base_model

    base = load_base_model(config.model, load_in_4bit=config.load_in_4bit, device=device)
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


# -- data -------------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[tuple[str, Any]]:
    """``(where, row)`` per non-blank line; ``where`` = ``"<path>: row N (line L)"`` for errors."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}: row {len(rows)} (line {lineno})"
            try:
                rows.append((where, json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
    return rows


def split_rows(rows: Sequence[Any], eval_size: int, seed: int, what: str) -> tuple[list, list]:
    """(train, held-out) with ``eval_size`` rows held out, chosen by ``seed``."""
    n = len(rows)
    if eval_size >= n:
        raise ValueError(
            f"eval_size={eval_size}: the {what} has only {n} rows and training needs at least "
            f"one; lower --eval-size (0 = no held-out evaluation) or add data"
        )
    perm = np.random.default_rng([seed, 0x5B17]).permutation(n)
    held = sorted(perm[:eval_size].tolist())
    train = sorted(perm[eval_size:].tolist())
    return [rows[i] for i in train], [rows[i] for i in held]


def pad_left(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-padded ``input_ids`` int64 ``[B, L]`` and ``attention_mask`` int64 ``[B, L]``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(list(row), dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids, mask


# -- the loop ---------------------------------------------------------------------------------------


def prepare_run(config: Any) -> tuple[torch.device, Path]:
    """Validate, seed, resolve the device, create ``output_dir`` and write ``config.yaml``."""
    from textrl.trainer import resolve_device, seed_everything

    config.validate()
    device = resolve_device(config.device)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, output_dir / "config.yaml")
    seed_everything(config.seed)
    return device, output_dir


def fit(
    config: StageConfig,
    params: Sequence[torch.nn.Parameter],
    train_rows: Sequence[Any],
    loss_fn: Callable[[list[Any]], tuple[Tensor, dict[str, float]]],
    evaluate: Callable[[], dict[str, float]],
    save: Callable[[Path], Any],
    *,
    name: str,
) -> dict[str, Any]:
    """Train ``params`` for ``config.steps`` AdamW steps; return ``{"before", "after", ...}``.

    ``loss_fn(rows)`` puts the model in train mode and returns the loss of a batch of rows and
    its detached stats; ``evaluate()`` returns held-out metrics (keys without prefix; they are
    logged under ``eval/``); ``save(path)`` writes the model to ``path``. Batches are shuffled
    epochs from a private generator seeded with ``config.seed``.
    """
    from textrl.trainer import MetricsLog
    from textrl.warmup import _batch_order

    output_dir = Path(config.output_dir)
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError(f"{name}: no trainable parameters")
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    log = MetricsLog(output_dir, enabled=True, resume_after=None)
    start = time.perf_counter()
    before = evaluate()
    after = before
    generator = torch.Generator().manual_seed(config.seed)
    batches = _batch_order(len(train_rows), config.steps, config.batch_size, generator)
    progress = None
    if config.progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=config.steps, desc=name, dynamic_ncols=True)
    for step, indices in enumerate(batches, start=1):
        t0 = time.perf_counter()
        loss, stats = loss_fn([train_rows[i] for i in indices.tolist()])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            params, config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
        )
        optimizer.step()
        row: dict[str, float] = {"iteration": step, "loss": loss.item(), **stats,
                                 "grad_norm": float(grad_norm), "lr": config.lr}
        if step == config.steps or (config.eval_every and step % config.eval_every == 0):
            after = evaluate()
            row.update({f"eval/{k}": v for k, v in after.items()})
        row["time/step_s"] = time.perf_counter() - t0
        log.write(row)
        if progress is not None:
            progress.set_postfix(loss=f"{row['loss']:.3f}")
            progress.update(1)
        if config.checkpoint_every and step % config.checkpoint_every == 0 and step < config.steps:
            save_stage_checkpoint(output_dir, step, save, config.keep_checkpoints)
    if progress is not None:
        progress.close()
    log.close()
    model_dir = output_dir / MODEL_DIR
    save(model_dir)
    summary = {"stage": name, "before": before, "after": after, "model": str(model_dir),
               "steps": config.steps, "seconds": time.perf_counter() - start}
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def save_stage_checkpoint(output_dir: Path, step: int, save: Callable[[Path], Any], keep: int) -> Path:
    """``checkpoints/step_NNNNNN`` (atomic through ``save``), keeping the newest ``keep``."""
    root = output_dir / "checkpoints"
    path = root / f"step_{step:06d}"
    save(path)
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def format_summary(summary: dict[str, Any], keys: Sequence[str]) -> str:
    """A before/after table of the held-out metrics ``keys``."""
    lines = [f"{'held-out metric':<28}{'before':>10}{'after':>10}"]
    for key in keys:
        if key in summary["after"]:
            lines.append(f"{key:<28}{summary['before'][key]:>10.3f}{summary['after'][key]:>10.3f}")
    lines.append(f"model: {summary['model']} ({summary['steps']} steps, {summary['seconds']:.1f}s)")
    return "\n".join(lines)


__all__ = [
    "ADAPTER_META",
    "MODEL_DIR",
    "StageConfig",
    "adapter_base",
    "add_lora",
    "add_stage_arguments",
    "all_field_docs",
    "fit",
    "format_summary",
    "is_adapter_dir",
    "load_adapter_model",
    "load_policy",
    "model_record",
    "pad_left",
    "prepare_run",
    "read_jsonl",
    "resolve_model_path",
    "save_policy",
    "save_stage_checkpoint",
    "split_rows",
    "write_atomically",
]
