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

import hashlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from textrl.run.signals import stop_phase, until_stopped
from textrl.run.user_code import file_sha256

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
    run's :meth:`textrl.core.precision.Precision.autocast`). ``steps=0`` is a no-op. The model is left in
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


# -- the warmed-up start, kept in the run folder ------------------------------------------------------

KEPT_WARMUP = "warmup"
"""The folder in a run folder that keeps the warmed-up policy (``policy.pt``: its state dict) and
``record.json`` (the warm-up's settings, its statistics and the sha256 of ``policy.pt``)."""


@dataclass(frozen=True)
class WarmupStore:
    """Where a run keeps its warmed-up start (``folder``: ``RUN/warmup``), whether this process
    loads it when it is there (``load``: a ``--resume``) and whether it writes it after a warm-up
    (``save``: the main process)."""

    folder: Path
    load: bool
    save: bool


_STORE: ContextVar[WarmupStore | None] = ContextVar("textrl_warmup_store", default=None)


@contextmanager
def keeping_warmup(output_dir: str | Path, *, load: bool, save: bool) -> Iterator[WarmupStore]:
    """Within the block, :func:`warm_up` loads the start kept in ``output_dir`` (``load``) instead of
    running the warm-up again, and keeps the one it runs (``save``): a resumed run never repeats
    the warm-up, and its reference model is the same copy of the same start."""
    store = WarmupStore(Path(output_dir) / KEPT_WARMUP, load=load, save=save)
    token = _STORE.set(store)
    try:
        yield store
    finally:
        _STORE.reset(token)


def warmup_settings(model: str, pairs: Sequence[tuple[Prompt, str]], **settings: Any) -> dict[str, Any]:
    """What defines a warm-up's result, as ``record.json`` holds it: the model, the settings
    (steps, lr, batch size, seed, dtype) and the sha256 of the (prompt, completion) pairs."""
    text = json.dumps([list(p) for p in pairs], sort_keys=True, default=str)
    return {"model": model, **settings, "pairs_sha256": hashlib.sha256(text.encode()).hexdigest()}


def warm_up(model: torch.nn.Module, tokenizer: Any, pairs: Sequence[tuple[Prompt, str]], *, steps: int, lr: float,
            batch_size: int, seed: int, model_name: str, log: Callable[[str], Any] = print,
            autocast: Callable[[], AbstractContextManager[Any]] = nullcontext) -> dict[str, float]:
    """:func:`sft_warmup` of ``model`` in place, or, within :func:`keeping_warmup` with ``load``, the
    weights a run kept after the same warm-up (its :func:`warmup_settings`: ``model_name``, the
    pairs, the steps, lr, batch size, seed and the weights' dtype; and the file's sha256 must match;
    otherwise it runs, saying why). Logs one line; returns the statistics (``loaded``: 1.0 when the
    weights were loaded)."""
    settings = warmup_settings(model_name, pairs, steps=steps, lr=lr, batch_size=batch_size, seed=seed,
                               dtype=str(next(model.parameters()).dtype))
    store = _STORE.get()
    if store is not None and store.load:
        kept = _load_kept(model, store.folder, settings, log)
        if kept is not None:
            log(f"warm-up: loaded from {store.folder} ({int(kept['steps'])} SFT steps, the start this run "
                f"trained from; not run again)")
            return kept
    stats = sft_warmup(model, tokenizer, pairs, steps=steps, lr=lr, batch_size=batch_size, seed=seed, autocast=autocast)
    log(f"warm-up: {int(stats['steps'])} SFT steps on the format, loss {stats['loss_first']:.2f} -> "
        f"{stats['loss_last']:.2f} in {stats['seconds']:.1f}s")
    if store is not None and store.save:
        _keep(model, store.folder, settings, stats)
    return {**stats, "loaded": 0.0}


def _keep(model: torch.nn.Module, folder: Path, settings: dict[str, Any], stats: dict[str, float]) -> None:
    """Write ``folder`` (atomically: a temporary sibling, renamed): ``policy.pt`` and ``record.json``."""
    from textrl.run.atomic import write_folder

    def write(tmp: Path) -> None:
        torch.save(model.state_dict(), tmp / "policy.pt")
        record = {"settings": settings, "stats": stats, "policy_sha256": file_sha256(tmp / "policy.pt")}
        (tmp / "record.json").write_text(json.dumps(record, indent=2) + "\n")

    write_folder(folder, write)


def _load_kept(model: torch.nn.Module, folder: Path, settings: dict[str, Any],
               log: Callable[[str], Any]) -> dict[str, float] | None:
    """The kept warm-up's statistics after loading its weights into ``model``; None (and a line
    saying why, when a kept start is there but unusable) when the warm-up must run."""
    record_file, weights = folder / "record.json", folder / "policy.pt"
    if not record_file.is_file():
        return None
    try:
        record = json.loads(record_file.read_text())
        why = ("its settings differ from this run's" if record["settings"] != json.loads(json.dumps(settings))
               else "policy.pt is missing or corrupt (its sha256 differs from record.json's)"
               if file_sha256(weights) != record["policy_sha256"] else None)
    except (ValueError, KeyError, TypeError) as err:
        why = f"record.json cannot be read ({type(err).__name__}: {err})"
    if why is None:
        state = torch.load(weights, map_location=next(model.parameters()).device, weights_only=True)
        model.load_state_dict(state)
        model.eval()
        return {**record["stats"], "loaded": 1.0}
    log(f"warm-up: the start kept in {folder} is not used ({why}); running the warm-up again")
    return None


__all__ = ["IGNORE_INDEX", "KEPT_WARMUP", "WarmupStore", "build_sft_batch", "encode_sft_example", "keeping_warmup",
           "sft_warmup", "warm_up", "warmup_settings"]
