"""Shared by the engine tests: the tiny tokenizer, the two model families every engine is held to
``hf`` on (a Llama and a GPT-2), and the two vLLM servers of the tiny model that the served tests
(test_vllm_served.py, test_vllm_receive.py) share: started once for the session, as each start
takes 30-90 s."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from textrl.models import build_tiny_causal_lm, build_tiny_gpt2, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module", params=[build_tiny_causal_lm, build_tiny_gpt2], ids=["llama", "gpt2"])
def model(request, tok):
    return request.param(tok).eval()


@pytest.fixture(scope="session")
def served_folder(tmp_path_factory) -> Path:
    """The tiny model with heads of 32 (vLLM's CPU attention refuses 16) and its tokenizer."""
    path = tmp_path_factory.mktemp("model") / "tiny32"
    tok = build_tiny_tokenizer()
    build_tiny_causal_lm(tok, num_attention_heads=2).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def servers(served_folder, tmp_path_factory):
    """Two vLLM servers of ``served_folder`` on localhost, started at once, stopped after the session;
    each worker on a core of its own where there are two (vLLM binds every server's to the first).
    Each run pushes its weights and releases its claim at its end, so a test may follow any other."""
    from tests.generation.test_vllm_served import start_server, stop, wait_ready

    logs = tmp_path_factory.mktemp("servers")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    started = [start_server(served_folder, logs / f"server{i}.log", cores=str(cores[i]) if len(cores) > 1 else None)
               for i in range(2)]
    try:
        for i, (proc, url) in enumerate(started):
            wait_ready(proc, url, logs / f"server{i}.log")
        yield [url for _, url in started]
    finally:
        for proc, _ in started:
            stop(proc)
