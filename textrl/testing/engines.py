"""Engine doubles for tests of a run's weight handling: :func:`register_stale_engine`, an engine
whose weight sync never happens (the fault :mod:`textrl.agents.weight_check` stops a run for).

Not imported by :mod:`textrl.testing` itself (it reaches the engines' registry)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from textrl.generation.base import ENGINES, get_engine, register_engine


def register_stale_engine(name: str = "stale", inner: str = "textrl") -> str:
    """Register (once) the engine ``name``: the registered engine ``inner`` sampling with a copy of the
    model taken at its first call, so that no later update reaches it (a LoRA adapter never loaded, a
    broken weight sync). Returns ``name``, for ``--generation-engine``."""
    if name in ENGINES:
        return name
    base = type(get_engine(inner))

    class StaleEngine(base):  # type: ignore[misc, valid-type]
        frozen: Any = None

        def _model(self, model: Any) -> Any:
            if self.frozen is None:
                self.frozen = copy.deepcopy(model)
            return self.frozen

        def generate(self, model: Any, *args: Any, **kwargs: Any) -> Any:
            return super().generate(self._model(model), *args, **kwargs)

        def generate_with_logprobs(self, model: Any, *args: Any, **kwargs: Any) -> Any:
            return super().generate_with_logprobs(self._model(model), *args, **kwargs)

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


__all__ = ["register_stale_engine", "stale_engine"]
