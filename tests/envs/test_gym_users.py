"""What a Gymnasium user meets: making the ids in a fresh interpreter, the registry's ids, a
``max_episode_steps`` cut that is scored like the env's own caps, and ``import textrl.envs``
leaving the multiprocessing start method alone (``AsyncVectorEnv`` scripts without a
``__main__`` guard)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from tests.envs.test_token_env_multiturn import EOS, A, Echo, Z, count_a
from textrl.envs import ENV_ID, TimeLimitCap, TokenMDPEnv
from textrl.envs.gym_ids import register
from textrl.envs.registry import ENVS, gym_id, register_env


def python(code: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (this venv's), with one thread."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})


@pytest.mark.slow
def test_fresh_interpreter_makes_the_id_by_naming_the_module():
    # Gymnasium >= 1.0 dropped plugin entry points: the id names the module that registers it
    out = python("""
        import sys, gymnasium as gym
        assert "textrl" not in sys.modules
        env = gym.make("textrl.envs:textrl/TokenMDP-v0", max_new_tokens=2)
        obs, _ = env.reset(seed=0)
        *_, info = env.step(3)
        print(sorted(info))
        env = gym.make("textrl.envs:textrl/GuessNumber-v0", max_episode_steps=2)  # a built-in environment
        env.reset(seed=0)
        env.step(52)
        *_, truncated, info = env.step(52)
        print(truncated, info["end_reason"])
    """)
    assert out.returncode == 0, out.stderr
    assert "'score'" in out.stdout and "'end_reason'" in out.stdout
    assert out.stdout.splitlines()[-1] == "True length"


@pytest.fixture
def echo_id():
    """A registry id for :class:`Echo` (and its Gymnasium id), removed afterwards."""
    register_env("echo-gym-test", overwrite=True)(lambda: Echo(reward=count_a))
    yield gym_id("echo-gym-test")
    del ENVS["echo-gym-test"]
    gym.registry.pop(gym_id("echo-gym-test"), None)


def test_a_registered_environment_is_a_gymnasium_id(echo_id):
    assert echo_id == "textrl/EchoGymTest-v0"
    env = gym.make(echo_id, max_new_tokens=4)
    assert isinstance(env.unwrapped.task, Echo)
    env.reset(seed=0, options={"prompt_index": 0})
    _, reward, *_ , info = env.step(A)
    _, reward, terminated, truncated, info = env.step(EOS)
    assert (reward, terminated, truncated, info) == (1.0, False, False, {"turn": 1, "turn_reward": 1.0})
    register()  # idempotent, and every textrl id carries TimeLimitCap
    assert all(TimeLimitCap.__name__ in [w.name for w in gym.spec(i).additional_wrappers] for i in (ENV_ID, echo_id))


def step_tokens(env, tokens):
    env.reset(options={"prompt_index": 0})
    return [env.step(t) for t in tokens]


@pytest.mark.parametrize("cap", [1, 5])
def test_max_episode_steps_is_scored_like_the_env_cap(cap):
    env = gym.make(ENV_ID, max_episode_steps=cap, max_new_tokens=32)
    assert env.spec.max_episode_steps == cap
    steps = step_tokens(env, [508] + [Z] * (cap - 1))
    own = step_tokens(TokenMDPEnv(max_new_tokens=cap), [508] + [Z] * (cap - 1))
    (_, reward, terminated, truncated, info), (_, own_reward, *_, own_info) = steps[-1], own[-1]
    assert (terminated, truncated, info["end_reason"]) == (False, True, "length")
    assert reward == info["score"] == own_reward == own_info["score"]
    assert info["reward_components"] == own_info["reward_components"]
    assert np.array_equal(info["per_token_rewards"][:cap], own_info["per_token_rewards"])
    assert not info["per_token_rewards"][cap:].any()
    assert all(s[4] == {} and s[1] == 0.0 for s in steps[:-1])
    # the next episode is capped again; without a limit the episode goes on
    assert step_tokens(env, [Z] * cap)[-1][3]
    assert not any(s[3] for s in step_tokens(gym.make(ENV_ID, max_new_tokens=32), [Z] * (cap + 1)))


def test_max_episode_steps_caps_a_multi_turn_episode():
    env = gym.make(ENV_ID, env=Echo(reward=count_a), max_episode_steps=3, max_new_tokens=4)
    steps = step_tokens(env, [A, EOS, A])
    _, reward, terminated, truncated, info = steps[-1]
    assert (terminated, truncated, info["end_reason"], info["turns"]) == (False, True, "length", 2)
    assert reward == info["per_token_rewards"][info["response_length"] - 1] and info["score"] == 1.0 + 2.0
    # a step cap at the end of an answered turn ends the episode before the observation
    steps = step_tokens(gym.make(ENV_ID, env=Echo(reward=count_a), max_episode_steps=2, max_new_tokens=4), [A, EOS])
    _, reward, _, truncated, info = steps[-1]
    assert truncated and info["response_length"] == 2 and reward == 1.0 + 1.0


def test_check_env_and_vector_env_on_a_multi_turn_environment():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(TokenMDPEnv(env=Echo(), max_new_tokens=3))
    vec = gym.vector.SyncVectorEnv([lambda: gym.make(ENV_ID, env=Echo(), max_new_tokens=3) for _ in range(2)])
    obs, _ = vec.reset(seed=0)
    assert obs["response_ids"].shape == (2, 3 * 3 + 2 * 16) and obs["agent_mask"].shape == (2, 41)
    for _ in range(8):
        obs, reward, *_ = vec.step(np.array([EOS, A]))
    vec.close()


START_METHOD = """
    import multiprocessing as mp
    {preset}
    import textrl.envs
    after_envs = mp.get_start_method(allow_none=True)
    from textrl.envs import TextGenEnv  # imports TorchRL
    print(after_envs, mp.get_start_method(allow_none=True))
"""


@pytest.mark.slow
@pytest.mark.parametrize("preset, expected", [("", "None None"), ("mp.set_start_method('forkserver')", "forkserver forkserver")])
def test_importing_textrl_envs_leaves_the_start_method(preset, expected):
    out = python(START_METHOD.format(preset=preset))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == expected.split()


@pytest.mark.slow
def test_async_vector_env_script_without_main_guard(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import gymnasium as gym
        import textrl.envs
        from textrl.envs import TextGenEnv  # TorchRL too

        vec = gym.vector.AsyncVectorEnv([lambda: gym.make("textrl/TokenMDP-v0", max_new_tokens=2)] * 2)
        vec.reset(seed=0)
        obs, reward, terminated, truncated, info = vec.step([3, 3])
        vec.close()
        print("finished", terminated.tolist())
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "finished [True, True]" in out.stdout
