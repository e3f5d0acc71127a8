"""The limits the house keeps (docs/design.md, "Layers"): a newcomer reads a function in one screen,
a class's methods in one list, a file in one sitting.

- a function or method: at most 80 lines;
- a class: at most 30 methods;
- a file in ``textrl/``: at most 600 lines, 400 in the rooms a newcomer opens first (``agents/``,
  ``generation/``, ``envs/``);
- at most 10 functions that take the whole agent (:data:`TAKES_AGENT`, each with its reason): the
  others take the parts they read;
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
    "textrl/agents/update.py": (484, "the update: epochs, minibatches, the loss's checks and the update's metrics"),
    "textrl/agents/base.py": (514, "PPOAgent: the agent every estimator shares"),
}
"""File -> (lines it may have, why it is over its limit)."""

FUNCTIONS: dict[str, tuple[int, str]] = {
}
"""``path:name`` -> (lines it may have, why it is over :data:`FUNCTION_LINES`)."""

CLASSES: dict[str, tuple[int, str]] = {}
"""``path:name`` -> (methods it may have, why it is over :data:`CLASS_METHODS`)."""

TYPE_HINT_CIRCLES: dict[tuple[str, ...], str] = {}
"""Circles through ``TYPE_CHECKING`` imports only -> why each is kept."""

TAKES_AGENT: dict[str, str] = {
    "textrl/run/rollout.py:collect": "the rollout's entry point: it drives a duck-typed agent's act / rollout and "
                                     "process_rollout (tests hand it scripted agents)",
    "textrl/run/rollout.py:evaluate_prompts": "the held-out evaluation's entry point, over the same duck-typed agent",
    "textrl/run/rollout.py:run_episodes": "the episodes' sampler: a duck-typed agent's rollout() or act(), its device "
                                          "and its backend's processes",
    "textrl/training/ppo_run.py:evaluate": "the trainer's evaluation of the agent it trains (through evaluate_prompts)",
    "textrl/training/ppo_run.py:sample_completions": "the trainer's sample of the agent's answers (through run_episodes)",
    "textrl/agents/forwards.py:forward_policy": "a loss's public call, forward_policy(self, mb): reads only the "
                                                "learner (an agent's or the learner itself)",
    "textrl/agents/forwards.py:forward_values": "a loss's public call, forward_values(self, mb), as forward_policy",
    "textrl/agents/teacher.py:token_rewards": "an estimator's public call, token_rewards(self, td): the agent's "
                                              "task_token_rewards hook (a subclass's, e.g. DAPO's) plus the teacher's",
    "textrl/agents/build.py:build_actor": "the actor of an agent: its models, forwards, backend, facts, teacher and its "
                                          "behaviour_logprobs hook, once per backend and device",
    "textrl/agents/build.py:task_reward": "the run's reward joined with the agent's own reward model, placed in its "
                                          "precision (the trainer and the tests call it with the agent)",
}
"""``path:name`` of a function that takes the whole agent -> why (what it reads of the agent is most of it, or
it is a public call an agent's hook makes with ``self``). Any other function takes what it uses:
the learner, the actor, the forwards, the config's values (``benchmarks/code_shape.py`` lists them)."""
TAKES_AGENT_LIMIT = 10

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


def test_functions_take_the_agents_parts_not_the_agent(found):
    """A function takes what it reads of an agent (its learner, actor, forwards, config values) or is a
    method of that object; the few that take the whole agent are listed, each with its reason."""
    takes = set(found["takes_agent"])
    new = sorted(takes - set(TAKES_AGENT))
    assert not new, (f"functions that take the whole agent: {new}; pass the parts they read (agent.learner, "
                     "agent.actor, agent.config values) or list them in TAKES_AGENT with the reason")
    stale = sorted(set(TAKES_AGENT) - takes)
    assert not stale, f"listed functions that no longer take the agent (take them off the list): {stale}"
    assert len(TAKES_AGENT) <= TAKES_AGENT_LIMIT and all(TAKES_AGENT.values())


@pytest.mark.parametrize("source, takes", [
    ("def f(agent, td): pass", True), ("def f(agent: Any) -> None: pass", True),
    ("def f(x: int, owner: 'PPOAgent') -> None: pass", True), ("def f(agent: str) -> str: pass", False),
    ("def f(cls: type[PPOAgent]) -> None: pass", False), ("def f(learner, td): pass", False),
    ("class C:\n    def m(self, agent): pass", False),
])
def test_the_takes_agent_count_reads_the_first_parameter_and_agent_annotations(tmp_path, source, takes):
    from benchmarks.code_shape import takes_agent

    (tmp_path / "textrl").mkdir()
    (tmp_path / "textrl" / "m.py").write_text("class PPOAgent: pass\n" + source + "\n")
    assert (takes_agent(tmp_path) == ["textrl/m.py:f"]) is takes


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
