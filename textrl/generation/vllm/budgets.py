"""The served engine's budgets: how long a request, a health check, a weight push or a claim is given,
how often a request is sent again, how many are pending at once (docs/vllm.md, "When a server fails").
The served engine's modules read them here at call time (``budgets.RETRIES``), so that one setting
(a test's shorter budgets) holds for them all."""

from __future__ import annotations

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
through :attr:`~textrl.generation.vllm.server.HTTPClient.stop`) before it is left behind."""

LEASE_S = 30.0
"""A claim on a server not renewed for this long is stale: another run may take the server over (a
run that crashed, or whose machine went away, holds it no longer)."""

RENEW_EVERY_S = 5.0
"""How often a run renews its claims (:data:`~textrl.generation.vllm.claims.CLAIMS`' thread): six renewals within a lease."""

IN_FLIGHT = 32
"""Requests a call keeps pending at once, over all its servers."""

TRANSIENT_STATUS = (502, 503, 504)
"""HTTP statuses worth a retry: a proxy or the server between states, not the request's fault."""

DROPPED_VERSION = "textrl-dropped"
"""The weight version rank 0 sets on a server it dropped while it still answers (a push that broke):
the other ranks, waiting for rank 0's weights there, drop it too instead of waiting out their budget."""


__all__ = ["REQUEST_TIMEOUT_S", "RETRIES", "BACKOFF_S", "COMPLETION_FLOOR_S", "SECONDS_PER_TOKEN",
           "HEALTH_EVERY_S", "HEALTH_TIMEOUT_S", "HEALTH_MISSES", "PROBE_TIMEOUT_S", "TRANSFER_TIMEOUT_S",
           "ABANDON_WAIT_S", "LEASE_S", "RENEW_EVERY_S", "IN_FLIGHT", "TRANSIENT_STATUS", "DROPPED_VERSION"]
