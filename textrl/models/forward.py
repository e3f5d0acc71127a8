"""Model forwards that never hand a fully masked attention row to an attention kernel.

A row padded on the left (a prompt shorter than the batch's longest) has query positions whose
causal window holds padding only: their attention rows are fully masked. Fused attention kernels
treat such rows badly in the backward (NaN query gradients: cuDNN's since PyTorch 2.11, the
memory-efficient kernel for some shapes), and transformers stopped un-masking them (5.15). So the
forwards here first rotate each row's columns left by its count of leading padding: the row's
tokens start at column 0 and its padding follows them, where every query attends to at least the
row's first token. Position ids come from the mask (``cumsum - 1``), so every token keeps the
position it had; the outputs are rotated back, so callers see the layout they passed. A row
with no leading padding is left as it is; so is a batch with none (no copy at all).

- :func:`response_logits`: a causal LM's logits that predict the tokens after ``prompt_len``;
  the rotation back happens on the hidden states just before the LM head (a gather of
  ``[B, T, H]``, not of ``[B, T, V]`` logits), so the head runs on the response columns only.
- :func:`hidden_states`: a transformer body's final hidden states ``[B, L, H]`` (critics,
  reward heads).

Docs: docs/design.md, "Precision and padding".
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import Tensor, nn


def leading_padding(attention_mask: Tensor) -> Tensor:
    """Columns before each row's first attended token, int64 ``[B]`` (0 for a row without one).
    ``attention_mask`` ``[B, L]`` (bool or 0/1)."""
    mask = attention_mask.bool()
    if mask.shape[1] == 0:
        return torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    first = mask.int().argmax(dim=1)  # the first True; 0 for a row of Falses
    return torch.where(mask.any(dim=1), first, 0).long()


def rotate_rows(x: Tensor, shift: Tensor) -> Tensor:
    """``y[b, j] = x[b, (j + shift[b]) mod L]``: each row of ``x`` ``[B, L, ...]`` rotated left by
    ``shift[b]`` columns (a negative shift rotates right). Returns a new tensor of ``x``'s shape."""
    if x.dim() < 2 or shift.shape != (x.shape[0],):
        raise ValueError(f"rotate_rows: x must be [B, L, ...] and shift [B], got {tuple(x.shape)} and "
                         f"{tuple(shift.shape)}")
    length = x.shape[1]
    index = (torch.arange(length, device=x.device) + shift.to(x.device)[:, None]) % length  # [B, L]
    return x.gather(1, index.view(*index.shape, *([1] * (x.dim() - 2))).expand(x.shape))


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids ``cumsum(mask) - 1`` clamped at 0, int64 ``[B, L]``: padding takes no position."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _left_aligned(input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(input_ids, attention_mask, position_ids, shift)`` with each row's tokens moved to column 0
    (``shift`` ``[B]``), or the inputs as they are and ``shift=None`` when no row is padded on the left."""
    shift = leading_padding(attention_mask)
    if not bool(shift.any()):
        return input_ids, attention_mask, positions_from_mask(attention_mask), None
    ids, mask = rotate_rows(input_ids, shift), rotate_rows(attention_mask, shift)
    return ids, mask, positions_from_mask(mask), shift


@functools.cache
def _accepts_logits_to_keep(model_type: type) -> bool:
    """Whether ``model_type.forward`` names HF's ``logits_to_keep`` (wrappers taking ``**kwargs`` do not count)."""
    try:
        return "logits_to_keep" in inspect.signature(model_type.forward).parameters
    except (TypeError, ValueError):
        return False


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """The module a causal LM applies to its final hidden states to get logits (its LM head), or None."""
    getter = getattr(model, "get_output_embeddings", None)
    try:
        head = getter() if callable(getter) else None
    except (AttributeError, NotImplementedError):
        return None
    return head if isinstance(head, nn.Module) else None


def response_logits(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> Tensor:
    """Logits that predict each token after the first ``prompt_len`` columns: ``[B, L - P, V]``.

    ``input_ids``, ``attention_mask`` ``[B, L]``, the prompt left-padded in the first ``P`` columns.
    Column ``t`` of the result is the model's output at column ``P + t - 1`` of the input. No
    attention row is fully masked (module docstring); without left padding this is one forward with
    ``logits_to_keep`` (when the model takes it), as a plain call would be.
    """
    length = input_ids.shape[1]
    n_out = length - prompt_len
    if prompt_len < 1 or n_out < 0:
        raise ValueError(f"response_logits: prompt_len={prompt_len} must lie in [1, {length}] for inputs of "
                         f"{length} columns")
    ids, mask, positions, shift = _left_aligned(input_ids, attention_mask)
    kwargs: dict[str, Any] = dict(input_ids=ids, attention_mask=mask.long(), position_ids=positions, use_cache=False)
    head = output_embeddings(model) if shift is not None else None
    if shift is None or head is None:
        if shift is None and _accepts_logits_to_keep(type(model)):
            kwargs["logits_to_keep"] = n_out + 1
        logits = model(**kwargs).logits  # [B, L, V], or [B, n_out + 1, V] with logits_to_keep
        if shift is not None:  # no LM head module to gather before: rotate the logits back
            logits = rotate_rows(logits, -shift)
        return logits[:, logits.shape[1] - n_out - 1 : -1]
    # the LM head reads the hidden states of the wanted columns only, in the caller's layout
    wanted = (torch.arange(prompt_len - 1, length - 1, device=ids.device) - shift[:, None]) % length  # [B, n_out]
    calls = []

    def gather_wanted(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]  # [B, L, H]
        calls.append(hidden.shape)
        picked = hidden.gather(1, wanted[:, :, None].expand(-1, -1, hidden.shape[-1]))  # [B, n_out, H]
        return (picked, *args[1:])

    handle = head.register_forward_pre_hook(gather_wanted)
    try:
        logits = model(**kwargs).logits
    finally:
        handle.remove()
    if len(calls) != 1 or tuple(logits.shape[:2]) != (input_ids.shape[0], n_out):
        raise RuntimeError(f"{type(model).__name__}'s LM head ran {len(calls)} times on one forward, or its logits "
                           f"have shape {tuple(logits.shape)}; textrl.models.forward expects one LM head call on the "
                           "final hidden states [B, L, H]")
    return logits


def hidden_states(body: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Final hidden states ``[B, L, H]`` of a transformer body (``LlamaModel``, a PeftModel's base
    body, ...), in the caller's layout, positions from the mask, no attention row fully masked."""
    ids, mask, positions, shift = _left_aligned(input_ids, attention_mask)
    out = body(input_ids=ids, attention_mask=mask.long(), position_ids=positions, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [B, L, H]
    return hidden if shift is None else rotate_rows(hidden, -shift)


__all__ = ["hidden_states", "leading_padding", "output_embeddings", "positions_from_mask", "response_logits",
           "rotate_rows"]
