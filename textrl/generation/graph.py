"""The ``textrl`` engine's decode step over a static KV cache, captured as a CUDA graph on CUDA.

A decode step is the same work every time: feed one token a row, write its keys and values into
the next cache column, draw the next token. :class:`StaticKV` holds the cache in buffers of a
fixed width ``L`` (per layer ``[B, H, L, D]``), written at a column held *on the device*
(``column``, moved by the step itself), and the attention mask is an additive ``[B, 1, 1, L]``
tensor whose column is opened by the step: nothing about a step depends on a host value, so one
step of :class:`DecodeGraph` is captured once (``torch.cuda.CUDAGraph``) and replayed for every
token of every later call of the same shape: one launch a token instead of a few hundred.

A carried turn of a multi-turn episode starts the same way: its new tokens (the last sampled one
and the observation, ``S`` a row) are fed in one forward into the next ``S`` columns
(:class:`Feed`, :func:`feed_step`), each attending to the real columns up to its own through an
additive ``[B, 1, S, L]`` mask, the columns written held on the device: captured once per
``(rows, S, width)`` too.

The captured step reads the model's parameters where they are, so an optimiser's in-place update
is seen by the next replay; parameters replaced by new tensors (another ``data_ptr``) make a new
graph (:func:`graph_key`). Under autocast, the weights autocast would cast for every matmul
(the weights and biases of ``nn.Linear`` and GPT-2's ``Conv1D`` in another dtype) are cast once per call instead
(:class:`WeightCasts`: a copy in the autocast dtype, refreshed from the current weights at the start
of every call, the step reading the copy: autocast's own cache, kept between calls); the rest of
the step runs under the ambient autocast with its cache off, as captured graphs need.

With ``compile``, the step is compiled first (``torch.compile``, inductor: the norms, rotary
embeddings, casts and the sampling fused into fewer kernels), then captured. It is compiled with
torch's automatic dynamic shapes: the first shape (rows, cache width) with static sizes, and once a
second one comes, once more with symbolic sizes that every later shape reuses. A multi-turn
rollout meets a new shape nearly every turn (fewer running rows, wider contexts): compiled per
shape, each would be a compile of its own (tens of seconds at 114M on a GPU); so it is at most three.
Each shape is still captured as a graph of its own.

The cache is duck-typed to what transformers' model and attention forwards call on one
(``update(keys, values, layer_idx, ...)`` returning the layer's whole keys and values,
``get_seq_length``), and the mask is passed 4-D, which transformers' mask builders return as is;
so any model whose attention layers write through ``cache.update`` and accept an additive 4-D mask
(the eager and SDPA attentions of transformers' decoder models) decodes through it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from textrl.generation.base import Sampling

MATMUL_LAYERS: tuple[type[nn.Module], ...] = (nn.Linear, Conv1D)
"""The layers whose ``weight`` and ``bias`` a matmul reads, which autocast casts at every call:
``nn.Linear`` and transformers' ``Conv1D`` (GPT-2's attention and MLP)."""


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


def ambient_autocast(device: torch.device | str) -> torch.dtype | None:
    """The dtype of the autocast open for ``device``'s type here and now (CUDA or the CPU), else None."""
    kind = torch.device(device).type
    if kind not in ("cuda", "cpu") or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def recent(entries: dict[Any, Any], key: Any, keep: int, make: Callable[[], Any]) -> tuple[Any, bool]:
    """``(entries[key], whether it was made now)``: made by ``make()`` when absent (the oldest
    dropped to keep at most ``keep``), and moved last, as the most recent."""
    value = entries.pop(key, None)
    made = value is None
    if made:
        while len(entries) >= keep:
            entries.pop(next(iter(entries)))
        value = make()
    entries[key] = value
    return value, made


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


@dataclass
class DecodeState:
    """The buffers a step reads and writes, one set per shape: ``token`` ``[B]`` (fed next),
    ``position`` ``[B, 1]`` (its position id), ``running`` ``[B]``, ``mask`` ``[B, 1, 1, L]``
    (additive: 0 on the columns a row attends to), ``out`` ``[B, L]`` (the tokens drawn, column
    ``step``), ``step`` ``[1]``, ``invalid`` ``[1]`` (a step drew from non-finite logits), ``kv``."""

    kv: StaticKV
    token: Tensor
    position: Tensor
    running: Tensor
    mask: Tensor
    out: Tensor
    step: Tensor
    invalid: Tensor

    @classmethod
    def new(cls, like: list[tuple[Tensor, Tensor]], rows: int, width: int, kv_dtype: torch.dtype | None = None,
            storage: list[tuple[Tensor, Tensor]] | None = None) -> DecodeState:
        """Buffers for ``rows`` x ``width``, the cache and the mask in ``kv_dtype`` (None: the prefill
        keys' dtype; attention casts its mask to its keys' dtype, so a mask kept in it is not cast each
        layer), the cache a view of ``storage`` (flat, per run of layers: :class:`StaticKV`; None: its own)."""
        device, dtype = like[0][0].device, kv_dtype or like[0][0].dtype
        kv = StaticKV(like, width, kv_dtype, rows, storage)
        return cls(kv=kv, token=torch.zeros(rows, dtype=torch.long, device=device),
                   position=torch.zeros(rows, 1, dtype=torch.long, device=device),
                   running=torch.ones(rows, dtype=torch.bool, device=device),
                   mask=torch.full((rows, 1, 1, width), torch.finfo(dtype).min, dtype=dtype, device=device),
                   out=torch.zeros(rows, width, dtype=torch.long, device=device),
                   step=torch.zeros(1, dtype=torch.long, device=device),
                   invalid=torch.zeros(1, dtype=torch.bool, device=device))

    def load(self, layers: list[tuple[Tensor, Tensor]], mask: Tensor, first: Tensor, running: Tensor,
             pad: int) -> None:
        """Start a call: the prefilled cache and its 2-D mask ``[B, W]``, the first token drawn ``[B]``."""
        self.load_context(layers, mask)
        self.start(first, running, pad)

    def load_context(self, layers: list[tuple[Tensor, Tensor]], mask: Tensor) -> None:
        """The prefilled cache ``[B', H, W, D]`` a layer and its 2-D mask ``[B', W]`` into the first
        ``B'`` rows (the first token comes by :meth:`start`)."""
        self.kv.load(layers)
        self.attend(mask.bool())

    def attend(self, real: Tensor) -> None:
        """The context of the first ``B'`` rows: the columns holding their real tokens, ``real``
        ``[B', W]`` (bool, columns ``[0, W)``), which a step attends to (none past them), and the next
        position id, their count; a filler row past them attends to no column but the one each step
        writes."""
        self.mask.fill_(torch.finfo(self.mask.dtype).min)
        self.mask[:real.shape[0], 0, 0, :real.shape[1]].masked_fill_(real, 0.0)
        self.position.zero_()
        self.position[:real.shape[0]] = real.sum(-1, keepdim=True)

    def start(self, first: Tensor, running: Tensor, pad: int) -> None:
        """The first token drawn ``[B']`` (fed by the first step) and the rows still running after it;
        filler rows past ``B'`` feed ``pad`` and are not running."""
        b = first.shape[0]
        if b == self.token.shape[0]:
            self.token.copy_(first)
            self.running.copy_(running)
        else:
            self.token.fill_(pad)
            self.token[:b] = first
            self.running.fill_(False)
            self.running[:b] = running
        self.out.fill_(pad)
        self.out[:b, 0] = first
        self.step.fill_(1)
        self.invalid.fill_(False)


def decode_step(model: nn.Module, state: DecodeState, sampling: Sampling, name: str) -> None:
    """One step, in place: feed ``state.token`` at ``state.position`` into cache column
    ``kv.column``, draw the next token (``pad`` for a row past its EOS) into ``token`` and ``out[:, step]``."""
    state.mask.index_fill_(3, state.kv.column, 0.0)
    mask = state.mask if state.kv.window is None else state.mask[..., :state.kv.window]
    logits = model(input_ids=state.token[:, None], attention_mask=mask, position_ids=state.position,
                   use_cache=True, **{name: state.kv}).logits[:, -1]
    token = torch.where(state.running, next_tokens(logits, sampling, state.invalid), sampling.pad_token_id)
    state.out.index_copy_(1, state.step, token[:, None])
    if sampling.eos_token_id is not None:
        state.running.logical_and_(token != sampling.eos_token_id)
    state.token.copy_(token)
    state.position.add_(1)
    state.kv.column.add_(1)
    state.step.add_(1)


def compile_options(device: torch.device) -> dict[str, Any]:
    """The inductor options the engine compiles its steps for ``device`` with. On the CPU: the vector
    width of the C++ that inductor writes (``cpp.simdlen``), pinned to the one it picks now (the CPU's
    widest ISA, or the one ``ATEN_CPU_CAPABILITY`` names: 512, 256, or 0 for scalar code).

    Inductor's on-disk graph cache (torch 2.13) keys a compiled graph by its config, not by the ISA it
    picked, and a cache hit compiles the cached C++ again with the flags of the ISA picked *now*: C++
    written for 16 float lanes a vector (AVX-512) built for 8 (AVX2) decoded ``pad`` after the first
    token, and the reverse wrote past its buffers and aborted the process. Two runs sharing one cache
    (``/tmp/torchinductor_$USER`` by default) meet it whenever they pick different ISAs: one under
    ``ATEN_CPU_CAPABILITY=avx2`` after one without, or a cache directory shared by an AVX-512 and an
    AVX2 machine. The width in the config is in the key, so each ISA has its own entries. Other
    devices: none (picking the ISA test-builds C++ for each candidate, seconds)."""
    if device.type != "cpu":
        return {}
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return {"cpp.simdlen": pick_vec_isa().bit_width()}


@dataclass
class Feed:
    """A step that feeds ``S`` tokens a row at once into a decoder's static cache (a carried turn's
    new tokens, the ``textrl`` engine), its buffers: ``ids`` and ``positions`` ``[B, S]``, ``mask``
    ``[B, 1, S, L]`` (additive), ``index`` ``[S]`` (the cache columns written); ``logits`` ``[B, V]``
    (the last token's, once run) and, on CUDA, its captured ``graph``. Like the decode step it reads
    no host value, so it is captured once per ``(rows, S, width)`` and replayed every later turn."""

    ids: Tensor
    positions: Tensor
    mask: Tensor
    index: Tensor
    logits: Tensor | None = None
    graph: Any = None

    @classmethod
    def new(cls, state: DecodeState, tokens: int) -> Feed:
        rows, width, device = state.mask.shape[0], state.mask.shape[-1], state.mask.device
        return cls(ids=torch.zeros(rows, tokens, dtype=torch.long, device=device),
                   positions=torch.zeros(rows, tokens, dtype=torch.long, device=device),
                   mask=torch.zeros(rows, 1, tokens, width, dtype=state.mask.dtype, device=device),
                   index=torch.arange(tokens, device=device))

    def fill(self, ids: Tensor, positions: Tensor, real: Tensor, start: int) -> None:
        """Feed ``ids`` ``[B', S]`` at ``positions`` into columns ``[start, start + S)`` of the first
        ``B'`` rows (filler rows past them feed padding); ``real`` ``[B', start + S]`` (bool): the
        columns holding a row's real tokens, those before ``start`` and the new ones. A token attends
        to the real columns up to its own, and a padding token to its own column too (a query with no
        column would be NaN, and its keys and values written with it; no real token attends to them)."""
        (b, s), width = ids.shape, self.mask.shape[-1]
        if b < self.ids.shape[0]:
            self.ids.zero_()
            self.positions.zero_()
        self.ids[:b] = ids
        self.positions[:b] = positions
        self.index.copy_(torch.arange(start, start + s, device=ids.device))
        cols = torch.arange(width, device=ids.device)
        keys = torch.zeros(self.ids.shape[0], width, dtype=torch.bool, device=ids.device)
        keys[:b, :real.shape[1]] = real
        before = cols <= self.index[:, None]  # [S, L]: a token's own column and those left of it
        allowed = (keys[:, None, :] & before) | (cols == self.index[:, None])
        self.mask.fill_(torch.finfo(self.mask.dtype).min)
        self.mask.masked_fill_(allowed[:, None], 0.0)


def feed_step(model: nn.Module, state: DecodeState, feed: Feed, name: str) -> Tensor:
    """Feed ``feed.ids`` ``[B, S]`` into the cache columns ``feed.index`` (``state.kv.index`` is set
    to it around the call): the logits of each row's last token ``[B, V]``."""
    return model(input_ids=feed.ids, attention_mask=feed.mask, position_ids=feed.positions, use_cache=True,
                 logits_to_keep=1, **{name: state.kv}).logits[:, -1]


class WeightCasts:
    """The weights and biases of ``model``'s :data:`MATMUL_LAYERS` autocast would cast to ``dtype`` (floating,
    another dtype, plain ``nn.Parameter``: not a quantised one), each with a copy in ``dtype``.
    :meth:`refresh` copies the current values in; inside :meth:`swapped` the modules read the copies."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.entries: list[tuple[nn.Module, str, Tensor, Tensor]] = []
        for module in model.modules():
            if not isinstance(module, MATMUL_LAYERS):
                continue
            for name in ("weight", "bias"):
                p = module._parameters.get(name)
                if p is not None and type(p) is nn.Parameter and p.is_floating_point() and p.dtype != dtype:
                    self.entries.append((module, name, p, torch.empty_like(p, dtype=dtype)))
        self.versions: tuple[int, ...] | None = None
        """Each weight's ``_version`` at the last :meth:`refresh` (None: never)."""

    def refresh(self) -> None:
        with torch.no_grad():
            for _, _, p, copy in self.entries:
                copy.copy_(p)
        self.versions = self._versions()

    def changed(self) -> bool:
        """Whether a weight was changed in place (an optimiser step, a load) since the last :meth:`refresh`.
        A write through ``.data`` is not seen: the engine refreshes at the start of every rollout anyway."""
        return self._versions() != self.versions

    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for _, _, p, _ in self.entries)

    @contextmanager
    def swapped(self) -> Iterator[None]:
        for module, name, _, copy in self.entries:
            module._parameters[name] = copy  # type: ignore[assignment]
        try:
            yield
        finally:
            for module, name, p, _ in self.entries:
                module._parameters[name] = p

    @property
    def nbytes(self) -> int:
        return sum(copy.nbytes for *_, copy in self.entries)


def graph_key(model: nn.Module, rows: int, width: int, like: list[tuple[Tensor, Tensor]], sampling: Sampling,
              name: str, storage: tuple[int, ...] | None = None, kv_dtype: torch.dtype | None = None) -> tuple[Any, ...]:
    """What a captured step is valid for: the model object, its mode and active adapters, where
    its parameters live (``storage``: their ``data_ptr``s, computed here when not given), the
    shape, the cache dtype (``kv_dtype``, else ``like``'s), the ambient autocast and the sampling."""
    adapters = getattr(model, "active_adapters", None)
    adapters = tuple(adapters) if isinstance(adapters, (list, tuple)) else adapters
    if storage is None:
        storage = tuple(p.data_ptr() for p in model.parameters())
    return (id(model), model.training, adapters, storage, rows, width, kv_dtype or like[0][0].dtype,
            ambient_autocast(like[0][0].device), sampling.greedy, sampling.temperature, sampling.top_k,
            sampling.top_p, sampling.eos_token_id, sampling.pad_token_id, name)


@dataclass
class DecodeGraph:
    """One shape's :class:`DecodeState` and, on CUDA, its captured step (``graph``, attending to
    the whole width; None: the step runs eagerly, on the CPU or where capture failed) and the steps
    captured attending to fewer columns (``windows``: window -> graph), with the weight casts it
    reads (``casts``); its :class:`Feed` of each number of tokens (``feeds``), run by ``feeder``."""

    state: DecodeState
    step: Callable[..., None]
    casts: WeightCasts | None = None
    graph: Any = None
    windows: dict[int, Any] = field(default_factory=dict)
    replays: int = 0
    feeder: Callable[..., Tensor] = feed_step
    kv_key: tuple[Any, ...] | None = None
    """The key of the :meth:`Graphs.kv_buffers` its cache views (None: its own)."""
    feeds: dict[int, Feed] = field(default_factory=dict)

    def run(self, model: nn.Module, sampling: Sampling, name: str, window: int | None = None) -> None:
        """One step, attending to cache columns ``[0, window)`` (None: all; a captured decoder without
        that window's graph attends to all, which masks the columns past it)."""
        if self.graph is not None:
            self.windows.get(window, self.graph).replay()  # type: ignore[arg-type]
        else:
            self.state.kv.window = window
            try:
                with self.casts.swapped() if self.casts is not None else nullcontext():
                    self.step(model, self.state, sampling, name)
            finally:
                self.state.kv.window = None
        self.replays += 1

    def feed(self, model: nn.Module, feed: Feed, name: str) -> Tensor:
        """Run a filled ``feed`` of this decoder (its graph on CUDA): each row's last logits ``[B, V]``,
        the feed's own output buffer on CUDA, rewritten by its next replay."""
        if feed.graph is not None:
            feed.graph.replay()
            assert feed.logits is not None
            return feed.logits
        self.state.kv.index = feed.index
        try:
            with self.casts.swapped() if self.casts is not None else nullcontext():
                return self.feeder(model, self.state, feed, name)
        finally:
            self.state.kv.index = None


def windows(width: int, every: int | None) -> list[int]:
    """The attention windows a step of a ``width``-column cache may use: the multiples of ``every`` below
    ``width`` (None: none, every step attends to the whole width)."""
    return list(range(every, width, every)) if every else []


CASTS_KEPT = 4
"""The :class:`WeightCasts` a :class:`Graphs` keeps (per model, autocast dtype and parameter storage)."""


@dataclass
class Graphs:
    """The engine's :class:`DecodeGraph` per :func:`graph_key`, the ``keep`` most recent; one
    :class:`WeightCasts` per model, autocast dtype and parameter storage; the step compiled once
    (``compile``; None: where it is captured, on CUDA).

    One call decodes at a time, so the decoders share their memory: each static cache is a view of
    one flat buffer for the keys and one for the values of all layers (``buffers``, per device, dtype
    and layer shapes; one pair a layer where the layers' shapes differ, :func:`layer_runs`; grown when
    a shape needs more, and the decoders viewing the old buffers made again), and every graph is
    captured in one memory pool (a graph's temporaries live only within its replay, so the graphs,
    replayed one at a time, may reuse each other's; what outlives a replay, a feed's logits, stays
    allocated, so no graph captured later takes its memory, and the engine reads them before it
    replays another graph, which may have taken it before). So the rows x widths a multi-turn
    rollout meets keep their captured graphs from one iteration to the next, for the memory of the
    largest."""

    capture: bool = True
    compile: bool | None = None
    keep: int = 32
    graphs: dict[tuple[Any, ...], DecodeGraph] = field(default_factory=dict)
    casts: dict[tuple[Any, ...], WeightCasts] = field(default_factory=dict)
    buffers: dict[tuple[Any, ...], list[tuple[Tensor, Tensor]]] = field(default_factory=dict)
    captured: int = 0
    """Graphs captured, all calls."""
    made: int = 0
    """Decoders made, all calls (each a static cache view and, on CUDA, a graph captured)."""
    feeds_made: int = 0
    """Feeds made, all calls (each, on CUDA, a graph captured)."""
    fresh: set[int] | None = None
    """The weight casts refreshed in the rollout open (``id``s; :meth:`get` refreshes one again there only
    when a weight changed in place); None: no rollout open, every call refreshes its casts."""
    _compiled: dict[tuple[Callable[..., Any], str], Any] = field(default_factory=dict)
    """The compiled steps by (step, device type)."""
    _pool: Any = None

    def kv_buffers(self, like: list[tuple[Tensor, Tensor]], rows: int, width: int,
                   dtype: torch.dtype) -> tuple[tuple[Any, ...], list[tuple[Tensor, Tensor]]]:
        """``(key, flat buffers)``: the keys' and values' buffer of each run of layers
        (:func:`layer_runs`: one for most models; ``like``'s heads and head sizes, in ``dtype``) that a
        ``rows`` x ``width`` static cache's stacks view; when they are too small, the decoders viewing
        them are dropped and they are made again, as large as needed."""
        key = (like[0][0].device, dtype, tuple((k.shape[1], k.shape[3], v.shape[1], v.shape[3]) for k, v in like))
        need = [tuple(math.prod(stack_shape(x, len(r), rows, width)) for x in like[r[0]]) for r in layer_runs(like)]
        flats = self.buffers.get(key)
        if flats is None or any(fk.numel() < nk or fv.numel() < nv for (fk, fv), (nk, nv) in zip(flats, need)):
            for old in [k for k, decoder in self.graphs.items() if decoder.kv_key == key]:
                del self.graphs[old]  # their graphs read the old buffers' addresses
            self.buffers.pop(key, None)  # freed before the larger ones are made
            flats = self.buffers[key] = [(like[0][0].new_zeros(nk, dtype=dtype), like[0][1].new_zeros(nv, dtype=dtype))
                                         for nk, nv in need]
        return key, flats

    def step_function(self, device: torch.device, step: Callable[..., Any] = decode_step) -> Callable[..., Any]:
        """``step`` (:func:`decode_step`, :func:`feed_step`) as a new decoder on ``device`` runs it:
        compiled once where ``compile`` says."""
        compile = self.compile if self.compile is not None else self.capture and device.type == "cuda"
        if not compile:
            return step
        key = (step, device.type)
        if key not in self._compiled:
            # automatic dynamic shapes (module docstring); on the CPU its vector width pinned (compile_options)
            self._compiled[key] = torch.compile(step, options=compile_options(device))
        return self._compiled[key]

    def weight_casts(self, model: nn.Module, device: torch.device,
                     storage: tuple[int, ...] | None = None) -> WeightCasts | None:
        """The casts of ``model``'s weights under the ambient autocast (None: no autocast, or
        nothing to cast), one per model, dtype and parameter storage (``storage``: their
        ``data_ptr``s, computed here when not given; the ``keep`` most recent; a decoder keeps the
        one it was made with, and :meth:`get` refreshes that one)."""
        dtype = ambient_autocast(device)
        if dtype is None:
            return None
        if storage is None:
            storage = tuple(p.data_ptr() for p in model.parameters())
        casts, _ = recent(self.casts, (id(model), dtype, storage), CASTS_KEPT, lambda: WeightCasts(model, dtype))
        return casts if casts.entries else None

    def get(self, model: nn.Module, rows: int, width: int, like: list[tuple[Tensor, Tensor]], sampling: Sampling,
            name: str, attention_window: int | None = None) -> DecodeGraph:
        """The decoder of this call's shape, its weight casts refreshed (captured first, on CUDA: the
        whole width, then each of :func:`windows`)."""
        device = like[0][0].device
        storage = tuple(p.data_ptr() for p in model.parameters())
        casts = self.weight_casts(model, device, storage)
        autocast = ambient_autocast(device)
        kv_dtype = autocast if autocast is not None and like[0][0].is_floating_point() else None

        def make() -> DecodeGraph:
            self.made += 1
            kv_key, flats = self.kv_buffers(like, rows, width, kv_dtype or like[0][0].dtype)
            return DecodeGraph(DecodeState.new(like, rows, width, kv_dtype, flats), self.step_function(device), casts,
                               feeder=self.step_function(device, feed_step), kv_key=kv_key)

        found, made = recent(self.graphs, graph_key(model, rows, width, like, sampling, name, storage, kv_dtype),
                             self.keep, make)
        casts = found.casts
        if casts is not None and (self.fresh is None or id(casts) not in self.fresh or casts.changed()):
            casts.refresh()  # the weights as they are now, for this call (and a new capture's warm-up)
            if self.fresh is not None:
                self.fresh.add(id(casts))
        if made and self.capture and device.type == "cuda":
            self.capture_step(model, found, sampling, name)
            self._capture_windows(model, found, sampling, name, windows(width, attention_window))
        return found

    def capture_step(self, model: nn.Module, decoder: DecodeGraph, sampling: Sampling, name: str) -> None:
        """Capture the decoder's step attending to the whole width (``decoder.graph``; None: it runs eagerly)."""
        captured = self._capture_or_fall_back(model, decoder, "step", decode_step,
                                              lambda fn: fn(model, decoder.state, sampling, name))
        decoder.graph = captured[0] if captured is not None else None

    def feed(self, model: nn.Module, decoder: DecodeGraph, tokens: int, name: str) -> Feed:
        """The decoder's :class:`Feed` of ``tokens`` a row, made once (and captured then, where its steps
        are: before the caller loads the cache, which the capture's warm-ups write into)."""
        feed = decoder.feeds.get(tokens)
        if feed is None:
            self.feeds_made += 1
            feed = decoder.feeds[tokens] = Feed.new(decoder.state, tokens)
            if decoder.graph is not None:
                decoder.state.kv.index = feed.index
                try:
                    captured = self._capture_or_fall_back(
                        model, decoder, "feeder", feed_step, lambda fn: fn(model, decoder.state, feed, name))
                finally:
                    decoder.state.kv.index = None
                if captured is not None:
                    feed.graph, feed.logits = captured
        return feed

    def _capture_or_fall_back(self, model: nn.Module, decoder: DecodeGraph, attribute: str,
                              written: Callable[..., Any], call: Callable[[Callable[..., Any]], Any]) -> Any:
        """Capture ``call(decoder.<attribute>)`` (the decoder's compiled step or feed): ``(graph, its
        output)``; a compiled one that fails is captured as ``written`` instead (and the decoder keeps
        that), and one that fails too runs eagerly (None)."""
        fn, what = getattr(decoder, attribute), "decode step" if attribute == "step" else "feed of new tokens"
        captured = self._capture(model, decoder, lambda: call(fn), fn is not written, what=what)
        if captured is None and fn is not written:
            setattr(decoder, attribute, written)
            captured = self._capture(model, decoder, lambda: call(written), False, what=what)
        return captured

    def _capture_windows(self, model: nn.Module, decoder: DecodeGraph, sampling: Sampling, name: str,
                         sizes: list[int]) -> None:
        """Capture the decoder's step once per attention window in ``sizes`` (``decoder.windows``); a
        window that fails is left out (its steps replay the whole width's graph)."""
        if decoder.graph is None:
            return
        for size in sizes:
            decoder.state.kv.window = size
            try:
                captured = self._capture(model, decoder, lambda: decoder.step(model, decoder.state, sampling, name),
                                         decoder.step is not decode_step)
            finally:
                decoder.state.kv.window = None
            if captured is not None:
                decoder.windows[size] = captured[0]

    def _capture(self, model: nn.Module, decoder: DecodeGraph, run: Callable[[], Any], compiled: bool,
                 what: str = "decode step") -> tuple[Any, Any] | None:
        """Capture ``run()`` (one step or feed on the decoder's buffers; warmed up on a side stream
        first, as CUDA graphs need; compiled then, where ``compiled``), in the engine's memory pool
        (the class docstring): ``(graph, run's output)``; None, with a warning, if the model cannot
        be captured (the step then runs eagerly)."""
        state = decoder.state
        device = state.token.device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        dtype = ambient_autocast(device)
        state.kv.column.zero_()  # the warm-ups write from the first column on, whatever ran before
        state.step.fill_(1)

        def step() -> Any:
            with torch.autocast("cuda", dtype=dtype or torch.bfloat16, enabled=dtype is not None, cache_enabled=False):
                return run()

        rng = torch.cuda.get_rng_state(device)  # the warm-up's draws are not the caller's
        try:
            with (decoder.casts.swapped() if decoder.casts is not None else nullcontext(),
                  torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit))):
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(3):
                        step()
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    out = step()
        except Exception as err:  # noqa: BLE001 - a model that cannot be captured still decodes, eagerly
            then = "captures the step uncompiled" if compiled else "decodes eagerly over the static cache"
            warnings.warn(f"the textrl engine could not {'compile and ' if compiled else ''}capture "
                          f"{type(model).__name__}'s {what} as a CUDA graph ({type(err).__name__}: {err}); it "
                          f"{then} (DecodeEngine(compile=False) skips the compile)", stacklevel=4)
            torch.cuda.synchronize(device)
            torch.cuda.set_rng_state(rng, device)
            return None
        torch.cuda.set_rng_state(rng, device)
        self.captured += 1
        return graph, out

    def clear(self) -> None:
        self.graphs.clear()
        self.casts.clear()
        self.buffers.clear()


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


__all__ = ["INVALID", "MATMUL_LAYERS", "DecodeGraph", "DecodeState", "Graphs", "StaticKV", "Stacks", "WeightCasts",
           "ambient_autocast", "bucket", "Feed", "decode_step", "draw", "feed_step", "graph_key", "layer_runs",
           "layer_views", "next_tokens", "recent", "stack_shape", "static_unsupported", "windows"]
