"""One vLLM server as the served engine sees it (:class:`Server`): JSON over HTTP with its retries and
errors that name it, the checks before any work (a vLLM server, with the routes and worker extension a
run needs, serving the run's model: :meth:`Server.check`), its claim for a run
(:meth:`Server.claim`, :class:`ServerBusy`), its weight version; and vLLM's weight-sync control
plane over its routes (:class:`HTTPClient`)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any

from textrl.generation.vllm import budgets
from textrl.generation.vllm.transport import (
    ServerDown,
    ServerRefused,
    error_detail,
    exchange,
    failure_reason,
)
from textrl.generation.vllm_worker import ESSENTIALS


class ServerBusy(ValueError):
    """A server another run holds (its claim renewed within :data:`budgets.LEASE_S`): one line naming it;
    ``holder``: the server's word on that run (:meth:`~textrl.generation.vllm_worker.LeaseBook.claim`)."""

    def __init__(self, url: str, holder: dict[str, Any]) -> None:
        super().__init__(busy_message(url, holder))
        self.holder = holder



def busy_message(url: str, holder: dict[str, Any]) -> str:
    """The line that stops a second run at its start."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("since", 0.0))))
    return (f"vLLM server {url} is in use by another run ({holder.get('run')}, since {since}, last seen "
            f"{float(holder.get('seen_ago', 0.0)):.0f} s ago); give each run servers of its own (a run's claim "
            f"not renewed for {budgets.LEASE_S:.0f} s is taken over)")



def what_failed(server: Server, err: ConnectionError) -> str:
    """What failed, from a :class:`ServerDown` or :class:`ServerRefused` of ``server`` (its URL left out)."""
    if isinstance(err, ServerDown):
        return err.what
    return str(err).removeprefix(f"vLLM server {server.url} ")



def first_difference(served: dict[str, Any], trained: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """The first of :data:`ESSENTIALS` both configs set and set differently: ``(field, served's,
    trained's)``; None when none does."""
    for field in ESSENTIALS:
        if field in served and field in trained and served[field] != trained[field]:
            return field, served[field], trained[field]
    return None



def describe(essentials: dict[str, Any]) -> str:
    """A model in a few words: ``llama, 2 layers, hidden 64, vocab 300``."""
    parts = [str(essentials.get("model_type", "?"))]
    for field, name in (("num_hidden_layers", "layers"), ("hidden_size", "hidden"), ("vocab_size", "vocab")):
        if field in essentials:
            parts.append(f"{essentials[field]} {name}" if name == "layers" else f"{name} {essentials[field]}")
    return ", ".join(parts)



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
        ``retries`` times (:data:`budgets.BACKOFF_S`), then :class:`ServerDown`; another HTTP error is
        :class:`ServerRefused` at once."""
        timeout = budgets.REQUEST_TIMEOUT_S if timeout is None else timeout
        failure = ""
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(budgets.BACKOFF_S * 2 ** (attempt - 1))
            try:
                status, _, text = exchange(self.url, path, body, timeout)
            except (OSError, http.client.HTTPException) as err:
                failure = failure_reason(err, timeout)
                continue
            if status in budgets.TRANSIENT_STATUS:
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
        timeout = budgets.HEALTH_TIMEOUT_S if timeout is None else timeout
        try:
            status, _, _ = exchange(self.url, "health", None, timeout)
        except (OSError, http.client.HTTPException) as err:
            return failure_reason(err, timeout)
        return None if status == 200 else f"HTTP {status}"

    def complete(self, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        """A ``/v1/completions`` answer to ``body`` (its ``model`` this server's), retried as idempotent."""
        return self.request("v1/completions", {**body, "model": self.model}, timeout=timeout, retries=budgets.RETRIES)

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
            status, kind, text = exchange(self.url, "v1/models", None, budgets.REQUEST_TIMEOUT_S)
        except (OSError, http.client.HTTPException) as err:
            raise ValueError(f"vLLM server {self.url} does not answer GET /v1/models "
                             f"({failure_reason(err, budgets.REQUEST_TIMEOUT_S)}): {SERVE_HINT}, or fix --vllm-server") from None
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
            return self.worker_call("textrl_model_config", retries=budgets.RETRIES)[0]
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
                status, _, _ = exchange(self.url, route, None, budgets.REQUEST_TIMEOUT_S)
            except (OSError, http.client.HTTPException) as err:
                raise ValueError(f"vLLM server {self.url} does not answer GET /{route} "
                                 f"({failure_reason(err, budgets.REQUEST_TIMEOUT_S)})") from None
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
        """Claim the server for ``run`` (:class:`~textrl.generation.vllm_worker.LeaseBook` in each worker); :class:`ServerBusy` in one
        line when another run holds it."""
        answers = self.worker_call("textrl_claim", timeout=timeout, retries=budgets.RETRIES, run=run,
                                   lease_s=budgets.LEASE_S)
        refused = [answer for answer in answers if not answer["granted"]]
        if refused:
            raise ServerBusy(self.url, refused[0])
        return answers[0]

    # -- during the run ---------------------------------------------------------------------------------
    def weight_version(self) -> str | None:
        return self.request("weight_info", retries=budgets.RETRIES).get("weight_version")

    def wait_for_version(self, version: str, timeout: float | None = None) -> None:
        """Until the server's weight version is ``version`` (rank 0 sets it once it sent them);
        :class:`ServerDown` when it stops answering, rank 0 dropped it (:data:`budgets.DROPPED_VERSION`), or
        ``timeout`` passes."""
        timeout = budgets.TRANSFER_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while (held := self.weight_version()) != version:
            if held == budgets.DROPPED_VERSION:
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
        self.server.request("update_weights", {"update_info": update_info}, timeout=budgets.TRANSFER_TIMEOUT_S)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.server.request("finish_weight_update", {} if weight_version is None else {"weight_version": weight_version})
        self.server.request("resume", {})



__all__ = ["HTTPClient", "SERVE_HINT", "Server", "ServerBusy", "WEIGHT_ROUTES", "busy_message", "describe",
           "first_difference", "what_failed"]
