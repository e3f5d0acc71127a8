"""One run per server: a run's claims on its servers (:class:`Claims`, the process's :data:`CLAIMS`,
renewed from a thread, given back at the end), and the check of every server before any work
(:func:`check_servers`: each fit for the run, then claimed; :func:`release_servers` at its end)."""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from torch import nn

from textrl.generation.vllm import budgets
from textrl.generation.vllm.dealing import server_urls
from textrl.generation.vllm.server import Server, ServerBusy
from textrl.generation.vllm.transport import on_thread, say, world_rank
from textrl.generation.vllm_worker import model_essentials


def trained_essentials(model: Any) -> dict[str, Any]:
    """:func:`model_essentials` of the run's model: a model object's config, or the config of the
    folder or hub id (``tiny`` too) it names, read without loading any weight."""
    if isinstance(model, nn.Module):
        return model_essentials(model.config)
    from transformers import AutoConfig

    from textrl.models.tiny import _resolve

    return model_essentials(AutoConfig.from_pretrained(_resolve(str(model), "causal_lm")))



def run_id(output_dir: str | os.PathLike[str]) -> str:
    """A run's id in its claims: this host and its run folder's absolute path. The same when the run is
    resumed (it takes its own claim back at once, stale or not); two runs never share it (a run
    folder has one run at a time: :func:`textrl.run.lock.take_run_folder`)."""
    return f"{socket.gethostname()}:{Path(output_dir).resolve()}"



class Claims:
    """This process's claims on servers, ``(url, run) -> server``: granted by the server (:meth:`hold`),
    renewed from a daemon thread every :data:`budgets.RENEW_EVERY_S` (one renewal in flight per server, so a
    server that hangs delays no other's), given back when the run ends (:meth:`let_go`, and at exit).
    A renewal refused (the claim went stale and another run took the server) is kept in :meth:`lost`
    for the engine, which drops the server."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], Any] = {}
        self._lost: dict[tuple[str, str], str] = {}
        self._renewing: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def hold(self, server: Server, run: str) -> dict[str, Any]:
        """Claim ``server`` for ``run`` (:class:`ServerBusy` when another run holds it) and keep the
        claim renewed; the server's answer (``taken_over``: a stale claim this one replaced)."""
        answer = server.claim(run)
        with self._lock:
            self._held[(server.url, run)] = server
            self._lost.pop((server.url, run), None)
            if self._thread is None:
                self._thread = threading.Thread(target=self._renew, name="textrl-vllm-claims", daemon=True)
                self._thread.start()
        return answer

    def holds(self, url: str, run: str) -> bool:
        with self._lock:
            return (url, run) in self._held

    def lost(self, url: str, run: str) -> str | None:
        """Why ``run``'s claim on ``url`` was lost since it was granted (None: it was not)."""
        with self._lock:
            return self._lost.get((url, run))

    def let_go(self, run: str | None = None, urls: Sequence[str] | None = None) -> None:
        """Give up ``run``'s claims (every run's: None) on ``urls`` (all: None), telling each server
        (a server that does not answer keeps it until it goes stale)."""
        with self._lock:
            keys = [key for key in self._held if (run is None or key[1] == run) and (urls is None or key[0] in urls)]
            servers = [(self._held.pop(key), key[1]) for key in keys]
        for server, holder in servers:
            try:
                server.worker_call("textrl_release", timeout=budgets.PROBE_TIMEOUT_S, run=holder)
            except (ConnectionError, KeyError, TypeError, ValueError):
                pass

    def _renew(self) -> None:
        while True:
            time.sleep(budgets.RENEW_EVERY_S)
            with self._lock:
                due = [(key, server) for key, server in self._held.items()
                       if key not in self._renewing or self._renewing[key].done()]
                for key, server in due:
                    self._renewing[key] = on_thread(lambda key=key, server=server: self._renew_one(key, server),
                                                    name="textrl-vllm-renew")

    def _renew_one(self, key: tuple[str, str], server: Server) -> None:
        try:
            server.claim(key[1], timeout=budgets.TRANSFER_TIMEOUT_S)  # queued behind a long push: not given up on
        except ServerBusy as err:
            holder = err.holder
            with self._lock:
                if key in self._held:
                    del self._held[key]
                    self._lost[key] = (f"another run took it over ({holder.get('run')}) when this run's claim was "
                                       f"not renewed for over {budgets.LEASE_S:.0f} s")
            return
        except (ConnectionError, KeyError, TypeError, ValueError):
            return  # a server down: the engine's own checks find it; the claim is renewed once it answers
        with self._lock:
            given_back = key not in self._held
        if given_back:  # let go of while this renewal was on its way: the server must not keep it
            try:
                server.worker_call("textrl_release", timeout=budgets.PROBE_TIMEOUT_S, run=key[1])
            except (ConnectionError, KeyError, TypeError, ValueError):
                pass


CLAIMS = Claims()
"""The process's claims (one renewal thread for every engine and :func:`check_servers`)."""
atexit.register(CLAIMS.let_go)


def check_servers(config: Any, log: Callable[[str], None] = say) -> None:
    """Before any work (the trainer's set-up, before the warm-up): each server of
    ``config.vllm_server`` checked (:meth:`Server.check`: a vLLM server with the routes a run needs,
    serving ``config.model`` by its config), then claimed for the run (rank 0: :data:`CLAIMS`, the
    run's id :func:`run_id` of ``config.output_dir``, renewed until :func:`release_servers` or the
    process ends). ``ValueError`` in one line naming the first server that is not fit (nothing claimed
    then), or :class:`ServerBusy` for one another run holds; one ``log`` line for each server that is."""
    servers = [Server(url) for url in server_urls(config.vllm_server)]
    trained = trained_essentials(config.model)
    lines = [server.check(trained) for server in servers]
    if world_rank() == 0:
        claim_all(servers, run_id(config.output_dir), log)
    for line in lines:
        log(line)


def claim_all(servers: Sequence[Server], run: str, log: Callable[[str], None]) -> None:
    """Claim each of ``servers`` for ``run``; where one is refused, give back those claimed and raise."""
    claimed = []
    try:
        for server in servers:
            answer = CLAIMS.hold(server, run)
            claimed.append(server.url)
            if answer.get("taken_over"):
                stale = answer["taken_over"]
                log(f"vLLM server {server.url}: the claim of run {stale['run']} was not renewed for "
                    f"{float(stale['seen_ago']):.0f} s (over {budgets.LEASE_S:.0f} s): this run takes the server over")
    except BaseException:
        CLAIMS.let_go(run, claimed)
        raise


def release_servers(config: Any) -> None:
    """Give back the run's claims (:func:`check_servers`' and its engines'): the trainer calls it when
    the run ends, however it ends, so that the next run may take the servers at once."""
    CLAIMS.let_go(run_id(config.output_dir))


__all__ = ["CLAIMS", "Claims", "check_servers", "claim_all", "release_servers", "run_id", "trained_essentials"]
