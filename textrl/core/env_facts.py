"""What an agent's construction needs from the run's environment, handed over by its caller.

The agents (``textrl/agents/``) import no environment code: the trainer builds the environment
once and hands the agent an :class:`EnvFacts` (the format warm-up's pairs, the episode budget).
A direct ``Agent.from_config(config)`` without one asks the provider registered in
:data:`REGISTRY` (:func:`provide_env_facts`, :func:`env_facts_of`). ``textrl.envs.registry``
registers it when it is imported, and the registry names that module as its built-in, imported on
the first lookup as the agents' and the generation engines' registries import theirs: the
dependency is a declared registration, this module imports nothing of ``textrl.envs``, and a
script that never imports ``textrl.envs`` works.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from textrl.registry import Registry


@dataclass(frozen=True)
class EnvFacts:
    """What the agent reads of the run's environment."""

    env_id: str
    """The environment's id (a warm-up record names it)."""
    episode_budget: int
    """The token budget of an episode after the prompt (:func:`textrl.agents.build.episode_budget`)."""
    warmup_pairs: list[tuple[Any, str]] | None = None
    """The (prompt, completion) pairs of the format warm-up (None: none, or not asked)."""
    max_prompt_length: int | None = None
    """The prompts' cap in tokens the run uses, once ``textrl train`` has resolved it after the models
    load (``max_prompt_length``, else the longest of its prompts, bounded by the context); None: not yet."""


PROVIDER = "environment"
"""The one name in :data:`REGISTRY`: the provider of the run's environment facts."""

REGISTRY: Registry[Callable[..., EnvFacts]] = Registry(
    "environment facts provider", builtins=("textrl.envs.registry",))
"""The environment facts provider's :class:`textrl.registry.Registry`: one entry, :data:`PROVIDER`,
registered by :func:`provide_env_facts`; its built-in module registers the environments' own."""


def provide_env_facts(provider: Callable[..., EnvFacts]) -> None:
    """Register ``provider(config, warmup=bool) -> EnvFacts``, replacing the one registered
    (``textrl.envs.registry`` does on import)."""
    REGISTRY.register(PROVIDER, provider, replace=True)


def env_facts_of(config: Any, *, warmup: bool = True) -> EnvFacts:
    """The :class:`EnvFacts` of ``config``'s environment, built by the registered provider
    (the warm-up pairs only with ``warmup``)."""
    provider = REGISTRY.find(PROVIDER)  # imports the built-in provider's module the first time
    if provider is None:
        raise ValueError("no environment to read the warm-up and episode budget from: import textrl.envs "
                         "(it provides them), or pass env_facts=textrl.envs.env_facts(config)")
    return provider(config, warmup=warmup)


__all__ = ["PROVIDER", "REGISTRY", "EnvFacts", "env_facts_of", "provide_env_facts"]
