"""textrl.registry.Registry, the one registry type of agents, environments and rewards: register and
look up, "did you mean", ``file.py:Name``, entry points, listing."""

from __future__ import annotations

import difflib
from importlib.metadata import EntryPoint

import pytest
from hypothesis import given
from hypothesis import strategies as st

from textrl import registry
from textrl.core.agent_registry import REGISTRY as AGENT_REGISTRY
from textrl.envs.registry import REGISTRY as ENV_REGISTRY
from textrl.registry import Messages, Registry
from textrl.rewards.registry import REGISTRY as REWARD_REGISTRY

NAMES = st.text(st.sampled_from("abcdefgh_"), min_size=1, max_size=8)


def shout(prompts, completions, **kwargs):
    """Upper-case completions score 1."""
    return [float(c.isupper()) for c in completions]


@given(st.dictionaries(NAMES, st.integers(), max_size=8))
def test_register_then_look_up_round_trips(table):
    reg = Registry("thing")
    for name, value in table.items():
        assert reg.register(name, value) == value
    assert reg.names() == sorted(table)
    assert all(reg.lookup(name) == value and name in reg for name, value in table.items())


@given(st.lists(NAMES, min_size=1, max_size=6, unique=True), NAMES)
def test_did_you_mean_suggests_the_closest_name(known, asked):
    reg = Registry("thing")
    for name in known:
        reg.register(name, object())
    if asked in known:
        return
    with pytest.raises(ValueError, match="unknown thing") as err:
        reg.lookup(asked)
    ratio = {name: difflib.SequenceMatcher(None, name, asked).ratio() for name in known}
    suggested = reg.close_names(asked)
    assert ("did you mean" in str(err.value)) == bool(suggested) == (max(ratio.values()) >= reg.cutoff)
    if suggested:  # the closest known name, in the message
        assert ratio[suggested[0]] == max(ratio.values()) and f"(did you mean {suggested[0]!r}?)" in str(err.value)


def test_a_taken_name_is_refused_unless_replaced_or_the_same_object():
    reg = Registry("thing")
    first, second = object(), object()
    reg.register("a", first)
    reg.register("a", first)  # the same object again
    with pytest.raises(ValueError, match="thing name 'a' is already registered"):
        reg.register("a", second)
    reg.register("a", second, replace=True)
    assert reg.lookup("a") is second
    with pytest.raises(ValueError, match="must be a non-empty str without"):
        reg.register("a:b", first)


def test_the_decorator_form_and_the_listing():
    reg = Registry("reward")

    @reg.register("shout")
    def loud(prompts, completions):
        """Scores shouting."""

    reg.register("plain", 3, description="three")
    assert reg.lookup("shout") is loud
    assert reg.describe("shout") == "Scores shouting." and reg.describe("plain") == "three"
    assert reg.pprint().splitlines() == ["plain  three", "shout  Scores shouting."]


def test_an_entry_point_is_listed_and_loaded_on_first_lookup(monkeypatch):
    point = EntryPoint(name="ep_shout", value="tests.test_registry:shout", group="textrl.things")
    monkeypatch.setattr(registry, "entry_points", lambda group: [point] if group == "textrl.things" else [])
    loaded = []
    reg = Registry("thing", group="textrl.things",
                   register_loaded=lambda name, obj: loaded.append(name) or reg.register(name, obj))
    assert reg.names() == ["ep_shout"] and "ep_shout" not in reg.entries
    assert reg.lookup("ep_shout") is shout and loaded == ["ep_shout"]
    assert reg.lookup("ep_shout") is shout and loaded == ["ep_shout"]  # loaded once


@pytest.mark.parametrize("reg, group", [(AGENT_REGISTRY, "textrl.agents"), (ENV_REGISTRY, "textrl.envs"),
                                        (REWARD_REGISTRY, "textrl.rewards")])
def test_each_kind_reads_its_entry_point_group(monkeypatch, reg, group):
    point = EntryPoint(name="from_a_package", value="tests.test_registry:shout", group=group)
    monkeypatch.setattr(registry, "entry_points", lambda g: [point] if g == group else [])
    assert reg.group == group and "from_a_package" in reg.names()


def test_an_entry_point_reward_is_registered_as_register_reward_would(monkeypatch):
    from textrl.rewards import REWARDS, get_reward

    point = EntryPoint(name="ep_loud", value="tests.test_registry:shout", group="textrl.rewards")
    monkeypatch.setattr(registry, "entry_points", lambda group: [point] if group == "textrl.rewards" else [])
    try:
        assert get_reward("ep_loud")(["q", "q"], ["HI", "hi"]) == [1.0, 0.0]
        assert "ep_loud" in REWARDS and REWARD_REGISTRY.describe("ep_loud") == "Upper-case completions score 1."
    finally:
        REWARDS.pop("ep_loud", None)


def test_a_file_spec_loads_the_named_object(tmp_path):
    path = tmp_path / "things.py"
    path.write_text("VALUE = 7\nNONE_HERE = None\n")
    reg = Registry("thing", messages=Messages(no_file="no file {file}", no_name="{attr!r} {what} in {where}"))
    assert reg.load_file(f"{path}:VALUE") == 7 and reg.load_file(str(path), "VALUE") == 7
    assert Registry.file_spec(f"{path}:VALUE") == (str(path), "VALUE") and Registry.file_spec("a:b") is None
    with pytest.raises(ValueError, match="'OTHER' is not defined in"):
        reg.load_file(f"{path}:OTHER")
    with pytest.raises(ValueError, match="no file .*missing.py"):
        reg.load_file(f"{tmp_path}/missing.py:VALUE")


def test_a_file_that_raises_is_worded_when_the_kind_says_so(tmp_path):
    path = tmp_path / "broken_thing.py"
    path.write_text("raise RuntimeError('boom')\n")
    quiet = Registry("thing_quiet")
    with pytest.raises(RuntimeError, match="boom"):
        quiet.load_file(f"{path}:X")
    worded = Registry("thing_worded", messages=Messages(import_failed="{where} failed: {error_type}: {error}"))
    with pytest.raises(ValueError, match="broken_thing.py failed: RuntimeError: boom"):
        worded.load_file(f"{path}:X")


def test_agents_gain_did_you_mean_at_the_end_of_their_message():
    from textrl.core.agent_registry import agent_class

    with pytest.raises(ValueError, match=r"agent='gae_pp': must be one of .*agent of your own "
                                         r"\(did you mean 'gae_ppo'\?\)$"):
        agent_class("gae_pp")
