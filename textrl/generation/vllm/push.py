"""The served engine's weight push: rank 0 sends the weights the servers should hold to each live
server that lacks them, through vLLM's weight-transfer engines (``nccl`` on CUDA, textrl's
``textrl_gloo`` on the CPU: :mod:`textrl.generation.vllm_transfer`), its health polled meanwhile,
checks what each server's workers took (:func:`~textrl.generation.weight_sync.check_taken`) and sets
its weight version; the other ranks wait for that version, or take part in the push under a
backend that partitions the weights. A server whose push fails is dropped (:class:`WeightPush`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import wait
from typing import Any

import torch
from torch import nn

from textrl.generation.vllm import budgets
from textrl.generation.vllm.checks import import_vllm
from textrl.generation.vllm.server import HTTPClient, Server, what_failed
from textrl.generation.vllm.transport import (
    ServerDown,
    ServerRefused,
    free_port,
    on_thread,
    own_address,
    world_rank,
)
from textrl.generation.weight_sync import WeightSync, check_taken, fingerprint


class WeightPush:
    """The weight push of :class:`~textrl.generation.vllm.served.VLLMServerEngine`, which it is part of:
    it reads the engine's ``servers``, ``sync`` (:class:`~textrl.generation.weight_sync.WeightSync`),
    ``partitioned``, ``bucket_bytes`` and the version last sent (``_version``), and calls its
    ``_live``, ``_drop``, ``_revive`` and ``_together``."""

    servers: list[Server]
    sync: WeightSync
    partitioned: bool
    bucket_bytes: int
    _version: str | None
    _handovers: int
    _live: Callable[[], list[Server]]
    _drop: Callable[..., None]
    _revive: Callable[..., None]
    _together: Callable[[], bool]

    def _sync(self, model: nn.Module) -> str:
        """The live servers without the policy's current weights take them. Rank 0 sends them through
        vLLM's weight transfer (under a backend that partitions them every rank takes part, gathering
        each weight as it is sent: their generation calls are collectives, so they come here
        together, and rank 0 tells them which servers), checks what each server's workers took,
        drops its prefix cache and sets its weight version to the weights' fingerprint; a server
        whose push fails is dropped (on every rank when they push together). Every other rank waits
        until each live server reports its own weights' fingerprint (the ranks' generation calls
        need not line up: an evaluation may call more often on one rank than on another). Returns
        the fingerprint."""
        rank, together, now = world_rank(), self._together(), self.sync.wanted()
        if rank != 0 and not self.partitioned:
            version = fingerprint(self.sync.outgoing())
            for server in [s for s in self._live() if s.sent != now]:
                try:
                    server.wait_for_version(version)
                    server.sent = now
                except (ServerDown, ServerRefused) as err:
                    self._drop(server, what_failed(server, err))
            return version
        plan = [i for i, server in enumerate(self.servers) if server.live and server.sent != now]
        if together:  # every rank pushes to the same servers, in the same order
            shared: list[Any] = [plan]
            torch.distributed.broadcast_object_list(shared, src=0)
            plan = shared[0]
            for index in plan:
                if not self.servers[index].live:  # rank 0 took it back
                    self._revive(self.servers[index], holds=None)
        version, failed = None, {}
        for index in plan:
            server = self.servers[index]
            try:
                version = self._push(server, model, rank, watched=not together or rank == 0)
                server.sent = now
            except ServerDown as err:
                failed[index] = err.what
                if not together:
                    self._drop(server, err.what)
        if together:  # rank 0's outcome, so that every rank goes on with the same servers
            outcome: list[Any] = [failed]
            torch.distributed.broadcast_object_list(outcome, src=0)
            for index, what in outcome[0].items():
                self._drop(self.servers[index], what)
        if plan:
            self.sync.handovers += 1
        return version if version is not None else self._version or fingerprint(self.sync.outgoing())

    def _push(self, server: Server, model: nn.Module, rank: int, *, watched: bool = True) -> str:
        """Send ``server`` the policy's weights (a fresh weight-transfer engine where it has none), check
        what its workers took (rank 0) and set its weight version; :class:`ServerDown` where it fails
        (rank 0 then marks the server's version :data:`budgets.DROPPED_VERSION` where it still answers, so
        that the other ranks drop it too). ``watched``: the server's health polled meanwhile
        (:meth:`_watched`; not on the ranks that only gather, which must not leave a pass half done).
        The fingerprint sent."""
        run = self._watched if watched else (lambda server, work, what: work())
        try:
            if server.sender is None:
                server.client = HTTPClient(server)
                server.sender = run(server, lambda: self._open(server, model, rank), "opening the weight transfer")
            sender = server.sender
            run(server, sender.send_weights, "the weight push")
            version = sender.source.fingerprint
            if rank == 0:
                self._check_taken(server, sender.source)
                try:
                    server.request("reset_prefix_cache", {})
                    server.request("update_weight_version", {"new_version": version})
                except (ServerDown, ServerRefused) as err:
                    raise ServerDown(server.url, f"after the weight push: {what_failed(server, err)}") from None
        except ServerDown:
            server.sender = None
            self._mark_dropped(server, rank)
            raise
        return version

    @staticmethod
    def _mark_dropped(server: Server, rank: int) -> None:
        """Tell the other ranks, through the server where it still answers, that rank 0 dropped it."""
        if rank != 0:
            return
        try:
            server.request("update_weight_version", {"new_version": budgets.DROPPED_VERSION},
                           timeout=budgets.PROBE_TIMEOUT_S)
        except ConnectionError:
            pass

    @staticmethod
    def _watched(server: Server, work: Callable[[], Any], what: str) -> Any:
        """``work()`` (a step of a weight push to ``server``) on a thread of its own while the server's
        ``/health`` is polled: :class:`ServerDown` when it stops answering (the push told to stop,
        through its client's ``stop``, and left behind after :data:`budgets.ABANDON_WAIT_S`: textrl's gloo
        transfer stops at once; vLLM's nccl one waits for NCCL's own timeout) or when the step fails
        on the server's side (a route failed, the transfer's group broke)."""
        future = on_thread(work, name="textrl-vllm-push")
        misses = 0
        while not wait([future], timeout=budgets.HEALTH_EVERY_S).done:
            reason = server.health()
            misses = 0 if reason is None else misses + 1
            if reason is not None and ("refused" in reason or misses >= budgets.HEALTH_MISSES):
                if server.client is not None:
                    server.client.stop.set()
                wait([future], timeout=budgets.ABANDON_WAIT_S)
                raise ServerDown(server.url, f"{what}: it stopped answering (GET /health: {reason})")
        try:
            return future.result()
        except (ServerDown, ServerRefused) as err:
            raise ServerDown(server.url, f"{what}: {what_failed(server, err)}") from None
        except (RuntimeError, ConnectionError) as err:  # the transfer's own group broke: the server's side went away
            first = str(err).splitlines()[0][:160] if str(err).strip() else type(err).__name__
            raise ServerDown(server.url, f"{what} broke ({first})") from None

    def _check_taken(self, server: Server, source: Any) -> None:
        """Each of ``server``'s workers took what ``source`` sent in its last pass (:func:`check_taken`)."""
        try:
            reports = server.worker_call("textrl_weight_report", timeout=60)
        except (ServerDown, ServerRefused) as err:
            raise ServerDown(server.url, f"after the weight push: {what_failed(server, err)}") from None
        for report in reports:
            check_taken(report, source.fingerprint, source.count, engine=f"vLLM server {server.url}",
                        handover=self._handovers + 1)

    @staticmethod
    def _watch(server: Server) -> None:
        """Have ``server``'s workers fingerprint what their loads take (textrl's worker extension)."""
        try:
            server.worker_call("textrl_watch_loads", timeout=60)
        except ServerRefused:
            raise ValueError(f"vLLM server {server.url} cannot report the weights it loads (no textrl worker "
                             "extension, or no dev routes): start it with textrl vllm-serve MODEL, or add "
                             "--worker-extension-cls textrl.generation.vllm_transfer.WeightWatch and "
                             "VLLM_SERVER_DEV_MODE=1 to your vllm serve") from None

    def _open(self, server: Server, model: nn.Module, rank: int) -> Any:
        """vLLM's trainer-side weight-transfer engine to ``server`` (``nccl`` on CUDA, ``textrl_gloo`` on the CPU)."""
        import_vllm()
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from textrl.generation.vllm_transfer import GlooTrainerInitInfo, NamedTensors, register

        register()
        if rank == 0:
            self._watch(server)
        world = 1 + int(server.request("get_world_size?include_dp=true")["world_size"]) if rank == 0 else 0
        device = next(model.parameters()).device
        if device.type == "cuda":  # NCCL sends from the GPU: a CPU snapshot goes there one tensor at a time
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            source = NamedTensors(self.sync.outgoing, device=device)
            info: Any = NCCLTrainerInitInfo(own_address(server.url), free_port(), world, rank=rank,
                                            packed_buffer_size_bytes=self.bucket_bytes)
        else:
            source = NamedTensors(self.sync.outgoing)
            info = GlooTrainerInitInfo(own_address(server.url), free_port(), world, rank=rank,
                                       bucket_bytes=self.bucket_bytes)
        return WeightTransferTrainerFactory.trainer_init(info, client=server.client, source=source)


__all__ = ["WeightPush"]
