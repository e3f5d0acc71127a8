"""Importing a user's Python file (``--agent``, ``--reward`` or ``--env`` as ``PATH.py:NAME``).

The file becomes a module of its own, named by what it provides and a hash of its resolved path,
so two files with the same name do not collide and importing the same file twice gives the same
module. It is put in ``sys.modules`` before it runs (dataclasses and pickling look it up there)
and taken out again if it raises.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def module_name(path: str | os.PathLike[str], kind: str) -> str:
    """``textrl_user_<kind>_<stem>_<hash>`` for the file at ``path``."""
    file = Path(path).expanduser().resolve()
    return f"textrl_user_{kind}_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:12]}"


def import_file(path: str | os.PathLike[str], kind: str) -> ModuleType:
    """The module of the Python file ``path`` (imported once per process); ``ValueError`` when it
    cannot be imported as Python; whatever the file raises while it runs propagates."""
    name = module_name(path, kind)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(path).expanduser().resolve())
    if spec is None or spec.loader is None:
        raise ValueError(f"{str(path)!r} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def import_path(fn: Any) -> str | None:
    """``module.qualname`` under which a fresh Python process imports ``fn`` again, None when it
    cannot (a lambda, a function defined inside another, in ``__main__`` or in a file loaded as a
    ``file.py:function`` reward, a callable object)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    if module == "__main__" or module.startswith("textrl_user_"):
        return None
    top = module.split(".")[0]
    if top not in sys.builtin_module_names and importlib.machinery.PathFinder.find_spec(top) is None:
        return None  # a module that exists only in this process
    obj: Any = sys.modules.get(module)
    for attribute in qualname.split("."):
        obj = getattr(obj, attribute, None)
    return f"{module}.{qualname}" if obj is fn else None


LOCAL_PATH_FIELDS = ("model", "tokenizer", "reward_model", "dataset")
"""Config fields whose value may be a local file or folder (else a hub id or a name): recorded as an
absolute path when it names one relative to the working folder."""


def absolute_file(path: str) -> str:
    """``path`` made absolute when it is relative and names a file seen from the working folder;
    else as it is."""
    file = Path(path).expanduser()
    return str(file.resolve()) if not file.is_absolute() and file.is_file() else path


def absolute_local(value: str) -> str:
    """``value`` made absolute when it is relative and names a file or folder seen from the working
    folder (a local model, tokenizer or dataset); else as it is (a hub id, a name)."""
    path = Path(value).expanduser()
    return str(path.resolve()) if value.strip() and not path.is_absolute() and path.exists() else value


def absolute_spec(text: str) -> str:
    """``text`` with each comma-separated ``PATH.py:NAME`` entry whose relative ``PATH.py`` is a file
    (seen from the working folder) written with its absolute path: ``badrew.py:fn`` ->
    ``/home/u/proj/badrew.py:fn``. Other entries (names, ``module:NAME``, absolute paths) are kept,
    as is the spacing of a spec without a relative file."""
    entries = text.split(",")
    changed = False
    for i, entry in enumerate(entries):
        stripped = entry.strip()
        cut = stripped.find(".py:")
        if cut <= 0:
            continue
        file = absolute_file(stripped[:cut + 3])
        if file != stripped[:cut + 3]:
            entries[i] = f"{file}{stripped[cut + 3:]}"
            changed = True
    return ",".join(entries) if changed else text


def absolute_paths(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (field -> value of a config) with relative local paths made absolute, so that the
    run's record (``config.yaml``, ``user_code.json``) names the same files from any working folder:
    a ``--resume`` started elsewhere, or from a moved run folder, finds them. ``PATH.py:NAME``
    entries of any string field (:func:`absolute_spec`), and the local files or folders of
    :data:`LOCAL_PATH_FIELDS`; hub ids, names and objects are kept."""
    out = dict(values)
    for name, value in values.items():
        if not isinstance(value, str):
            continue
        out[name] = absolute_spec(value)
        if name in LOCAL_PATH_FIELDS and out[name] == value:
            out[name] = absolute_local(value)
    return out


__all__ = ["LOCAL_PATH_FIELDS", "absolute_file", "absolute_local", "absolute_paths", "absolute_spec", "import_file", "import_path", "module_name"]
