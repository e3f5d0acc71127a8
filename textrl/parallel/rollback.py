"""The copy that rolls an update back (``nonfinite_weights='rollback'``): what the update changes, in
buffers reused update after update.

An update that leaves NaN/inf weights is undone from a copy of what it changes on this process
(:func:`update_state`: the trained weights' local parts, the optimisers' state, learning rates and
the schedulers). :meth:`textrl.parallel.Backend.snapshot` makes such a copy in new tensors; the
agent's update uses a :class:`RollbackCopy` instead, which

- allocates its buffers once and fills them again for every update (``torch._foreach_copy_``);
  they are allocated again only when what they copy changes shape, dtype or device (the
  optimiser state AdamW creates at its first step, a backend that shards the weights);
- keeps them where ``config.rollback_copy`` says (:func:`placement`): ``'device'`` (next to the
  tensors they copy: on CUDA a device-to-device copy, about 1 ms per 1.4 GB), ``'host'`` (CPU
  memory, pinned on CUDA) or ``'auto'``;
- is *staged* early: :meth:`RollbackCopy.stage` starts the copy when the rollout is processed
  (nothing changes the weights or the optimiser state from then until the update's first step),
  on CUDA on a side stream that overlaps the rollout's forwards, and :meth:`RollbackCopy.take`
  hands it to the update behind a device-side wait (a CUDA event; no host sync). The copy is
  made again, at once, when nothing was staged or what it copies changed since: an explicit
  :meth:`RollbackCopy.invalidate` (loads, restores) or a changed ``(data_ptr, _version)`` of a
  copied tensor (an optimiser step, an in-place edit, a write through ``.data`` its writer marked:
  :func:`textrl.core.versions.mark_written`).

Scheduler states, learning rates and any optimiser state that is not a tensor are small: they
are deep-copied when the update takes the copy.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from textrl.core.versions import tensor_versions
from textrl.parallel.fsdp_sharding import local

DEVICE_SHARE = 0.1
"""``rollback_copy='auto'`` keeps the copy on a CUDA device when it takes at most this share of
the device's memory (and at most half of what is free); else in pinned host memory."""


@dataclass
class OptimizerCopy:
    """One optimiser's state as a copy holds it: ``groups`` the hyperparameters of each parameter
    group (``lr``, ...; not its parameters), ``state`` the per-parameter state in the groups'
    parameter order (tensors: this process's local part; None: no state yet)."""

    groups: list[dict[str, Any]]
    state: list[dict[str, Any] | None]


@dataclass
class UpdateSnapshot:
    """What one update changes on this process, copied (opaque to callers; see
    :meth:`textrl.parallel.Backend.snapshot` and :class:`RollbackCopy`).

    ``tensors``: :meth:`Backend.updated_tensors` in order; ``optimizers``: one
    :class:`OptimizerCopy` per optimiser; ``schedulers``: each scheduler's ``state_dict``.
    """

    tensors: list[Tensor]
    optimizers: list[OptimizerCopy]
    schedulers: list[dict[str, Any]]

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data held (the weights and the optimiser states)."""
        states = [v for o in self.optimizers for s in o.state if s for v in s.values()]
        return sum(t.nbytes for t in [*self.tensors, *states] if isinstance(t, Tensor))


@dataclass
class UpdateState:
    """The live tensors and states one update changes on this process (:func:`update_state`).

    ``tensors``: the backend's ``updated_tensors``, then every optimiser's state tensors (their
    local parts), in the order :meth:`snapshot_of` reads them back; ``keys``: per optimiser, per
    parameter, the keys of its tensor state (None: no state yet).
    """

    tensors: list[Tensor]
    weights: int
    """How many of ``tensors`` are ``updated_tensors`` (the rest are optimiser states)."""
    optimizers: list[tuple[torch.optim.Optimizer, list[Tensor]]]
    keys: list[list[tuple[str, ...] | None]]
    schedulers: list[Any]

    def layout(self) -> tuple[Any, ...]:
        """What buffers that copy ``tensors`` must be: shapes, dtypes, devices (and which states exist)."""
        return tuple((t.shape, t.dtype, t.device) for t in self.tensors), tuple(map(tuple, self.keys))

    def version(self) -> tuple[Any, ...]:
        """Changes when a tensor is replaced or modified in place (optimiser steps, loads, restores)."""
        return self.layout(), tensor_versions(self.tensors)

    def snapshot_of(self, copies: list[Tensor]) -> UpdateSnapshot:
        """An :class:`UpdateSnapshot` whose tensors are ``copies`` (of ``tensors``, in order), with
        the hyperparameters, the optimisers' other state and the schedulers deep-copied now."""
        weights, states = copies[:self.weights], iter(copies[self.weights:])
        optimizers = []
        for (optimizer, params), keys in zip(self.optimizers, self.keys):
            groups = [copy.deepcopy({k: v for k, v in group.items() if k != "params"}) for group in optimizer.param_groups]
            state = []
            for param, tensor_keys in zip(params, keys):
                own = optimizer.state.get(param)
                state.append(None if tensor_keys is None else
                             {k: next(states) if k in tensor_keys else copy.deepcopy(v) for k, v in own.items()})
            optimizers.append(OptimizerCopy(groups, state))
        schedulers = [copy.deepcopy(scheduler.state_dict()) for scheduler in self.schedulers]
        return UpdateSnapshot(weights, optimizers, schedulers)


def update_state(backend: Any, agent: Any) -> UpdateState:
    """What an update of ``agent`` changes on this process under ``backend``: the backend's
    ``updated_tensors``, every optimiser's state (keyed by ``optimizer_parameters``), every scheduler."""
    tensors = [t.detach() for t in backend.updated_tensors(agent)]
    weights = len(tensors)
    optimizers = list(zip(agent.optimizers, backend.optimizer_parameters(agent)))
    keys: list[list[tuple[str, ...] | None]] = []
    for optimizer, params in optimizers:
        keys.append([])
        for param in params:
            own = optimizer.state.get(param)
            tensor_keys = tuple(k for k, v in own.items() if isinstance(v, Tensor)) if own else None
            keys[-1].append(tensor_keys)
            tensors += [local(own[k]).detach() for k in tensor_keys or ()]
    return UpdateState(tensors, weights, optimizers, keys, list(agent.schedulers))


def placement(requested: str, device: torch.device | None, nbytes: int) -> str:
    """Where a copy of ``nbytes`` of tensors on ``device`` goes: ``requested`` ('device' | 'host'),
    or for 'auto' on CUDA the device when the copy takes at most :data:`DEVICE_SHARE` of its
    memory and half of what is free, else the host; on any other device, the host."""
    if requested != "auto":
        return requested
    if device is None or device.type != "cuda":
        return "host"
    free, _ = torch.cuda.mem_get_info(device)
    fits = nbytes <= DEVICE_SHARE * torch.cuda.get_device_properties(device).total_memory and nbytes <= free / 2
    return "device" if fits else "host"


def copy_all(dsts: list[Tensor], srcs: list[Tensor], non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for each pair: one ``torch._foreach_copy_`` per device for the pairs on
    one device, a ``copy_`` (``non_blocking``: asynchronous to or from pinned memory) for each
    pair across devices."""
    on_one: dict[torch.device, tuple[list[Tensor], list[Tensor]]] = {}
    for dst, src in zip(dsts, srcs):
        if dst.device == src.device:
            group = on_one.setdefault(src.device, ([], []))
            group[0].append(dst)
            group[1].append(src)
        else:
            dst.copy_(src, non_blocking=non_blocking)
    for dst_group, src_group in on_one.values():
        torch._foreach_copy_(dst_group, src_group)


class RollbackCopy:
    """The rollback's copy of what an update changes, in buffers reused from one update to the
    next (see the module docstring). One per backend; not shared between agents.

    ``placement``: where the buffers are ('device' or 'host'; '' before the first copy);
    ``seconds``: host wall-clock seconds spent in its calls and in blocks timed with :meth:`timed`
    (the backend's finiteness check and restore) since they were last read
    (``Backend.rollback_metrics``).
    """

    def __init__(self) -> None:
        self.buffers: list[Tensor] = []
        self.placement = ""
        self.seconds = 0.0
        self._layout: tuple[Any, ...] | None = None
        self._staged: tuple[Any, ...] | None = None  # UpdateState.version() when staged; None: nothing staged
        self._stream: Any = None  # CUDA: the side stream the copies run on, and the event that ends them
        self._event: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold (the trained weights' local parts and the optimiser states)."""
        return sum(b.nbytes for b in self.buffers)

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Add the block's host wall-clock seconds to :attr:`seconds`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start

    def stage(self, backend: Any, agent: Any) -> None:
        """Start copying what the next update changes (asynchronously on CUDA); :meth:`take` hands
        the copy over if nothing changed in between."""
        with self.timed(), torch.no_grad():
            state = update_state(backend, agent)
            self._fill(state, agent.config.rollback_copy)
            self._staged = state.version()

    def take(self, backend: Any, agent: Any) -> UpdateSnapshot:
        """The copy for the update about to run: the staged one when what it copies is unchanged,
        else a copy made now. On CUDA the current stream waits for it on the device, so the
        optimiser steps queued after this call run after it; read its host buffers only after a
        synchronisation. Its tensors are the buffers: the next :meth:`stage` overwrites them."""
        with self.timed(), torch.no_grad():
            state = update_state(backend, agent)
            if self._staged is None or self._staged != state.version():
                self._fill(state, agent.config.rollback_copy)
            self._staged = None
            if self._stream is not None:
                torch.cuda.current_stream(self._stream.device).wait_event(self._event)
            return state.snapshot_of(self.buffers)

    def invalidate(self) -> None:
        """What the copy holds is stale (a load, a restore): the next :meth:`take` copies again.
        Waits for a copy in flight, so no tensor it reads is freed and reused under it."""
        self._staged = None
        if self._event is not None:
            self._event.synchronize()

    def _fill(self, state: UpdateState, requested: str) -> None:
        """Copy ``state.tensors`` into the buffers (allocated again when their layout changed); on
        CUDA on the side stream, after the work queued so far on the current stream."""
        layout = (state.layout(), requested)
        if layout != self._layout:
            self._allocate(state, requested)
            self._layout = layout
        cuda = next((t.device for t in state.tensors if t.is_cuda), None)
        if cuda is None:
            copy_all(self.buffers, state.tensors)
            return
        if self._stream is None or self._stream.device != cuda:
            self._stream, self._event = torch.cuda.Stream(cuda), torch.cuda.Event()
        self._stream.wait_stream(torch.cuda.current_stream(cuda))
        with torch.cuda.stream(self._stream):
            copy_all(self.buffers, state.tensors, non_blocking=True)
            self._event.record(self._stream)

    def _allocate(self, state: UpdateState, requested: str) -> None:
        """Buffers for ``state.tensors`` where :func:`placement` puts them (the old ones freed first)."""
        self.invalidate()
        self.buffers = []
        cuda = next((t.device for t in state.tensors if t.is_cuda), None)
        self.placement = placement(requested, cuda, sum(t.nbytes for t in state.tensors))
        on_host = self.placement == "host"
        self.buffers = [torch.empty(t.shape, dtype=t.dtype, device="cpu" if on_host else t.device,
                                    pin_memory=on_host and t.is_cuda) for t in state.tensors]


__all__ = ["DEVICE_SHARE", "OptimizerCopy", "RollbackCopy", "UpdateSnapshot", "UpdateState", "copy_all", "placement",
           "update_state"]
