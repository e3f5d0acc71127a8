"""Shared by the engine tests: the tiny tokenizer, the two model families every engine is held to
``hf`` on (a Llama and a GPT-2)."""

from __future__ import annotations

import pytest

from textrl.models import build_tiny_causal_lm, build_tiny_gpt2, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module", params=[build_tiny_causal_lm, build_tiny_gpt2], ids=["llama", "gpt2"])
def model(request, tok):
    return request.param(tok).eval()
