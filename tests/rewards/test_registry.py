from __future__ import annotations

import textwrap

import pytest
import torch

from textrl.rewards import (
    REWARDS,
    CompositeReward,
    get_reward,
    parse_reward_spec,
    register_reward,
    tag_count_reward,
    think_format_reward,
)
from textrl.rewards.base import reward_name

BUILTINS = [
    "think_format",
    "tag_count",
    "accuracy",
    "length_penalty",
    "repetition_penalty",
    "missing_eos_penalty",
]


@pytest.fixture
def clean_registry():
    before = dict(REWARDS)
    yield
    REWARDS.clear()
    REWARDS.update(before)


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_names_resolve_and_carry_their_name(name):
    fn = get_reward(name)
    assert reward_name(fn) == name


def test_get_reward_returns_the_plain_function_without_settings():
    assert get_reward("think_format") is think_format_reward


def test_settings_are_bound_and_named():
    fn = get_reward("missing_eos_penalty", penalty=2.0)
    assert reward_name(fn) == "missing_eos_penalty"
    assert fn(["q"], ["a"], truncated=[True]).tolist() == [-2.0]


def test_misspelt_setting_lists_the_known_ones():
    with pytest.raises(
        ValueError, match=r"no setting 'target'; its settings are .*'target_tokens'"
    ):
        get_reward("length_penalty", target=3)


def test_setting_for_a_reward_without_settings():
    with pytest.raises(
        ValueError, match=r"reward 'tag_count' has no setting 'x'; its settings are none"
    ):
        get_reward("tag_count", x=1)


def test_unknown_name_lists_known_and_suggests():
    with pytest.raises(
        ValueError, match=r"unknown reward 'think_fromat' \(did you mean 'think_format'\?\)"
    ) as err:
        get_reward("think_fromat")
    for name in BUILTINS:
        assert name in str(err.value)


def test_unknown_name_without_close_match_still_lists_known():
    with pytest.raises(ValueError, match=r"unknown reward 'zzz'\. Known rewards: accuracy, "):
        get_reward("zzz")


def test_callable_passes_through():
    def mine(prompts, completions, **kwargs):
        return torch.zeros(len(completions))

    assert get_reward(mine) is mine


def test_register_reward_function_and_spec(clean_registry):
    @register_reward("shout")
    def shout(prompts, completions, *, bonus: float = 1.0, **kwargs):
        return torch.tensor([bonus * c.isupper() for c in completions])

    assert get_reward("shout") is shout and shout.name == "shout"
    assert get_reward("shout", bonus=3.0)(["q"], ["HI"]).tolist() == [3.0]
    total, raw = parse_reward_spec("shout:2,tag_count").components(["q"], ["HI"])
    assert raw["shout"].tolist() == [1.0] and total.tolist() == [2.0]


def test_register_factory(clean_registry):
    @register_reward("const", factory=True)
    def make_const(value: float = 1.0):
        def const(prompts, completions, **kwargs):
            return torch.full((len(completions),), value)

        const.name = "const"
        return const

    assert get_reward("const", value=0.25)(["q"], ["a"]).tolist() == [0.25]


def test_register_duplicate_name_refused(clean_registry):
    with pytest.raises(ValueError, match=r"'tag_count' is already registered.*overwrite=True"):
        register_reward("tag_count")(tag_count_reward)


@pytest.mark.parametrize("bad", ["", "a:b", "a,b"])
def test_register_bad_name(bad):
    with pytest.raises(ValueError, match=r"must be a non-empty str without"):
        register_reward(bad)


def test_reward_model_scheme_names_a_missing_path():
    with pytest.raises(ValueError, match=r"/models/rm"):
        get_reward("reward_model:/models/rm")


# ---- loading from a file -------------------------------------------------------------------


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        textwrap.dedent(
            """
        import torch

        def brevity(prompts, completions, *, scale=1.0, **kwargs):
            return torch.tensor([-scale * len(c) for c in completions], dtype=torch.float32)

        NOT_CALLABLE = 3
        """
        )
    )
    return path


def test_load_function_from_file(reward_file):
    fn = get_reward(f"{reward_file}:brevity")
    assert reward_name(fn) == "brevity"
    assert fn(["q"], ["abc"]).tolist() == [-3.0]
    assert get_reward(f"{reward_file}:brevity", scale=2.0)(["q"], ["ab"]).tolist() == [-4.0]


def test_missing_file_is_named(tmp_path):
    path = tmp_path / "nope.py"
    with pytest.raises(ValueError, match=r"reward file '.*nope\.py' does not exist"):
        get_reward(f"{path}:brevity")


def test_missing_function_is_named(reward_file):
    with pytest.raises(
        ValueError,
        match=r"'shortness' is not defined in reward file .*callables defined there: \['brevity'\]",
    ):
        get_reward(f"{reward_file}:shortness")


def test_non_callable_attribute(reward_file):
    with pytest.raises(ValueError, match=r"'NOT_CALLABLE' is not callable in reward file"):
        get_reward(f"{reward_file}:NOT_CALLABLE")


def test_file_without_function_name(reward_file):
    with pytest.raises(ValueError, match=r"name the function too"):
        get_reward(str(reward_file))


def test_file_that_fails_to_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(
        ValueError, match=r"importing reward file .*broken\.py' failed with RuntimeError: boom"
    ):
        get_reward(f"{path}:anything")


# ---- reward specs --------------------------------------------------------------------------


def test_parse_spec_weights_and_defaults():
    reward = parse_reward_spec("think_format:0.5,tag_count,accuracy:2")
    assert isinstance(reward, CompositeReward)
    assert reward.weights == {"think_format": 0.5, "tag_count": 1.0, "accuracy": 2.0}


def test_parse_spec_tolerates_spaces_and_negative_weights():
    reward = parse_reward_spec(" tag_count : 1.5 , length_penalty:-1e-1 ")
    assert reward.weights == {"tag_count": 1.5, "length_penalty": -0.1}


def test_parse_spec_with_file_paths(reward_file):
    reward = parse_reward_spec(f"{reward_file}:brevity:0.5,tag_count")
    assert reward.weights == {"brevity": 0.5, "tag_count": 1.0}
    reward = parse_reward_spec(f"{reward_file}:brevity")  # no weight: 1.0
    assert reward.weights == {"brevity": 1.0}
    assert reward(["q"], ["abcd"]).tolist() == [-4.0]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("accuracy:abc", r"bad weight 'abc' in reward spec entry 'accuracy:abc'"),
        ("accuracy:2:3", r"unknown reward 'accuracy:2' \(did you mean 'accuracy'\?\)"),
        ("accuracy:nan", r"reward spec entry 'accuracy:nan'.*not finite"),
        ("accuracy:inf", r"reward spec entry 'accuracy:inf'.*not finite"),
        (":2", r"entry ':2' has a weight but no reward name"),
        ("tag_count,,accuracy", r"empty entry at position 1"),
        ("tag_count,", r"empty entry at position 1"),
        ("", r"empty reward spec"),
        ("tag_count,tag_count:2", r"names the reward 'tag_count' twice"),
        ("tag_cout", r"unknown reward 'tag_cout' \(did you mean 'tag_count'\?\)"),
    ],
)
def test_parse_spec_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_reward_spec(spec)
