"""docs/design.md, "Layers": imports point one way.

``agents``, ``envs`` and ``rewards`` may import ``textrl``; inside ``textrl`` only the
orchestration modules (the trainer, the command line and the pipeline stages) may import them;
``textrl.functional`` imports only torch (and itself). Lazy imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = {"agents", "envs", "rewards"}
ORCHESTRATION = {"textrl/training/trainer.py", "textrl/training/records.py", "textrl/training/async_training.py",
                 "textrl/training/rollout_sources.py", "textrl/training/ppo_run.py", "textrl/training/set_up.py",
                 "textrl/training/run_checks.py", "textrl/cli.py", "textrl/bench/plan.py", "textrl/bench/compare.py"}
ORCHESTRATION_DIRS = ("textrl/stages/",)


def imported_modules(path: Path) -> set[str]:
    """Every module named by ``import x`` / ``from x import y`` in a file (absolute only)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            if node.module == "textrl":  # from textrl import envs
                names.update(f"textrl.{alias.name}" for alias in node.names)
    return names


def imported_roots(path: Path) -> set[str]:
    """Top-level package of every import, with ``textrl.envs`` / ``.agents`` / ``.rewards``
    named as the product package they are (``envs``, ``agents``, ``rewards``)."""
    roots = set()
    for name in imported_modules(path):
        parts = name.split(".")
        if parts[0] == "textrl" and len(parts) > 1 and parts[1] in PRODUCT_PACKAGES:
            roots.add(parts[1])
        else:
            roots.add(parts[0])
    return roots


def textrl_files() -> list[Path]:
    """textrl's core: its files outside the product packages (textrl/envs, textrl/agents,
    textrl/rewards)."""
    return sorted(p for p in (ROOT / "textrl").rglob("*.py")
                  if p.relative_to(ROOT / "textrl").parts[0] not in PRODUCT_PACKAGES)


def python_files() -> list[Path]:
    return sorted(p for folder in ("textrl", "tests", "benchmarks") for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_top_level_envs_agents_or_rewards_import(path):
    """The product installs one top-level name, ``textrl``: ``envs`` is a PyPI package of its own
    and a user's ``envs/`` folder would shadow ours, so nothing imports the bare names."""
    bare = {name.split(".")[0] for name in imported_modules(path)} & PRODUCT_PACKAGES
    assert not bare, f"{path.relative_to(ROOT)} imports {sorted(bare)}; import textrl.{sorted(bare)[0]} instead"


@pytest.mark.parametrize("path", textrl_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_textrl_core_imports_no_agent_env_or_reward(path):
    rel = path.relative_to(ROOT).as_posix()
    if rel in ORCHESTRATION or rel.startswith(ORCHESTRATION_DIRS):
        return
    bad = imported_roots(path) & PRODUCT_PACKAGES
    assert not bad, (
        f"{rel} imports {sorted(bad)}: textrl's core knows no specific agent, env or reward "
        "(docs/design.md, 'Layers'); take the object as an argument or move the code to the orchestration"
    )


@pytest.mark.parametrize("path", sorted((ROOT / "textrl" / "agents").rglob("*.py")), ids=lambda p: p.name)
def test_agents_import_no_environment_code(path):
    """The trainer hands an agent what it reads of the environment (``textrl.core.env_facts.EnvFacts``):
    nothing under ``textrl/agents/`` imports ``textrl.envs``, imports inside functions included."""
    bad = sorted(name for name in imported_modules(path) if name == "textrl.envs" or name.startswith("textrl.envs."))
    assert not bad, (f"textrl/agents/{path.name} imports {bad}: take what the environment gives from "
                     "textrl.core.env_facts (the trainer hands it over)")


@pytest.mark.parametrize(
    "path", sorted((ROOT / "textrl" / "functional").rglob("*.py")), ids=lambda p: p.name
)
def test_functional_imports_only_torch(path):
    allowed = {"torch", "textrl", "__future__", "math", "typing", "collections", "functools"}
    extra = imported_roots(path) - allowed
    assert not extra, f"textrl/functional/{path.name} imports {sorted(extra)}; it may import only torch"


def test_docs_cited_by_the_code_exist():
    """Docstrings cite design documents inside the repository only (files under docs/)."""
    import re

    cited = set()
    for path in python_files():
        text = path.read_text()
        outside = "DESIGN" + ".md"  # spelled in two parts so that this file does not cite it
        assert outside not in text, f"{path.relative_to(ROOT)} cites {outside}, which is not in the repository"
        cited.update(re.findall(r"docs/[\w-]+\.md", text))
    missing = sorted(c for c in cited if not (ROOT / c).is_file())
    assert not missing, f"cited but missing: {missing}"
