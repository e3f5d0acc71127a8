"""Model loading and tiny offline models.

``load_tokenizer`` / ``load_causal_lm`` / ``load_reward_model`` take a local path or a hub id;
the name ``"tiny"`` resolves to a small seeded Llama (and its 512-token ChatML tokenizer) built
offline and cached by ``tiny_model_path`` under ``$TEXTRL_CACHE`` (default ``~/.cache/textrl``).
Before loading, :mod:`textrl.models.sources` checks where a model comes from (a folder that holds a
model or tokenizer, a hub id that is cached or reachable); after loading, :mod:`textrl.models.checks`
checks a model against its tokenizer and reads its context.
"""

from __future__ import annotations

from textrl.models.tiny import (
    CACHE_ENV,
    CHAT_TEMPLATE,
    TAG_TOKENS,
    TINY_NAMES,
    build_tiny_causal_lm,
    build_tiny_gpt2,
    build_tiny_reward_model,
    build_tiny_tokenizer,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    tiny_model_path,
)
from textrl.models.value import ValueModel

__all__ = [
    "CACHE_ENV",
    "CHAT_TEMPLATE",
    "TAG_TOKENS",
    "TINY_NAMES",
    "ValueModel",
    "build_tiny_causal_lm",
    "build_tiny_gpt2",
    "build_tiny_reward_model",
    "build_tiny_tokenizer",
    "load_causal_lm",
    "load_reward_model",
    "load_tokenizer",
    "tiny_model_path",
]
