"""The environment registry: ids, files, settings, the run's environment, the held-out split."""

from __future__ import annotations

import textwrap

import pytest

from textrl.envs.environment import PromptTask
from textrl.envs.registry import (
    env_ids,
    gym_id,
    make_env,
    parse_env_args,
    split_rows,
    task_environment,
)

ENV_FILE = '''
from textrl.envs import Environment, Turn


class Echo(Environment):
    max_turns = 2

    def __init__(self, word="cat"):
        self.word = word

    def rows(self):
        return [{"prompt": f"Say {self.word} {i}"} for i in range(10)]

    def step(self, episode, completion):
        return Turn(reward=1.0, done=True)


def not_an_env():
    return 3
'''


def test_an_environment_from_a_users_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(textwrap.dedent(ENV_FILE))
    env = make_env(f"{path}:Echo", word="dog")
    assert env.rows()[0]["prompt"] == "Say dog 0"
    assert env.id == f"{path}:Echo"  # a class without an id is named by its spec in messages
    with pytest.raises(ValueError, match="defines no 'Nope'; its environments: Echo"):
        make_env(f"{path}:Nope")
    with pytest.raises(TypeError, match="built a int, not a textrl.envs.Environment"):
        make_env(f"{path}:not_an_env")
    with pytest.raises(ValueError, match="no file"):
        make_env(f"{tmp_path}/missing.py:Echo")


def test_unknown_ids_list_the_registered_ones_and_suggest_the_closest():
    with pytest.raises(ValueError, match=r"unknown environment 'guess_numbr' \(did you mean 'guess_number'\?\); "
                                         r"registered: arithmetic, calculator, digits, guess_number"):
        make_env("guess_numbr")
    assert {"digits", "arithmetic", "calculator", "guess_number", "reward_model"} <= set(env_ids())
    assert gym_id("guess_number") == "textrl/GuessNumber-v0"


def test_env_args_are_yaml_scalars_and_a_malformed_item_is_named():
    assert parse_env_args("max_n=16, turn_cost=0.1,name=x") == {"max_n": 16, "turn_cost": 0.1, "name": "x"}
    assert parse_env_args(None) == {} and parse_env_args("") == {}
    with pytest.raises(ValueError, match="'max_n' is not KEY=VALUE"):
        parse_env_args("max_n")
    assert task_environment("guess_number", env_args="max_n=16").max_n == 16


def test_the_runs_environment_from_env_dataset_and_reward():
    assert task_environment().id == "digits"  # nothing given: the embedded default's task
    assert task_environment(dataset="builtin:digits").id == "digits"  # a built-in dataset is its environment
    task = task_environment(dataset=["What is 2+2?", "Name a colour."], reward="tag_count")
    assert isinstance(task, PromptTask) and task.reward == "tag_count" and len(task.rows()) == 2
    assert task_environment("digits", reward="accuracy").reward == "accuracy"  # --reward replaces it
    with pytest.raises(ValueError, match="both given"):
        task_environment("digits", dataset="builtin:digits")
    with pytest.raises(ValueError, match="env_args .* given with a --dataset"):
        task_environment(dataset=["a prompt"], env_args="n=1")


def test_split_uses_the_environments_own_held_out_rows_when_it_has_them():
    game = make_env("guess_number")
    train, held_out = split_rows(game, eval_size=16, seed=0)
    assert len(train) == len(game.rows()) and len(held_out) == 16
    assert [r["instance"] for r in held_out] == [r["instance"] for r in game.eval_rows()[:16]]
    digits = make_env("digits")  # no held-out rows of its own: eval_size rows held out, seeded
    train, held_out = split_rows(digits, eval_size=32, seed=0)
    assert len(held_out) == 32 and len(train) == len(digits.rows()) - 32
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}


def test_a_run_gets_its_own_copy_of_an_environment_built_once(tmp_path):
    path = tmp_path / "counted_env.py"
    path.write_text(textwrap.dedent('''
        from textrl.envs import Environment

        class Counted(Environment):
            built = 0
            rows_made = 0

            def __init__(self):
                type(self).built += 1
                self._rows = None

            def rows(self):
                if self._rows is None:
                    type(self).rows_made += 1
                    self._rows = [{"prompt": f"p{i}"} for i in range(4)]
                return self._rows
    '''))
    first = task_environment(f"{path}:Counted")
    second = task_environment(f"{path}:Counted", reward="tag_count")
    cls = type(first)
    assert (cls.built, cls.rows_made) == (1, 1)  # checks, set-up and warm-up share one build and its rows
    assert first is not second and first.reward is None and second.reward == "tag_count"
    mine = make_env(f"{path}:Counted")
    task_environment(mine, reward="accuracy")
    assert mine.reward is None  # the caller's own instance is left as it is
