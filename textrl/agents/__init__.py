"""PPO-family agents (docs/design.md, "Agents") and the one registry of agent names.

Each agent class registers itself with :func:`register_agent`; ``--agent`` accepts a registered
name, an entry point of the packaging group ``textrl.agents``, or ``path/to/file.py:Class`` (see
:mod:`textrl.core.agent_registry`). The built-ins:

>>> sorted(AGENTS)  # doctest: +NORMALIZE_WHITESPACE
['cispo', 'dapo', 'dr_grpo', 'gae_ppo', 'grpo', 'gspo', 'multi_adapter_ppo', 'one_step_ppo',
 'reinforce_pp', 'reinforce_pp_baseline', 'rloo', 'vapo']

An agent of your own subclasses :class:`PPOAgent` (or one of these), declares what it needs
(``needs_critic``, ``min_samples_per_prompt``, ``lora``) and the options it reads (``options``),
and implements ``estimate`` and ``loss``::

    @register_agent("my_grpo")
    class MyGRPO(GroupPPO):
        def group_advantage(self, rewards, group_size): ...
"""

from __future__ import annotations

from typing import Any

from textrl.agents.base import CriticFreePPO, PPOAgent
from textrl.agents.gae_ppo import GAEPPO
from textrl.agents.group_ppo import GRPO, RLOO, GroupPPO
from textrl.agents.multi_adapter_ppo import MultiAdapterPPO
from textrl.agents.one_step_ppo import OneStepPPO
from textrl.agents.zoo import CISPO, DAPO, GSPO, VAPO, DrGRPO, ReinforcePP, ReinforcePPBaseline
from textrl.core.agent_registry import (
    AGENTS,
    ENTRY_POINT_GROUP,
    agent_class,
    agent_names,
    register_agent,
)


def make_agent(name: str, *args: Any, **kwargs: Any) -> PPOAgent:
    """Build the agent ``name`` (a registered name or ``file.py:Class``); arguments go to its constructor."""
    return agent_class(name)(*args, **kwargs)


__all__ = [
    "AGENTS", "CISPO", "DAPO", "CriticFreePPO", "ENTRY_POINT_GROUP", "GAEPPO", "GRPO", "GSPO", "RLOO", "VAPO", "DrGRPO",
    "GroupPPO", "MultiAdapterPPO", "OneStepPPO", "PPOAgent", "ReinforcePP", "ReinforcePPBaseline", "agent_class", "agent_names", "make_agent", "register_agent",
]
