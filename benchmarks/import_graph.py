"""The import graph of textrl/: its circles and the imports that point up docs/design.md's layers.

    python benchmarks/import_graph.py [--root PATH]

Walks ``PATH/textrl`` (default: this checkout) with ``ast`` and prints

- the import circles: the strongly connected components of the module graph (Tarjan), each as its
  member modules, and for comparison how many there are counted as ``tests/test_import_cycles.py``
  counts (static imports only, the edges between a package and its own modules dropped);
- the upward arrows: imports of a module in a later (higher) entry of ``PATH/docs/design.md``'s
  "Layers" list than the importing module's entry, each with the file and line;
- the imports by name (``importlib.import_module("textrl.x")``, an f-string's literal head
  included), flagged, upward or not;
- the registries' ``builtins=`` modules (``Registry(..., builtins=(...))``): the declared
  registrations through which a lower layer reaches a higher one, listed, not counted as arrows.

Which imports count: every ``import`` and ``from ... import`` statement, those inside functions
included, those under ``if TYPE_CHECKING:`` excluded (they never run; the circles are also counted
with them, a second line, as a type checker sees the graph); imports by name count too.
Relative imports are resolved; ``from pkg import name`` is an import of ``pkg.name`` when that is
a module, else of ``pkg``. An edge from a module to a package it sits in (``from textrl.envs import
x`` inside ``textrl.envs.tasks``) is dropped: Python has imported that package already. A package's
imports of its own modules are kept.

A script, never imported by textrl. Exits 0.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Edge:
    """One import: ``source`` imports ``target`` at ``where`` (``path:line``)."""

    source: str
    target: str
    where: str
    by_name: bool = False
    type_checking: bool = False
    """Under ``if TYPE_CHECKING:`` (left out of every count but the one that says it has them)."""


# -- the modules and their imports ------------------------------------------------------------------


def modules(root: Path) -> dict[str, Path]:
    """Every module of ``root/textrl``: dotted name -> file."""
    found = {}
    for path in sorted((root / "textrl").rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def type_checking_nodes(tree: ast.AST) -> set[int]:
    """The ids of the nodes under an ``if TYPE_CHECKING:`` (its body, not its ``else``)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """``name``, else its longest prefix that is a module of ``known``; None outside textrl."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def by_name_target(node: ast.Call) -> str | None:
    """The module an ``import_module(...)`` call names: a string constant, or an f-string's literal
    head up to its last dot; None for any other call."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if called != "import_module" or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rpartition(".")[0] or None
    return None


def statement_targets(node: ast.AST, package: str, known: dict[str, Path]) -> list[str]:
    """The dotted names an ``import`` / ``from ... import`` statement imports (relative resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]


def file_edges(name: str, path: Path, root: Path, known: dict[str, Path]) -> list[Edge]:
    """Every textrl import of one module (static and by name), those under TYPE_CHECKING marked."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    rel = path.relative_to(root).as_posix()
    edges = []
    for node in ast.walk(tree):
        targets, by_name = statement_targets(node, package, known), False
        if isinstance(node, ast.Call) and (named := by_name_target(node)):
            targets, by_name = [named], True
        for target in targets:
            module = resolve(target, known)
            if module is not None and (module != name or by_name):  # by name: f"textrl.bench.{x}" in textrl.bench
                edges.append(Edge(name, module, f"{rel}:{node.lineno}", by_name, id(node) in skip))
    return edges


def all_edges(root: Path) -> tuple[dict[str, Path], list[Edge]]:
    """The modules of ``root/textrl`` and every import among them."""
    known = modules(root)
    return known, [edge for name, path in known.items() for edge in file_edges(name, path, root, known)]


def is_inside(module: str, package: str) -> bool:
    return module.startswith(package + ".")


# -- circles -----------------------------------------------------------------------------------------


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (node -> successors), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def circles(known: dict[str, Path], edges: list[Edge], *, as_the_test: bool = False,
            type_checking: bool = False) -> list[list[str]]:
    """The components of more than one module. This script's graph: every edge but a module's to a
    package it sits in and, unless ``type_checking``, those under TYPE_CHECKING. ``as_the_test``:
    static edges only, both directions between a package and its own modules dropped
    (``tests/test_import_cycles.py``)."""
    graph: dict[str, set[str]] = {name: set() for name in known}
    for edge in edges:
        if edge.source == edge.target or is_inside(edge.source, edge.target):
            continue
        if edge.type_checking and not type_checking:
            continue
        if as_the_test and (edge.by_name or is_inside(edge.target, edge.source)):
            continue
        graph[edge.source].add(edge.target)
    return sorted((c for c in strongly_connected(graph) if len(c) > 1), key=lambda c: (-len(c), c))


# -- layers (the parsing of tests/test_layer_list.py, for any checkout) ----------------------------------


def layer_entries(design: Path) -> list[list[str]]:
    """The entries of the "Layers" list of ``design``, bottom first, each as the module names it
    covers (empty when the page has no such list)."""
    text = design.read_text() if design.is_file() else ""
    if "\n## Layers\n" not in text:
        return []
    match = re.search(r"```\n(.*?)```", text.split("\n## Layers\n", 1)[1], flags=re.S)
    entries: list[list[str]] = []
    continued = False
    for line in (match[1] if match else "").splitlines():
        if not line or line.startswith(" "):
            continued = False
            continue
        names_part = re.split(r"\s{2,}", line)[0]
        names = [n.strip().removeprefix("textrl/").rstrip("/") for n in names_part.split(",") if n.strip()]
        found = ["textrl" if n == "__init__.py" else "textrl." + n.removesuffix(".py").replace("/", ".") for n in names]
        if continued:
            entries[-1].extend(found)
        else:
            entries.append(found)
        continued = names_part.rstrip().endswith(",")
    return entries


def layer_of(module: str, entries: list[list[str]]) -> int | None:
    """The index of the entry whose name is the longest prefix of ``module``."""
    best, best_len = None, -1
    for number, names in enumerate(entries):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best_len:
                best, best_len = number, len(name)
    return best


def upward(edges: list[Edge], entries: list[list[str]]) -> list[tuple[Edge, int, int]]:
    """The imports of a later entry than the importer's: (edge, its entry, the target's entry)."""
    found = []
    for edge in edges:
        source, target = layer_of(edge.source, entries), layer_of(edge.target, entries)
        if source is not None and target is not None and target > source:
            found.append((edge, source, target))
    return found


def registry_builtins(root: Path, known: dict[str, Path]) -> list[tuple[str, str, str]]:
    """(registry module, built-in module, ``path:line``) of every ``Registry(..., builtins=(...))``
    (string constants, or names of the file's top-level string constants)."""
    found = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                     and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                     for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Registry"):
                continue
            for keyword in node.keywords:
                if keyword.arg != "builtins" or not isinstance(keyword.value, (ast.Tuple, ast.List)):
                    continue
                for item in keyword.value.elts:
                    value = item.value if isinstance(item, ast.Constant) else constants.get(getattr(item, "id", ""))
                    if isinstance(value, str):
                        found.append((name, value, f"{path.relative_to(root).as_posix()}:{node.lineno}"))
    return found


# -- the report ---------------------------------------------------------------------------------------


def report(root: Path) -> list[str]:
    """The printed lines for the checkout at ``root``."""
    known, every_edge = all_edges(root)
    edges = [e for e in every_edge if not e.type_checking]
    entries = layer_entries(root / "docs" / "design.md")
    found, as_test = circles(known, edges), circles(known, edges, as_the_test=True)
    arrows = upward(edges, entries)
    pairs = sorted({(e.source, e.target) for e, _, _ in arrows})
    named = [e for e in edges if e.by_name]
    lines = [f"Import graph of {root / 'textrl'}: {len(known)} modules, {len({(e.source, e.target) for e in edges if e.source != e.target})} "
             "imports (module pairs; inside functions included, TYPE_CHECKING-only excluded, by name included)",
             f"Import circles (strongly connected components): {len(found)} "
             f"({sum(map(len, found))} modules); counted as tests/test_import_cycles.py counts: {len(as_test)}"]
    lines += [f"  {n}. ({len(c)} modules) {', '.join(c)}" for n, c in enumerate(found, 1)]
    typed = circles(known, every_edge, type_checking=True)
    lines.append(f"  with the TYPE_CHECKING-only imports too: {len(typed)} ({sum(map(len, typed))} modules)")
    lines += [f"    {n}. ({len(c)} modules) {', '.join(c)}" for n, c in enumerate(typed, 1)]
    lines.append(f"Upward arrows (an import of a later entry of docs/design.md's Layers; {len(entries)} entries): "
                 f"{len(pairs)} module pairs, {len(arrows)} import statements, "
                 f"{sum(e.by_name for e, _, _ in arrows)} of them by name")
    for edge, source, target in sorted(arrows, key=lambda a: (a[0].source, a[0].target, a[0].where)):
        flag = "  [by name]" if edge.by_name else ""
        lines.append(f"  {edge.source} (entry {source}) -> {edge.target} (entry {target})  {edge.where}{flag}")
    lines.append(f"Imports by name (importlib.import_module of a textrl module): {len(named)}")
    for edge in sorted(named, key=lambda e: e.where):
        up = any(edge is e for e, _, _ in arrows)
        lines.append(f"  {edge.source} -> {edge.target}  {edge.where}  [by name{', upward' if up else ''}]")
    builtins = registry_builtins(root, known)
    lines.append(f"Registries' builtins= (declared registrations, not counted as arrows): {len(builtins)}")
    for registry, module, where in sorted(builtins):
        target, source = layer_of(module, entries), layer_of(registry, entries)
        direction = "up" if target is not None and source is not None and target > source else "same or down"
        lines.append(f"  {registry} -> {module}  {where}  ({direction})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose textrl/ to read (default: this one)")
    args = parser.parse_args(argv)
    print("\n".join(report(args.root.resolve())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
