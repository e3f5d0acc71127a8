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
    (older releases, and wrappers whose forward takes ``**kwargs``)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


__all__ = ["cache_argument", "new_cache"]
