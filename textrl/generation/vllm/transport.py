"""A served engine's requests on the wire: one HTTP exchange (:func:`exchange`), what failed in a few
words (:func:`failure_reason`, :func:`error_detail`), the errors that name the server
(:class:`ServerDown`, :class:`ServerRefused`), work on a daemon thread (:func:`on_thread`), and where
this process stands (:func:`world_rank`, :func:`say`, :func:`own_address`, :func:`free_port`)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch


class ServerDown(ConnectionError):
    """A server that does not answer (after its retries, where a request has any), or whose weight
    transfer broke: the engine drops it (:meth:`~textrl.generation.vllm.served.VLLMServerEngine._drop`). ``what``: what failed."""

    def __init__(self, url: str, what: str) -> None:
        super().__init__(f"vLLM server {url}: {what}")
        self.url, self.what = url, what


class ServerRefused(ConnectionError):
    """A server that answered a request with an HTTP error that is not transient (``status``, its
    ``detail``: the first line of vLLM's message)."""

    def __init__(self, url: str, path: str, status: int, text: str) -> None:
        self.url, self.path, self.status, self.detail = url, path, status, error_detail(text)
        super().__init__(f"vLLM server {url} refused /{path} (HTTP {status}: {self.detail})")


def error_detail(text: str, limit: int = 200) -> str:
    """The message of a server's error answer: vLLM's JSON ``{"error": {"message": ...}}`` or
    ``{"detail": ...}``, else the text; its first line, at most ``limit`` characters."""
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if isinstance(answer, dict):
        error = answer.get("error", answer.get("detail", answer.get("message", text)))
        text = str(error.get("message", error) if isinstance(error, dict) else error)
    line = next((line.strip() for line in text.splitlines() if line.strip()), "no message")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def failure_reason(err: BaseException, timeout: float) -> str:
    """A transport failure in a few words: ``connection refused``, ``no answer in 5 s``, ..."""
    reason = getattr(err, "reason", err)
    if isinstance(reason, TimeoutError):
        return f"no answer in {timeout:g} s"
    if isinstance(reason, http.client.RemoteDisconnected):
        return "the connection closed without an answer"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, ConnectionResetError):
        return "connection reset"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror[0].lower() + reason.strerror[1:]
    return error_detail(str(reason) or type(reason).__name__)


def exchange(url: str, path: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, str, str]:
    """One HTTP request to ``url/path`` (``GET``, or ``POST`` of ``body`` as JSON): ``(status, content
    type, text)`` whatever the status; a transport failure raises (``OSError``,
    ``http.client.HTTPException``)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{url}/{path}", data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, response.headers.get_content_type(), response.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        kind = err.headers.get_content_type() if err.headers is not None else ""
        return err.code, kind, err.read().decode(errors="replace")


def on_thread(work: Callable[[], Any], name: str = "textrl-vllm") -> Future:
    """``work()`` on a daemon thread of its own; its future. Not a thread pool: a request left behind
    (its server dropped) must not hold the process at exit until its budget runs out."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(work())
        except BaseException as err:  # noqa: BLE001 - handed to the future's reader
            future.set_exception(err)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def own_address(url: str) -> str:
    """This machine's address as the server at ``url`` reaches it (the interface a connection to it leaves by)."""
    host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 80))
        return str(s.getsockname()[0])


def world_rank() -> int:
    """This process's rank: the process group's, or before it is set up, the launcher's (``RANK``)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def say(line: str) -> None:
    """A line of the run's log (this process's rank named where it is not 0)."""
    rank = world_rank()
    print(line if rank == 0 else f"rank {rank}: {line}", flush=True)



__all__ = ["ServerDown", "ServerRefused", "error_detail", "exchange", "failure_reason", "free_port", "on_thread",
           "own_address", "say", "world_rank"]
