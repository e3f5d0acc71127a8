"""The shape of the code a newcomer reads: the longest functions, the largest classes (by lines
and by methods) and the files over a line limit, for textrl/ (tests and data left out).

    python benchmarks/code_shape.py [--top 10] [--file-limit 600] [--method-limit 30] [--root PATH]

Prints three tables and exits 1 when a class has more methods than ``--method-limit`` or a file
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
            "files": sorted(files, reverse=True)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=10, help="rows of each table (default 10)")
    parser.add_argument("--file-limit", type=int, default=600, help="lines a file may have (default 600)")
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
    print(f"Classes over {args.method_limit} methods: {len(many)}")
    for _, methods, name in many:
        print(f"  {methods:5}  {name}")
    return 1 if over or many else 0


if __name__ == "__main__":
    sys.exit(main())
