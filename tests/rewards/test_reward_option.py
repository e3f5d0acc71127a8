"""``reward=`` takes TRL's ``reward_funcs`` forms (a callable, a list of callables and names) with
``reward_weights``; ``config.yaml`` records a function by its import path, and reading the file
back imports it again or refuses, saying how to pass it; a reward's ``sys.exit`` is a named
:class:`RewardError`; every row is checked for the columns its rewards read before a model loads."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from textrl.config import TrainConfig, load_yaml
from textrl.core.user_files import import_path
from textrl.envs.prompts import check_reward_columns
from textrl.rewards import CompositeReward, RewardError, evaluate_reward, named
from textrl.rewards.base import needs, required_columns
from textrl.rewards.options import (
    check_reward_option,
    resolve_reward,
    reward_columns,
    reward_record,
)
from textrl.rewards.registry import get_reward
from textrl.training.trainer import train

SMALL = dict(iterations=1, warmup_sft_steps=0, prompts_per_iteration=2, n_samples_per_prompt=2, max_new_tokens=4,
             eval_size=2, eval_every=0, progress=False, ppo_epochs=1, num_minibatches=1, checkpoint_every=1)


def brevity(completions, **kwargs):
    """A TRL-style reward (keyword call): shorter completions score higher."""
    return [-len(c) / 100.0 for c in completions]


def says_hi(prompts, completions, **kwargs):
    return [float("hi" in c) for c in completions]


@needs("solution")
def exact_solution(prompts, completions, *, solution=None, **kwargs):
    return [float(c.strip() == s) for c, s in zip(completions, solution)]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))


def test_resolve_reward_forms():
    assert resolve_reward(brevity) is brevity
    assert resolve_reward("think_format,accuracy", [0.5, 2.0]) == "think_format:0.5,accuracy:2"
    mixed = resolve_reward([brevity, "think_format"], [2.0, 0.5])
    assert isinstance(mixed, CompositeReward) and mixed.weights == {"brevity": 2.0, "think_format": 0.5}
    good = "<think>\nx\n</think>\n<answer>\n1\n</answer>"
    total = mixed(["q", "q"], [good, "hi"])
    assert total.tolist() == pytest.approx([2 * -len(good) / 100 + 0.5 * 0.5, 2 * -0.02])
    assert resolve_reward([brevity, says_hi]).weights == {"brevity": 1.0, "says_hi": 1.0}


@pytest.mark.parametrize("reward, weights, message", [
    ("", [1.0], r"reward_weights=\[1.0\] given with an empty reward spec ''"),
    ("  ", [1.0], r"given with an empty reward spec"),
    ([], None, r"reward=\[\]: name at least one reward"),
    ([brevity, ""], None, r"reward entry 1 is ''"),
    ([brevity, "a,b"], None, r"reward entry 1 is 'a,b'"),
    ([brevity, 3], None, r"reward entry 1 is 3"),
    ([brevity, says_hi], [1.0], r"reward_weights has 1 weights for 2 rewards \(brevity, says_hi\)"),
    ([brevity], [float("nan")], r"is not a finite number"),
    ("accuracy:2", [1.0], r"carries a weight and reward_weights gives another"),
    (None, [1.0], r"reward_weights=\[1.0\] given without reward"),
    ([lambda p, c, **k: [0.0] * len(c), lambda p, c, **k: [1.0] * len(c)], None, "two reward functions are named"),
])
def test_bad_reward_options_name_the_option(reward, weights, message):
    with pytest.raises(ValueError, match=message):
        resolve_reward(reward, weights)


def test_trainconfig_takes_callables_and_lists():
    TrainConfig(reward=brevity).validate()
    TrainConfig(reward=[brevity, "think_format"], reward_weights=[1.0, 0.5]).validate()
    TrainConfig(reward="").validate()  # no rule reward: the run refuses it if nothing else scores
    with pytest.raises(ValueError, match="given with an empty reward spec"):
        TrainConfig(reward="", reward_weights=[1.0]).validate()


def test_config_yaml_records_import_paths_and_refuses_what_cannot_be_imported(tmp_path):
    assert import_path(brevity) == f"{__name__}.brevity"
    assert get_reward(f"{__name__}.brevity") is brevity
    assert reward_record([brevity, "think_format"]) == [f"{__name__}.brevity", "think_format"]
    local = lambda p, c, **k: [0.0] * len(c)  # noqa: E731
    recorded = reward_record([local, "think_format"])
    assert recorded[0] == {"callable": f"{__name__}.{local.__qualname__}", "restorable": False}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"reward": recorded}))
    with pytest.raises(ValueError, match=r"reward: this config was saved from a run given the Python function "
                                         r".*<lambda>, which a YAML file cannot hold.*pass it again"):
        load_yaml(path)


def test_train_with_reward_functions_records_and_resumes_by_import_path(tmp_path):
    out = tmp_path / "run"
    train(TrainConfig(output_dir=str(out), reward=[brevity, "think_format"], reward_weights=[2.0, 0.5], **SMALL))
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["reward"] == [f"{__name__}.brevity", "think_format"] and saved["reward_weights"] == [2.0, 0.5]
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert {"reward_components/brevity/mean", "reward_components/think_format/mean"} <= set(row)
    # the YAML file alone restores the run: the function is imported again by its path
    resumed = TrainConfig(**{**load_yaml(out / "config.yaml"), "iterations": 2, "resume": True})
    summary = train(resumed)
    assert summary and len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_reward_that_calls_sys_exit_is_a_named_reward_error():
    def quits(prompts, completions, **kwargs):
        sys.exit(3)

    with pytest.raises(RewardError, match=r"reward 'quits' raised SystemExit: sys.exit\(3\) was called.*"
                                          r"must return scores, not end the process"):
        evaluate_reward(quits, ["p"], ["c"])


def test_a_reward_file_that_calls_sys_exit_on_import_is_named(tmp_path):
    file = tmp_path / "quits.py"
    file.write_text("import sys\nsys.exit(2)\n")
    with pytest.raises(ValueError, match=r"reward file .*quits.py' called sys.exit\(2\) while it was imported"):
        get_reward(f"{file}:f")


def test_rewards_declare_the_columns_they_read():
    assert reward_columns("think_format,accuracy:2,math_verify") == {"answer": ["accuracy", "math_verify"]}
    assert required_columns(exact_solution) == {"solution": ["exact_solution"]}
    assert reward_columns([exact_solution, "tag_count"]) == {"solution": ["exact_solution"]}
    assert reward_columns(f"{__name__}.exact_solution") == {"solution": ["exact_solution"]}
    assert reward_columns(named("renamed")(exact_solution)) == {"solution": ["renamed"]}


def test_rows_without_a_column_a_reward_reads_are_named_by_file_and_line(tmp_path):
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)]
    rows[13] = {"prompt": "q13"}
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    check_reward_columns(data, "think_format,tag_count")  # no reward reads 'answer'
    with pytest.raises(ValueError, match=r"data.jsonl:14: row has no 'answer', which reward 'accuracy' reads; "
                                         r"add it or choose another reward"):
        check_reward_columns(data, "think_format,accuracy")
    with pytest.raises(ValueError, match=r"list\[0\]: row has 'solution' null.*\(2 of 2 rows lack it\)"):
        check_reward_columns([{"prompt": "a", "solution": None}, {"prompt": "b"}], exact_solution)


def test_train_refuses_a_bad_row_before_any_model_loads(tmp_path, monkeypatch):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n{"prompt": "c", "answer": "3"}\n')

    def no_models(*args, **kwargs):
        raise AssertionError("a model was built before the bad row was refused")

    monkeypatch.setattr("textrl.training.set_up.build_agent", no_models)
    with pytest.raises(ValueError, match=r"data.jsonl:2: row has no 'answer', which reward 'accuracy' reads"):
        train(TrainConfig(output_dir=str(tmp_path / "run"), dataset=str(data), reward="accuracy", **SMALL))
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_check_reward_option_accepts_none():
    check_reward_option(None, None)


BADREW = '''
def nan(prompts, completions, **kwargs):
    return [0.25] * len(completions)


def inf(prompts, completions, **kwargs):
    return [0.5] * len(completions)
'''


def test_a_function_called_nan_in_a_reward_file_is_a_function_not_a_weight(tmp_path):
    """``--reward badrew.py:nan``: ``PATH.py:NAME`` names a function even when NAME reads as a
    number; a weight after it (from the entry or reward_weights) still applies."""
    from textrl.rewards.registry import parse_reward_spec

    path = tmp_path / "badrew.py"
    path.write_text(BADREW)
    for spec in (f"{path}:nan", f"{path}:inf"):
        check_reward_option(spec, None)
        TrainConfig(reward=spec).validate()
    composite = parse_reward_spec(f"{path}:nan,{path}:inf:2")
    assert composite.weights == {"nan": 1.0, "inf": 2.0}
    assert composite(["q"], ["a"]).tolist() == [0.25 + 2 * 0.5]
    assert resolve_reward(f"{path}:nan", [3.0]) == f"{path}:nan:3"  # reward_weights: no "weight given twice"
    assert parse_reward_spec(resolve_reward(f"{path}:nan", [3.0])).weights == {"nan": 3.0}


@pytest.mark.parametrize("entry", ["accuracy:nan", "accuracy:inf", "accuracy:-inf", "think_format:NaN"])
def test_a_weight_that_is_not_a_finite_number_is_refused_in_one_line(entry):
    from textrl.rewards.registry import parse_reward_spec

    message = rf"reward spec entry '{entry}': weight '{entry.split(':')[1]}' is not finite; give a finite number as the weight"
    with pytest.raises(ValueError, match=message):
        check_reward_option(entry, None)
    with pytest.raises(ValueError, match=message):
        parse_reward_spec(entry)
