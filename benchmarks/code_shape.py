"""The shape of the code a newcomer reads: the longest functions, the largest classes (by lines
and by methods), the files over a line limit and the functions that take the whole agent, for
textrl/ (tests and data left out).

    python benchmarks/code_shape.py [--top 10] [--file-limit 600] [--method-limit 30] [--root PATH]

Prints four tables and exits 1 when a class has more methods than ``--method-limit`` or a file
has more lines than ``--file-limit`` (docs/design.md, "Layers": the aims of the agent room).
``--root`` reads another checkout's textrl/ (default: this one). A script, never imported by textrl.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "textrl").rglob("*.py") if "__pycache__" not in p.parts)


def shape(root: Path = ROOT) -> dict[str, list[tuple]]:
    """``functions``: (lines, 'path:name'); ``classes``: (lines, methods, 'path:name');
    ``files``: (lines, path), each sorted largest first."""
    functions, classes, files = [], [], []
    for path in _files(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        files.append((len(text.splitlines()), rel))
        tree = ast.parse(text, filename=rel)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))
            elif isinstance(node, ast.ClassDef):
                methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                classes.append((node.end_lineno - node.lineno + 1, methods, f"{rel}:{node.name}"))
    return {"functions": sorted(functions, reverse=True), "classes": sorted(classes, reverse=True),
            "files": sorted(files, reverse=True), "takes_agent": takes_agent(root)}


def _agent_classes(trees: dict[str, ast.Module]) -> set[str]:
    """``PPOAgent`` and every class of textrl/ that derives from it (by name, transitively)."""
    bases = {node.name: {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
             for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    found, grew = {"PPOAgent"}, True
    while grew:
        new = {name for name, of in bases.items() if of & found} - found
        found, grew = found | new, bool(new)
    return found


def _takes_agent(fn: ast.FunctionDef | ast.AsyncFunctionDef, agents: set[str]) -> bool:
    """Whether ``fn`` (a function, not a method) takes the whole agent: its first parameter is
    ``agent`` (unannotated, ``Any`` or an agent class: not ``agent: str``, a name), or a parameter
    is annotated with an agent class (``type[...]``, a class, does not count)."""
    params = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]

    def agent_type(note: ast.expr | None) -> bool:
        if note is None or (isinstance(note, ast.Subscript) and ast.unparse(note.value) == "type"):
            return False
        text = ast.unparse(note).strip("'\"")
        return any(part.strip().rsplit(".", 1)[-1] in agents for part in text.split("|"))

    if params and params[0].arg == "agent" and (params[0].annotation is None or agent_type(params[0].annotation)
                                                 or ast.unparse(params[0].annotation) == "Any"):
        return True
    return any(agent_type(p.annotation) for p in params)


def takes_agent(root: Path = ROOT) -> list[str]:
    """``path:name`` of every function in textrl/ (methods left out) that takes the whole agent
    (:func:`_takes_agent`), in file order: what it reads of the agent it should take instead."""
    trees = {path.relative_to(root).as_posix(): ast.parse(path.read_text()) for path in _files(root)}
    agents = _agent_classes(trees)
    found = []
    for rel, tree in trees.items():
        methods = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for n in c.body}
        found += [f"{rel}:{node.name}" for node in ast.walk(tree)
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(node) not in methods
                  and _takes_agent(node, agents)]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=10, help="rows of each table (default 10)")
    parser.add_argument("--file-limit", type=int, default=600, help="lines a file may have (default 600)")
    parser.add_argument("--room-limit", type=int, default=400,
                        help="lines a file in agents/, generation/ or envs/ may have (default 400)")
    parser.add_argument("--method-limit", type=int, default=30, help="methods a class may have (default 30)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose textrl/ to read (default: this one)")
    args = parser.parse_args(argv)
    found = shape(args.root.resolve())
    print(f"The {args.top} longest functions (lines):")
    for lines, name in found["functions"][: args.top]:
        print(f"  {lines:5}  {name}")
    print(f"The {args.top} largest classes (lines, methods):")
    for lines, methods, name in found["classes"][: args.top]:
        print(f"  {lines:5}  {methods:3}  {name}")
    by_methods = sorted(found["classes"], key=lambda c: c[1], reverse=True)
    print(f"The class with the most methods: {by_methods[0][2]} ({by_methods[0][1]})")
    over = [(n, p) for n, p in found["files"] if n > args.file_limit]
    many = [c for c in by_methods if c[1] > args.method_limit]
    print(f"Files over {args.file_limit} lines: {len(over)}")
    for lines, path in over:
        print(f"  {lines:5}  {path}")
    rooms = ("textrl/agents/", "textrl/generation/", "textrl/envs/")
    over_room = [(n, p) for n, p in found["files"] if p.startswith(rooms) and n > args.room_limit]
    print(f"Files in {', '.join(r.removeprefix('textrl/') for r in rooms)} over {args.room_limit} lines: {len(over_room)}")
    for lines, path in over_room:
        print(f"  {lines:5}  {path}")
    print(f"Classes over {args.method_limit} methods: {len(many)}")
    for _, methods, name in many:
        print(f"  {methods:5}  {name}")
    print(f"Functions that take the whole agent: {len(found['takes_agent'])}")
    for name in found["takes_agent"]:
        print(f"         {name}")
    return 1 if over or many else 0


if __name__ == "__main__":
    sys.exit(main())
