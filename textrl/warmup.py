"""A short supervised warm-up before RL: completion-only next-token loss on (prompt, completion).

RL from a randomly initialised tiny model would spend its whole budget discovering the answer
format; a few hundred SFT steps on :func:`textrl.envs.tasks.warmup_examples` teach the format (not the
task) so that PPO starts from a policy that ends its responses with EOS and earns format reward.

Each example is tokenized as the policy will see it at generation time: the prompt wrapped in
the chat template as one user turn with the generation prompt (``<|im_start|>assistant\\n``),
then the completion followed by the EOS token. Only the completion tokens and the EOS are in the
loss (the prompt's labels are ``-100``), as in TRL's ``completion_only_loss``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from textrl.run.signals import stop_phase, until_stopped

IGNORE_INDEX = -100
"""Label of tokens left out of the loss (``torch.nn.CrossEntropyLoss``'s ``ignore_index``)."""


Prompt = str | list[dict[str, str]]
"""A user message, or a conversation (``[{"role", "content"}, ...]``) up to the turn answered."""


def _prompt_text(tokenizer: Any, prompt: Prompt) -> tuple[str, bool]:
    """(text the policy continues, whether a chat template produced it)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, True
    if not isinstance(prompt, str):
        raise ValueError(
            "the tokenizer has no chat template, so a conversation prompt cannot be rendered; "
            "give the prompt as plain text or use a tokenizer with a chat template"
        )
    return prompt, False


def encode_sft_example(tokenizer: Any, prompt: Prompt, completion: str) -> tuple[list[int], int]:
    """(token ids of templated prompt + completion + EOS, number of prompt tokens).

    ``prompt`` is one user message or a conversation (a list of messages) up to the answer.

    Prompt and completion are tokenized separately, so the split is exactly where generation
    starts (BPE merges never cross it).
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id; set one so completions can end")
    text, templated = _prompt_text(tokenizer, prompt)
    # After a template the special tokens are already in the text; a BOS would double them.
    prompt_ids = tokenizer(text, add_special_tokens=not templated)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    return [*prompt_ids, *completion_ids, int(tokenizer.eos_token_id)], len(prompt_ids)


def build_sft_batch(
    tokenizer: Any, pairs: Sequence[tuple[Prompt, str]], max_length: int | None = None
) -> dict[str, Tensor]:
    """Right-padded training batch of (prompt, completion) pairs.

    Returns ``input_ids`` int64 ``[B, L]``, ``attention_mask`` int64 ``[B, L]`` and ``labels``
    int64 ``[B, L]``: the token id on completion and EOS tokens, ``-100`` on prompt and padding.
    A sequence longer than ``max_length`` loses its tail (the EOS first); one whose prompt alone
    fills ``max_length`` raises, since it would have nothing to learn.
    """
    if not pairs:
        raise ValueError("build_sft_batch: no (prompt, completion) pairs given")
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    encoded = []
    for i, (prompt, completion) in enumerate(pairs):
        ids, n_prompt = encode_sft_example(tokenizer, prompt, completion)
        if max_length is not None:
            if n_prompt >= max_length:
                raise ValueError(
                    f"pair {i}: the templated prompt is {n_prompt} tokens, not shorter than "
                    f"max_length={max_length}; raise max_length or shorten the prompt"
                )
            ids = ids[:max_length]
        encoded.append((ids, n_prompt))
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), int(pad_id), dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)  # [B, L]
    labels = torch.full((len(encoded), width), IGNORE_INDEX, dtype=torch.long)  # [B, L]
    for b, (ids, n_prompt) in enumerate(encoded):
        row = torch.tensor(ids, dtype=torch.long)
        input_ids[b, : len(ids)] = row
        attention_mask[b, : len(ids)] = 1
        labels[b, n_prompt : len(ids)] = row[n_prompt:]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _batch_order(n: int, steps: int, batch_size: int, generator: torch.Generator) -> list[Tensor]:
    """Index batches for ``steps`` steps: shuffled epochs, run on across epoch boundaries."""
    order: list[int] = []
    while len(order) < steps * batch_size:
        order.extend(torch.randperm(n, generator=generator).tolist())
    return [torch.tensor(order[s * batch_size : (s + 1) * batch_size]) for s in range(steps)]


def sft_warmup(
    model: torch.nn.Module,
    tokenizer: Any,
    pairs: Sequence[tuple[str, str]],
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    max_length: int | None = None,
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> dict[str, float]:
    """Supervised warm-up of a causal LM in place; returns ``loss_first``, ``loss_last``,
    ``steps`` and ``seconds``.

    ``steps`` AdamW steps (no weight decay, gradient norm clipped at 1) of the completion-only
    loss (see :func:`build_sft_batch`) on batches of ``batch_size`` pairs, drawn epoch by epoch
    in an order from a private ``torch.Generator`` seeded with ``seed`` (the global RNGs are
    untouched). Batches go to the model's device; each forward runs under ``autocast()`` (the
    run's :meth:`textrl.precision.Precision.autocast`). ``steps=0`` is a no-op. The model is left in
    eval mode.
    """
    if steps < 0 or batch_size < 1 or not lr > 0:
        raise ValueError(
            f"sft_warmup: need steps >= 0, batch_size >= 1 and lr > 0, got steps={steps}, "
            f"batch_size={batch_size}, lr={lr}"
        )
    if steps and not pairs:
        raise ValueError("sft_warmup: no (prompt, completion) pairs to train on")
    start = time.perf_counter()
    losses: list[float] = []
    if steps:
        generator = torch.Generator().manual_seed(int(seed))
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        model.train()
        batches = _batch_order(len(pairs), steps, batch_size, generator)
        # in a run, a stop signal ends the warm-up between two steps (StopRequested): nothing of it
        # is saved, and the command run again starts it over
        with stop_phase("the current warm-up step", "stopping before the first iteration (nothing is saved "
                        "before it; the same command starts the warm-up over)", stoppable=True):
            losses = _train_steps(model, tokenizer, pairs, until_stopped(batches, "the supervised warm-up"),
                                  optimizer, params, max_length, autocast)
    model.eval()
    nan = float("nan")
    return {
        "loss_first": losses[0] if losses else nan,
        "loss_last": losses[-1] if losses else nan,
        "steps": float(len(losses)),
        "seconds": time.perf_counter() - start,
    }


def _train_steps(model: torch.nn.Module, tokenizer: Any, pairs: Sequence[tuple[str, str]], batches: Any,
                 optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_length: int | None,
                 autocast: Callable[[], AbstractContextManager[Any]]) -> list[float]:
    """One AdamW step (gradient norm clipped at 1) per batch of indices; the losses."""
    device = next(model.parameters()).device
    losses: list[float] = []
    for indices in batches:
        batch = build_sft_batch(tokenizer, [pairs[i] for i in indices], max_length)
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast():
            loss = model(**batch, use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


__all__ = ["IGNORE_INDEX", "build_sft_batch", "encode_sft_example", "sft_warmup"]
