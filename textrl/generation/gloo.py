"""The gloo side of textrl's weight transfer to vLLM servers (``textrl_gloo``:
:mod:`textrl.generation.vllm_transfer`), without vLLM: the group, a broadcast that stops waiting on a
peer that failed, a call on a daemon thread.

A gloo broadcast to a peer that went silent (its machine gone, its process stopped, or a worker
left alive after its server's API process died: a killed process closes its connections and gloo
fails at once) waits for the group's timeout, and neither ``abort`` nor ``shutdown`` ends the wait; a
broadcast still pending holds the process at exit until then. So the trainer waits in slices
(:data:`WAIT_SLICE`), asking between them whether the server's side failed (its ``/update_weights``
answered an error, or the engine's health check found it dead and set the client's ``stop``): it
then leaves the broadcast pending and stops sending; and each of its broadcasts has a timeout of its
size (:func:`op_timeout`), so one left pending holds the process at exit seconds, not minutes.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

import torch

TIMEOUT = datetime.timedelta(minutes=2)
"""The group's timeout: the rendezvous, and each operation of a server's worker (it waits for each
weight while the trainer gathers and sends it). Not how a dead server is found (the engine's health
check finds it in seconds: :mod:`textrl.generation.vllm.served`); the trainer's own broadcasts have
their size's (:func:`op_timeout`)."""

WAIT_SLICE = datetime.timedelta(milliseconds=200)
"""How long the trainer waits on a broadcast before it looks whether the server's side failed."""

OP_FLOOR = datetime.timedelta(seconds=30)
"""The least time the trainer gives one broadcast (the server's worker starts receiving once the
``/update_weights`` call reaches it, and loads each weight before it receives the next)."""

OP_BYTES_PER_S = 10e6
"""The slowest transfer a broadcast is given time for beyond :data:`OP_FLOOR`: 10 MB/s."""


def op_timeout(nbytes: int) -> datetime.timedelta:
    """The timeout of the trainer's broadcast of ``nbytes``: :data:`OP_FLOOR` plus its bytes at
    :data:`OP_BYTES_PER_S` (a 1 GB weight: 130 s)."""
    return OP_FLOOR + datetime.timedelta(seconds=nbytes / OP_BYTES_PER_S)


def gloo_group(address: str, port: int, rank: int, world_size: int) -> Any:
    """A gloo process group of its own over a TCP store the trainer (rank 0) hosts: no default
    process group is needed or touched (the trainer's and vLLM's stay as they are)."""
    store = torch.distributed.TCPStore(address, port, world_size, is_master=rank == 0, timeout=TIMEOUT)
    return torch.distributed.ProcessGroupGloo(store, rank, world_size, TIMEOUT)


def broadcast(group: Any, tensor: torch.Tensor, failed: Callable[[], BaseException | None] | None = None) -> None:
    """Rank 0's ``tensor`` into every rank's (a CPU tensor), in place. ``failed`` (the trainer's side):
    asked every :data:`WAIT_SLICE` while the broadcast is pending; what it returns (the other side's
    failure) is raised, the broadcast left pending, to fail by itself within :func:`op_timeout`."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    if failed is not None:
        group.set_timeout(op_timeout(tensor.numel() * tensor.element_size()))
    work = group.broadcast([tensor], options)
    if failed is None:
        work.wait()
        return
    while True:
        try:
            work.wait(WAIT_SLICE)
            return
        except RuntimeError:
            if work.is_completed():  # done since the slice ended: its own outcome (sent, a closed connection,
                work.wait()  # its own timeout), not the slice's timeout (a thread descheduled in between)
                return
        failure = failed()
        if failure is not None:
            raise failure


class Call:
    """A call on a daemon thread (one a server that went away leaves waiting must not hold the
    process at exit): :meth:`wait`, :meth:`failure` (its exception once it ended with one), :meth:`result`."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = work()
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                self._error = err
            finally:
                self._done.set()

        threading.Thread(target=run, name="textrl-gloo", daemon=True).start()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def failure(self) -> BaseException | None:
        return self._error if self._done.is_set() else None

    def result(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


def stopped(client: Any) -> BaseException | None:
    """A ``ConnectionError`` once the engine set ``client.stop`` (it found the server dead), else None."""
    stop = getattr(client, "stop", None)
    if stop is None or not stop.is_set():
        return None
    server = getattr(client, "server", None)
    return ConnectionError(f"the transfer to vLLM server {getattr(server, 'url', '?')} was abandoned: the server "
                           "stopped answering")


__all__ = ["Call", "OP_BYTES_PER_S", "OP_FLOOR", "TIMEOUT", "WAIT_SLICE", "broadcast", "gloo_group", "op_timeout",
           "stopped"]
