"""KVCachePolicy uses transformers' Cache API: no deprecation warning, the same actions as a full
recompute (tests/envs/test_policies.py holds the rest of its behaviour)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from tensordict import TensorDict

from textrl.envs import KVCachePolicy
from textrl.models import build_tiny_causal_lm, build_tiny_gpt2, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _observation(tok, steps: int) -> TensorDict:
    enc = tok(["What is 1+2?", "hi"], return_tensors="pt", padding=True)
    b = enc["input_ids"].shape[0]
    return TensorDict({"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"],
                       "response_ids": torch.zeros(b, steps, dtype=torch.long),
                       "response_length": torch.zeros(b, dtype=torch.long)}, [b])


def _roll(policy: KVCachePolicy, td: TensorDict, steps: int) -> torch.Tensor:
    """``steps`` greedy steps, each appending the action; the actions ``[B, steps]``."""
    for step in range(steps):
        policy(td)
        td["response_ids"][:, step] = td["action"]
        td["response_length"] += 1
    return td["response_ids"].clone()


@pytest.mark.parametrize("build", [build_tiny_causal_lm, build_tiny_gpt2], ids=["llama", "gpt2"])
def test_no_past_key_values_deprecation_warning(tok, build, caplog):
    model = build(tok, seed=0).eval()
    policy = KVCachePolicy(model)
    td = _observation(tok, 4)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error")  # a FutureWarning / DeprecationWarning fails the test
        actions = _roll(policy, td, 4)
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()], caplog.text
    assert policy.n_prefill == 1 and policy.n_incremental == 3 and policy.n_fallback == 0
    expected = _observation(tok, 4)  # the same greedy actions, each step recomputed from scratch
    for step in range(4):
        fresh = KVCachePolicy(model)
        fresh(expected)
        expected["response_ids"][:, step] = expected["action"]
        expected["response_length"] += 1
    torch.testing.assert_close(actions, expected["response_ids"], rtol=0, atol=0)
