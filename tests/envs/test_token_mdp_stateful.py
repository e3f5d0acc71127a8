"""A hypothesis state machine drives ``textrl/TokenMDP-v0`` with valid and invalid actions,
resets and seeds, and checks after every rule that the env's state is what a model predicts:
invalid input raises a clear error and changes nothing, a step after the end raises, and a
reset with the same seed reproduces the same episode start."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import ResetNeeded
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from textrl import envs  # registers textrl/TokenMDP-v0
from textrl.envs.fast_path import default_tokenizer

MAX_NEW_TOKENS = 4
PROMPTS = ["What is 1+2?", "hi", {"prompt": "Count to 3", "answer": "3"}]
BAD_ACTIONS = st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=len(default_tokenizer())),
    st.floats(allow_nan=True),
    st.booleans(),
    st.text(max_size=3),
    st.none(),
    st.just(np.array([1, 2])),
)


class TokenMDPMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.env = gym.make(envs.ENV_ID, prompts=PROMPTS, max_new_tokens=MAX_NEW_TOKENS).unwrapped
        self.vocab = self.env.action_space.n
        self.eos = self.env.eos_token_ids
        self.started = False  # model of the env: reset yet? the actions so far, the end
        self.actions: list[int] = []
        self.done = False
        self.seen: dict[int, dict[str, np.ndarray]] = {}  # seed -> first observation

    def _snapshot(self):
        env = self.env
        return (env._prompt_ids.copy(), env._response.copy(), env._length, env._done, env._prompt_index)

    @rule(seed=st.one_of(st.none(), st.integers(0, 3)))
    def reset(self, seed):
        obs, info = self.env.reset(seed=seed)
        if seed is not None:
            first = self.seen.setdefault(seed, obs)
            assert all(np.array_equal(first[k], obs[k]) for k in obs), f"reset(seed={seed}) differs"
        assert 0 <= info["prompt_index"] < len(PROMPTS)
        self.started, self.actions, self.done = True, [], False

    @rule(index=st.integers(-2, len(PROMPTS) + 1))
    def reset_to_prompt(self, index):
        before = self._snapshot()
        if 0 <= index < len(PROMPTS):
            _, info = self.env.reset(options={"prompt_index": index})
            assert info["prompt_index"] == index
            self.started, self.actions, self.done = True, [], False
        else:
            with pytest.raises(ValueError, match=f"prompt_index={index} is out of range for 3 prompts"):
                self.env.reset(options={"prompt_index": index})
            after = self._snapshot()
            assert all(np.array_equal(a, b) for a, b in zip(before, after))

    @precondition(lambda self: self.started and not self.done)
    @rule(token=st.integers(0, len(default_tokenizer()) - 1), eos=st.booleans())
    def step_valid(self, token, eos):
        action = self.eos[0] if eos else token
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.actions.append(action)
        assert terminated == (action in self.eos)
        assert truncated == (not terminated and len(self.actions) == MAX_NEW_TOKENS)
        self.done = terminated or truncated
        if self.done:
            assert np.isfinite(reward) and info["response_length"] == len(self.actions)
        else:
            assert reward == 0.0 and info == {}

    @rule(action=BAD_ACTIONS)
    def step_invalid(self, action):
        before = self._snapshot()
        if not self.started or self.done:
            with pytest.raises(ResetNeeded, match="call reset"):
                self.env.step(action)
        else:
            with pytest.raises(ValueError, match=rf"vocab_size={self.vocab}"):
                self.env.step(action)
        after = self._snapshot()
        assert all(np.array_equal(a, b) for a, b in zip(before, after)), "a rejected step changed the env"

    @precondition(lambda self: self.done)
    @rule()
    def step_after_end(self):
        with pytest.raises(ResetNeeded, match="after the episode ended"):
            self.env.step(0)

    @invariant()
    def state_matches_the_model(self):
        if not self.started:
            return
        env, n = self.env, len(self.actions)
        obs = env._observation()
        assert env.observation_space.contains(obs)
        assert obs["response_length"] == n
        assert obs["response_ids"][:n].tolist() == self.actions
        assert (obs["response_ids"][n:] == env.pad_token_id).all()
        assert env._done == self.done
        assert obs["prompt_mask"].sum() > 0 and (obs["prompt_ids"][obs["prompt_mask"] == 0] == env.pad_token_id).all()


TokenMDPMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_token_mdp_state_machine = TokenMDPMachine.TestCase
