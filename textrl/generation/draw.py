"""The next token drawn on the device, with no host sync: argmax when greedy, else one draw from
the filtered distribution as ``generate`` makes it (what a captured step can hold)."""

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
(textrl.agents.forwards.act turns it into the overflow error that names the learning rate)."""


def next_tokens(logits: Tensor, sampling: Sampling, invalid: Tensor | None = None) -> Tensor:
    """``[B, V]`` logits -> ``[B]`` tokens: argmax when greedy, else one draw (:func:`draw`) from
    ``softmax(sampling_filter(logits / temperature))`` in float32, as ``generate`` draws. When
    sampling, ``invalid`` (a bool tensor on the device) is or-ed with "some logit is not finite",
    the check ``torch.multinomial`` makes on the host, here without a sync."""
    from textrl.functional import sampling_filter

    logits = logits.float()
    if sampling.greedy:
        return logits.argmax(-1)
    if invalid is not None:
        invalid.logical_or_(~torch.isfinite(logits).all())
    z = logits / sampling.temperature if sampling.temperature != 1.0 else logits
    z = sampling_filter(z, sampling.top_k, sampling.top_p)
    return draw(z.softmax(-1))


__all__ = ["INVALID", "draw", "next_tokens"]
