"""The one list of agent names, and the resolver of an ``--agent`` spec (docs/design.md, "Agents").

An agent is found by its spec, in this order:

- ``path/to/file.py:Class``: the class ``Class`` of a user's file (loaded once per file);
- ``package.module:Class``: an importable class;
- a registered name (:data:`REGISTRY`, a :class:`textrl.registry.Registry`): a class decorated
  with :func:`register_agent`, or an entry point of the packaging group ``textrl.agents``
  (``[project.entry-points."textrl.agents"]`` in a ``pyproject.toml``:
  ``my_agent = "my_package.agents:MyAgent"``).

The built-in agents register themselves when :mod:`textrl.agents` is imported; :func:`agent_class`
imports that package, as it loads an entry point, the first time a name is looked up. This module
lives in the core and names no agent: the configuration checks an agent from its class's
declarations (``validate_config``), whichever package the class comes from.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from textrl.registry import Messages, Registry

ENTRY_POINT_GROUP = "textrl.agents"
"""The packaging entry point group of agents from other packages."""
BUILTIN_PACKAGE = "textrl.agents"
"""The package whose import registers the built-in agents."""


def _same_class(old: type, new: type) -> bool:
    return (old.__module__, old.__qualname__) == (new.__module__, new.__qualname__)


def _is_agent_class(obj: object) -> bool:
    return isinstance(obj, type) and hasattr(obj, "from_config") and hasattr(obj, "validate_config")


_NO_CLASS = ("agent={spec!r}: {where} has no agent class {attr!r} (a subclass of textrl.agents.PPOAgent, "
             "with from_config and validate_config)")

REGISTRY: Registry[type] = Registry(
    "agent", group=ENTRY_POINT_GROUP, builtins=(BUILTIN_PACKAGE,), same=_same_class, accepts=_is_agent_class,
    valid_name=lambda name: isinstance(name, str) and bool(name) and ":" not in name,
    register_loaded=lambda name, cls: register_agent(name)(cls), suggestions=1,
    messages=Messages(
        bad_name="agent name {name!r} must be a non-empty str without ':'",
        taken="agent name {name!r} is taken by {old}; register {new} under another name",
        unknown="agent={name!r}: must be one of {names}, or path/to/file.py:Class for an agent of your own{hint}",
        no_file="agent={spec!r}: no such file {path}", no_name=_NO_CLASS))
"""The agents' :class:`textrl.registry.Registry`."""

AGENTS: dict[str, type] = REGISTRY.entries
"""Registered name -> agent class (the built-ins, :func:`register_agent` calls, loaded entry points)."""
_FROM_SPECS: dict[str, type] = {}


def register_agent(name: str) -> Callable[[type], type]:
    """Class decorator: make the agent class available as ``--agent name``.

    The class's ``name`` attribute becomes ``name``. Registering another class under a taken name
    is an error (a second registration of the same class is not).
    """
    return REGISTRY.named_class(name)


BUILTIN_AGENTS = ("cispo", "dapo", "dr_grpo", "gae_ppo", "grpo", "gspo", "multi_adapter_ppo", "one_step_ppo",
                  "reinforce_pp", "reinforce_pp_baseline", "rloo", "vapo")
"""The names :mod:`textrl.agents` registers, for ``--help`` to list without importing the agents
(and torch); ``tests/test_help_topics.py`` checks it against the registry."""


def listed_agent_names() -> list[str]:
    """The agent names ``--help`` lists, without importing any agent: the built-ins, the agents of
    installed packages (entry points) and any registered in this process."""
    return sorted(set(BUILTIN_AGENTS) | set(AGENTS) | set(REGISTRY.entry_points()))


def agent_names() -> list[str]:
    """Every agent name ``--agent`` accepts, sorted: registered classes and entry points."""
    return REGISTRY.names()


def is_spec(name: str) -> bool:
    """Whether ``name`` names a class by location (``file.py:Class`` or ``module:Class``)."""
    return ":" in name


def absolute_spec(spec: str) -> str:
    """``spec`` with a ``file.py`` part made absolute (a subprocess in another folder finds it); a
    name or ``module:Class`` unchanged. ``ValueError`` when the spec resolves to no agent."""
    agent_class(spec)
    where, _, attr = spec.rpartition(":")
    if is_spec(spec) and where.endswith(".py"):
        return f"{Path(where).expanduser().resolve()}:{attr}"
    return spec


def agent_class(spec: str) -> type:
    """The agent class of ``spec`` (a registered name, ``file.py:Class`` or ``module:Class``).

    ``ValueError`` naming ``agent``, the spec and what is accepted (and the closest name) when it
    resolves to nothing.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"agent={spec!r}: must be one of {', '.join(agent_names())}, or path/to/file.py:Class")
    if is_spec(spec):
        if spec not in _FROM_SPECS:
            _FROM_SPECS[spec] = _load_spec(spec)
        return _FROM_SPECS[spec]
    return REGISTRY.lookup(spec)


def _load_spec(spec: str) -> type:
    """Import ``Class`` of ``file.py:Class`` (the file as a module of its own) or ``module:Class``."""
    if REGISTRY.file_spec(spec) is not None:
        return REGISTRY.load_file(spec)
    where, _, attr = spec.rpartition(":")
    try:
        module = importlib.import_module(where)
    except ImportError as err:
        raise ValueError(f"agent={spec!r}: cannot import {where!r} ({err})") from err
    cls = getattr(module, attr, None)
    if not _is_agent_class(cls):
        raise ValueError(_NO_CLASS.format(spec=spec, where=where, attr=attr))
    return cls


__all__ = ["AGENTS", "BUILTIN_AGENTS", "ENTRY_POINT_GROUP", "REGISTRY", "absolute_spec", "agent_class", "agent_names", "is_spec",
           "listed_agent_names", "register_agent"]
