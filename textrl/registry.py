"""One registry type for agents, environments and rewards (after ``gymnasium.envs.registration``).

A :class:`Registry` maps names to objects (an agent class, an environment constructor, a reward
constructor). What every kind gets from it:

- ``register(name, obj, replace=False)``, or ``@register(name)`` as a decorator;
- lookup by name (:meth:`Registry.find`, :meth:`Registry.lookup`), with a "did you mean" on a name
  it does not know (:meth:`Registry.hint`);
- ``path/to/file.py:Name`` loading (:meth:`Registry.load_file`, through :mod:`textrl.core.user_files`);
- entry points: a packaging entry-point group per kind (``textrl.agents``, ``textrl.envs``,
  ``textrl.rewards``), so another package's ``pyproject.toml`` adds names::

      [project.entry-points."textrl.envs"]
      my_game = "my_package.games:MyGame"

  an entry point is loaded, and registered through the kind's own register function, the first
  time its name is looked up;
- listing: :meth:`Registry.names` (registered and entry-point names, sorted) and
  :meth:`Registry.describe` / :meth:`Registry.pprint` (a name and the first line of its docstring).

The kinds keep their own words: each registry is given its messages as format templates
(:class:`Messages`), so ``textrl.agents``, ``textrl.envs`` and ``textrl.rewards`` say what they
said before. This module is in the core and names no agent, environment or reward; a registry
imports its built-ins by module name the first time it is asked.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar

from textrl.core.user_files import import_file

T = TypeVar("T")


def entry_points(group: str) -> list[Any]:
    """The installed packages' entry points of ``group`` (``importlib.metadata.entry_points``; a
    test replaces this function to add its own)."""
    return list(metadata.entry_points(group=group))


@dataclass(frozen=True)
class Messages:
    """A registry's messages, as ``str.format`` templates over the fields each one lists.

    - ``bad_name`` ({name}): a name :meth:`Registry.register` refuses;
    - ``taken`` ({name}, {old}, {new}: the registered and the new object's qualified names);
    - ``unknown`` ({name}, {hint}, {names}): a name nothing is registered under;
    - ``no_file`` ({spec}, {where}, {file}, {path}): ``file.py:Name`` of a file that does not exist
      (``where`` as written, ``file`` with ``~`` expanded, ``path`` resolved);
    - ``no_name`` (the same and {attr}, {what}: "is not defined" or ``not_accepted``, {found}: the
      registry's ``candidates`` of the file): the file has no acceptable ``Name``;
    - ``import_failed`` ({where}, {error_type}, {error}) and ``import_exited`` ({where}, {code}):
      the file raised, or called ``sys.exit``, while it was imported; None lets it propagate.
    """

    bad_name: str = "{noun} name {name!r} must be a non-empty str without ':' or ','"
    taken: str = "{noun} name {name!r} is already registered (by {old}); pick another name or pass replace=True"
    unknown: str = "unknown {noun} {name!r}{hint}; registered: {names}"
    no_file: str = "{spec!r}: no file {file!r}"
    no_name: str = "{spec!r}: {file!r} {what}"
    not_accepted: str = "is not a {noun}"
    import_failed: str | None = None
    import_exited: str | None = None


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a class or function (its repr otherwise)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(obj)


def first_line(doc: str | None) -> str:
    """The first line of a docstring ("" without one)."""
    lines = (doc or "").strip().splitlines()
    return lines[0].strip() if lines else ""


class Registry(Generic[T]):
    """Names of one kind (agents, environments, rewards) -> the objects they stand for.

    ``kind`` names user files' modules (:func:`textrl.core.user_files.import_file`); ``noun`` is the
    word in messages; ``group`` the entry-point group (None: none); ``builtins`` the modules whose
    import registers the built-in names (imported on the first listing, or the first lookup that
    misses); ``valid_name`` says whether :meth:`register` takes a name; ``same`` whether a second
    registration under a taken name is the same object again (then not an error); ``accepts``
    whether a file's attribute is an object of this kind; ``candidates`` what the ``no_name``
    message lists of a file; ``register_loaded`` registers a loaded entry point (the kind's own
    register function, so a name from a package is set up as a built-in one is); ``suggestions``
    and ``cutoff`` tune "did you mean" (``difflib.get_close_matches``).
    """

    def __init__(self, kind: str, *, noun: str | None = None, group: str | None = None,
                 builtins: Iterable[str] = (), messages: Messages | None = None,
                 valid_name: Callable[[str], bool] | None = None,
                 same: Callable[[Any, Any], bool] | None = None,
                 accepts: Callable[[Any], bool] | None = None,
                 candidates: Callable[[ModuleType], str] | None = None,
                 register_loaded: Callable[[str, Any], Any] | None = None,
                 suggestions: int = 1, cutoff: float = 0.6) -> None:
        self.kind = kind
        self.noun = noun or kind
        self.group = group
        self.builtins = tuple(builtins)
        self.messages = messages or Messages()
        self.entries: dict[str, T] = {}
        """Registered name -> object: the kind's public table (``AGENTS``, ``ENVS``, ``REWARDS``)."""
        self.descriptions: dict[str, str] = {}
        self._valid_name = valid_name or (lambda name: isinstance(name, str) and bool(name)
                                          and ":" not in name and "," not in name)
        self._same = same or (lambda old, new: old is new)
        self._accepts = accepts or (lambda obj: obj is not None)
        self._candidates = candidates or (lambda module: "")
        self._register_loaded = register_loaded or (lambda name, obj: self.register(name, obj))
        self.suggestions = suggestions
        self.cutoff = cutoff

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, group={self.group!r}, {len(self.entries)} registered)"

    # -- registering ---------------------------------------------------------------------------

    def check_name(self, name: Any) -> str:
        """``name`` when :meth:`register` takes it; ``ValueError`` (``bad_name``) otherwise."""
        if not self._valid_name(name):
            raise ValueError(self.messages.bad_name.format(noun=self.noun, name=name))
        return name

    def register(self, name: str, obj: Any = None, *, replace: bool = False,
                 description: str | None = None) -> Any:
        """Register ``obj`` under ``name``; without ``obj``, a decorator that does.

        A taken name is a ``ValueError`` (``taken``) unless ``replace`` or the object is the one
        registered (``same``). ``description`` is the listing's text (default: the first line of
        ``obj``'s docstring). Returns ``obj``.
        """
        self.check_name(name)
        if obj is None:
            return lambda target: self.register(name, target, replace=replace, description=description)
        taken = self.entries.get(name)
        if taken is not None and not replace and not self._same(taken, obj):
            raise ValueError(self.messages.taken.format(noun=self.noun, name=name, old=qualified_name(taken),
                                                        new=getattr(obj, "__qualname__", repr(obj))))
        self.entries[name] = obj
        if description is not None:
            self.descriptions[name] = description
        else:
            self.descriptions.pop(name, None)
        return obj

    def named_class(self, name: str) -> Callable[[type], type]:
        """Class decorator: register the class under ``name`` and set its ``name`` attribute to it
        (the agents', the generation engines')."""

        def register(cls: type) -> type:
            self.register(name, cls)
            cls.name = name
            return cls

        return register

    # -- looking up ----------------------------------------------------------------------------

    def load_builtins(self) -> None:
        """Import the modules that register the built-in names (once; a missing optional
        dependency of one of them is skipped, the module itself missing is a bug)."""
        for module in self.builtins:
            if module in sys.modules:
                continue
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as error:
                if error.name == module:
                    raise

    def entry_points(self) -> dict[str, Any]:
        """Name -> entry point of the registry's group (empty without a group)."""
        if self.group is None:
            return {}
        return {point.name: point for point in entry_points(self.group)}

    def names(self) -> list[str]:
        """Every name :meth:`find` resolves, sorted: registered ones and entry points."""
        self.load_builtins()
        return sorted(set(self.entries) | set(self.entry_points()))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.find(name) is not None

    def find(self, name: str) -> T | None:
        """The object registered under ``name`` (an entry point loaded and registered the first
        time), None when nothing is."""
        if name not in self.entries:
            self.load_builtins()
        if name not in self.entries:
            if not self._valid_name(name):  # a file spec, a scheme: never an entry point's name
                return None
            point = self.entry_points().get(name)
            if point is None:
                return None
            self._register_loaded(name, point.load())
        return self.entries.get(name)

    def close_names(self, name: str, known: Iterable[str] | None = None) -> list[str]:
        """The names closest to ``name`` (at most ``suggestions``)."""
        known = sorted(self.entries) if known is None else list(known)
        return difflib.get_close_matches(name, known, n=self.suggestions, cutoff=self.cutoff)

    def hint(self, name: str, known: Iterable[str] | None = None) -> str:
        """`` (did you mean 'x'?)`` (or ``'x' or 'y'``) for the closest names; "" when none is close."""
        close = self.close_names(name, known)
        return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""

    def unknown(self, name: str, known: Iterable[str] | None = None) -> str:
        """The ``unknown`` message for ``name``: the hint and the known names."""
        known = self.names() if known is None else sorted(known)
        return self.messages.unknown.format(noun=self.noun, name=name, hint=self.hint(name, known),
                                            names=", ".join(known))

    def lookup(self, name: str) -> T:
        """The object registered under ``name``; ``ValueError`` (``unknown``) when nothing is."""
        found = self.find(name) if isinstance(name, str) else None
        if found is None:
            raise ValueError(self.unknown(name))
        return found

    # -- files ---------------------------------------------------------------------------------

    @staticmethod
    def file_spec(spec: str) -> tuple[str, str] | None:
        """``(file, Name)`` of ``path/to/file.py:Name``; None for anything else."""
        where, sep, attr = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
        return (where, attr) if sep and where.endswith(".py") else None

    def load_file(self, spec: str, attr: str | None = None) -> Any:
        """The object ``Name`` of ``path/to/file.py:Name`` (or of ``load_file(path, Name)``; the
        file imported once, as a module of its own); ``ValueError`` (``no_file``, ``no_name``,
        ``import_failed``) when there is none."""
        if attr is None:
            parts = self.file_spec(spec)
            if parts is None:
                raise ValueError(f"{spec!r} is not path/to/file.py:Name")
            where, attr = parts
        else:
            where, spec = spec, f"{spec}:{attr}"
        file = Path(where).expanduser()
        fields = dict(noun=self.noun, spec=spec, where=where, file=str(file), path=str(file.resolve()), attr=attr)
        if not file.is_file():
            raise ValueError(self.messages.no_file.format(**fields))
        module = self.import_file(file, where)
        obj = getattr(module, attr, None)
        if not self._accepts(obj):
            what = "is not defined" if obj is None else self.messages.not_accepted.format(noun=self.noun)
            raise ValueError(self.messages.no_name.format(**fields, what=what, found=self._candidates(module)))
        return obj

    def import_file(self, file: str | Path, where: str | None = None) -> ModuleType:
        """The module of a user's file, its failures worded by ``import_failed`` / ``import_exited``
        when the registry has them."""
        where = str(file) if where is None else where
        try:
            return import_file(file, self.kind)
        except SystemExit as err:
            if self.messages.import_exited is None:
                raise
            raise ValueError(self.messages.import_exited.format(noun=self.noun, where=where, code=err.code)) from None
        except Exception as err:
            if self.messages.import_failed is None:
                raise
            raise ValueError(self.messages.import_failed.format(noun=self.noun, where=where, error_type=type(err).__name__,
                                                                error=err)) from err

    # -- listing -------------------------------------------------------------------------------

    def describe(self, name: str) -> str:
        """One line about ``name``: its registered description, else its docstring's first line
        ("" for an entry point not loaded yet)."""
        if name in self.descriptions:
            return self.descriptions[name]
        obj = self.entries.get(name)
        return first_line(getattr(obj, "__doc__", None)) if obj is not None else ""

    def pprint(self, *, descriptions: bool = True) -> str:
        """The names, one a line, each with its description (as ``gymnasium.pprint_registry``)."""
        names = self.names()
        width = max((len(n) for n in names), default=0)
        lines = []
        for name in names:
            text = self.describe(name) if descriptions else ""
            lines.append(f"{name:<{width}}  {text}".rstrip() if text else name)
        return "\n".join(lines)


__all__ = ["Messages", "Registry", "entry_points", "first_line", "qualified_name"]
