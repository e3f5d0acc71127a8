"""TokenMDPEnv: Gymnasium conformance, seeding, equality with the fast path, bad inputs."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.error import ResetNeeded
from gymnasium.utils.env_checker import check_env

from tests.envs.test_fast_path import EOS, draw_responses, pad_eq_eos_tokenizer, prompt_batch
from textrl import envs
from textrl.envs import TokenMDPEnv, rollout_from_responses
from textrl.envs.fast_path import default_tokenizer
from textrl.keys import KEYS
from textrl.rewards import RewardError


def test_check_env_passes_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(TokenMDPEnv())
        check_env(TokenMDPEnv(render_mode="ansi", max_new_tokens=3))
        check_env(gym.make(envs.ENV_ID, max_new_tokens=3).unwrapped)


def test_gym_make_with_no_arguments():
    assert envs.ENV_ID in gym.registry
    envs.register()  # idempotent
    env = gym.make("textrl/TokenMDP-v0")
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    assert env.action_space.n == len(env.unwrapped.tokenizer)


def test_seeded_reset_is_deterministic():
    a, b = TokenMDPEnv(), TokenMDPEnv()
    for seed in (0, 1, 123):
        (oa, ia), (ob, ib) = a.reset(seed=seed), b.reset(seed=seed)
        assert ia == ib
        assert all(np.array_equal(oa[k], ob[k]) for k in oa)
    drawn = {a.reset(seed=s)[1]["prompt_index"] for s in range(20)}
    assert len(drawn) > 1


def _step_rows(env: TokenMDPEnv, responses: torch.Tensor):
    """Step the env through each row's valid tokens; per-step rewards, flags, final infos."""
    b, t = responses.shape
    rewards = torch.zeros(b, t)
    term = torch.zeros(b, t, dtype=torch.bool)
    trunc = torch.zeros(b, t, dtype=torch.bool)
    infos = []
    for i in range(b):
        env.reset(options={"prompt_index": i})
        for j in range(t):
            _, r, te, tr, info = env.step(int(responses[i, j]))
            rewards[i, j], term[i, j], trunc[i, j] = r, te, tr
            if te or tr:
                infos.append(info)
                break
        else:
            raise AssertionError(f"row {i} never ended")
    return rewards, term, trunc, infos


@pytest.mark.parametrize("pad_is_eos", [False, True])
@pytest.mark.parametrize("placement", ["last", "uniform"])
def test_stepping_equals_fast_path(pad_is_eos, placement):
    tok = pad_eq_eos_tokenizer() if pad_is_eos else default_tokenizer()
    t = 6
    env = TokenMDPEnv(tokenizer=tok, max_new_tokens=t, reward_placement=placement)
    responses = draw_responses(torch.Generator().manual_seed(7), 10, t, tok.pad_token_id)
    rewards, term, trunc, infos = _step_rows(env, responses)
    ids, mask, texts, fields = prompt_batch(env.prompts, list(range(10)), tok.pad_token_id)
    kwargs = dict(tokenizer=tok, reward_fn=env.reward_fn, eos_token_id=EOS, max_new_tokens=t)
    fast = rollout_from_responses(
        ids,
        mask,
        responses,
        pad_token_id=tok.pad_token_id,
        fields=fields,
        prompt_texts=texts,
        reward_placement=placement,
        **kwargs,
    )
    valid = fast[KEYS.mask]
    assert torch.equal(term | trunc, fast[KEYS.done].squeeze(-1))
    assert torch.equal(term, fast[KEYS.terminated].squeeze(-1))
    assert torch.equal(trunc, fast[KEYS.truncated].squeeze(-1))
    per_token = torch.from_numpy(np.stack([i["per_token_rewards"] for i in infos]))
    assert torch.equal(per_token, fast[KEYS.reward].squeeze(-1))
    assert torch.equal(rewards.sum(1), per_token.sum(1)) or torch.allclose(
        rewards.sum(1), per_token.sum(1)
    )
    assert (rewards[valid & ~(term | trunc)] == 0).all()  # paid on the final step only
    for name, score in fast[KEYS.reward_components].items():
        assert [i["reward_components"][name] for i in infos] == score.tolist()
    # the observation arrays of the env hold exactly the fast path's prompt layout
    obs, _ = env.reset(options={"prompt_index": 3})
    assert np.array_equal(obs["prompt_ids"], ids[3].numpy())
    assert np.array_equal(obs["prompt_mask"].astype(bool), mask[3].numpy())


def test_sync_vector_env():
    vec = gym.vector.SyncVectorEnv(
        [lambda: gym.make("textrl/TokenMDP-v0", max_new_tokens=3) for _ in range(2)]
    )
    vec.reset(seed=0)
    vec.action_space.seed(0)
    finished = 0
    for _ in range(8):
        obs, reward, term, trunc, _ = vec.step(vec.action_space.sample())
        assert obs["response_ids"].shape == (2, 3) and reward.shape == (2,)
        finished += int((term | trunc).sum())
    assert finished >= 2
    vec.close()


def test_episode_info_and_ansi_render():
    env = TokenMDPEnv(render_mode="ansi", max_new_tokens=4)
    env.reset(seed=0, options={"prompt": {"prompt": "say hi", "answer": "1"}})
    env.step(508)
    assert "say hi" in env.render()
    *_, info = env.step(EOS)
    assert set(info["reward_components"]) == {"think_format", "tag_count"}
    assert info["prompt"] == "say hi" and info["response"] == "<think>"
    text = env.render()
    assert isinstance(text, str) and "score:" in text
    assert TokenMDPEnv().render() is None


@pytest.mark.parametrize("action", [512, -1, 1.5, "a", True, np.array([1, 2])])
def test_bad_action_names_action_and_vocab(action):
    env = TokenMDPEnv()
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"action .* 512"):
        env.step(action)


def test_step_needs_reset():
    env = TokenMDPEnv(max_new_tokens=2)
    with pytest.raises(ResetNeeded, match=r"reset\(\)"):
        env.step(5)
    env.reset(seed=0)
    env.step(EOS)
    with pytest.raises(ResetNeeded, match=r"call reset\(\)"):
        env.step(5)


def test_empty_prompt_names_its_index():
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        TokenMDPEnv(prompts=["hello", "  "])


def test_long_prompt_raises_or_truncates_left():
    long = " ".join(["word"] * 200)
    env = TokenMDPEnv(prompts=[long])
    with pytest.raises(ValueError, match=r"prompt 0 has \d+ tokens > max_prompt_length=64"):
        env.reset(seed=0)
    env = TokenMDPEnv(prompts=[long], truncate_prompt="left")
    with pytest.warns(UserWarning, match="keeping its last 64"):
        obs, _ = env.reset(seed=0)
    assert obs["prompt_mask"].all()


def _nan(prompts, completions, **kwargs):
    return torch.full((len(completions),), float("nan"))


def _wrong_shape(prompts, completions, **kwargs):
    return torch.zeros(len(completions), 2)


def _raises(prompts, completions, **kwargs):
    raise KeyError("missing")


@pytest.mark.parametrize("fn", [_nan, _wrong_shape, _raises])
def test_bad_reward_raises_reward_error_naming_it(fn):
    env = TokenMDPEnv(reward=fn, max_new_tokens=2)
    env.reset(seed=0)
    with pytest.raises(RewardError, match=fn.__name__):
        env.step(EOS)
