"""The longest functions of the repository's Python (tests and virtual environments aside).

    python benchmarks/longest_functions.py [-n 10] [ROOT]

A function's length is its line count from ``def`` (decorators excluded) to its last line,
docstring and blank lines included: what a reader scrolls through. Nested functions count on
their own and inside their parent. Prints ``lines  file:line  name`` (methods as
``Class.method``), longest first. A script, never imported.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

SKIPPED = {"tests", ".venv", "venv", ".git", "build", "dist", "__pycache__"}
"""Folder names never searched."""


def python_files(root: Path) -> list[Path]:
    """Every ``*.py`` under ``root`` outside the :data:`SKIPPED` folders, sorted."""
    return sorted(p for p in root.rglob("*.py") if not SKIPPED & set(p.relative_to(root).parts[:-1]))


def functions(path: Path) -> list[tuple[int, str, int]]:
    """``(lines, qualified name, first line)`` of every function and method defined in ``path``."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                found.append((child.end_lineno - child.lineno + 1, name, child.lineno))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), "")
    return found


def longest(root: Path, n: int) -> list[tuple[int, str, str, int]]:
    """The ``n`` longest functions under ``root``: ``(lines, file, name, first line)``."""
    rows = [(lines, path.relative_to(root).as_posix(), name, lineno)
            for path in python_files(root) for lines, name, lineno in functions(path)]
    return sorted(rows, key=lambda r: (-r[0], r[1], r[3]))[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default=Path(__file__).resolve().parents[1], type=Path)
    parser.add_argument("-n", type=int, default=10, help="how many functions to list (default: 10)")
    args = parser.parse_args()
    for lines, file, name, lineno in longest(args.root.resolve(), args.n):
        print(f"{lines:5d}  {file}:{lineno}  {name}")


if __name__ == "__main__":
    main()
