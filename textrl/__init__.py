"""textrl: text generation as a token-level RL environment, and PPO agents for RLHF.

``from textrl import TrainConfig, train`` trains from Python as ``textrl train`` does from the
command line (both are imported on first use, so ``import textrl`` stays light).
"""

from __future__ import annotations

from typing import Any

from textrl.core.moved import install as _install_moved_paths
from textrl.keys import KEYS, RolloutKeys

__version__ = "0.1.0"

_LAZY = {"TrainConfig": "textrl.config", "train": "textrl.training.trainer"}
"""Names importable from ``textrl`` whose modules load on first use (torch and transformers)."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'textrl' has no attribute {name!r}")


_install_moved_paths()  # the former paths of moved modules keep importing (textrl/core/moved.py)

__all__ = ["KEYS", "RolloutKeys", "TrainConfig", "__version__", "train"]
