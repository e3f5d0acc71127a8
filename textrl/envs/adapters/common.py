"""What the adapters share: importing a suite (or naming the extra that installs it), an unknown id's
message and the checks of the row counts."""

from __future__ import annotations

import difflib
import importlib
import random
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_EXTRAS = {"reasoning_gym": ("reasoning-gym", "reasoning-gym"), "textarena": ("textarena", "textarena")}
"""Import name -> (PyPI package, textrl extra)."""


def require(module: str, what: str) -> ModuleType:
    """``import module``, or a one-line ``ImportError`` naming ``what`` needs it and the extra
    that installs it (``pip install 'textrl[reasoning-gym]'``). The global ``random`` state is
    kept: importing reasoning_gym or textarena draws from it."""
    outer = random.getstate()
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package, extra = _EXTRAS[module]
        raise ImportError(f"{what} needs the {package} package, which cannot be imported ({error}); "
                          f"install it with: pip install 'textrl[{extra}]'") from None
    finally:
        random.setstate(outer)


def unknown_id(kind: str, name: str, known: Sequence[str], checked: Sequence[str]) -> ValueError:
    close = difflib.get_close_matches(name, list(known), n=3)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    return ValueError(f"{kind}:{name}: no such {kind} id{hint}; ids checked to work offline: "
                      f"{', '.join(checked)}")


def check_sizes(what: str, size: Any, eval_size: Any, seed: Any) -> None:
    for name, value, low in (("size", size, 1), ("eval_size", eval_size, 0), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{what}: {name}={value!r} must be an int >= {low}")


__all__ = ["check_sizes", "require", "unknown_id"]
