"""docs/design.md, "Layers": the list of folders and files is the import order of ``textrl/``.

The list's code block names each entry's folders and files (``textrl/functional/``, then paths
relative to ``textrl/``: ``checks.py``, ``bench/``, ``testing`` for a file or a folder), bottom
first. Every module of ``textrl/`` must belong to an entry, and every ``textrl`` import it makes,
inside functions too, must name a module of its own entry or of an entry above it. An import by
name (``importlib.import_module("textrl.x")``, an f-string's literal head included) is an import.
A registry's ``builtins=`` (``Registry(..., builtins=("textrl.x",))``) is the sanctioned way to
reach a later entry: the modules it names are imported on its first lookup and register
themselves there, so they are not checked against the order, only for existing.
"""

from __future__ import annotations

import ast
from pathlib import Path

from benchmarks.import_graph import layer_entries as read_layer_entries
from benchmarks.import_graph import layer_of

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"


def layer_entries() -> list[list[str]]:
    """The entries of the list, bottom first, each as the module names it covers."""
    entries = read_layer_entries(DESIGN)
    assert entries, f"{DESIGN} has no list under '## Layers'"
    return entries


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def textrl_imports(path: Path) -> set[str]:
    """Every ``textrl`` module a file imports, relative imports resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # from textrl import zero
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            found.update(_literal_module(node.args[0]))
    return {m for m in found if m == "textrl" or m.startswith("textrl.")}


def _is_import_module(func: ast.expr) -> bool:
    """Whether a call's function is ``importlib.import_module`` (or ``import_module``)."""
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name == "import_module"


def _literal_module(arg: ast.expr) -> set[str]:
    """The module a by-name import names: a string constant, or an f-string's literal head up to
    its last dot (``f"textrl.bench.{name}"`` imports a module of ``textrl.bench``)."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return {arg.value}
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        head = str(arg.values[0].value).rpartition(".")[0]
        return {head} if head else set()
    return set()


def registry_builtins(path: Path) -> set[str]:
    """The modules a file's ``Registry(..., builtins=(...))`` calls name (string constants, or
    names of the file's top-level string constants)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for target in node.targets if isinstance(target, ast.Name)}
    found = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Registry"):
            continue
        for keyword in node.keywords:
            if keyword.arg == "builtins" and isinstance(keyword.value, (ast.Tuple, ast.List)):
                for item in keyword.value.elts:
                    if isinstance(item, ast.Constant) and isinstance(item.value, str):
                        found.add(item.value)
                    elif isinstance(item, ast.Name) and item.id in constants:
                        found.add(constants[item.id])
    return found


def test_every_module_is_in_the_list_and_imports_only_its_entry_and_those_above():
    entries = layer_entries()
    assert len(entries) >= 10, entries
    unlisted, upward = [], []
    for path in sorted((ROOT / "textrl").rglob("*.py")):
        module = module_name(path)
        layer = layer_of(module, entries)
        if layer is None:
            unlisted.append(module)
            continue
        for imported in textrl_imports(path):
            target = layer_of(imported, entries)
            if target is not None and target > layer:
                upward.append(f"{module} imports {imported}")
    assert not unlisted, f"modules not in docs/design.md's layer list (add them to an entry): {unlisted}"
    assert not upward, f"imports of an entry below it in docs/design.md's layer list: {upward}"


def test_an_import_by_name_is_an_import():
    tree = ast.parse('import importlib\nimportlib.import_module("textrl.envs")\n'
                     'importlib.import_module(f"textrl.bench.{name}")\n')
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _is_import_module(n.func)]
    assert [_literal_module(c.args[0]) for c in calls] == [{"textrl.envs"}, {"textrl.bench"}]


def test_registries_name_builtin_modules_that_exist():
    """Each registry's ``builtins=`` names a module of ``textrl/`` (a rename is caught here, not at
    a user's first lookup); the registries of agents, engines and environment facts are found."""
    modules = {module_name(path) for path in (ROOT / "textrl").rglob("*.py")}
    declared = {module_name(path): registry_builtins(path) for path in sorted((ROOT / "textrl").rglob("*.py"))}
    declared = {module: names for module, names in declared.items() if names}
    for registry in ("textrl.core.agent_registry", "textrl.generation.base", "textrl.core.env_facts"):
        assert registry in declared, f"{registry}: no Registry(builtins=...) found"
    missing = sorted(f"{module}: {name}" for module, names in declared.items() for name in names
                     if name not in modules)
    assert not missing, f"registries' builtins= that name no module of textrl/: {missing}"
