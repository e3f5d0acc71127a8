"""The ``vllm-server`` engine's names where users import them: rollouts from vLLM servers
(:class:`~textrl.generation.vllm.served.VLLMServerEngine`, ``textrl train --vllm-server URL``), the
servers checked and claimed before any work (:func:`check_servers`), ``textrl vllm-serve``
(:func:`serve_command`). Each lives in the module of its concern under :mod:`textrl.generation.vllm`:
``served`` (the engine), ``budgets`` (timeouts, retries, health checks, leases), ``transport`` (an
HTTP exchange and its failures), ``server`` (one server: requests, checks, claim), ``claims`` (one
run per server), ``dealing`` (a call's requests over the servers), ``push`` (the weights sent),
``serve_command``.

The budgets (``RETRIES``, ``BACKOFF_S``, ...) are read here as they were at import; the engine reads
:mod:`textrl.generation.vllm.budgets`' own at each call, so set a budget there."""

from __future__ import annotations

from textrl.generation.vllm.budgets import (
    ABANDON_WAIT_S,
    BACKOFF_S,
    COMPLETION_FLOOR_S,
    DROPPED_VERSION,
    HEALTH_EVERY_S,
    HEALTH_MISSES,
    HEALTH_TIMEOUT_S,
    IN_FLIGHT,
    LEASE_S,
    PROBE_TIMEOUT_S,
    RENEW_EVERY_S,
    REQUEST_TIMEOUT_S,
    RETRIES,
    SECONDS_PER_TOKEN,
    TRANSFER_TIMEOUT_S,
    TRANSIENT_STATUS,
)
from textrl.generation.vllm.claims import (
    CLAIMS,
    Claims,
    check_servers,
    claim_all,
    release_servers,
    run_id,
    trained_essentials,
)
from textrl.generation.vllm.dealing import (
    Job,
    choice_rows,
    completion_budget,
    completion_request,
    first_server,
    requested_tokens,
    server_urls,
)
from textrl.generation.vllm.serve_command import cpu_prefill_options, serve_command
from textrl.generation.vllm.served import VLLMServerEngine
from textrl.generation.vllm.server import (
    SERVE_HINT,
    WEIGHT_ROUTES,
    HTTPClient,
    Server,
    ServerBusy,
    busy_message,
    describe,
    first_difference,
)
from textrl.generation.vllm.transport import (
    ServerDown,
    ServerRefused,
    error_detail,
    exchange,
    failure_reason,
    free_port,
    on_thread,
    own_address,
    say,
    world_rank,
)
from textrl.generation.vllm_worker import ESSENTIALS, LeaseBook, model_essentials

__all__ = ["ABANDON_WAIT_S", "BACKOFF_S", "CLAIMS", "COMPLETION_FLOOR_S", "DROPPED_VERSION", "ESSENTIALS",
           "HEALTH_EVERY_S", "HEALTH_MISSES", "HEALTH_TIMEOUT_S", "IN_FLIGHT", "LEASE_S", "PROBE_TIMEOUT_S",
           "RENEW_EVERY_S", "REQUEST_TIMEOUT_S", "RETRIES", "SECONDS_PER_TOKEN", "SERVE_HINT", "TRANSFER_TIMEOUT_S",
           "TRANSIENT_STATUS", "WEIGHT_ROUTES", "busy_message", "check_servers", "choice_rows", "claim_all",
           "Claims", "completion_budget", "completion_request", "cpu_prefill_options", "describe", "error_detail",
           "exchange", "failure_reason", "first_difference", "first_server", "free_port", "HTTPClient", "Job",
           "LeaseBook", "model_essentials", "on_thread", "own_address", "release_servers", "requested_tokens",
           "run_id", "say", "serve_command", "Server", "server_urls", "ServerBusy", "ServerDown", "ServerRefused",
           "trained_essentials", "VLLMServerEngine", "world_rank"]
