"""KVCachePolicy: same actions as full recompute and ``generate``, one token per step, fallback."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.envs.utils import check_env_specs

from tests.envs.test_fast_path import EOS
from tests.envs.test_torchrl_env import NextTokenPolicy, greedy_generate
from textrl.envs import KVCachePolicy, TextGenEnv
from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer

KEYS_IN = ["prompt_ids", "prompt_mask", "response_ids", "response_length"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_causal_lm(tok, seed=0).eval()


@pytest.fixture(scope="module")
def ref_model(tok):
    """A bit-identical copy for the full-recompute reference, so hooks on ``model`` see only
    the cached policy's forwards."""
    return build_tiny_causal_lm(tok, seed=0).eval()


def full_policy(model):
    return TensorDictModule(NextTokenPolicy(model), in_keys=KEYS_IN, out_keys=["action"])


def record_input_shapes(model):
    shapes = []

    def hook(module, args, kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))

    return shapes, model.register_forward_pre_hook(hook, with_kwargs=True)


def test_greedy_rollout_equals_full_recompute_and_generate(tok, model, ref_model):
    b, t = 3, 5
    env = TextGenEnv(b, tokenizer=tok, max_new_tokens=t, seed=0)
    policy = KVCachePolicy(model)
    shapes, handle = record_input_shapes(model)
    try:
        td = env.reset(TensorDict({"prompt_index": torch.arange(b)}, [b]))
        for _ in range(t):
            expected = full_policy(ref_model)(td.clone())["action"]
            td = policy(td)
            assert torch.equal(td["action"], expected)
            td = env.step(td)["next"]
    finally:
        handle.remove()
    # one prefill of the prompts, then one token per row for every step
    p = env.max_prompt_length
    assert shapes[0] == (b, p)
    assert shapes[1:] and all(s == (b, 1) for s in shapes[1:])
    assert policy.n_prefill == 1 and policy.n_fallback == 0
    generated = greedy_generate(model, env, tok, b, t)
    assert torch.equal(td["response_ids"], generated)
    assert (td["response_ids"] != tok.pad_token_id).sum() > b


def test_env_rollout_matches_full_recompute_one_token_per_step(tok, model, ref_model):
    b, t = 3, 4
    policy = KVCachePolicy(model, return_log_prob=True)
    shapes, handle = record_input_shapes(model)
    try:
        cached = TextGenEnv(b, tokenizer=tok, max_new_tokens=t, seed=0).rollout(
            t, policy, break_when_any_done=False, break_when_all_done=True
        )
    finally:
        handle.remove()
    full = TextGenEnv(b, tokenizer=tok, max_new_tokens=t, seed=0).rollout(
        t, full_policy(ref_model), break_when_any_done=False, break_when_all_done=True
    )
    assert torch.equal(cached["action"], full["action"])
    assert torch.equal(cached["next", "response_ids"], full["next", "response_ids"])
    assert shapes[0][1] > 1 and all(s == (b, 1) for s in shapes[1:])
    assert len(shapes) <= cached.batch_size[1]  # no forward when no row advanced
    assert (cached["action_log_prob"] <= 0).all()


def test_finished_row_is_frozen_without_fallback(tok, model, ref_model):
    """A row ended early (EOS forced) keeps its logits; the others go on one token at a time."""
    b, t = 3, 5
    env = TextGenEnv(b, tokenizer=tok, max_new_tokens=t, seed=0)
    policy = KVCachePolicy(model)
    td = env.reset(TensorDict({"prompt_index": torch.arange(b)}, [b]))
    for j in range(t):
        expected = full_policy(ref_model)(td.clone())["action"]
        td = policy(td)
        assert torch.equal(td["action"], expected)
        if j == 0:
            td["action"] = torch.tensor([EOS, td["action"][1], td["action"][2]])
        td = env.step(td)["next"]
    assert policy.n_fallback == 0 and td["response_length"][0].item() == 1


def test_partial_reset_falls_back_and_still_matches(tok, model, ref_model):
    b, t = 3, 4
    env = TextGenEnv(b, tokenizer=tok, max_new_tokens=t, seed=0)
    policy = KVCachePolicy(model)
    shapes, handle = record_input_shapes(model)
    try:
        td = env.reset(TensorDict({"prompt_index": torch.arange(b)}, [b]))
        for j in range(6):
            if j == 2:  # reset row 1 mid-episode onto another prompt
                td["_reset"] = torch.tensor([False, True, False]).unsqueeze(-1)
                td["prompt_index"] = torch.tensor([0, 4, 0])
                td = env.reset(td)
                assert td["response_length"].flatten().tolist() == [2, 0, 2]
            expected = full_policy(ref_model)(td.clone())["action"]
            td = policy(td)
            assert torch.equal(td["action"], expected), j
            td = env.step(td)["next"]
    finally:
        handle.remove()
    assert policy.n_fallback == 1 and policy.n_prefill == 1
    assert shapes[2][1] > 1  # the fallback re-encodes prompt + response ...
    assert all(s == (b, 1) for s in shapes[3:])  # ... then single tokens again


def test_rollout_across_resets_matches_full_recompute(tok, model, ref_model):
    b, t, n = 3, 3, 10
    policy = KVCachePolicy(model)
    cached = TextGenEnv(b, tokenizer=tok, max_new_tokens=t, seed=1).rollout(
        n, policy, break_when_any_done=False
    )
    full = TextGenEnv(b, tokenizer=tok, max_new_tokens=t, seed=1).rollout(
        n, full_policy(ref_model), break_when_any_done=False
    )
    assert torch.equal(cached["action"], full["action"])
    assert policy.n_prefill >= 2  # every row was reset along the way and re-prefilled


def test_sampling_is_seeded_and_private(tok, model, ref_model):
    b, t = 3, 4

    def run(seed):
        env = TextGenEnv(b, tokenizer=tok, max_new_tokens=t, seed=0)
        return env.rollout(t, KVCachePolicy(model, temperature=1.0, seed=seed))["action"]

    torch.manual_seed(0)
    state = torch.get_rng_state()
    a, a2 = run(0), run(0)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, a2)
    assert any(not torch.equal(a, run(s)) for s in range(1, 4))


def test_check_env_specs_unaffected(tok, model, ref_model):
    env = TextGenEnv(3, tokenizer=tok, max_new_tokens=4, seed=0)
    policy = KVCachePolicy(model)
    td = env.rollout(4, policy)
    assert env.action_spec.is_in(td["action"][:, 0])
    policy.reset_cache()
    check_env_specs(env)
    check_env_specs(env, break_when_any_done="both")
