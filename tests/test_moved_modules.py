"""Former import paths keep working (``textrl.core.moved``), and textrl's own code uses present ones."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from textrl.core.moved import MOVED

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("former", sorted(MOVED))
def test_a_former_path_is_the_present_module_and_says_where_it_went(former):
    present = importlib.import_module(MOVED[former])
    sys.modules.pop(former, None)  # an earlier test may have imported the former path already
    with pytest.warns(DeprecationWarning, match=re.escape(f"{former} moved to {MOVED[former]}")):
        module = importlib.import_module(former)
    assert module is present
    assert module.__spec__.name == MOVED[former]  # the present module keeps its own spec
    assert module.__name__ == MOVED[former]


def test_from_imports_of_former_names_work_in_a_fresh_process():
    """``from textrl import trainer`` and a name from a former module path, as user code wrote them."""
    code = ("import warnings; warnings.simplefilter('error')\n"
            "with warnings.catch_warnings():\n"
            "    warnings.simplefilter('ignore', DeprecationWarning)\n"
            "    from textrl import trainer\n"
            "    from textrl.checks import check_rollout\n"
            "    from textrl.envs.prompt_sampler import PromptSampler\n"
            "    from textrl.precision import Precision\n"
            "import textrl.training.trainer, textrl.core.checks, textrl.envs.prompts.sampler, textrl.core.precision\n"
            "assert trainer is textrl.training.trainer\n"
            "assert check_rollout is textrl.core.checks.check_rollout\n"
            "assert PromptSampler is textrl.envs.prompts.sampler.PromptSampler\n"
            "assert Precision is textrl.core.precision.Precision\n"
            "from textrl import train, TrainConfig\n"
            "assert callable(train) and TrainConfig.__name__ == 'TrainConfig'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr


def test_an_unknown_module_is_still_missing():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("textrl.no_such_module")


def test_each_present_path_exists_and_no_former_path_is_a_file():
    for former, present in MOVED.items():
        assert importlib.util.find_spec(present) is not None, present
        assert not (ROOT / (former.replace(".", "/") + ".py")).exists(), f"{former} is both moved and present"


def test_textrl_benchmarks_tests_and_docs_name_present_paths_only():
    """A former path in our own code or docs would hide a move from the next reader (the table of
    :mod:`textrl.core.moved` itself and this test are the only places that name them)."""
    pattern = re.compile(r"(?<![\w.])(" + "|".join(re.escape(name) for name in MOVED) + r")(?![\w])")
    own = {ROOT / "textrl" / "core" / "moved.py", Path(__file__).resolve()}
    found = []
    for folder in ("textrl", "benchmarks", "tests", "docs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".md") or path in own:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    readme = ROOT / "README.md"
    found += [f"README.md:{n}: {line.strip()[:100]}" for n, line in enumerate(readme.read_text().splitlines(), 1)
              if pattern.search(line)]
    assert not found, "former module paths (use the present one, textrl/core/moved.py):\n" + "\n".join(found)
