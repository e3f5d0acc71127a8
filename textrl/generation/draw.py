"""The next token drawn on the device, with no host sync: argmax when greedy, else one draw from
the filtered distribution as ``generate`` makes it (what a captured step can hold), and, when
asked, its log-prob under that distribution."""

from __future__ import annotations

import torch
from torch import Tensor

from textrl.generation.base import Sampling


def draw(probs: Tensor) -> Tensor:
    """One index a row of ``probs`` ``[B, V]``, without a host sync: ``argmax(probs / q)``, ``q ~
    Exp(1)``. It is the draw ``torch.multinomial(probs, 1)`` makes (same generator, same numbers:
    the same tokens for the same seed), minus its check of the probabilities on the host, which a
    CUDA graph cannot hold."""
    q = torch.empty_like(probs).exponential_(1)
    return (probs / q).argmax(-1)


INVALID = "probability tensor contains either `inf`, `nan` or element < 0"
"""What ``torch.multinomial`` raises on non-finite probabilities, and the ``textrl`` engine with it
(textrl.agents.actor.Actor.sample turns it into the overflow error that names the learning rate)."""


def warped(logits: Tensor, sampling: Sampling) -> Tensor:
    """``[B, V]`` logits -> float32 ``[B, V]``: ``sampling_filter(logits / temperature)``, the logits of
    the distribution a row draws from (temperature, then top-k, then top-p; ``-inf`` on the entries
    filtered out); the temperature 1 left out, as no division by 1 changes a value."""
    from textrl.functional import sampling_filter

    logits = logits.float()
    z = logits / sampling.temperature if sampling.temperature != 1.0 else logits
    return sampling_filter(z, sampling.top_k, sampling.top_p)


def next_tokens(logits: Tensor, sampling: Sampling, invalid: Tensor | None = None) -> Tensor:
    """``[B, V]`` logits -> ``[B]`` tokens: argmax when greedy, else one draw (:func:`draw`) from
    ``softmax(sampling_filter(logits / temperature))`` in float32, as ``generate`` draws. When
    sampling, ``invalid`` (a bool tensor on the device) is or-ed with "some logit is not finite",
    the check ``torch.multinomial`` makes on the host, here without a sync."""
    logits = logits.float()
    if sampling.greedy:
        return logits.argmax(-1)
    if invalid is not None:
        invalid.logical_or_(~torch.isfinite(logits).all())
    return draw(warped(logits, sampling).softmax(-1))


def next_tokens_and_logprobs(logits: Tensor, sampling: Sampling,
                             invalid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`next_tokens`' tokens ``[B]`` (the same draw: the same random numbers, the same tokens)
    and their log-probs ``[B]`` (float32) under the distribution drawn from: when sampling, the log
    of the drawn token's probability, gathered from the probabilities of the draw (no second
    softmax over the vocabulary); when greedy, the argmax's log-prob under ``sampling_filter(logits
    / temperature)`` (0.0 at a temperature <= 0, the limit: the argmax is certain)."""
    logits = logits.float()
    if sampling.greedy:
        tokens = logits.argmax(-1)
        if not sampling.temperature > 0:
            return tokens, torch.zeros(tokens.shape, device=logits.device)
        z = warped(logits, sampling)
        return tokens, z.gather(-1, tokens[:, None])[:, 0] - z.logsumexp(-1)
    if invalid is not None:
        invalid.logical_or_(~torch.isfinite(logits).all())
    probs = warped(logits, sampling).softmax(-1)
    tokens = draw(probs)
    return tokens, probs.gather(-1, tokens[:, None])[:, 0].log()


__all__ = ["INVALID", "draw", "next_tokens", "next_tokens_and_logprobs", "warped"]
