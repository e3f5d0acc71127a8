"""How an engine that holds its own copy of the weights (the ``vllm`` engines) is given them: the one
place the logic lives for both.

**Two sources.** An engine samples either

- the live module it is called with (the synchronous loop, where the learner's module is the policy):
  before each call it compares the module's :class:`textrl.core.versions.VersionCounter` with the version
  it last took and, where the weights moved, takes them (:meth:`WeightSync.follow`); or
- weights pushed to it (:meth:`textrl.generation.base.GenerationEngine.load_weights`, as verl's,
  OpenRLHF's and prime-rl's trainers push named tensors with a version): the asynchronous actor hands
  it each published snapshot, and the module it is called with then only describes the model (its
  config, the folder vLLM starts on); its weights are not read again (:meth:`WeightSync.receive`).

Either way :meth:`WeightSync.due` says whether a hand-over is needed before the next call and
:meth:`WeightSync.outgoing` what to hand over.

**Buckets.** A hand-over is sent in buckets of at most ``bucket_bytes`` (:data:`DEFAULT_BUCKET_BYTES`,
``--weight-sync-bucket-mb``; one tensor larger than that alone: :func:`buckets`), never one flat copy
of the whole model: the colocated engine moves one bucket at a time to vLLM's device and loads it,
the CPU transfer to servers packs one bucket into one buffer per broadcast (:func:`pack`,
:func:`unpack`), vLLM's NCCL one packs buffers of the same size.

**What was taken.** Each hand-over's tensors are fingerprinted as they go (:class:`Sent`), vLLM's
workers fingerprint what their loads take (:class:`LoadWatch`), and :func:`check_taken` stops the run
in one line where the two differ. The seconds of every hand-over add up in :attr:`WeightSync.seconds`
(``time/weight_sync_s``: :meth:`WeightSync.take_seconds`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from textrl.core.versions import VersionCounter
from textrl.generation.base import EngineFailed

DEFAULT_BUCKET_BYTES = 512 * 2**20
"""A hand-over's bucket (``--weight-sync-bucket-mb`` 512): the tensors moved or sent together."""

PACK_ALIGN = 16
"""Each tensor's offset in a packed bucket is a multiple of this many bytes (a view of any dtype)."""


# -- fingerprints ---------------------------------------------------------------------------------------
class Fingerprint:
    """A running SHA-256 of named weights: each name, dtype and shape, then the tensor's bytes. Exact:
    equal digests mean bit-equal weights in the same order, whatever device or process computed
    them (no floating-point reduction whose order could differ)."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()

    def add(self, name: str, tensor: Tensor) -> None:
        values = tensor.detach()
        self._digest.update(f"{name}|{str(values.dtype).removeprefix('torch.')}|{tuple(values.shape)}|".encode())
        self._digest.update(values.contiguous().cpu().reshape(-1).view(torch.uint8).numpy())

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def fingerprint(weights: Iterable[tuple[str, Tensor]]) -> str:
    """The :class:`Fingerprint` of ``(name, tensor)`` pairs, in order."""
    running = Fingerprint()
    for name, tensor in weights:
        running.add(name, tensor)
    return running.hexdigest()


class Sent:
    """One pass over ``(name, tensor)`` pairs as they are sent: iterating it yields them and, once
    the pass ended, :attr:`fingerprint` and :attr:`count` say what went (what the workers' reports
    must equal: :func:`check_taken`)."""

    def __init__(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        self._weights = weights
        self.fingerprint: str | None = None
        self.count = 0

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        running, count = Fingerprint(), 0
        for name, tensor in self._weights:
            running.add(name, tensor)
            count += 1
            yield name, tensor
        self.fingerprint, self.count = running.hexdigest(), count


class WeightFingerprintError(EngineFailed):
    """A vLLM worker took other weights than were sent: the engine cannot go on, so the run saves its
    last finished iteration and stops (one line, :func:`check_taken`; :class:`EngineFailed`)."""


class LoadWatch:
    """Worker side: what a vLLM model's ``load_weights`` took since the last :meth:`report`: the
    :class:`Fingerprint` of the ``(name, tensor)`` pairs as the load consumed them (transformers
    names, the dtype sent, before vLLM fuses or casts them) and the names of the parameters it says
    it loaded (its return value, the set vLLM's own loader checks at start-up)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._restart()

    def _restart(self) -> None:
        self.running = Fingerprint()
        self.tensors = 0
        self.loaded: set[str] | None = set()

    def load(self, load_weights: Any, weights: Iterable[tuple[str, Tensor]]) -> Any:
        """``load_weights(weights)``, each pair fingerprinted as the load takes it."""
        def taken() -> Iterator[tuple[str, Tensor]]:
            for name, tensor in weights:
                self.running.add(name, tensor)
                self.tensors += 1
                yield name, tensor

        loaded = load_weights(taken())
        if loaded is None or self.loaded is None:  # a model whose load does not say what it loaded
            self.loaded = None
        else:
            self.loaded |= set(loaded)
        return loaded

    def report(self) -> dict[str, Any]:
        """``{"fingerprint", "tensors", "missing"}`` of the loads since the last report (``missing``:
        the model's parameters none of them wrote, sorted; None where the model does not say), and
        a fresh start."""
        missing = None if self.loaded is None else sorted({n for n, _ in self.model.named_parameters()} - self.loaded)
        out = {"fingerprint": self.running.hexdigest(), "tensors": self.tensors, "missing": missing}
        self._restart()
        return out


def check_taken(report: dict[str, Any], sent: str, tensors: int, *, engine: str, handover: int) -> None:
    """:class:`WeightFingerprintError` in one line when a worker's :meth:`LoadWatch.report` is not
    what was sent (``sent``: the :func:`fingerprint` of the ``tensors`` pairs sent): another
    fingerprint or count, or parameters the load never wrote (vLLM keeps their old values)."""
    missing = report.get("missing") or []
    if report["fingerprint"] == sent and report["tensors"] == tensors and not missing:
        return
    lost = f"; not loaded: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}" if missing else ""
    raise WeightFingerprintError(
        f"{engine}: at weight hand-over {handover} vLLM's worker took other weights than were sent (fingerprint "
        f"sent {sent[:12]}, taken {report['fingerprint'][:12]}; {report['tensors']} of {tensors} tensors{lost}): its "
        "rollouts would not sample the learner's policy; check that this vLLM loads the model's weight names "
        "(docs/vllm.md)")


# -- buckets --------------------------------------------------------------------------------------------
def tensor_bytes(tensor: Tensor) -> int:
    """The bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()


def shaped_bytes(dtype: torch.dtype, shape: Iterable[int]) -> int:
    """The bytes of a tensor of ``dtype`` and ``shape``."""
    return torch.Size(list(shape)).numel() * torch.empty((), dtype=dtype).element_size()


def buckets(weights: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """``weights`` in order, grouped: each group's tensors hold at most ``bucket_bytes`` together, a
    tensor larger than that a group alone. Lazy: a pair is read when its group is made."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: a bucket holds at least 1 byte")
    group: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor_bytes(tensor)
        if group and size + nbytes > bucket_bytes:
            yield group
            group, size = [], 0
        group.append((name, tensor))
        size += nbytes
    if group:
        yield group


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`PACK_ALIGN`."""
    return -(-nbytes // PACK_ALIGN) * PACK_ALIGN


def packed_bytes(sizes: Iterable[int]) -> int:
    """The bytes of a packed bucket of tensors of ``sizes`` bytes (:func:`pack`)."""
    return sum(aligned(n) for n in sizes)


def pack(bucket: list[tuple[str, Tensor]], device: torch.device | str = "cpu") -> Tensor:
    """One uint8 buffer ``[N]`` on ``device`` holding the bucket's tensors' bytes in order, each at a
    multiple of :data:`PACK_ALIGN` (:func:`unpack` reads them back)."""
    flat = torch.empty(packed_bytes(tensor_bytes(t) for _, t in bucket), dtype=torch.uint8, device=device)
    offset = 0
    for _, tensor in bucket:
        nbytes = tensor_bytes(tensor)
        flat[offset: offset + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        offset += aligned(nbytes)
    return flat


def unpack(flat: Tensor, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[tuple[str, Tensor]]:
    """The ``(name, tensor)`` pairs :func:`pack` laid into ``flat``: views into it, no copy."""
    out, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        nbytes = shaped_bytes(dtype, shape)
        out.append((name, flat[offset: offset + nbytes].view(dtype).reshape(shape)))
        offset += aligned(nbytes)
    if offset != flat.numel():
        raise ValueError(f"a packed bucket of {flat.numel()} bytes holds {offset} bytes of its {len(names)} tensors")
    return out


def bucket_counts(sizes: list[int], bucket_bytes: int) -> list[int]:
    """How many of the tensors of ``sizes`` bytes (in order) each of :func:`buckets`' groups holds."""
    counts: list[int] = []
    size = 0
    for nbytes in sizes:
        if counts and size + nbytes <= bucket_bytes:
            counts[-1] += 1
            size += nbytes
        else:
            counts.append(1)
            size = nbytes
    return counts


# -- which weights an engine holds ------------------------------------------------------------------------
class WeightSync:
    """Which weights an engine should hold, and its hand-overs (module docstring).

    :meth:`follow` names the live module it samples and how to read the weights to hand over from it
    (``weights_of(module) -> {name: tensor}``); :meth:`receive` takes pushed weights instead, from then
    on. :meth:`wanted` is a token of the weights it should hold (the module's version, or which push),
    :meth:`due` whether it holds other ones, :meth:`took` records a hand-over done; :meth:`timed`
    counts a hand-over's seconds into :attr:`seconds`."""

    def __init__(self) -> None:
        self._module: nn.Module | None = None
        self._weights_of: Callable[[nn.Module], dict[str, Tensor]] | None = None
        self._counter: VersionCounter | None = None
        self._received: list[tuple[str, Tensor]] | None = None
        self._pushes = 0
        self._pushed_version = 0
        self._held: tuple[str, int] | None = None
        self.version: int | None = None
        """The version of the weights held: the module's (:class:`~textrl.core.versions.VersionCounter`) or the one pushed with them."""
        self.handovers = 0
        """Hand-overs so far (named by :func:`check_taken`)."""
        self.seconds = 0.0
        """Seconds spent handing weights over, since :meth:`take_seconds` last read them."""

    def follow(self, module: nn.Module, weights_of: Callable[[nn.Module], dict[str, Tensor]]) -> None:
        """Sample ``module``: hand over ``weights_of(module)`` whenever its weights moved (unless
        weights were pushed: :meth:`receive`)."""
        self._module, self._weights_of = module, weights_of
        self._counter = VersionCounter(module.parameters)

    def receive(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Hold these weights from the next call on (``version``: the caller's, stamped on the rows);
        the module is not read again. The pairs are kept as given (a reference, not a copy)."""
        self._received = [(str(name), tensor) for name, tensor in named_tensors]
        self._pushes += 1
        self._pushed_version = int(version)

    @property
    def receiving(self) -> bool:
        """Whether weights were pushed (the module is no longer read)."""
        return self._received is not None

    def wanted(self) -> tuple[str, int]:
        """A token of the weights the engine should hold: which push, else the module's version."""
        if self._received is not None:
            return ("pushed", self._pushes)
        if self._counter is None:
            raise RuntimeError("WeightSync: no module followed and no weights received")
        return ("module", self._counter.now())

    def due(self) -> bool:
        """Whether the engine holds other weights than :meth:`wanted` (a hand-over is needed)."""
        return self.wanted() != self._held

    def outgoing(self) -> list[tuple[str, Tensor]]:
        """The weights to hand over: the last pushed ones, else the module's now."""
        if self._received is not None:
            return self._received
        return list(self._weights_of(self._module).items())

    def took(self, token: tuple[str, int]) -> None:
        """The engine now holds the weights of ``token`` (a :meth:`wanted` read before the hand-over)."""
        self._held = token
        self.version = self._pushed_version if token[0] == "pushed" else token[1]

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Add the block's seconds to :attr:`seconds` (a hand-over)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start

    def take_seconds(self) -> float:
        """:attr:`seconds`, then 0 (the seconds since the last read: one iteration's)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


__all__ = ["DEFAULT_BUCKET_BYTES", "Fingerprint", "LoadWatch", "PACK_ALIGN", "Sent", "WeightFingerprintError",
           "WeightSync", "aligned", "bucket_counts", "buckets", "check_taken", "fingerprint", "pack", "packed_bytes",
           "shaped_bytes", "tensor_bytes", "unpack"]
