"""The limits the house keeps (docs/design.md, "Layers"): a newcomer reads a function in one screen,
a class's methods in one list, a file in one sitting.

- a function or method: at most 80 lines;
- a class: at most 30 methods;
- a file in ``textrl/``: at most 600 lines, 400 in the rooms a newcomer opens first (``agents/``,
  ``generation/``, ``envs/``);
- no import circle, type hints included (``tests/test_import_cycles.py`` holds the run-time
  imports; here the ``TYPE_CHECKING`` ones count too); upward arrows: ``tests/test_layer_list.py``;
- no issue numbers in the product, its benchmarks or its docs (an issue is where work was asked
  for, not where a reader can look).

Today's exceptions are listed below, each at its size today (a ceiling: it may shrink, not grow)
with the reason it is kept. ``benchmarks/code_shape.py`` and ``benchmarks/import_graph.py`` print
the figures.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.code_shape import shape
from benchmarks.import_graph import all_edges, circles

ROOT = Path(__file__).resolve().parents[1]
FUNCTION_LINES = 80
CLASS_METHODS = 30
FILE_LINES = 600
FIRST_ROOMS = ("textrl/agents/", "textrl/generation/", "textrl/envs/")
FIRST_ROOM_FILE_LINES = 400

FILES: dict[str, tuple[int, str]] = {
    "textrl/agents/async_actor.py": (596, "the asynchronous actor, its schedule and its snapshots"),
    "textrl/envs/builtin.py": (593, "the built-in environments and their tables"),
    "textrl/agents/update.py": (568, "the update: epochs, minibatches, micro-batches, checks"),
    "textrl/envs/adapters.py": (527, "the reasoning-gym and TextArena adapters"),
    "textrl/agents/base.py": (527, "PPOAgent: the agent every estimator shares"),
    "textrl/envs/torchrl_env.py": (468, "the TorchRL environment and its specs"),
    "textrl/envs/token_mdp.py": (462, "the Gymnasium token MDP"),
    "textrl/agents/build.py": (415, "building an agent from a config: models, precision, engines"),
}
"""File -> (lines it may have, why it is over its limit)."""

FUNCTIONS: dict[str, tuple[int, str]] = {
}
"""``path:name`` -> (lines it may have, why it is over :data:`FUNCTION_LINES`)."""

CLASSES: dict[str, tuple[int, str]] = {
    "textrl/agents/base.py:PPOAgent": (34, "the shared agent: rollout, forwards, update and state in one class"),
    "textrl/parallel/base.py:Backend": (31, "the backend interface every parallel backend implements"),
}
"""``path:name`` -> (methods it may have, why it is over :data:`CLASS_METHODS`)."""

TYPE_HINT_CIRCLES: dict[tuple[str, ...], str] = {
    ("textrl.agents.actor", "textrl.agents.update"): "the update's hints name the actor and the actor's the update",
    ("textrl.agents.base", "textrl.agents.build"): "build's hints name the agent it builds, the agent's its builder",
}
"""Circles through ``TYPE_CHECKING`` imports only -> why each is kept."""

ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\d+|\bissue's\b", re.IGNORECASE)


def _file_limit(path: str) -> int:
    return FIRST_ROOM_FILE_LINES if path.startswith(FIRST_ROOMS) else FILE_LINES


@pytest.fixture(scope="module")
def found():
    return shape(ROOT)


def _over(rows: list[tuple[int, str]], limit_of, exceptions: dict[str, tuple[int, str]]) -> list[str]:
    """The rows over their limit and not excepted, or over their exception's ceiling."""
    bad = []
    for size, name in rows:
        ceiling = exceptions.get(name, (limit_of(name), ""))[0]
        if size > ceiling:
            why = "its listed ceiling" if name in exceptions else "the limit"
            bad.append(f"{name}: {size} > {ceiling} ({why})")
    return bad


def test_files_stay_within_their_limit(found):
    bad = _over(found["files"], _file_limit, FILES)
    assert not bad, f"files over their line limit (split them by what they do): {bad}"


def test_functions_stay_within_80_lines(found):
    bad = _over(found["functions"], lambda _: FUNCTION_LINES, FUNCTIONS)
    assert not bad, f"functions over {FUNCTION_LINES} lines (give a part its own function): {bad}"


def test_classes_stay_within_30_methods(found):
    rows = [(methods, name) for _, methods, name in found["classes"]]
    bad = _over(rows, lambda _: CLASS_METHODS, CLASSES)
    assert not bad, f"classes over {CLASS_METHODS} methods (move a concern to an object of its own): {bad}"


def test_every_exception_is_still_needed(found):
    """An exception whose file, function or class is back within its limit (or gone) leaves the
    list: the list says what is over today, not what once was."""
    sizes = {name: size for size, name in found["files"]}
    sizes.update({name: size for size, name in found["functions"]})
    methods = {name: m for _, m, name in found["classes"]}
    stale = [f for f in FILES if sizes.get(f, 0) <= _file_limit(f)]
    stale += [f for f in FUNCTIONS if sizes.get(f, 0) <= FUNCTION_LINES]
    stale += [c for c in CLASSES if methods.get(c, 0) <= CLASS_METHODS]
    assert not stale, f"listed exceptions now within their limits (take them off the list): {stale}"
    assert all(reason for _, reason in [*FILES.values(), *FUNCTIONS.values(), *CLASSES.values()])


def test_no_import_circle_through_type_hints():
    known, edges = all_edges(ROOT)
    found = {tuple(c) for c in circles(known, edges, type_checking=True)}
    new = found - set(TYPE_HINT_CIRCLES)
    assert not new, f"import circles (type hints included): {sorted(new)}; import one side's names from a lower module"
    stale = set(TYPE_HINT_CIRCLES) - found
    assert not stale, f"listed circles that are gone (take them off the list): {sorted(stale)}"


def _house_text() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("textrl", "benchmarks"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".yaml", ".json")
                        and "__pycache__" not in p.parts)
    return files


def test_no_issue_numbers_in_the_product_benchmarks_or_docs():
    hits = []
    for path in _house_text():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if ISSUE_NUMBER.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:80]}")
    assert not hits, f"issue numbers (say what is meant, or link the doc that says it): {hits}"


@pytest.mark.parametrize("line, flagged", [
    ("the traps of issue 42", True), ("(issue #7)", True), ("as in the issue's measurement", True),
    ("issues 49", True), ("a known issue with the cache", False), ("tissue 4", False),
])
def test_the_issue_pattern_flags_numbers_not_the_word(line, flagged):
    assert bool(ISSUE_NUMBER.search(line)) is flagged
