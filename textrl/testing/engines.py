"""Engine doubles for tests: :func:`register_stale_engine`, an engine whose weight sync never happens
(the fault :mod:`textrl.agents.weight_check` stops a run for), :func:`failing_engine`, one that
stops answering after some calls (a vLLM server that died: the run saves its last finished
iteration and stops, :mod:`textrl.run.loop`), and :func:`register_receiving_engine`, one that holds
weights of its own and takes them pushed, in the process (what a vLLM server is to the run: the
asynchronous actor's hand-over without vLLM).

Not imported by :mod:`textrl.testing` itself (it reaches the engines' registry)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from textrl.generation.base import ENGINES, EngineFailed, get_engine, register_engine


class SamplesItsOwnModel:
    """Mixed in before an engine class: each call samples ``self._model(model)`` (the double's own
    model, from the module it is called with) through the engine it is mixed into."""

    def _model(self, model: Any) -> Any:
        raise NotImplementedError

    def generate(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        return super().generate(self._model(model), *args, **kwargs)  # type: ignore[misc]

    def generate_with_logprobs(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        return super().generate_with_logprobs(self._model(model), *args, **kwargs)  # type: ignore[misc]


def register_stale_engine(name: str = "stale", inner: str = "textrl") -> str:
    """Register (once) the engine ``name``: the registered engine ``inner`` sampling with a copy of the
    model taken at its first call, so that no later update reaches it (a LoRA adapter never loaded, a
    broken weight sync). Returns ``name``, for ``--generation-engine``."""
    if name in ENGINES:
        return name
    base = type(get_engine(inner))

    class StaleEngine(SamplesItsOwnModel, base):  # type: ignore[misc, valid-type]
        frozen: Any = None

        def _model(self, model: Any) -> Any:
            if self.frozen is None:
                self.frozen = copy.deepcopy(model)
            return self.frozen

    StaleEngine.__name__ = StaleEngine.__qualname__ = f"Stale{base.__name__}"
    register_engine(name)(StaleEngine)
    return name


@contextmanager
def stale_engine(name: str = "stale", inner: str = "textrl") -> Iterator[str]:
    """:func:`register_stale_engine` for the block only: the engine's name inside, unregistered after."""
    added = name not in ENGINES
    try:
        yield register_stale_engine(name, inner)
    finally:
        if added:
            ENGINES.pop(name, None)


def register_receiving_engine(name: str = "receiving", inner: str = "hf") -> str:
    """Register (once) the engine ``name``: the registered engine ``inner`` sampling a model of its own
    (built from the config of the module it is called with, at its first call, the random state left
    as it was) that holds only the weights pushed to it (:meth:`load_weights`, loaded at the next
    call; every parameter must come, as a vLLM server needs them). The module it is called with is
    read for its config alone, as the served engine reads it. Returns ``name``."""
    if name in ENGINES:
        return name
    base = type(get_engine(inner))

    class ReceivingEngine(SamplesItsOwnModel, base):  # type: ignore[misc, valid-type]
        receives_weights = True
        own: Any = None
        pushed: dict[str, Any] | None = None

        def load_weights(self, named_tensors: Any, version: int) -> None:
            self.pushed = dict(named_tensors)

        def check_backend(self, partitions_weights: bool) -> None:
            """Any backend: the pushed weights come whole."""

        def _model(self, model: Any) -> Any:
            import torch
            from transformers import AutoModelForCausalLM

            if self.own is None:
                with torch.random.fork_rng(devices=[]):  # the initialisation draws nothing from the run's RNG
                    self.own = AutoModelForCausalLM.from_config(model.config).eval().requires_grad_(False)
            if self.pushed is not None:
                missing = {n for n, _ in self.own.named_parameters()} - set(self.pushed)
                if missing:
                    raise ValueError(f"engine double {name!r}: pushed weights lack {sorted(missing)[:3]}")
                with torch.no_grad():
                    for key, value in self.pushed.items():
                        self.own.get_parameter(key).copy_(value)
                self.pushed = None
            return self.own

    ReceivingEngine.__name__ = ReceivingEngine.__qualname__ = f"Receiving{base.__name__}"
    register_engine(name)(ReceivingEngine)
    return name


class FailingEngine:
    """The calls the engine :func:`failing_engine` registered answers before it fails (``calls``:
    a generation call answered, counting all of them: rollouts, held-out evaluations, warm-up
    samples). Set ``fail_after`` to the number of calls to answer; None: never fail."""

    def __init__(self, fail_after: int | None) -> None:
        self.fail_after = fail_after
        self.calls = 0

    def answer(self) -> None:
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise EngineFailed(f"engine double: no engine answers after {self.calls} calls (as a vLLM server that died)")
        self.calls += 1


@contextmanager
def failing_engine(fail_after: int | None, name: str = "failing", inner: str = "textrl") -> Iterator[FailingEngine]:
    """Register, for the block only, the engine ``name``: the registered engine ``inner`` raising
    :class:`~textrl.errors.EngineFailed` from its call number ``fail_after + 1`` on. Yields the
    :class:`FailingEngine` counter (``fail_after`` may be changed inside the block)."""
    if name in ENGINES:
        raise ValueError(f"an engine named {name!r} is registered already")
    counter = FailingEngine(fail_after)
    base = type(get_engine(inner))

    class Failing(base):  # type: ignore[misc, valid-type]
        def generate(self, *args: Any, **kwargs: Any) -> Any:
            counter.answer()
            return super().generate(*args, **kwargs)

        def generate_with_logprobs(self, *args: Any, **kwargs: Any) -> Any:
            counter.answer()
            return super().generate_with_logprobs(*args, **kwargs)

    Failing.__name__ = Failing.__qualname__ = f"Failing{base.__name__}"
    register_engine(name)(Failing)
    try:
        yield counter
    finally:
        ENGINES.pop(name, None)


__all__ = ["FailingEngine", "failing_engine", "register_receiving_engine", "register_stale_engine", "stale_engine"]
