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
- :func:`response_hidden`: the final hidden states the LM head would turn into
  :func:`response_logits`, ``[B, L - P, H]``, and the head; the head itself gets (almost)
  nothing to do. :func:`response_logprobs` feeds them to
  :func:`textrl.functional.logprobs_from_hidden`, so no ``[B, T, V]`` logits exist at all. Only
  for a model whose logits are the plain ``F.linear(hidden, head.weight, head.bias)``
  (:func:`unfusable_reason`); others raise :class:`UnfusableHead`, and callers use
  :func:`response_logits`.

Docs: docs/design.md, "Precision and padding".
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from textrl.functional.logprobs import logprobs_from_hidden


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


LOGIT_POSTPROCESSING = {"final_logit_softcapping": None, "logit_softcapping": None, "logits_scaling": 1.0,
                       "logit_scale": 1.0}
"""Config fields (of a model's config or its text config) with which transformers' models change the
LM head's output (Gemma's tanh soft-capping, Granite's division, Cohere's scale), each with the
value that leaves the logits as they are."""


class UnfusableHead(ValueError):
    """A model's logits are not ``F.linear(final hidden states, head.weight, head.bias)``, so
    :func:`response_hidden` / :func:`response_logprobs` do not apply: use :func:`response_logits`."""


_REFUSED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
"""Models whose forward was seen to change the head's logits (:func:`response_hidden`'s probe)."""


def _partitioned(weight: Tensor) -> bool:
    """An FSDP2 shard (``DTensor``), a DeepSpeed ZeRO-3 partition or a meta tensor: not the whole weight."""
    if weight.is_meta or hasattr(weight, "ds_id"):
        return True
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed
        return False
    return isinstance(weight, DTensor)


def unfusable_reason(model: nn.Module) -> str | None:
    """Why the LM head of ``model`` cannot be applied outside its forward, or None when it can.

    Fusable: :func:`output_embeddings` is a plain ``torch.nn.Linear`` (not a subclass: no LoRA
    wrapper, no 4-bit / 8-bit layer) without hooks of its own, its weight whole on one device (no
    FSDP / ZeRO-3 partition, no offloading), and no config field of :data:`LOGIT_POSTPROCESSING`
    away from its neutral value; and no earlier :func:`response_hidden` saw the model's logits
    differ from its head's output.
    """
    if model in _REFUSED:
        return _REFUSED[model]
    head = output_embeddings(model)
    if head is None:
        return f"{type(model).__name__} has no LM head (get_output_embeddings() gives none)"
    if type(head) is not nn.Linear:
        return (f"its LM head is a {type(head).__module__}.{type(head).__qualname__}, not a plain torch.nn.Linear "
                "(a LoRA-wrapped or quantised head computes more than its weight and bias show)")
    if head._forward_hooks or head._forward_pre_hooks or "forward" in vars(head) or hasattr(head, "_hf_hook"):
        return "its LM head has forward hooks or a replaced forward (offloading, sharding, ...)"
    if _partitioned(head.weight) or (head.bias is not None and _partitioned(head.bias)):
        return "its LM head's weight is partitioned or not loaded (FSDP, DeepSpeed ZeRO-3, meta device)"
    config = getattr(model, "config", None)
    configs = [config]
    text = getattr(config, "get_text_config", None)
    if callable(text):
        configs.append(text())
    for cfg in configs:
        for name, neutral in LOGIT_POSTPROCESSING.items():
            value = getattr(cfg, name, neutral)
            if value is not None and value != neutral:
                return f"config.{name}={value!r}: the model post-processes its LM head's logits"
    return None


def response_hidden(model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                    prompt_len: int) -> tuple[Tensor, nn.Linear]:
    """``(hidden [B, L - P, H], head)``: the final hidden states that ``model``'s LM head ``head`` (a
    plain ``nn.Linear``) turns into :func:`response_logits`, and that head.

    Inputs as :func:`response_logits`; column ``t`` of ``hidden`` is the model's final hidden state
    at column ``P + t - 1`` of the input, so ``F.linear(hidden, head.weight, head.bias)`` equals
    ``response_logits(...)`` (same left-alignment: no attention row fully masked). One forward, with
    a pre-hook on the head that keeps those columns and hands the head a single position
    ``[1, 1, H]`` instead of ``[B, L, H]``: a probe whose output is compared with ``head`` applied
    to it, which catches a forward that post-processes the logits under a name
    :data:`LOGIT_POSTPROCESSING` does not list. Gradients flow to the body through ``hidden``;
    use ``head.weight`` / ``head.bias`` for the head's.

    Raises :class:`UnfusableHead` (a ``ValueError``) before any forward when
    :func:`unfusable_reason` names one, or after the forward when the probe differs (the model is
    then remembered as unfusable); the caller falls back to :func:`response_logits`.
    """
    reason = unfusable_reason(model)
    if reason is not None:
        raise UnfusableHead(f"response_hidden: {type(model).__name__}: {reason}; use response_logits")
    batch, length = input_ids.shape
    n_out = length - prompt_len
    if prompt_len < 1 or n_out < 0:
        raise ValueError(f"response_hidden: prompt_len={prompt_len} must lie in [1, {length}] for inputs of "
                         f"{length} columns")
    head = output_embeddings(model)
    ids, mask, positions, shift = _left_aligned(input_ids, attention_mask)
    if shift is not None:  # the wanted columns of the left-aligned rows, in the caller's layout
        wanted = (torch.arange(prompt_len - 1, length - 1, device=ids.device) - shift[:, None]) % length  # [B, n_out]
    seen: list[tuple[int, ...]] = []
    kept: list[Tensor] = []

    def keep_wanted(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]  # [B, L, H]
        seen.append(tuple(hidden.shape))
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != (batch, length):
            return args
        if shift is None:
            kept.append(hidden[:, prompt_len - 1 : length - 1])
        else:
            kept.append(hidden.gather(1, wanted[:, :, None].expand(-1, -1, hidden.shape[-1])))
        kept.append(hidden[:1, :1])  # the probe
        return (kept[-1], *args[1:])

    handle = head.register_forward_pre_hook(keep_wanted)
    try:
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions, use_cache=False).logits
    finally:
        handle.remove()
    if len(seen) != 1 or len(kept) != 2:
        raise RuntimeError(f"{type(model).__name__}'s LM head ran {len(seen)} times on one forward, on "
                           f"{seen}; textrl.models.forward expects one LM head call on the final hidden "
                           f"states [B, L, H] = [{batch}, {length}, H]")
    hidden, probe = kept
    check_head_probe(model, head, probe, logits, "response_hidden")
    return hidden, head


def check_head_probe(model: nn.Module, head: nn.Module, probe: Tensor, logits: Tensor, caller: str) -> None:
    """Raise :class:`UnfusableHead` (and remember ``model`` as unfusable) unless ``logits``, what
    ``model``'s forward returned for the one position ``probe`` ``[1, 1, H]`` its head was handed,
    equal ``head(probe)``: a forward that post-processes its head's output fails it."""
    with torch.no_grad():
        expected = head(probe)  # [1, 1, V], under the caller's autocast like the forward's call
    if tuple(logits.shape) != tuple(expected.shape) or not torch.equal(logits.detach(), expected.to(logits.dtype)):
        _REFUSED[model] = "its forward changes its LM head's output (soft-capping, scaling, ...; seen on a probe)"
        raise UnfusableHead(f"{caller}: {type(model).__name__}: {_REFUSED[model]}; use response_logits")


def response_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int,
                      tokens: Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                      chunk_size: int | None = None, entropy: str = "none") -> tuple[Tensor, Tensor | None]:
    """``(logp [B, T], entropy [B, T] or None)`` of the response ``tokens`` ``[B, T]`` (``T = L - P``,
    the last ``T`` columns of ``input_ids``) under ``model``'s sampling distribution, without the
    ``[B, T, V]`` logits: :func:`response_hidden`, then
    :func:`textrl.functional.logprobs_from_hidden` with the head's weight and bias (see there for
    ``temperature``, ``top_k``, ``top_p``, ``chunk_size``, ``entropy``).

    Equal, up to rounding and with the same gradients, to :func:`response_logits` followed by the
    warping and :func:`textrl.functional.logprobs_from_logits` /
    :func:`textrl.functional.entropy_from_logits`, under the caller's autocast too. Raises
    :class:`UnfusableHead` as :func:`response_hidden` does.
    """
    hidden, head = response_hidden(model, input_ids, attention_mask, prompt_len)
    return logprobs_from_hidden(hidden, head.weight, tokens, bias=head.bias, temperature=temperature, top_k=top_k,
                                top_p=top_p, chunk_size=chunk_size, entropy=entropy)


def hidden_states(body: nn.Module, input_ids: Tensor, attention_mask: Tensor | None,
                  position_ids: Tensor | None = None) -> Tensor:
    """Final hidden states ``[B, L, H]`` of a transformer body (``LlamaModel``, a PeftModel's base
    body, ...), in the caller's layout, positions from the mask, no attention row fully masked.

    ``attention_mask=None``: packed rows (:mod:`textrl.models.packing`) whose ``position_ids``
    restart at each row, from which the model builds its masks; nothing is padded."""
    if attention_mask is None:
        out = body(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    ids, mask, positions, shift = _left_aligned(input_ids, attention_mask)
    out = body(input_ids=ids, attention_mask=mask.long(), position_ids=positions, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [B, L, H]
    return hidden if shift is None else rotate_rows(hidden, -shift)


__all__ = ["LOGIT_POSTPROCESSING", "UnfusableHead", "check_head_probe", "hidden_states", "leading_padding", "output_embeddings",
           "positions_from_mask", "response_hidden", "response_logits", "response_logprobs", "rotate_rows",
           "unfusable_reason"]
