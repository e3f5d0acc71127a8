"""PPO-family agents (docs/design.md, "Agents") and a registry by name.

>>> sorted(AGENTS)
['gae_ppo', 'grpo', 'multi_adapter_ppo', 'one_step_ppo', 'rloo']
"""

from __future__ import annotations

from typing import Any

from textrl.agents.base import PPOAgent
from textrl.agents.gae_ppo import GAEPPO
from textrl.agents.group_ppo import GRPO, RLOO
from textrl.agents.multi_adapter_ppo import MultiAdapterPPO
from textrl.agents.one_step_ppo import OneStepPPO

AGENTS: dict[str, type[PPOAgent]] = {
    "gae_ppo": GAEPPO,
    "grpo": GRPO,
    "multi_adapter_ppo": MultiAdapterPPO,
    "one_step_ppo": OneStepPPO,
    "rloo": RLOO,
}
"""Agent name (``--agent``) -> class."""


def make_agent(name: str, *args: Any, **kwargs: Any) -> PPOAgent:
    """Build the agent registered as ``name``; arguments go to its constructor."""
    if name not in AGENTS:
        raise ValueError(f"unknown agent {name!r}: choose one of {', '.join(sorted(AGENTS))}")
    return AGENTS[name](*args, **kwargs)


__all__ = ["AGENTS", "GAEPPO", "GRPO", "RLOO", "MultiAdapterPPO", "OneStepPPO", "PPOAgent", "make_agent"]
