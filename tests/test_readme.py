"""The README's two set-up commands stay true: CI runs the README's test command verbatim."""

from __future__ import annotations

import re
from pathlib import Path

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


def test_readme_python_examples_run(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path))
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
