"""The README's two set-up commands stay true: CI runs the README's test command verbatim. The
Python examples of the README and of the docs it points to run, and every relative link of the
README and docs/*.md points to a file (and a heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [c.strip() for c in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readme_test_command():
    commands = _readme_commands()
    test_commands = [c for c in commands if "pytest" in c]
    assert len(test_commands) == 1
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_commands[0] in ci


def test_both_commands_install_the_cpu_torch_first():
    commands = [c for c in _readme_commands() if c.startswith("python3 -m venv")]
    assert len(commands) == 2
    assert commands[0].endswith("textrl train") and commands[1].endswith("pytest -q")
    for command in commands:
        assert command.index("torch==2.13.0") < command.index("pip install -q -e")


EXAMPLE_PAGES = ["README.md", "docs/environments.md", "docs/rewards.md", "docs/testing.md", "docs/pipeline.md"]
"""The pages whose ```python blocks are whole, runnable examples (moved out of the README)."""


@pytest.mark.parametrize("page", EXAMPLE_PAGES)
def test_python_examples_run(tmp_path, monkeypatch, page):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # what an example writes (a run folder) goes there
    text = (ROOT / page).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, page, "exec"), {})


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to what does not exist: {broken}"
