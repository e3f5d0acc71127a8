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
in the worker, so the trainer compares them with what it sent (docs/vllm.md).
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch

from textrl.generation.vllm_engine import Fingerprint, LoadWatch, import_vllm

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

TIMEOUT = datetime.timedelta(minutes=10)


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


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One round's weights, in the order they are broadcast: names, dtype names, shapes."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


def gloo_group(address: str, port: int, rank: int, world_size: int) -> Any:
    """A gloo process group of its own over a TCP store the trainer (rank 0) hosts: no default
    process group is needed or touched (the trainer's and vLLM's stay as they are)."""
    store = torch.distributed.TCPStore(address, port, world_size, is_master=rank == 0, timeout=TIMEOUT)
    return torch.distributed.ProcessGroupGloo(store, rank, world_size, TIMEOUT)


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Rank 0's ``tensor`` into every rank's (a CPU tensor), in place."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


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
        if self.group is None:
            raise RuntimeError(f"{GLOO_BACKEND}: weights sent before init_weight_transfer_engine")
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
            broadcast(self.group, weight)
            self.model.load_weights([(name, weight.to(self.device))])

    def shutdown(self) -> None:
        self.group = None


class NamedTensors(WeightSource):
    """A :class:`~vllm.distributed.weight_transfer.base.WeightSource` over ``weights()``, a fresh
    ``{name: tensor}`` each round (a sharded tensor gathered when it is sent); ``fingerprint``: the
    :func:`~textrl.generation.vllm_engine.fingerprint` of the last whole pass's full tensors."""

    def __init__(self, weights: Any) -> None:
        self._weights = weights
        self.fingerprint: str | None = None
        self.count = 0
        """How many tensors that pass sent."""

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._weights().items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        running = Fingerprint()
        count = 0
        for name, tensor in self._weights().items():
            full = materialize_full_tensor(tensor)
            running.add(name, full)
            count += 1
            yield name, full
        self.fingerprint, self.count = running.hexdigest(), count


class WeightWatch:
    """vLLM worker extension (``--worker-extension-cls``, set by ``textrl vllm-serve``): methods the
    trainer calls on each worker through the server's ``/collective_rpc``, whatever the transfer
    backend (they all load through the model's ``load_weights``)."""

    def textrl_watch_loads(self) -> None:
        """Wrap the worker's model's ``load_weights`` in a :class:`~textrl.generation.vllm_engine.LoadWatch`, once."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        if getattr(model, "_textrl_watch", None) is None:
            watch, original = LoadWatch(model), model.load_weights
            model.load_weights = lambda weights: watch.load(original, weights)
            model._textrl_watch = watch

    def textrl_weight_report(self) -> dict[str, Any]:
        """The watch's report of the loads since the last one (:meth:`~textrl.generation.vllm_engine.LoadWatch.report`)."""
        return self.model_runner.get_model()._textrl_watch.report()  # type: ignore[attr-defined]


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer side: rank 0 opens the group with the server's workers and, each round, drives
    the server's update routes while it broadcasts every weight (the other trainer ranks only
    iterate the source, which gathers a sharded weight with them)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: Any, source: WeightSource, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group: Any = None
        self._failure: Exception | None = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: Any,
                     source: WeightSource | None = None) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError(f"{GLOO_BACKEND}: the trainer side needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        worker = GlooInitInfo(init_info.master_address, init_info.master_port, 1, init_info.world_size)
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, asdict(worker))
            engine.group = gloo_group(init_info.master_address, init_info.master_port, 0, init_info.world_size)
            joined.result()
        return engine

    def send_weights(self) -> None:
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        info = GlooUpdateInfo([m.name for m in meta], [str(m.dtype).removeprefix("torch.") for m in meta],
                              [list(m.shape) for m in meta])
        self.client.start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as pool:
            received = pool.submit(self.client.update_weights, asdict(info))
            sent = threading.Thread(target=self._broadcast, args=(meta,), daemon=True)
            sent.start()
            while sent.is_alive():  # a server that fails mid-update leaves the broadcast waiting: stop on its error
                sent.join(0.1)
                if received.done() and received.exception() is not None:
                    received.result()
            if self._failure is not None:
                raise self._failure
            received.result()
        self.client.finish_weight_update()

    def _broadcast(self, meta: list[ParamMeta]) -> None:
        """Every weight of a pass over the source, broadcast in order (run on a thread of its own)."""
        self._failure = None
        try:
            for (name, tensor), m in zip(self.source, meta, strict=True):
                if name != m.name or tuple(tensor.shape) != m.shape:
                    raise ValueError(f"{GLOO_BACKEND}: the weights changed while they were sent ({name})")
                broadcast(self.group, tensor.detach().to("cpu").contiguous())
        except Exception as err:  # noqa: BLE001 - handed to the caller's thread
            self._failure = err

    def shutdown(self) -> None:
        self.group = None


def register() -> None:
    """Register ``textrl_gloo`` in vLLM's weight-transfer factories (worker and trainer side), once;
    the ``vllm.general_plugins`` entry point calls it in every vLLM process."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, cls in ((WeightTransferEngineFactory, GlooWeightTransferEngine),
                         (WeightTransferTrainerFactory, GlooTrainerWeightTransferEngine)):
        try:
            factory.register_engine(GLOO_BACKEND, __name__, cls.__name__)
        except ValueError:  # registered already (the plugin ran in this process)
            pass


__all__ = ["GLOO_BACKEND", "GlooInitInfo", "GlooTrainerInitInfo", "GlooTrainerWeightTransferEngine", "GlooUpdateInfo",
           "GlooWeightTransferEngine", "NamedTensors", "WeightWatch", "register"]
