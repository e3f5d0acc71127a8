"""Rewards scored by a server: ``reward_model:URL``, a reward model served by vLLM (``ServedReward``),
and what they share with the LLM judge (:mod:`textrl.rewards.judge`): the URL's settings, the server's
identity, batches sent concurrently with retries, and the one-line failures.

``reward_model:http://host:8002`` scores as ``reward_model:PATH`` does (:class:`~textrl.rewards.neural.NeuralReward`,
whose rendering, truncation, clip, baseline and answer blend it inherits): each row is rendered and
encoded here with the reward model's own tokenizer (:meth:`NeuralReward.encode`), and the token ids are
sent, ``batch_size`` rows a request, to vLLM's ``/classify`` route (``use_activation: false``: the score
head's raw output at the last token, the score ``NeuralReward`` reads), so the server tokenises nothing
and reads exactly the ids the in-process reward would. The server is one started with
``textrl vllm-serve --reward-model RM`` (vLLM's pooling runner).

Settings come as keyword arguments (``get_reward("reward_model:URL", clip=None)``) or in the URL's
query string, the only place a command line's ``--reward`` spec can hold them:
``reward_model:http://host:8002?clip=none&baseline=0.5&answer_blend=0.4;0.6`` (a pair is written
``a;b``; ``none`` is None). ``tokenizer`` names where the reward model's tokenizer is read from (default:
the model the server names in ``GET /v1/models``, a folder or hub id this machine can read).

Failures, as the served engine's (:mod:`textrl.generation.vllm_server`): a request that fails in
transit or times out (its budget ``timeout`` seconds) is sent again (:data:`~textrl.generation.vllm.budgets.RETRIES`
times, backing off); a server that still does not answer raises :class:`RewardServerDown`, an
:class:`~textrl.generation.base.EngineFailed` naming the server and what to do, so the run saves its
last finished iteration and stops (nothing is lost). A server that does not answer, or is not a
reward model's, when the reward is built is refused in one line (``ValueError``).

Both rewards declare ``does_io = True``: their time is spent waiting on a server, not computing.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from textrl.generation.base import EngineFailed
from textrl.generation.vllm_server import (
    REQUEST_TIMEOUT_S,
    RETRIES,
    Server,
    ServerDown,
    ServerRefused,
    exchange,
    failure_reason,
    on_thread,
)
from textrl.rewards.base import Completion, Prompt
from textrl.rewards.neural import NeuralReward, _context_length

REWARD_SERVE_HINT = "start it with textrl vllm-serve --reward-model MODEL"

IN_FLIGHT = 8
"""Requests a served reward keeps pending at once (a batch of rows each)."""


class RewardServerDown(EngineFailed):
    """A reward's server that stopped answering mid-run (after its retries) or refused a request:
    the run saves its last finished iteration and stops (:class:`EngineFailed`)."""


def is_url(argument: str) -> bool:
    """Whether a ``reward_model:`` / ``judge:`` argument is a server's URL (``http://``, ``https://``)."""
    return argument.strip().lower().startswith(("http://", "https://"))


def split_url(argument: str) -> tuple[str, dict[str, str]]:
    """``(base URL, query settings)`` of ``http://host:port[/...]?key=value&...``.

    >>> split_url("http://h:8002/?clip=none&baseline=0.5")
    ('http://h:8002', {'clip': 'none', 'baseline': '0.5'})
    """
    parts = urllib.parse.urlsplit(argument.strip())
    query = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False))
    base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")).rstrip("/")
    return base, query


def setting_value(name: str, text: str, kind: str) -> Any:
    """A query setting's text as its kind: ``int``, ``float``, ``bool``, ``pair`` (``a;b``), ``str``;
    ``none`` is None for every kind. ``ValueError`` naming the setting otherwise."""
    if text.strip().lower() == "none":
        return None
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if kind == "pair":
            low, high = text.split(";")
            return float(low), float(high)
    except ValueError:
        raise ValueError(f"URL setting {name}={text!r} is not a {'pair a;b' if kind == 'pair' else kind}") from None
    return text


def url_settings(url: str, kinds: dict[str, str], given: dict[str, Any], what: str) -> tuple[str, dict[str, Any]]:
    """``(base URL, settings)``: the query's settings (typed by ``kinds``), then ``given`` over them;
    ``ValueError`` naming ``what`` for a setting it does not have."""
    base, query = split_url(url)
    unknown = sorted(set(query) - set(kinds))
    if unknown:
        raise ValueError(f"{what} {url!r} has no setting {', '.join(map(repr, unknown))}; its settings are "
                         f"{sorted(kinds)}")
    settings = {key: setting_value(key, text, kinds[key]) for key, text in query.items()}
    return base, {**settings, **given}


def identify(url: str, what: str, hint: str) -> dict[str, Any]:
    """The first entry of ``GET url/v1/models`` (``id``, ``root``, ``max_model_len``); ``ValueError`` in
    one line where nothing answers or what answers is not a vLLM server."""
    try:
        status, kind, text = exchange(url, "v1/models", None, REQUEST_TIMEOUT_S)
    except (OSError, http.client.HTTPException) as err:
        raise ValueError(f"{what} server {url} does not answer GET /v1/models "
                         f"({failure_reason(err, REQUEST_TIMEOUT_S)}): {hint}, or fix the URL") from None
    try:
        if status != 200 or kind != "application/json":
            raise ValueError
        entry = json.loads(text)["data"][0]
        str(entry["id"])
        return entry
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"{url} is not a vLLM server (GET /v1/models answered HTTP {status} {kind or ''}, no "
                         f"model id): point {what} at a server started with {hint.removeprefix('start it with ')}") from None


def gather(requests: Sequence[Callable[[], Any]], in_flight: int) -> list[Any]:
    """Each request's answer, in order, ``in_flight`` of them pending at once (threads of their own);
    the first failure raised once every request sent has come back."""
    out: list[Any] = [None] * len(requests)
    for start in range(0, len(requests), in_flight):
        futures = [(start + i, on_thread(work, "textrl-reward")) for i, work in enumerate(requests[start:start + in_flight])]
        errors = []
        for i, future in futures:
            try:
                out[i] = future.result()
            except BaseException as err:  # noqa: BLE001 - the first one is raised below
                errors.append(err)
        if errors:
            raise errors[0]
    return out


def server_failure(url: str, err: ConnectionError, what: str, hint: str) -> RewardServerDown:
    """The one line of a reward server that failed a request (:class:`ServerDown`, :class:`ServerRefused`)."""
    detail = err.what if isinstance(err, ServerDown) else str(err).removeprefix(f"vLLM server {url} ")
    return RewardServerDown(f"{what} server {url}: {detail}; {hint} (the run saves its last finished iteration)")


class ServedReward(NeuralReward):
    """``reward_model:URL``: :class:`NeuralReward` with the forward done by a vLLM server; see the
    module docstring.

    Args:
        url: the server's base URL, ``http://host:port`` (a query string holds settings).
        tokenizer: the reward model's tokenizer, or where to read it (default: the served model's id).
        batch_size: rows per request.
        max_length: token budget per row, truncated from the left; None: the served ``max_model_len``
            (and the tokenizer's limit, when smaller).
        clip, baseline, use_chat_template, answer_blend, policy_tokenizer, output_device: as
            :class:`NeuralReward`'s.
        timeout: seconds a request (one batch) is given before it is sent again.
    """

    does_io = True
    SETTINGS = {"tokenizer": "str", "batch_size": "int", "max_length": "int", "clip": "pair", "baseline": "float",
                "use_chat_template": "bool", "answer_blend": "pair", "timeout": "float"}

    def __init__(
        self,
        url: str,
        tokenizer: Any = None,
        *,
        batch_size: int = 32,
        max_length: int | None = None,
        clip: tuple[float, float] | None = (-3.0, 3.0),
        baseline: float = 0.0,
        use_chat_template: bool = True,
        answer_blend: tuple[float, float] | None = None,
        policy_tokenizer: Any = None,
        output_device: torch.device | str = "cpu",
        timeout: float = 60.0,
    ) -> None:
        from textrl.models import load_tokenizer

        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"ServedReward: batch_size must be a positive int, got {batch_size!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"ServedReward: timeout must be a positive number of seconds, got {timeout!r}")
        self.server = Server(url.rstrip("/"))
        served = identify(self.server.url, "reward_model", REWARD_SERVE_HINT)
        self.server.model = str(served["id"])
        self._check_classifier()
        tokenizer = load_tokenizer(tokenizer if tokenizer is not None else str(served.get("root") or served["id"]))
        limits = [n for n in (served.get("max_model_len"), _context_length(_NoConfig(), tokenizer)) if isinstance(n, int)]
        if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
            raise ValueError(f"ServedReward: max_length must be a positive int, got {max_length!r}")
        self.max_length = max_length if max_length is not None else (min(limits) if limits else None)
        self._keep_scoring(tokenizer, policy_tokenizer, batch_size, clip, baseline, use_chat_template, answer_blend,
                           output_device, "ServedReward")
        self.padding_free = False
        self.timeout = float(timeout)

    def _check_classifier(self) -> None:
        """Refuse, in one line, a server without vLLM's ``/classify`` (a policy's server) or whose
        model's head is not scalar: one row of one token is scored."""
        try:
            answer = self.server.request("classify", self._body([[0]]), timeout=REQUEST_TIMEOUT_S, retries=RETRIES)
        except ServerRefused as err:
            raise ValueError(f"vLLM server {self.server.url} does not score with a reward model (POST /classify: HTTP "
                             f"{err.status}: {err.detail}): {REWARD_SERVE_HINT}, or point reward_model: at that "
                             "server") from None
        except ServerDown as err:
            raise ValueError(f"{err}: {REWARD_SERVE_HINT}, or fix the URL") from None
        classes = answer["data"][0].get("num_classes", len(answer["data"][0]["probs"]))
        if classes != 1:
            raise ValueError(f"vLLM server {self.server.url} serves {self.server.model!r} with {classes} classes; a "
                             "reward model has a scalar head (num_labels=1)")

    def _body(self, rows: list[list[int]]) -> dict[str, Any]:
        """The ``/classify`` body scoring ``rows`` (token ids): raw head outputs, no activation."""
        return {"model": self.server.model, "input": rows, "use_activation": False, "add_special_tokens": False}

    def _scores(self, rows: list[list[int]]) -> list[float]:
        """One request's raw scores, ``len(rows)`` floats in row order."""
        answer = self.server.request("classify", self._body(rows), timeout=self.timeout, retries=RETRIES)
        data = sorted(answer["data"], key=lambda d: d["index"])
        if len(data) != len(rows):
            raise ServerRefused(self.server.url, "classify", 200, f"{len(data)} scores for {len(rows)} rows")
        return [float(d["probs"][0]) for d in data]

    def score_raw(self, prompts: Sequence[Prompt], completions: Sequence[Completion]) -> Tensor:
        """The served model's raw score per row, float32 ``[B]``: the rows encoded here, sent
        ``batch_size`` a request, :data:`IN_FLIGHT` requests at once."""
        ids = self.encode(prompts, completions)
        out = torch.zeros(len(ids), dtype=torch.float32)
        empty = [i for i, row in enumerate(ids) if not row]
        if empty:
            raise ValueError(f"ServedReward: rows {empty[:10]} encode to no tokens; give the reward model some text "
                             "to read (use_chat_template=True renders at least the template)")
        chunks = [list(range(start, min(start + self.batch_size, len(ids)))) for start in range(0, len(ids), self.batch_size)]
        requests = [lambda chunk=chunk: self._scores([ids[i] for i in chunk]) for chunk in chunks]
        try:
            answers = gather(requests, IN_FLIGHT)
        except (ServerDown, ServerRefused) as err:
            raise server_failure(self.server.url, err, "reward_model", REWARD_SERVE_HINT) from None
        for chunk, scores in zip(chunks, answers):
            out[torch.tensor(chunk)] = torch.tensor(scores, dtype=torch.float32)
        return out

    def place(self, precision: Any, *, padding_free: bool | None = None) -> ServedReward:
        """Nothing to place: the server holds the model in its own dtype. Returns self."""
        return self

    def __repr__(self) -> str:
        return (f"ServedReward({self.server.url!r}, model={self.server.model!r}, batch_size={self.batch_size}, "
                f"max_length={self.max_length}, clip={self.clip}, baseline={self.baseline:g}, "
                f"answer_blend={self.answer_blend})")


class _NoConfig:
    """A model without a config, for :func:`_context_length` of a tokenizer alone."""

    config = None


def load_reward_model(argument: str, **settings: Any) -> NeuralReward:
    """Loader of the ``reward_model:`` scheme: a URL is a :class:`ServedReward` (its query's settings,
    then ``settings``), anything else :func:`textrl.rewards.neural.load_neural_reward`."""
    from textrl.rewards.neural import load_neural_reward

    if not is_url(argument):
        return load_neural_reward(argument, **settings)
    url, settings = url_settings(argument, ServedReward.SETTINGS, settings, "reward_model:")
    return ServedReward(url, **settings)


__all__ = ["IN_FLIGHT", "RewardServerDown", "ServedReward", "gather", "identify", "is_url", "load_reward_model",
           "server_failure", "split_url", "url_settings"]
