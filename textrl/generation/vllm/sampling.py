"""What a vLLM engine asks and what it hands back: the sampling settings of textrl's
:class:`~textrl.generation.base.Sampling` (:func:`sampling_params`), one seed a request from the run's
random stream (:func:`row_seeds`), the contexts without their padding (:func:`prompt_token_ids`) and
the drawn rows stacked into ``[B, T]`` tensors (:func:`stack_outputs`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from textrl.generation.base import Sampling


def sampling_params(sampling: Sampling, *, logprobs: bool, seed: int | None) -> dict[str, Any]:
    """vLLM ``SamplingParams`` keywords drawing what ``sampling`` describes (greedy: temperature 0),
    one row, token ids only, textrl's EOS the only stop; ``logprobs=0``: the drawn token's log-prob."""
    params: dict[str, Any] = dict(
        n=1, max_tokens=sampling.max_new_tokens, detokenize=False, skip_special_tokens=False,
        ignore_eos=True, stop_token_ids=None if sampling.eos_token_id is None else [sampling.eos_token_id],
        temperature=0.0 if sampling.greedy else sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
        repetition_penalty=1.0, min_p=0.0, seed=seed,
    )
    if logprobs:
        params["logprobs"] = 0
    return params


def row_seeds(rows: int, sampling: Sampling) -> list[int | None]:
    """The vLLM seeds of ``rows`` requests: drawn from torch's global generator when sampling (a
    seeded run repeats its rollouts), none when greedy (an argmax needs none, and a greedy call, the
    held-out evaluation's or ``samples.jsonl``'s, then leaves the run's random stream as it found it)."""
    if sampling.greedy:
        return [None] * rows
    return torch.randint(0, 2**31 - 1, (rows,)).tolist()


def prompt_token_ids(input_ids: Tensor, attention_mask: Tensor) -> list[list[int]]:
    """Each row's context without its (left) padding: ``[B, P]`` -> B lists of ids."""
    return [row[mask.bool()].tolist() for row, mask in zip(input_ids.cpu(), attention_mask.cpu(), strict=True)]


def stack_outputs(rows: list[tuple[list[int], list[float] | None]], sampling: Sampling,
                  device: torch.device) -> tuple[Tensor, Tensor | None]:
    """``(token ids, log-probs or None)`` per row -> ``tokens [B, T]`` (``pad_token_id`` after a
    row's end) and float32 ``logp [B, T]`` (0 after it; None when any row has none), ``T`` the
    longest row."""
    width = max(1, max(len(ids) for ids, _ in rows))
    tokens = torch.full((len(rows), width), sampling.pad_token_id, dtype=torch.long)
    logp = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (ids, lps) in enumerate(rows):
        tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        if lps is not None:
            logp[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
    has_logp = all(lps is not None for _, lps in rows)
    return tokens.to(device), (logp.to(device) if has_logp else None)


def drawn_logprobs(output: Any) -> list[float] | None:
    """The drawn tokens' log-probs of one vLLM ``CompletionOutput`` (None: none were asked for)."""
    if output.logprobs is None:
        return None
    return [step[token].logprob for token, step in zip(output.token_ids, output.logprobs, strict=True)]



__all__ = ["drawn_logprobs", "prompt_token_ids", "row_seeds", "sampling_params", "stack_outputs"]
