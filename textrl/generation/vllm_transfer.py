"""Weight transfer to vLLM servers where vLLM's own backends cannot go: ``textrl_gloo``.

vLLM moves a trainer's weights into a running server with its weight-transfer engines
(``vllm.distributed.weight_transfer``: the server's ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update`` routes, a worker-side
``WeightTransferEngine`` and a trainer-side ``TrainerWeightTransferEngine``). Its backends (``nccl``,
``ipc``, ...) are CUDA-only. ``textrl_gloo`` is the same protocol over a gloo process group (the
trainer rank 0 and each server's workers), so a CPU server takes weight updates too; it is
registered into vLLM's own factories (:func:`register`), in every vLLM process through vLLM's
plugin entry point (``vllm.general_plugins``, installed with textrl), so ``vllm serve
--weight-transfer-config '{"backend": "textrl_gloo"}'`` knows it. On CUDA textrl uses vLLM's
``nccl``. This module imports vLLM: without it, its import is an ``ImportError`` saying what to
install.

:class:`WeightWatch` is the servers' worker extension: it fingerprints the weights each load takes
in the worker, so the trainer compares them with what it sent; it says what model the worker holds
(by its config) and which run holds the server (its claim: docs/vllm.md).

The trainer's side of a transfer never waits on a server that went away: it waits for each
broadcast in slices (:mod:`textrl.generation.gloo`), stopping as soon as the server's
``/update_weights`` or ``/init_weight_transfer_engine`` fails or the engine, whose health check
found the server dead, sets the client's ``stop``; it still reads the rest of the weights (a
sharded weight's gather is a collective of every rank), but sends nothing more.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch

from textrl.generation.gloo import WAIT_SLICE, Call, broadcast, gloo_group, stopped
from textrl.generation.vllm.checks import import_vllm
from textrl.generation.vllm_worker import quiet_rotary_reloads
from textrl.generation.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    LoadWatch,
    Sent,
    bucket_counts,
    pack,
    packed_bytes,
    shaped_bytes,
    unpack,
)

import_vllm()  # where vLLM is missing: one ImportError saying what to install
from vllm.distributed.weight_transfer.base import (  # noqa: E402
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    materialize_full_tensor,
)

GLOO_BACKEND = "textrl_gloo"
"""The backend's name in vLLM's weight-transfer factories."""


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """What a server's worker needs to join the trainer's group: the trainer's store address and
    port, its own rank's offset (the trainer is rank 0) and the group's size."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer side's: where its store listens and the group's size (1 + the server's workers)."""

    backend: ClassVar[str] = GLOO_BACKEND
    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """The most bytes one broadcast carries (the tensors of a bucket packed into one buffer)."""


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One round's weights, in the order they are broadcast: names, dtype names, shapes, and how many
    of them each broadcast carries (one packed bucket each: :func:`~textrl.generation.weight_sync.pack`)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    counts: list[int]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """The worker side: receives each weight from the trainer's broadcast and loads it through vLLM's
    layerwise reload (``start_weight_update`` / ``finish_weight_update``)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = gloo_group(init_info.master_address, init_info.master_port, worker + init_info.rank_offset,
                                init_info.world_size)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # synchronous: nothing to wait for after

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Each bucket as one packed buffer, unpacked into its tensors and loaded."""
        if self.group is None:
            raise RuntimeError(f"{GLOO_BACKEND}: weights sent before init_weight_transfer_engine")
        dtypes = [getattr(torch, name) for name in update_info.dtype_names]
        start = 0
        for count in update_info.counts:
            part = slice(start, start + count)
            names, kinds, shapes = update_info.names[part], dtypes[part], update_info.shapes[part]
            sizes = [shaped_bytes(kind, shape) for kind, shape in zip(kinds, shapes, strict=True)]
            flat = torch.empty(packed_bytes(sizes), dtype=torch.uint8)
            broadcast(self.group, flat)
            self.model.load_weights([(name, weight.to(self.device)) for name, weight in unpack(flat, names, kinds, shapes)])
            start += count

    def shutdown(self) -> None:
        self.group = None


class NamedTensors(WeightSource):
    """A :class:`~vllm.distributed.weight_transfer.base.WeightSource` over ``weights()``, fresh
    ``(name, tensor)`` pairs each round (a sharded tensor gathered when it is sent), each yielded on
    ``device`` (None: where it is; a CPU snapshot moved to the GPU one tensor at a time for NCCL);
    ``fingerprint``: the :func:`~textrl.generation.weight_sync.fingerprint` of the last whole pass's
    full tensors."""

    def __init__(self, weights: Any, device: torch.device | None = None) -> None:
        self._weights, self.device = weights, device
        self.fingerprint: str | None = None
        self.count = 0
        """How many tensors that pass sent."""

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._weights()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        sent = Sent((name, materialize_full_tensor(tensor)) for name, tensor in self._weights())
        for name, full in sent:
            yield name, full if self.device is None else full.to(self.device, non_blocking=True)
        self.fingerprint, self.count = sent.fingerprint, sent.count


class WeightWatch:
    """vLLM worker extension (``--worker-extension-cls``, set by ``textrl vllm-serve``): methods the
    trainer calls on each worker through the server's ``/collective_rpc``, whatever the transfer
    backend (they all load through the model's ``load_weights``)."""

    def textrl_watch_loads(self) -> None:
        """Wrap the worker's model's ``load_weights`` in a :class:`~textrl.generation.weight_sync.LoadWatch`, once."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        if getattr(model, "_textrl_watch", None) is None:
            watch, original = LoadWatch(model), model.load_weights
            model.load_weights = lambda weights: watch.load(original, weights)
            model._textrl_watch = watch

    def textrl_weight_report(self) -> dict[str, Any]:
        """The watch's report of the loads since the last one (:meth:`~textrl.generation.weight_sync.LoadWatch.report`)."""
        return self.model_runner.get_model()._textrl_watch.report()  # type: ignore[attr-defined]

    def textrl_model_config(self) -> dict[str, Any]:
        """What the trainer checks before any work: the essentials of the worker's model's config
        (:func:`~textrl.generation.vllm_worker.model_essentials`) and the server's weight-transfer
        backend (None: started without one)."""
        from textrl.generation.vllm_worker import model_essentials

        vllm_config = self.vllm_config  # type: ignore[attr-defined]
        transfer = getattr(vllm_config, "weight_transfer_config", None)
        return {"config": model_essentials(vllm_config.model_config.hf_config),
                "weight_transfer": getattr(transfer, "backend", None)}

    def textrl_claim(self, run: str, lease_s: float) -> dict[str, Any]:
        """Claim the server for ``run`` (:meth:`~textrl.generation.vllm_worker.LeaseBook.claim`): granted
        to the run holding it, to any when none does or the holder's claim is stale, else refused
        naming the holder. The worker runs its calls one at a time, so a claim is one step."""
        return self._textrl_leases().claim(run, lease_s)

    def textrl_release(self, run: str) -> bool:
        """Give the server up if ``run`` holds it."""
        return self._textrl_leases().release(run)

    def _textrl_leases(self) -> Any:
        from textrl.generation.vllm_worker import LeaseBook

        if getattr(self, "_textrl_lease_book", None) is None:
            self._textrl_lease_book = LeaseBook()
        return self._textrl_lease_book


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer side: rank 0 opens the group with the server's workers and, each round, drives
    the server's update routes while it broadcasts every weight (the other trainer ranks only
    iterate the source, which gathers a sharded weight with them). It stops waiting on the server as
    soon as its side fails, or ``client.stop`` is set (module docstring)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: Any, source: WeightSource, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group: Any = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: Any,
                     source: WeightSource | None = None) -> GlooTrainerWeightTransferEngine:
        """The group with the server's workers: they join it (``/init_weight_transfer_engine``) while
        this side hosts its store; a failure of the route, or ``client.stop``, ends the wait at once."""
        if source is None:
            raise ValueError(f"{GLOO_BACKEND}: the trainer side needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.bucket_bytes = int(init_info.bucket_bytes)
        if not engine.is_sender:
            return engine
        worker = GlooInitInfo(init_info.master_address, init_info.master_port, 1, init_info.world_size)
        joined = Call(lambda: client.init_weight_transfer_engine(asdict(worker)))
        group = Call(lambda: gloo_group(init_info.master_address, init_info.master_port, 0, init_info.world_size))
        while not group.wait(WAIT_SLICE.total_seconds()):
            failure = joined.failure() or stopped(client)
            if failure is not None:
                raise failure
        engine.group = group.result()
        joined.wait()
        joined.result()
        return engine

    def send_weights(self) -> None:
        """Every weight, in buckets of at most :attr:`bucket_bytes`, each packed into one buffer and
        broadcast once (:func:`~textrl.generation.weight_sync.pack`)."""
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        counts = bucket_counts([shaped_bytes(m.dtype, m.shape) for m in meta], self.bucket_bytes)
        info = GlooUpdateInfo([m.name for m in meta], [str(m.dtype).removeprefix("torch.") for m in meta],
                              [list(m.shape) for m in meta], counts)
        self.client.start_weight_update()
        received = Call(lambda: self.client.update_weights(asdict(info)))

        def failed() -> BaseException | None:
            return received.failure() or stopped(self.client)

        failure: BaseException | None = None
        bucket: list[tuple[str, torch.Tensor]] = []
        ends = iter(counts)
        end = next(ends, 0)
        for (name, tensor), m in zip(self.source, meta, strict=True):  # every weight read, even after a failure
            if name != m.name or tuple(tensor.shape) != m.shape:
                raise ValueError(f"{GLOO_BACKEND}: the weights changed while they were sent ({name})")
            bucket.append((name, tensor.detach()))
            if len(bucket) < end:
                continue
            if failure is None:
                try:
                    broadcast(self.group, pack(bucket), failed)
                except Exception as err:  # noqa: BLE001 - raised once the pass is read
                    failure = err
            bucket, end = [], next(ends, 0)
        if failure is not None:
            raise failure
        while not received.wait(WAIT_SLICE.total_seconds()):
            abandoned = stopped(self.client)
            if abandoned is not None:
                raise abandoned
        received.result()
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.group = None


def register() -> None:
    """Register ``textrl_gloo`` in vLLM's weight-transfer factories (worker and trainer side), once;
    the ``vllm.general_plugins`` entry point calls it in every vLLM process."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    quiet_rotary_reloads()  # the server's workers: no false alarm at each weight update

    for factory, cls in ((WeightTransferEngineFactory, GlooWeightTransferEngine),
                         (WeightTransferTrainerFactory, GlooTrainerWeightTransferEngine)):
        try:
            factory.register_engine(GLOO_BACKEND, __name__, cls.__name__)
        except ValueError:  # registered already (the plugin ran in this process)
            pass


__all__ = ["GLOO_BACKEND", "GlooInitInfo", "GlooTrainerInitInfo", "GlooTrainerWeightTransferEngine", "GlooUpdateInfo",
           "GlooWeightTransferEngine", "NamedTensors", "WeightWatch", "register"]
