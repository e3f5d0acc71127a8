"""What a served call asks of its servers, and how it is dealt: the ``/v1/completions`` body of a
group of rows (:func:`completion_request`) and its budget (:func:`completion_budget`), the answer's rows
(:func:`choice_rows`), the groups dealt round-robin from a server the call names (:func:`first_server`,
:func:`deal`), and one call's requests sent, watched and dealt again when a server fails (:class:`Call`)."""

from __future__ import annotations

import json
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from textrl.generation.base import EngineFailed, Sampling
from textrl.generation.vllm import budgets
from textrl.generation.vllm.server import Server
from textrl.generation.vllm.transport import ServerDown, ServerRefused, on_thread


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
    ``sampling`` describes (:func:`textrl.generation.vllm.sampling.sampling_params`' settings); no
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
    :data:`budgets.COMPLETION_FLOOR_S` plus :data:`budgets.SECONDS_PER_TOKEN` each."""
    return budgets.COMPLETION_FLOOR_S + budgets.SECONDS_PER_TOKEN * tokens


def choice_rows(response: dict[str, Any], logprobs: bool) -> list[tuple[list[int], list[float] | None]]:
    """``(token ids, log-probs or None)`` of each choice of a ``/v1/completions`` response, in order."""
    rows = []
    for choice in sorted(response["choices"], key=lambda c: c["index"]):
        ids = list(choice["token_ids"])
        lps = [float(x) for x in choice["logprobs"]["token_logprobs"]] if logprobs else None
        rows.append((ids, lps))
    return rows


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


def deal(indices: list[int], servers: list[Server], jobs: list[Job]) -> list[tuple[int, Server]]:
    """The jobs ``indices`` of ``jobs`` round-robin over ``servers``, from :func:`first_server`."""
    start = first_server(jobs, len(servers))
    return [(index, servers[(start + k) % len(servers)]) for k, index in enumerate(indices)]


class Call:
    """One call's answers (:meth:`run`). The jobs are dealt over the live servers and sent
    (:data:`budgets.IN_FLIGHT` at once), each server with requests pending asked
    ``/health`` every :data:`budgets.HEALTH_EVERY_S`; a server that fails (its
    request after its retries, or its health check) is dropped and its jobs dealt again to the others,
    the same bodies; when all are answered, each server that answered must still hold this run's
    weights (another run's push would have changed what it sampled with), or it is dropped and its
    jobs dealt again. The engine's part: ``live()``, its live servers; ``drop(server, what, moved=)``,
    a server leaves the run (:class:`~textrl.generation.base.EngineFailed` when none is left);
    ``foreign(server)``, why a server does not hold the run's weights ('' where it does)."""

    def __init__(self, jobs: list[Job], live: Callable[[], list[Server]], drop: Callable[..., None],
                 foreign: Callable[[Server], str]) -> None:
        self.jobs, self.live, self.drop_server, self.foreign = jobs, live, drop, foreign
        self.answers: list[Any] = [None] * len(jobs)
        self.todo: list[int] = list(range(len(jobs)))
        """Jobs to deal."""
        self.queued: list[tuple[int, Server]] = []
        """Jobs dealt, not sent yet."""
        self.pending: dict[Future, tuple[int, Server]] = {}
        self.probes: dict[Server, Future] = {}
        """The health check in flight of each busy server."""
        self.probed: dict[Server, float] = {}
        self.misses: dict[Server, int] = defaultdict(int)
        self.asked: dict[Server, int] = defaultdict(int)
        """The tokens the call asks of each server (its completions' budget)."""
        self.served: dict[Server, list[int]] = defaultdict(list)
        self.verified: set[Server] = set()

    def run(self) -> list[dict[str, Any]]:
        """Each job's answer, in order."""
        while self.todo or self.queued or self.pending:
            self._deal()
            self._send()
            done, _ = wait([*self.pending, *self.probes.values()], timeout=budgets.HEALTH_EVERY_S,
                           return_when=FIRST_COMPLETED)
            self._take(done)
            self._check_health()
            if not (self.todo or self.queued or self.pending):
                self._verify()
        return self.answers

    def drop(self, server: Server, what: str, *, failed: tuple[int, ...] = (), answered_too: bool = False) -> None:
        """Drop ``server`` and deal its jobs again: ``failed``, those not answered yet, and with
        ``answered_too`` those it answered (drawn with weights not this run's)."""
        queued, pending = self.queued, self.pending
        back = [*failed, *(i for i, s in queued if s is server), *(i for i, s in pending.values() if s is server)]
        back += self.served.pop(server, []) if answered_too else []
        queued[:] = [(i, s) for i, s in queued if s is not server]
        for future in [f for f, (_, s) in pending.items() if s is server]:
            del pending[future]  # left behind: its thread ends with its request
        self.todo.extend(back)
        self.drop_server(server, what, moved=len(back))

    def _deal(self) -> None:
        """The jobs to deal, dealt over the live servers (:func:`deal`)."""
        if not self.todo:
            return
        if not self.live():
            raise EngineFailed("the vllm-server engine has no vLLM server (--vllm-server URL[,URL...])")
        dealt = deal(sorted(self.todo), self.live(), self.jobs)
        self.todo.clear()
        for index, server in dealt:
            self.asked[server] += requested_tokens(self.jobs[index].body)
        self.queued.extend(dealt)

    def _send(self) -> None:
        """Queued jobs sent, up to :data:`budgets.IN_FLIGHT` pending."""
        while self.queued and len(self.pending) < budgets.IN_FLIGHT:
            index, server = self.queued.pop(0)
            self.probed.setdefault(server, time.monotonic())  # its first health check a period after its first request
            budget = completion_budget(self.asked[server])
            future = on_thread(lambda s=server, b=self.jobs[index].body, t=budget: s.complete(b, t))
            self.pending[future] = (index, server)

    def _take(self, done: set[Future]) -> None:
        """The answers of the requests ``done``; a failed one's server dropped, the job dealt again."""
        for future in [f for f in done if f in self.pending]:
            index, server = self.pending.pop(future)
            try:
                self.answers[index] = future.result()
                self.served[server].append(index)
            except ServerDown as err:
                if server.live:
                    self.drop(server, err.what, failed=(index,))
                else:
                    self.todo.append(index)
            except ServerRefused as err:
                if server.health(budgets.PROBE_TIMEOUT_S) is None:  # the request's fault: another server would refuse it too
                    raise EngineFailed(f"{err}: see the server's log") from None
                if server.live:
                    self.drop(server, f"/v1/completions: HTTP {err.status}, and it answers /health no more", failed=(index,))
                else:
                    self.todo.append(index)

    def _check_health(self) -> None:
        """The health checks answered read (a server that misses too many dropped); each busy server
        without one in flight asked again once a period has passed since its last."""
        now = time.monotonic()
        misses = self.misses
        for server, future in list(self.probes.items()):
            if not future.done():
                continue
            del self.probes[server]
            reason = future.result()
            misses[server] = 0 if reason is None else misses[server] + 1
            if server.live and reason is not None and ("refused" in reason or misses[server] >= budgets.HEALTH_MISSES):
                tries = f" ({misses[server]} checks in a row)" if misses[server] > 1 else ""
                self.drop(server, f"GET /health: {reason}{tries}")
        busy = {server for _, server in self.pending.values()}
        for server in busy - set(self.probes):
            if now - self.probed.get(server, 0.0) >= budgets.HEALTH_EVERY_S:
                self.probed[server] = now
                self.probes[server] = on_thread(server.health, name="textrl-vllm-health")

    def _verify(self) -> None:
        """Each live server that answered still holds this run's weights, or it is dropped and the jobs
        it answered dealt again."""
        for server in [s for s in self.served if s.live and s not in self.verified]:
            self.verified.add(server)
            why = self.foreign(server)
            if why:
                self.verified.discard(server)
                self.drop(server, why, answered_too=True)


__all__ = ["Call", "Job", "choice_rows", "completion_budget", "completion_request", "deal", "first_server",
           "requested_tokens", "server_urls"]
