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

The pieces, each in its own module: the static cache (:mod:`textrl.generation.static_kv`), the
step and the feed over it (:mod:`textrl.generation.step`), the token drawn on the device
(:mod:`textrl.generation.draw`) and the weights cast once a call (:mod:`textrl.generation.casts`);
here, the decoders kept per shape and their capture.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from textrl.generation.base import Sampling
from textrl.generation.casts import WeightCasts, ambient_autocast
from textrl.generation.static_kv import layer_runs, stack_shape
from textrl.generation.step import DecodeState, Feed, decode_step, feed_step


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
                # thread_local: another thread's CUDA calls meanwhile (the learner's, beside an asynchronous
                # actor capturing on its own stream) do not invalidate the capture; this thread's still do
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
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


__all__ = ["CASTS_KEPT", "DecodeGraph", "Graphs", "compile_options", "graph_key", "recent", "windows"]
