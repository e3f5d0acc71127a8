"""Shared by the engine tests: the tiny tokenizer, the two model families every engine is held to
``hf`` on (a Llama and a GPT-2), and left padding as the multi-turn runner pads a turn's contexts."""

from __future__ import annotations

import pytest
import torch

from textrl.models import build_tiny_causal_lm, build_tiny_gpt2, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module", params=[build_tiny_causal_lm, build_tiny_gpt2], ids=["llama", "gpt2"])
def model(request, tok):
    return request.param(tok).eval()


def left_pad(tok, seqs):
    """Token lists -> ``(ids, mask)`` ``[B, max len]``, left-padded with ``tok.pad_token_id``."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    return ids, mask
