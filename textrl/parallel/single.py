"""One process: the agent's own optimisers over its own weights; every collective is a no-op."""

from __future__ import annotations

from textrl.parallel.base import Backend


class SingleProcess(Backend):
    """Training in this process alone (every agent starts under it).

    The interface's defaults are this backend: ``loss.backward()``, per-model clipping
    (``grad_norm/actor``, ``grad_norm/critic``), one AdamW per trained model, ``state_dict``.
    """

    name = "single"


__all__ = ["SingleProcess"]
