"""The ``vllm-server`` engine (``textrl train --vllm-server URL[,URL...]``): rollouts sampled by vLLM
servers on other GPUs or machines, the weights pushed to them after each update.

The servers are vLLM's own (``textrl vllm-serve MODEL``: ``vllm serve`` with the settings weight
updates need, :func:`serve_command`). A call's rows are grouped by context (the
``n_samples_per_prompt`` copies of a prompt are one request with ``n`` samples and one seed drawn from
torch's generator; greedy, one answer for them all and no seed: :func:`~textrl.generation.vllm.sampling.row_seeds`)
and the groups dealt round-robin over the servers from a server that the call's first request names
(:func:`first_server`: its seed, or its prompt when greedy), so that where each request goes is a
pure function of the call, the same in a resumed run as in the one it continues; sent concurrently to vLLM's
OpenAI-compatible ``/v1/completions`` with token ids in and out (``return_token_ids``) and the drawn
tokens' log-probs (``logprobs: 0``; the servers run ``--logprobs-mode processed_logprobs``, so they
are of the warped distribution, as in :mod:`textrl.generation.vllm.colocated`).

The weights (a LoRA policy's merged with its adapter: :func:`~textrl.generation.vllm.handover.merged_state_dict`)
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

Where each part lives, in :mod:`textrl.generation.vllm`: the budgets named here (``RETRIES``,
``LEASE_S``, ...) in ``budgets``; the requests, their retries and the checks of a server in
``server``; the claims and :func:`check_servers` in ``claims``; a call's requests dealt over the
servers (:func:`first_server`, :func:`completion_budget`) in ``dealing``; the weight push in
``push``; :func:`serve_command` in ``serve_command``.
"""

from __future__ import annotations

import os
import socket
from collections import defaultdict
from collections.abc import Callable, Sequence
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
from textrl.generation.vllm import budgets
from textrl.generation.vllm.claims import CLAIMS, claim_all, run_id
from textrl.generation.vllm.dealing import Call, Job, choice_rows, completion_request, server_urls
from textrl.generation.vllm.handover import merged_state_dict
from textrl.generation.vllm.options import run_bucket_bytes
from textrl.generation.vllm.push import WeightPush
from textrl.generation.vllm.sampling import prompt_token_ids, row_seeds, stack_outputs
from textrl.generation.vllm.server import Server, what_failed
from textrl.generation.vllm.transport import ServerDown, ServerRefused, on_thread, say, world_rank
from textrl.generation.vllm_worker import model_essentials
from textrl.generation.weight_sync import DEFAULT_BUCKET_BYTES, WeightSync
from textrl.run.rng import keeping_rng


@register_engine(SERVED_ENGINE)
class VLLMServerEngine(WeightPush, GenerationEngine):
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
        merged, as :func:`~textrl.generation.vllm.handover.merged_state_dict` gives them) from the next
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


    def _complete(self, jobs: list[Job]) -> list[dict[str, Any]]:
        """Each job's answer, the jobs dealt over the live servers, a server that fails dropped and its
        jobs dealt to the others (:class:`~textrl.generation.vllm.dealing.Call`)."""
        return Call(jobs, self._live, self._drop, self._foreign_weights).run()

    def _foreign_weights(self, server: Server) -> str:
        """Why ``server`` does not hold this run's weights ('' where it does): it holds another version
        (another run's push), or it does not answer."""
        try:
            held = server.weight_version()
        except (ServerDown, ServerRefused) as err:
            return what_failed(server, err)
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
        on rank 0, claimed for the run (``ValueError`` / :class:`~textrl.generation.vllm.server.ServerBusy` in one line)."""
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
        probes = {server: on_thread(lambda s=server: s.health(budgets.PROBE_TIMEOUT_S)) for server in dropped}
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


__all__ = ["VLLMServerEngine"]
