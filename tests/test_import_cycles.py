"""No import cycles among textrl's modules (docs/design.md, "Layers").

Every ``import`` statement counts, lazy ones inside functions too (a lazy import that closes a
cycle only hides it), except those under ``if TYPE_CHECKING:``. ``from package import name``
counts as importing ``package.name`` when that is a module, else ``package``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from benchmarks.import_graph import type_checking_nodes

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"textrl": ROOT / "textrl"}
"""Import prefix -> folder (a file's path is its import name)."""


def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    found = {}
    for prefix, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in out if m in known and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_config_does_not_import_the_adapters_module():
    known = modules()
    assert "textrl.models.adapters" not in imports("textrl.config", known["textrl.config"], known)


def test_no_import_cycles_between_modules():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    # a package importing its own submodules (to re-export them) is not a cycle of modules
    graph = {name: {m for m in deps if not m.startswith(name + ".") and not name.startswith(m + ".")}
             for name, deps in graph.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
