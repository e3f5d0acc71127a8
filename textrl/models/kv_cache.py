"""A transformers KV cache across releases: an empty one for a model, and the forward's name for it."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn


def new_cache(model: nn.Module) -> Any:
    """An empty ``DynamicCache`` for ``model`` (its layer types from its config); forwards fill it in place."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except (TypeError, AttributeError):  # a release whose DynamicCache takes no config, a model without one
        return DynamicCache()


def cache_argument(model: nn.Module) -> str:
    """The forward's name for the KV cache: ``cache`` (transformers 5.2x), else ``past_key_values``
    (older releases). A wrapper whose forward takes ``**kwargs`` (a peft model, textrl's adapter
    views) passes it on, so the name is that of the model it wraps (``generation_modules()``, else
    ``get_base_model()``)."""
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        parameters = inspect.signature(model.forward).parameters
        for name in ("cache", "past_key_values"):
            if name in parameters:
                return name
        inner = model.generation_modules()[0] if callable(getattr(model, "generation_modules", None)) else None
        if inner is None and callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return "past_key_values"


__all__ = ["cache_argument", "new_cache"]
