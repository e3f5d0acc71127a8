"""``textrl sft``: supervised fine-tuning with the completion-only loss.

Each example is a prompt (one user message or a conversation) and a response. It is tokenized
as the policy sees it at generation time (the tokenizer's chat template with the generation
prompt, then the response and EOS) and only the response tokens and the EOS are in the loss:
prompt and padding positions have label ``-100`` (:func:`textrl.run.warmup.build_sft_batch`, shared
with the trainer's warm-up). Full fine-tuning, or a LoRA adapter (optionally on a 4-bit NF4 base).

Data (``--data``):

- ``builtin:case``: the built-in instruction task (:mod:`textrl.envs.synthetic`);
- a ``.jsonl`` file of ``{"prompt": str | messages, "response": str}`` rows (``completion`` is
  accepted for ``response``) or ``{"messages": [...]}`` conversations whose last turn is the
  assistant's response (``conversations`` is accepted for ``messages``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from textrl.run import holds_run_folder
from textrl.run.signals import until_stopped
from textrl.run.warmup import IGNORE_INDEX, Prompt, build_sft_batch, encode_sft_example
from textrl.stages.common import (
    StageConfig,
    fit,
    format_summary,
    load_policy,
    prepare_run,
    save_policy,
    split_rows,
)


@dataclass
class SFTConfig(StageConfig):
    """``textrl sft``. Defaults: the tiny model on ``builtin:case`` (about 20 s on a CPU)."""

    output_dir: str = "runs/sft"
    """Where config.yaml, metrics.jsonl, tb/, summary.json, checkpoints/ and model/ go."""
    data: str = "builtin:case"
    """SFT data: 'builtin:case', or a .jsonl of {prompt, response} rows or {messages} conversations."""
    steps: int = 300
    """Optimiser steps."""
    lr: float = 3e-3
    """AdamW learning rate (constant; 3e-3 suits the tiny model trained from scratch)."""


def _message_list(value: Any, where: str, field: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: field {field!r} must be a non-empty list of messages")
    out = []
    for j, turn in enumerate(value):
        role = turn.get("role") if isinstance(turn, Mapping) else None
        content = turn.get("content") if isinstance(turn, Mapping) else None
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f"{where}: field {field!r}[{j}] needs string 'role' and 'content'")
        out.append({"role": role, "content": content})
    return out


def parse_sft_row(row: Any, where: str) -> tuple[Prompt, str]:
    """(prompt, response) of one row; ``ValueError`` naming ``where`` and the field otherwise."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: an SFT row must be an object, got {type(row).__name__}")
    conv = next((f for f in ("messages", "conversations") if f in row), None)
    if "prompt" not in row and conv is not None:
        messages = _message_list(row[conv], where, conv)
        if messages[-1]["role"] != "assistant" or len(messages) < 2:
            raise ValueError(
                f"{where}: field {conv!r} must end with an assistant turn (the response) after a user turn"
            )
        prompt: Prompt = messages[:-1]
        response = messages[-1]["content"]
    else:
        if "prompt" not in row:
            raise ValueError(f"{where}: missing field 'prompt' (or a 'messages' conversation)")
        prompt = row["prompt"]
        if isinstance(prompt, list):
            prompt = _message_list(prompt, where, "prompt")
        elif not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}: field 'prompt' must be a non-empty string or a list of messages")
        field = next((f for f in ("response", "completion") if f in row), None)
        if field is None:
            raise ValueError(f"{where}: missing field 'response'")
        response = row[field]
    if not isinstance(response, str) or not response.strip():
        raise ValueError(f"{where}: the response must be a non-empty string, got {response!r}")
    if isinstance(prompt, list) and len(prompt) == 1 and prompt[0]["role"] == "user":
        prompt = prompt[0]["content"]
    return prompt, response


def load_sft_examples(source: str | os.PathLike[str] | Iterable[Mapping[str, Any]]) -> list[tuple[str, tuple[Prompt, str]]]:
    """``(where, (prompt, response))`` of each row of ``builtin:NAME``, a ``.jsonl`` file, or a
    list of rows; ``where`` names the row in messages (``FILE: row N (line L)``)."""
    from textrl.envs.synthetic import BUILTIN_SFT
    from textrl.stages.common import source_rows

    return [(where, parse_sft_row(row, where)) for where, row in source_rows(source, BUILTIN_SFT, "SFT data")]


def load_sft_pairs(source: str | os.PathLike[str] | Iterable[Mapping[str, Any]]) -> list[tuple[Prompt, str]]:
    """(prompt, response) pairs from ``builtin:NAME``, a ``.jsonl`` file, or a list of rows."""
    return [pair for _, pair in load_sft_examples(source)]


def check_lengths(tokenizer: Any, examples: Sequence[tuple[str, tuple[Prompt, str]]], max_length: int) -> None:
    """Before training, every example as ``textrl sft`` tokenizes it against ``max_length``
    (``--max-length``): ``ValueError`` naming the first whose templated prompt alone fills it
    (nothing would be left to learn), and one warning counting those longer than it, which lose
    the end of their response and its EOS, naming the longest and the ``--max-length`` that keeps
    them whole. ``examples``: ``(where, (prompt, response))`` (:func:`load_sft_examples`)."""
    longer = []  # (tokens, where) of each example over max_length
    for where, (prompt, response) in examples:
        ids, n_prompt = encode_sft_example(tokenizer, prompt, response)
        if n_prompt >= max_length:
            raise ValueError(f"{where}: the templated prompt is {n_prompt} tokens, not shorter than "
                             f"max_length={max_length}, so no response token is left to learn; raise "
                             f"--max-length above {n_prompt} or shorten the prompt")
        if len(ids) > max_length:
            longer.append((len(ids), where))
    if longer:
        tokens, where = max(longer)
        warnings.warn(f"sft: {len(longer)} of {len(examples)} rows are longer than max_length={max_length} tokens "
                      f"(prompt + response + EOS) and are truncated, losing the end of their response and its EOS; "
                      f"the longest: {where} ({tokens} tokens); raise --max-length to {tokens} to keep every row "
                      "whole", stacklevel=2)


def completion_loss(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """(mean next-token loss over response tokens, number of them) of a ``build_sft_batch`` batch.

    ``labels`` ``[B, L]`` hold ``-100`` on prompt and padding; the loss of position ``t`` predicts
    ``labels[:, t]`` from the logits at ``t - 1`` (HF's shift).
    """
    loss = model(**batch, use_cache=False).loss
    n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    return loss, n


@holds_run_folder
def train_sft(config: SFTConfig) -> dict[str, Any]:
    """Run the stage; return ``{"before", "after", "model", ...}`` (held-out completion loss)."""
    from textrl.models import load_tokenizer

    device, _, checkpoint = prepare_run(config)
    examples = load_sft_examples(config.data)
    train_examples, eval_examples = split_rows(examples, config.eval_size, config.seed, "SFT data")
    train_pairs, eval_pairs = [pair for _, pair in train_examples], [pair for _, pair in eval_examples]
    tokenizer = load_tokenizer(config.model)
    check_lengths(tokenizer, examples, config.max_length)  # before the model loads
    model = load_policy(config, device)

    def to_device(rows: list[tuple[Prompt, str]]) -> dict[str, torch.Tensor]:
        batch = build_sft_batch(tokenizer, rows, config.max_length)
        return {k: v.to(device) for k, v in batch.items()}

    def loss_fn(rows: list[tuple[Prompt, str]]) -> tuple[torch.Tensor, dict[str, float]]:
        model.train()
        loss, n = completion_loss(model, to_device(rows))
        return loss, {"tokens": float(n)}

    def evaluate() -> dict[str, float]:
        if not eval_pairs:
            return {}
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            batches = range(0, len(eval_pairs), config.batch_size)
            for start in until_stopped(batches, "the held-out evaluation", "batch"):  # a signal: cut between batches
                loss, n = completion_loss(model, to_device(eval_pairs[start:start + config.batch_size]))
                total, count = total + loss.item() * n, count + n
        return {"loss": total / max(count, 1)}

    summary = fit(config, list(model.parameters()), train_pairs, loss_fn, evaluate,
                  lambda path: save_policy(model, tokenizer, path, config=config, stage="sft"),
                  name="sft", resume_from=checkpoint, row_names=[where for where, _ in train_examples])
    model.eval()
    return summary


def format_sft_summary(summary: dict[str, Any]) -> str:
    return format_summary(summary, ["loss"])


__all__ = ["SFTConfig", "check_lengths", "completion_loss", "format_sft_summary", "load_sft_examples",
           "load_sft_pairs", "parse_sft_row", "train_sft"]
