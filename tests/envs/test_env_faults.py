"""Environment faults each come back as one line naming the environment, the row and the field:
a constructor that raises, Turn fields of the wrong type (a reward float32 cannot hold, ``done="no"``,
an ``int`` observation, a lone surrogate), attributes of the wrong type (``max_turns="3"``), a lone
surrogate in a prompt row; and a slow ``step()`` is named by the watchdog and cut by a timeout."""

from __future__ import annotations

import time

import pytest

from tests.envs.test_collector import scripted
from textrl.envs.collector import EpisodeRunner
from textrl.envs.environment import EnvError, Environment, Turn
from textrl.envs.prompts import encode_prompts
from textrl.envs.registry import make_env, split_rows
from textrl.envs.watchdog import CallWatch, EnvTimeout


class Answers(Environment):
    """Answers each turn with the Turn it was built with."""

    id = "answers"
    max_turns = 2

    def __init__(self, turn=None, delay=0.0):
        self.turn = turn
        self.delay = delay

    def rows(self):
        return [{"prompt": "Say a"}, {"prompt": "Say b"}]

    def step(self, episode, completion):
        time.sleep(self.delay)
        return self.turn


def play(tok, env, **settings):
    batch = encode_prompts(env.rows(), tok)[0]
    gen = scripted(tok, [["a"], ["b"]])
    return EpisodeRunner(env, tokenizer=tok, max_new_tokens=4, max_episode_tokens=64, **settings).run(gen, batch)


@pytest.mark.parametrize("turn, message", [
    (Turn(reward=10**400, done=True), r"environment 'answers': step\(\) on row -?\d+ \(turn 1\) gave Turn.reward=1000.*"
                                      r"\(int\), too large for the rollout's float32 rewards"),
    (Turn(reward=1e39, done=True), r"gave Turn.reward=1e\+39 \(float\), too large for the rollout's float32"),
    (Turn(reward="1", done=True), r"gave Turn.reward='1' \(str\): a turn reward must be a float"),
    (Turn(reward=1.0, done="no"), r"gave Turn.done='no' \(str\): done must be True or False"),
    (Turn(observation=7), r"gave Turn.observation=7 \(int\): an observation is None, a str, or a list"),
    (Turn(observation=[{"role": "user"}]), r"Turn.observation\[0\]=.*each message must be"),
    (Turn(observation="bad \ud800"), r"gave Turn.observation with a lone surrogate '\\ud800' at character 4"),
    (Turn(done=True, info=[1]), r"gave Turn.info=\[1\] \(list\): info must be a dict"),
    ("done", r"step\(\) on row -?\d+ \(turn 1\) returned str; return a textrl.envs.Turn"),
])
def test_a_bad_turn_is_one_line_naming_the_environment_row_and_field(tok, turn, message):
    with pytest.raises(EnvError, match=message) as info:
        play(tok, Answers(turn))
    assert "\n" not in str(info.value)


def test_a_numpy_bool_done_and_an_int_reward_are_taken(tok):
    import numpy as np

    td = play(tok, Answers(Turn(reward=2, done=np.bool_(True))))
    assert td.get("score").tolist() == [2.0, 2.0]


@pytest.mark.parametrize("attr, value, message", [
    ("max_turns", "3", r"environment 'answers': max_turns='3' \(str\) must be an int >= 1; fix the attribute of Answers"),
    ("max_turns", 0, r"max_turns=0 \(int\) must be an int >= 1"),
    ("stop_strings", "</tool>", r"stop_strings='</tool>' \(str\) must be a tuple of non-empty strings"),
    ("reward", 3, r"reward=3 \(int\) must be None, a reward spec"),
    ("max_observation_tokens", "32", r"max_observation_tokens='32' \(str\) must be an int >= 1"),
    ("answers_truncated_turns", "no", r"answers_truncated_turns='no' \(str\) must be True or False"),
])
def test_bad_environment_attributes_are_named(tok, attr, value, message):
    env = Answers(Turn(done=True))
    setattr(env, attr, value)
    with pytest.raises(ValueError, match=message):
        play(tok, env)


def test_a_constructor_that_raises_is_named(tmp_path):
    path = tmp_path / "boom.py"
    path.write_text("from textrl.envs import Environment\n"
                    "class Boom(Environment):\n"
                    "    def __init__(self):\n"
                    "        raise RuntimeError('no game server')\n")
    with pytest.raises(ValueError, match=r"^--env '.*boom.py:Boom': its constructor raised RuntimeError: no game "
                                         r"server; fix the environment's __init__"):
        make_env(f"{path}:Boom")


def test_a_lone_surrogate_in_a_row_is_named_before_any_tokenizer_sees_it():
    env = Answers()
    env.rows = lambda: [{"prompt": "fine"}, {"prompt": "bad \ud800 text"}]
    with pytest.raises(ValueError, match=r"environment 'answers': rows\(\) row list\[1\]: its message 0 \(user\) "
                                         r"content has a lone surrogate '\\ud800' at character 4"):
        split_rows(env, 1, 0)


def test_a_slow_step_is_named_once_and_cut_by_the_timeout(tok):
    lines = []
    watch = CallWatch(None, notice_after=0.2, emit=lines.append)
    with watch("environment 'x' step() on row 3 (turn 1)"):
        time.sleep(0.7)
    assert len(lines) == 1
    assert lines[0].startswith("environment 'x' step() on row 3 (turn 1) has run for 0 s") or \
        lines[0].startswith("environment 'x' step() on row 3 (turn 1) has run for 1 s")
    with pytest.raises(EnvTimeout, match=r"environment 'answers' step\(\) on row -?\d+ \(turn 1\) ran past "
                                         r"env_timeout=0.3 s and was stopped"):
        play(tok, Answers(Turn(done=True), delay=5.0), env_timeout=0.3)


def test_an_idle_watchdog_wakes_for_each_new_call():
    """The watcher thread sleeps until a call comes due or a new one starts: short calls made while
    it is idle are each named (it once slept a whole second between looks and missed them)."""
    lines = []
    watch = CallWatch(None, notice_after=0.1, emit=lines.append)
    for i in range(5):
        with watch(f"call {i}"):
            time.sleep(0.35)
        time.sleep(0.05 * i)  # the watcher idles between calls
    assert [line.split(" has run")[0] for line in lines] == [f"call {i}" for i in range(5)]


def test_the_timeout_is_not_swallowed_by_the_environments_own_except():
    def swallowing():
        try:
            time.sleep(5)
        except Exception:  # what a careless environment does
            return "swallowed"
        return "finished"

    start = time.monotonic()
    with pytest.raises(EnvTimeout):
        with CallWatch(0.2)("environment 'x' reward on row(s) 0"):
            swallowing()
    assert time.monotonic() - start < 3


def test_a_bad_timeout_is_refused():
    with pytest.raises(ValueError, match=r"env_timeout=0: must be a number of seconds > 0"):
        CallWatch(0)
