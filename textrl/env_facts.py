"""What an agent's construction needs from the run's environment, handed over by its caller.

The agents (``textrl/agents/``) import no environment code: the trainer builds the environment
once and hands the agent an :class:`EnvFacts` (the format warm-up's pairs, the episode budget).
A direct ``Agent.from_config(config)`` without one asks the provider that ``textrl.envs``
registers here when it is imported (:func:`provide_env_facts`, :func:`env_facts_of`); when nothing
has imported it yet, :func:`env_facts_of` imports it by name, as a registry loads its built-ins,
so the dependency stays a registration and a script that never imports ``textrl.envs`` works.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvFacts:
    """What the agent reads of the run's environment."""

    env_id: str
    """The environment's id (a warm-up record names it)."""
    episode_budget: int
    """The token budget of an episode after the prompt (:func:`textrl.agents.build.episode_budget`)."""
    warmup_pairs: list[tuple[Any, str]] | None = None
    """The (prompt, completion) pairs of the format warm-up (None: none, or not asked)."""


_PROVIDER: list[Callable[..., EnvFacts]] = []


def provide_env_facts(provider: Callable[..., EnvFacts]) -> None:
    """Register ``provider(config, warmup=bool) -> EnvFacts`` (``textrl.envs`` does on import)."""
    _PROVIDER[:] = [provider]


def env_facts_of(config: Any, *, warmup: bool = True) -> EnvFacts:
    """The :class:`EnvFacts` of ``config``'s environment, built by the registered provider
    (the warm-up pairs only with ``warmup``)."""
    if not _PROVIDER:
        importlib.import_module("textrl.envs")  # registers its provider on import
    if not _PROVIDER:
        raise ValueError("no environment to read the warm-up and episode budget from: import textrl.envs "
                         "(it provides them), or pass env_facts=textrl.envs.env_facts(config)")
    return _PROVIDER[0](config, warmup=warmup)


__all__ = ["EnvFacts", "env_facts_of", "provide_env_facts"]
