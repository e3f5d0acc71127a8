"""The generation seam: :class:`Sampling` (what to draw), :class:`GenerationEngine` (how), the registry,
and :class:`EngineFailed` (an engine that cannot go on)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from textrl.registry import Messages, Registry


@dataclass(frozen=True)
class Sampling:
    """What a rollout draws: ``greedy`` (argmax), else sampling at ``temperature`` with ``top_k``
    (0: off) and ``top_p`` (1.0: off), applied in that order as HF's warpers and textrl's log-probs
    apply them; at most ``max_new_tokens`` tokens a row; a row ends at ``eos_token_id`` (None:
    never) and is ``pad_token_id`` after it."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    eos_token_id: int | None
    pad_token_id: int

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: generate at least 1 token")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: sampling needs a temperature > 0 (or greedy=True)")


class EngineFailed(ConnectionError):
    """A generation engine cannot go on (no vLLM server left, a weight transfer that broke, an
    asynchronous producer that died): raised out of a rollout, its message names the engine (a
    server's URL) and what happened. The run saves a checkpoint of its last finished iteration
    before it stops (:mod:`textrl.run.loop`), so nothing is lost; the command prints the message
    and how to resume in one line (a ``ConnectionError``: an ``OSError``, one of
    :func:`textrl.errors.user_errors`; also importable from :mod:`textrl.errors`)."""


class EngineFailedElsewhere(EngineFailed):
    """Under several processes: another process's engine failed (its own line is in its output), so
    this one stops with it (:func:`textrl.run.rollout.ended_together`, :mod:`textrl.run.loop`)."""


class GenerationEngine:
    """How responses are generated. ``generate(model, input_ids [B, P], attention_mask [B, P],
    sampling) -> [B, T]``: the response tokens (``T <= max_new_tokens``: as ``generate``, the
    columns up to the step where the last row ended), ``sampling.pad_token_id`` after a row's EOS.
    Runs under the caller's autocast and ``no_grad``; the model's weights are read as they are now
    (nothing is copied, so an update is seen by the next call)."""

    name = "?"

    receives_weights = False
    """Whether the engine holds its own copy of the weights and takes them pushed (:meth:`load_weights`):
    the ``vllm`` engines. False for the engines that sample the module they are called with (``hf``,
    ``static``, ``textrl``): its weights as they are now."""

    def generate(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling,
                 **kwargs: Any) -> Tensor:
        raise NotImplementedError

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Sample with these weights from the next call on (an engine with :attr:`receives_weights`):
        ``(name, tensor)`` pairs named as the model's own ``state_dict`` (transformers names), on any
        device (a CPU snapshot is moved in buckets), and ``version``, the caller's version of them.
        After the first call the engine reads no weights of the module it is called with (it only
        describes the model); the tensors are kept by reference until the next call replaces them.
        Here: ``TypeError``, an engine that samples the module it is given."""
        raise TypeError(f"the {self.name!r} engine samples the module it is called with; it takes no pushed weights "
                        "(receives_weights is False)")

    def take_weight_sync_seconds(self) -> float:
        """The seconds spent handing weights to the engine since the last call (``time/weight_sync_s``).
        Here: 0, an engine that samples the module's weights in place."""
        return 0.0

    def generate_with_logprobs(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling,
                               **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """``(tokens, logprobs)``: :meth:`generate`'s tokens ``[B, T]`` (the same ones: the same random
        numbers drawn) and the log-prob of each under the distribution it was drawn from ``[B, T]``
        (float32: ``log_softmax(sampling_filter(logits / temperature))`` at the drawn token; greedy, the
        same formula at the sampling's temperature), 0.0 after a row's EOS. Here: ``(generate(...),
        None)``, an engine that computes no log-probs (the built-in engines compute them)."""
        return self.generate(model, input_ids, attention_mask, sampling, **kwargs), None

    def configure(self, config: Any) -> None:
        """Take the run's settings an engine reads (``config``: a :class:`textrl.config.TrainConfig`);
        called once, when the actor is built, before any ``generate``. Here: nothing."""

    def fit_lengths(self, max_prompt_length: int, episode_budget: int) -> None:
        """The run's lengths, where they are known when the actor is built (after :meth:`configure`,
        before any ``generate``): the prompts' cap and the episode's token budget after the prompt, so
        no call's sequence is longer than their sum. An engine that sizes its memory by the longest
        sequence reads them (``vllm``: its ``max_model_len``). Here: nothing."""

    def check_backend(self, partitions_weights: bool) -> None:
        """Refuse a backend this engine cannot generate under (``ValueError`` naming both)."""

    def start(self, model: nn.Module, device: torch.device) -> None:
        """Called once on every process when the actor is built, after the backend made the models
        alike on every process, under the run's precision: an engine whose start is a collective over
        the training processes starts here, all of them together (``vllm`` under several processes);
        the others start at their first call. Here: nothing."""

    def close(self) -> None:
        """Release what the engine holds outside torch's tensors (vLLM's engine); the trainer calls it
        when the run ends. Here: nothing."""

    @contextmanager
    def rollout(self) -> Iterator[None]:
        """The calls inside are one rollout's turns (:func:`textrl.run.rollout.run_episodes` opens it):
        an engine may keep state across them (the ``textrl`` engine: each turn's KV cache, for the
        next turn) and drops it when the block ends."""
        yield


def _is_engine_class(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, GenerationEngine)


REGISTRY: Registry[type] = Registry(
    "generation engine", group="textrl.generation_engines", accepts=_is_engine_class,
    builtins=("textrl.generation.hf", "textrl.generation.decode", "textrl.generation.static",
              "textrl.generation.vllm.colocated", "textrl.generation.vllm.served"),
    valid_name=lambda name: isinstance(name, str) and bool(name) and ":" not in name,
    register_loaded=lambda name, cls: register_engine(name)(cls),
    messages=Messages(
        bad_name="generation engine name {name!r} must be a non-empty str without ':'",
        taken="generation engine name {name!r} is taken by {old}; register {new} under another name",
        unknown="generation_engine={name!r}: not a registered engine{hint}; choose auto or one of {names}"))
"""The generation engines' :class:`textrl.registry.Registry` (entry-point group ``textrl.generation_engines``)."""

ENGINES: dict[str, type] = REGISTRY.entries
"""Registered name -> engine class (:func:`register_engine`)."""


def register_engine(name: str) -> Callable[[type], type]:
    """``@register_engine("name")`` on a :class:`GenerationEngine` subclass: ``--generation-engine
    name`` selects it."""
    return REGISTRY.named_class(name)


def engine_names() -> list[str]:
    return REGISTRY.names()


def get_engine(name: str) -> GenerationEngine:
    """A new engine of the registered ``name``; ``ValueError`` with the names there are."""
    return REGISTRY.lookup(name)()


AUTO: dict[str, str] = {"cuda": "textrl", "cpu": "textrl"}
"""``generation_engine='auto'``: the engine of a device type measured fastest in the trainer's own
settings (``benchmarks/bench_generation.py``, docs/generation.md), ``hf`` for the others. On CUDA
the ``textrl`` engine (its step compiled and captured as a CUDA graph); on the CPU the ``textrl``
engine too (the same metrics and weights as ``hf`` in the embedded default). How much faster, on
an H200 and on the CPU: docs/benchmarks.md, "Generation engines"."""


def engine_for(name: str, device: torch.device | str, *, partitions_weights: bool = False) -> GenerationEngine:
    """A new engine of ``name``, ``auto`` resolved for ``device`` (:data:`AUTO`; ``hf`` under a
    backend that partitions the weights, whose forwards are collectives)."""
    if name == "auto":
        name = "hf" if partitions_weights else AUTO.get(torch.device(device).type, "hf")
    return get_engine(name)


def cut_at_last_eos(tokens: Tensor, eos_token_id: int | None) -> Tensor:
    """``tokens [B, T]`` cut after the column where the last row emitted EOS, when every row did
    (``generate`` stops there); as they are otherwise."""
    if eos_token_id is None:
        return tokens
    ended = tokens == eos_token_id
    if not bool(ended.any(1).all()):
        return tokens
    return tokens[:, : int(ended.long().argmax(1).max()) + 1]


SERVED_ENGINE = "vllm-server"
"""The engine of a run given ``--vllm-server`` (:mod:`textrl.generation.vllm.served`)."""


def run_engine_name(generation_engine: str, vllm_server: str | None) -> str:
    """The engine a run generates with: :data:`SERVED_ENGINE` when it names vLLM servers, else
    ``generation_engine``; ``ValueError`` for servers with an engine that is not vLLM's."""
    if not vllm_server:
        return generation_engine
    if generation_engine not in ("auto", "vllm", SERVED_ENGINE):
        raise ValueError(f"--vllm-server samples from vLLM servers, but --generation-engine {generation_engine} "
                         "asks for another engine; drop one of the two")
    return SERVED_ENGINE


def engine_named(name: str) -> None:
    """``ValueError`` (with the registered names) unless an engine is registered as ``name`` (or it is ``auto``)."""
    if name != "auto":
        REGISTRY.lookup(name)


__all__ = ["AUTO", "ENGINES", "EngineFailed", "EngineFailedElsewhere", "GenerationEngine", "Sampling", "SERVED_ENGINE", "cut_at_last_eos", "engine_for", "engine_named", "engine_names", "get_engine",
           "register_engine", "run_engine_name"]
