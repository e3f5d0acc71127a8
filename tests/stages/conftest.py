"""Shared set-up of the stage tests: one tiny-model cache and one briefly fine-tuned SFT model."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def _one_thread():
    """One torch thread: the tiny models gain nothing from two, and when another process keeps
    the second core of a 2-core machine busy, two threads made these tests 8x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="package", autouse=True)
def _tiny_cache(tmp_path_factory):
    """Build the tiny models once for the package, in a private cache."""
    old = os.environ.get("TEXTRL_CACHE")
    os.environ["TEXTRL_CACHE"] = str(tmp_path_factory.mktemp("textrl-cache"))
    yield
    if old is None:
        os.environ.pop("TEXTRL_CACHE", None)
    else:
        os.environ["TEXTRL_CACHE"] = old


@pytest.fixture(scope="package")
def sft_model(tmp_path_factory) -> str:
    """The tiny model after 150 SFT steps on builtin:case (it writes the task's language)."""
    from textrl.stages.sft import SFTConfig, train_sft

    out = tmp_path_factory.mktemp("sft")
    summary = train_sft(SFTConfig(output_dir=str(out), steps=150, eval_size=16, eval_every=0,
                                  progress=False))
    return summary["model"]
