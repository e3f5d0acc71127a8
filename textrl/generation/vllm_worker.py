"""What textrl's worker extension keeps and says in a vLLM server's workers
(:class:`textrl.generation.vllm_transfer.WeightWatch`), without vLLM, so that the trainer's side
(:mod:`textrl.generation.vllm.served`) and tests use the same code: the essentials of a model's
config, compared before any work, and the book of the run that holds the server (its claim).
"""

from __future__ import annotations

import logging
import time
from typing import Any

ESSENTIALS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size", "head_dim", "max_position_embeddings",
              "tie_word_embeddings")
"""The fields of a model's config compared between a server's model and the run's, in this order: what
decides whether the run's weights fit the server's model (names, shapes) and whether it is the same
architecture. Not its folder's name (a folder of the same name may hold another model) nor its dtype
(a server may run another precision: docs/vllm.md)."""


def model_essentials(config: Any) -> dict[str, Any]:
    """:data:`ESSENTIALS` of a transformers config (its text config where it has one), those it sets."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    out = {}
    for field in ESSENTIALS:
        value = getattr(text, field, None)
        if value is not None:
            out[field] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""vLLM's logger of weight reloads, which warns ``<Layer>: Failed to load weights`` for every layer
that holds tensors but takes none from a reload."""


def _not_a_rotary_reload(record: logging.LogRecord) -> bool:
    """False for vLLM's reload warning about a rotary embedding: its cos/sin table is computed from
    the config, not trained, so a weight hand-over never carries it and vLLM puts it back as it was."""
    args = record.args if isinstance(record.args, tuple) else ()
    return not (record.msg == "%s: Failed to load weights" and args and str(args[0]).endswith("RotaryEmbedding"))


def quiet_rotary_reloads() -> None:
    """Leave out vLLM's false alarm at every weight hand-over (:func:`_not_a_rotary_reload`) in this
    process, once; every other record of the logger stays."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if _not_a_rotary_reload not in logger.filters:
        logger.addFilter(_not_a_rotary_reload)


class LeaseBook:
    """What a server's worker keeps of the run that holds the server (textrl's worker extension holds
    one: :meth:`textrl.generation.vllm_transfer.WeightWatch.textrl_claim`): its id, since when (wall
    clock), when it last renewed its claim (the worker's monotonic clock: no two machines' clocks are
    compared). A claim is granted to the run that holds it, to any run when none does, or when the
    holder's claim is older than the lease (taken over); else refused, saying who holds it."""

    def __init__(self) -> None:
        self.run: str | None = None
        self.since = 0.0
        self.seen = 0.0

    def claim(self, run: str, lease_s: float, *, wall: float | None = None, clock: float | None = None) -> dict[str, Any]:
        """``{"granted": True, "taken_over": None or {"run", "seen_ago"}}`` or ``{"granted": False,
        "run", "since", "seen_ago"}``."""
        wall = time.time() if wall is None else wall
        clock = time.monotonic() if clock is None else clock
        ago = clock - self.seen
        if self.run is not None and self.run != run and ago <= lease_s:
            return {"granted": False, "run": self.run, "since": self.since, "seen_ago": ago}
        taken_over = {"run": self.run, "seen_ago": ago} if self.run is not None and self.run != run else None
        if self.run != run:
            self.since = wall
        self.run, self.seen = run, clock
        return {"granted": True, "taken_over": taken_over}

    def release(self, run: str) -> bool:
        """Give the server up, if ``run`` holds it (a run that ends: the next may start at once)."""
        if self.run != run:
            return False
        self.run = None
        return True


__all__ = ["ESSENTIALS", "LeaseBook", "model_essentials"]
