"""The one list of agent names, and the resolver of an ``--agent`` spec (docs/design.md, "Agents").

An agent is found by its spec, in this order:

- ``path/to/file.py:Class``: the class ``Class`` of a user's file (loaded once per file);
- ``package.module:Class``: an importable class;
- a registered name: a class decorated with :func:`register_agent`, or an entry point of the
  packaging group ``textrl.agents`` (``[project.entry-points."textrl.agents"]`` in a
  ``pyproject.toml``: ``my_agent = "my_package.agents:MyAgent"``).

The built-in agents register themselves when :mod:`textrl.agents` is imported; :func:`agent_class`
imports that package, as it loads an entry point, the first time a name is looked up. This module
lives in the core and names no agent: the configuration checks an agent from its class's
declarations (``validate_config``), whichever package the class comes from.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from textrl.user_files import import_file

ENTRY_POINT_GROUP = "textrl.agents"
"""The packaging entry point group of agents from other packages."""
BUILTIN_PACKAGE = "textrl.agents"
"""The package whose import registers the built-in agents."""

AGENTS: dict[str, type] = {}
"""Registered name -> agent class (the built-ins, :func:`register_agent` calls, loaded entry points)."""
_FROM_SPECS: dict[str, type] = {}


def register_agent(name: str) -> Callable[[type], type]:
    """Class decorator: make the agent class available as ``--agent name``.

    The class's ``name`` attribute becomes ``name``. Registering another class under a taken name
    is an error (a second registration of the same class is not).
    """

    def register(cls: type) -> type:
        taken = AGENTS.get(name)
        if taken is not None and (taken.__module__, taken.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"agent name {name!r} is taken by {taken.__module__}.{taken.__qualname__}; "
                             f"register {cls.__qualname__} under another name")
        cls.name = name
        AGENTS[name] = cls
        return cls

    return register


def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _load_builtins() -> None:
    if BUILTIN_PACKAGE not in sys.modules:
        importlib.import_module(BUILTIN_PACKAGE)


def agent_names() -> list[str]:
    """Every agent name ``--agent`` accepts, sorted: registered classes and entry points."""
    _load_builtins()
    return sorted(set(AGENTS) | set(_entry_points()))


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

    ``ValueError`` naming ``agent``, the spec and what is accepted when it resolves to nothing.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"agent={spec!r}: must be one of {', '.join(agent_names())}, or path/to/file.py:Class")
    if is_spec(spec):
        if spec not in _FROM_SPECS:
            _FROM_SPECS[spec] = _load_spec(spec)
        return _FROM_SPECS[spec]
    _load_builtins()
    if spec not in AGENTS:
        found = _entry_points().get(spec)
        if found is None:
            raise ValueError(f"agent={spec!r}: must be one of {', '.join(agent_names())}, "
                             "or path/to/file.py:Class for an agent of your own")
        cls = found.load()
        register_agent(spec)(cls)
    return AGENTS[spec]


def _load_spec(spec: str) -> type:
    """Import ``Class`` of ``file.py:Class`` (the file as a module of its own) or ``module:Class``."""
    where, _, attr = spec.rpartition(":")
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"agent={spec!r}: no such file {path}")
        module = import_file(path, "agent")
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise ValueError(f"agent={spec!r}: cannot import {where!r} ({err})") from err
    cls = getattr(module, attr, None)
    if not isinstance(cls, type) or not hasattr(cls, "from_config") or not hasattr(cls, "validate_config"):
        raise ValueError(f"agent={spec!r}: {where} has no agent class {attr!r} (a subclass of "
                         "textrl.agents.PPOAgent, with from_config and validate_config)")
    return cls


__all__ = ["AGENTS", "ENTRY_POINT_GROUP", "absolute_spec", "agent_class", "agent_names", "is_spec", "register_agent"]
