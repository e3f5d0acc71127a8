"""Models run on a :class:`textrl.models.packing.Packing`: the padding-free forwards (``padding_free``).

- :func:`packing_layout`: the layout a model takes. A probe runs once per model (three forwards
  of at most seven tokens): two runs packed in one row, against the second alone and against both
  joined under one mask. A model whose packed outputs are the lone run's (transformers' models
  whose masks come from ``masking_utils``, and flash attention's varlen path) takes ``one_row``
  under flash attention and ``bins`` under sdpa / eager / flex; one whose outputs leak across the
  runs (a model that ignores ``position_ids`` in its masks, or whose forward refuses them) takes
  ``per_row``: one unpadded forward per row, exact for any causal model.
- :func:`packed_logits` / :func:`packed_hidden`: the LM head on the picked positions only (a
  pre-hook on the head gathers them, as :func:`textrl.models.forward.response_logits` does), so no
  logits are computed for padding or prompts.
- :func:`packed_values`: a critic's values at the picks; a critic takes packed rows when its
  ``forward`` accepts ``position_ids`` (with ``attention_mask=None``) and its ``backbone``
  honours them, else one row at a time.
- :func:`packed_scores`: a sequence scorer's (a reward model's) score at each row's last token
  (:func:`textrl.models.packing.pack_last_tokens`), read from its per-token score head; it takes
  packed rows when its ``forward`` accepts ``position_ids`` and it has such a head
  (:func:`scorer_layout`: its body probed as the policy is), else one row at a time.

Docs: docs/design.md, "Padding-free forwards".
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from textrl.models.adapters import transformer_body
from textrl.models.forward import (
    UnfusableHead,
    check_head_probe,
    output_embeddings,
    unfusable_reason,
)
from textrl.models.packing import Call, Packing

LEAK_RATIO = 0.1
"""The probe's bound: packed outputs count as the lone run's when they differ from it by less
than this share of what joining the runs under one mask changes (rounding is ~1e-7 of it in
float32 and ~1e-2 in bf16; a leak is all of it)."""

_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, tuple[str | None, str]] = weakref.WeakKeyDictionary()
"""Each probed model's attention implementation then and its layout (:func:`packing_layout`)."""


def _features(out: Any) -> Tensor:
    """The per-position outputs of a forward: logits, last hidden states, or the tensor itself ``[B, L, ...]``."""
    for name in ("logits", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, Tensor):
            return value
    return out if isinstance(out, Tensor) else out[0]


def run_call(model: nn.Module, call: Call) -> Any:
    """``model``'s forward on one :class:`~textrl.models.packing.Call` (no KV cache: with one,
    transformers builds no packed mask)."""
    return model(input_ids=call.input_ids, attention_mask=call.attention_mask, position_ids=call.position_ids,
                 use_cache=False)


@torch.no_grad()
def honours_packed_positions(model: nn.Module, device: torch.device | str) -> bool:
    """Whether ``model`` attends only within a run when runs are packed in one row with positions
    restarting at 0 and no attention mask (the probe of the module docstring, in eval mode, the
    modes restored after)."""
    config = getattr(model, "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 8)
    first = torch.tensor([[1, 2, 3, 4]], device=device) % vocab
    second = torch.tensor([[5, 6, 7]], device=device) % vocab
    both = torch.cat([first, second], 1)  # [1, 7]
    restart = torch.tensor([[0, 1, 2, 3, 0, 1, 2]], device=device)
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        alone = _features(model(input_ids=second, position_ids=restart[:, 4:], use_cache=False)).float()
        packed = _features(model(input_ids=both, position_ids=restart, use_cache=False)).float()[:, 4:]
        joined = _features(model(input_ids=both, attention_mask=torch.ones_like(both), position_ids=restart,
                                 use_cache=False)).float()[:, 4:]
    except Exception:  # noqa: BLE001 - a forward that refuses packed inputs takes the per-row layout
        return False
    finally:
        for module, mode in modes:
            module.training = mode
    if packed.dim() < 2 or packed.shape[1] != 3 or alone.shape[1] != 3:
        return False  # no output per position (a pooled one): nothing to compare, one row at a time
    leak = float((joined - alone).abs().max())
    return float((packed - alone).abs().max()) <= LEAK_RATIO * leak


def attention_implementation(model: nn.Module) -> str | None:
    """The attention kernels ``model``'s config names (``sdpa``, ``eager``, ``flash_attention_2``, ...), or None."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def packing_layout(model: nn.Module, device: torch.device | str) -> str:
    """``one_row`` (flash attention), ``bins`` (other kernels) or ``per_row`` (packed positions not
    honoured: :func:`honours_packed_positions`); probed once per model and attention implementation."""
    impl = attention_implementation(model)
    seen, layout = _LAYOUTS.get(model, (None, None))
    if layout is None or seen != impl:
        if not honours_packed_positions(model, device):
            layout = "per_row"
        else:
            layout = "one_row" if "flash" in str(impl or "") else "bins"
        _LAYOUTS[model] = (impl, layout)
    return layout


def critic_layout(critic: nn.Module, device: torch.device | str) -> str:
    """A critic's layout: its ``backbone``'s (:func:`packing_layout`) when its ``forward`` takes
    ``position_ids``, else ``per_row``."""
    backbone = getattr(critic, "backbone", None)
    try:
        takes = "position_ids" in inspect.signature(critic.forward).parameters
    except (TypeError, ValueError):
        takes = False
    return packing_layout(backbone, device) if takes and isinstance(backbone, nn.Module) else "per_row"


def takes(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` accepts the keyword ``name`` (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def score_head(model: nn.Module) -> nn.Module | None:
    """A sequence scorer's head run on every position's final hidden state (transformers'
    ``*ForSequenceClassification.score``, whose per-token outputs ``[k, w, labels]`` it pools
    after), or textrl's reward adapter's ``score_head``; None when it has neither."""
    for name in ("score", "score_head"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
    return None


def scorer_body(model: nn.Module) -> nn.Module | None:
    """The transformer body a sequence scorer reads hidden states from: its ``backbone`` (textrl's
    views), else the body under it (:func:`textrl.models.adapters.transformer_body`: transformers'
    ``model.model``, ``model.transformer``, under a PeftModel too); None when it names neither."""
    backbone = getattr(model, "backbone", None)
    if isinstance(backbone, nn.Module):
        return backbone
    body = transformer_body(model)
    return body if body is not model else None


def scorer_layout(model: nn.Module, device: torch.device | str) -> str:
    """A sequence scorer's (reward model's) layout: its body's (:func:`packing_layout`, probed as the
    policy is) when its ``forward`` takes ``position_ids`` and it has a :func:`score_head` whose
    per-token outputs the picks read, else ``per_row``."""
    body = scorer_body(model)
    if body is None or score_head(model) is None or not takes(model, "position_ids"):
        return "per_row"
    return packing_layout(body, device)


def _picking(picks: Tensor, seen: list[tuple[int, ...]], kept: list[Tensor] | None) -> Callable[..., tuple[Any, ...]]:
    """A pre-hook for an LM head that hands it the picked positions ``[1, n, H]`` of its input
    ``[k, w, H]`` or, with ``kept``, keeps them there and hands it one position (a probe)."""

    def hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        seen.append(tuple(hidden.shape))
        picked = hidden.reshape(-1, hidden.shape[-1])[picks][None]  # [1, n, H]
        if kept is None:
            return (picked, *args[1:])
        kept.append(picked[0])
        return (picked[:, :1], *args[1:])

    return hook


def _hooked(model: nn.Module, head: nn.Module, call: Call, kept: list[Tensor] | None) -> Tensor:
    """One call's logits with the head on the picks (``[1, n, V]``), or on one probe position when
    ``kept`` collects the picked hidden states."""
    seen: list[tuple[int, ...]] = []
    handle = head.register_forward_pre_hook(_picking(call.picks, seen, kept))
    try:
        logits = run_call(model, call).logits
    finally:
        handle.remove()
    if len(seen) != 1 or len(seen[0]) != 3:
        raise RuntimeError(f"{type(model).__name__}'s LM head ran {len(seen)} times on one forward, on {seen}; "
                           "textrl.models.packed_forward expects one LM head call on the final hidden states [k, w, H]")
    return logits


def packed_logits(model: nn.Module, packing: Packing) -> Tensor:
    """The logits ``[n, V]`` at the packing's picks (the LM head runs on them alone)."""
    head = output_embeddings(model)
    out = []
    for call in packing.calls:
        if head is None:
            logits = run_call(model, call).logits  # [k, w, V]
            out.append(logits.reshape(-1, logits.shape[-1])[call.picks])
        else:
            out.append(_hooked(model, head, call, None)[0])
    return torch.cat(out)


def packed_hidden(model: nn.Module, packing: Packing) -> tuple[Tensor, nn.Linear]:
    """``(hidden [n, H], head)``: the final hidden states at the picks that ``model``'s plain linear
    LM head turns into :func:`packed_logits`, for the fused log-probs
    (:func:`textrl.functional.logprobs_from_hidden`). Raises :class:`UnfusableHead` as
    :func:`textrl.models.forward.response_hidden` does."""
    reason = unfusable_reason(model)
    if reason is not None:
        raise UnfusableHead(f"packed_hidden: {type(model).__name__}: {reason}; use response_logits")
    head = output_embeddings(model)
    out = []
    for call in packing.calls:
        kept: list[Tensor] = []
        logits = _hooked(model, head, call, kept)
        check_head_probe(model, head, kept[0][None, :1], logits, "packed_hidden")
        out.append(kept[0])
    return torch.cat(out), head  # type: ignore[return-value]


def packed_values(critic: nn.Module, packing: Packing) -> Tensor:
    """A critic's values ``[n]`` at the picks: packed rows (``attention_mask=None``, ``position_ids``)
    or one row at a time with an all-ones mask (:func:`critic_layout`)."""
    out = []
    for call in packing.calls:
        if call.attention_mask is None:
            values = critic(input_ids=call.input_ids, attention_mask=None, position_ids=call.position_ids)
        else:
            values = critic(input_ids=call.input_ids, attention_mask=call.attention_mask)
        out.append(values.reshape(-1)[call.picks])
    return torch.cat(out)


def _scorer_call(model: nn.Module, call: Call) -> tuple[Any, Tensor | None]:
    """``(output, per-token head output [k, w, labels] or None)`` of a scorer's forward on one call
    (``position_ids`` and ``use_cache=False`` where its ``forward`` takes them)."""
    head = score_head(model)
    captured: list[Any] = []
    handle = head.register_forward_hook(lambda _m, _i, out: captured.append(out)) if head is not None else None
    kwargs: dict[str, Any] = {"input_ids": call.input_ids, "attention_mask": call.attention_mask}
    if takes(model, "position_ids"):
        kwargs["position_ids"] = call.position_ids
    if takes(model, "use_cache"):
        kwargs["use_cache"] = False
    try:
        out = model(**kwargs)
    finally:
        if handle is not None:
            handle.remove()
    per_token = captured[-1] if captured else None
    shaped = isinstance(per_token, Tensor) and tuple(per_token.shape[:2]) == tuple(call.input_ids.shape)
    return out, per_token if shaped else None


def packed_scores(model: nn.Module, packing: Packing) -> Tensor:
    """A sequence scorer's outputs ``[n, labels]`` at the picks of
    :func:`textrl.models.packing.pack_last_tokens` (each row's last token): its :func:`score_head`'s
    per-token outputs there; for one row alone (``per_row``) without such outputs, the model's
    pooled ``logits`` ``[1, labels]``, which transformers reads at the row's last non-pad token."""
    out = []
    for call in packing.calls:
        result, per_token = _scorer_call(model, call)
        if per_token is not None:
            out.append(per_token.reshape(-1, per_token.shape[-1])[call.picks])
        elif call.attention_mask is not None:
            out.append(result.logits.reshape(1, -1))
        else:
            raise RuntimeError(f"{type(model).__name__}: packed rows need the score head's per-token outputs "
                               "[k, w, labels]; textrl.models.packed_forward.scorer_layout gives it per_row")
    return torch.cat(out)


__all__ = ["LEAK_RATIO", "attention_implementation", "critic_layout", "honours_packed_positions", "packed_hidden",
           "packed_logits", "packed_scores", "packed_values", "packing_layout", "run_call", "score_head", "scorer_body",
           "scorer_layout", "takes"]
