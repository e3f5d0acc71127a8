"""The static KV cache the ``textrl`` engine decodes over: buffers of a fixed width ``L``, all layers'
keys in one stack and their values in another (:class:`Stacks`), written at a column held on the
device (:class:`StaticKV`).

The cache is duck-typed to what transformers' model and attention forwards call on one
(``update(keys, values, layer_idx, ...)`` returning the layer's whole keys and values,
``get_seq_length``), and the mask is passed 4-D, which transformers' mask builders return as is;
so any model whose attention layers write through ``cache.update`` and accept an additive 4-D mask
(the eager and SDPA attentions of transformers' decoder models) decodes through it.
:func:`static_unsupported` says why a model cannot.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn


def layer_runs(like: list[tuple[Tensor, Tensor]]) -> list[range]:
    """The layers whose static caches are stacked in one tensor (keys) and one (values): all of
    them where every layer's keys and values have the same heads and head size (most models),
    else one run a layer."""
    if len({(k.shape[1], k.shape[3], v.shape[1], v.shape[3]) for k, v in like}) == 1:
        return [range(len(like))]
    return [range(i, i + 1) for i in range(len(like))]


def stack_shape(like: Tensor, layers: int, rows: int, width: int) -> tuple[int, int, int, int, int]:
    """``[layers, rows, H, width, D]``: the static cache's stack of ``layers`` layers shaped as ``like``
    ``[B, H, L, D]`` (:func:`layer_runs`)."""
    return layers, rows, like.shape[1], width, like.shape[3]


def layer_views(stacks: list[tuple[Tensor, Tensor]]) -> list[SimpleNamespace]:
    """Each layer's ``keys`` and ``values`` ``[B, H, L, D]``: views of ``stacks`` (:class:`Stacks`)."""
    return [SimpleNamespace(keys=k[i], values=v[i]) for k, v in stacks for i in range(k.shape[0])]


class Stacks:
    """A KV cache held as stacks of layers: ``stacks[j] = (keys, values)``, each ``[N, B, H, L, D]``
    (the ``N`` layers of run ``j``, :func:`layer_runs`), so a whole-cache copy, zeroing or gather is
    one op a stack, not one a layer; ``layers[i].keys`` / ``.values`` ``[B, H, L, D]``: views of them,
    made when read (:func:`textrl.generation.carry.cache_layers`)."""

    def __init__(self, stacks: list[tuple[Tensor, Tensor]]) -> None:
        self.stacks = stacks

    @property
    def layers(self) -> list[SimpleNamespace]:
        return layer_views(self.stacks)


class StaticKV:
    """A KV cache of ``width`` columns (module docstring): ``stacks`` as :class:`Stacks` holds them
    and ``layers[i].keys`` / ``.values`` ``[B, H, width, D]`` their views, written at ``column`` (``[1]`` long, on the
    device), in ``dtype`` (None: the prefill's). Under autocast it is the autocast dtype: attention
    casts its keys and values to it anyway (a Llama's keys leave the rotary embedding in float32
    under autocast), so storing them cast gives the same attention, and each step casts one column
    instead of the whole cache. ``storage``: a flat keys and values buffer a run of layers
    (:func:`layer_runs`) that the stacks view (None: their own)."""

    is_compileable = True

    def __init__(self, like: list[tuple[Tensor, Tensor]], width: int, dtype: torch.dtype | None = None,
                 rows: int | None = None, storage: list[tuple[Tensor, Tensor]] | None = None) -> None:
        b = rows or like[0][0].shape[0]  # like's own rows unless told
        runs = layer_runs(like)
        if storage is not None and len(storage) != len(runs):
            raise ValueError(f"storage holds {len(storage)} runs of layers; this cache has {len(runs)}")

        def stack(x: Tensor, n: int, flat: Tensor | None) -> Tensor:
            shape = stack_shape(x, n, b, width)
            if flat is None:
                return x.new_zeros(shape, dtype=dtype or x.dtype)
            return flat[:math.prod(shape)].view(shape)

        flats = storage or [(None, None)] * len(runs)
        self.stacks = [(stack(like[r[0]][0], len(r), fk), stack(like[r[0]][1], len(r), fv))
                       for r, (fk, fv) in zip(runs, flats)]
        self.layers = layer_views(self.stacks)  # what each step's attention reads and writes
        self.width = width
        self.column = torch.zeros(1, dtype=torch.long, device=like[0][0].device)
        self.index: Tensor | None = None
        """The columns a :class:`Feed` writes (``[S]`` long, on the device), set around its step; None: ``column``."""
        self.filled = 0
        """Columns filled before the steps (the prefill's), what ``get_seq_length`` reports."""
        self.window: int | None = None
        """Attention reads columns ``[0, window)`` (None: all ``width``); set on the host before a step,
        a multiple of the engine's ``attention_window`` past the column written."""

    def load(self, layers: list[tuple[Tensor, Tensor]]) -> None:
        """Copy a prefilled cache's layers ``[B', H, W, D]`` into rows ``[0, B')``, columns ``[0, W)``
        (the rest zero: a masked column still meets its value, weight 0 x NaN is NaN, so nothing of
        an earlier call's stays, in filler rows either); the next write goes to column ``W``."""
        b, w = layers[0][0].shape[0], layers[0][0].shape[2]
        self.clear(w)
        for mine, (k, v) in zip(self.layers, layers):
            mine.keys[:b, :, :w].copy_(k)
            mine.values[:b, :, :w].copy_(v)

    def clear(self, filled: int) -> None:
        """Zero every column (the caller writes a context into columns ``[0, filled)``); the next write goes to ``filled``."""
        for keys, values in self.stacks:
            keys.zero_()
            values.zero_()
        self.column.fill_(filled)
        self.filled = filled

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        layer = self.layers[layer_idx]
        index = self.column if self.index is None else self.index
        layer.keys.index_copy_(2, index, key_states.to(layer.keys.dtype))
        layer.values.index_copy_(2, index, value_states.to(layer.values.dtype))
        if self.window is None:
            return layer.keys, layer.values
        return layer.keys[:, :, :self.window], layer.values[:, :, :self.window]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.filled

    def __len__(self) -> int:
        return len(self.layers)

    def snapshot(self, width: int, rows: int | None = None) -> Stacks:
        """A copy of columns ``[0, width)`` of rows ``[0, rows)`` (None: all), one clone a stack (the
        buffers are the next call's); :func:`textrl.generation.carry.cache_layers` reads its layers."""
        return Stacks([(k[:, :rows, :, :width].clone(), v[:, :rows, :, :width].clone()) for k, v in self.stacks])


def static_unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot decode over :class:`StaticKV` with a 4-D additive mask, or None when it
    can: an encoder-decoder, a model whose cache is not transformers' ``DynamicCache`` kind (state
    space models), an attention that takes no 4-D mask (flash attention), or sliding-window layers
    (the 4-D mask would override their window)."""
    config = getattr(model, "config", None)
    if config is None:
        return "it has no config"
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder"
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if callable(supports) and not supports():
        return "its cache is not a KV cache"
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in ("sdpa", "eager"):
        return f"its attention ({attention}) takes no 4-D mask"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if any(t != "full_attention" for t in layer_types):
            return "it has sliding-window layers"
    elif getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "it has sliding-window layers"
    return None


def bucket(n: int, size: int) -> int:
    """``n`` rounded up to a multiple of ``size`` (the static cache's width: fewer shapes, fewer captures)."""
    return -(-n // size) * size


__all__ = ["Stacks", "StaticKV", "bucket", "layer_runs", "layer_views", "stack_shape", "static_unsupported"]
