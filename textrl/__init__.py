"""textrl: text generation as a token-level RL environment, and PPO agents for RLHF."""

from __future__ import annotations

from textrl.keys import KEYS, RolloutKeys

__version__ = "0.1.0"

__all__ = ["KEYS", "RolloutKeys", "__version__"]
