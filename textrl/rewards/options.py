"""The ``reward`` / ``reward_weights`` options of a run (TRL's ``reward_funcs`` / ``reward_weights``).

``reward`` is any of

- a spec string, ``"think_format:0.5,tag_count,accuracy"`` (:func:`parse_reward_spec`);
- a reward function (any callable ``fn(prompts, completions, **kwargs)``, TRL's convention);
- a list of them, each a function or one spec entry (a registered name, ``file.py:function``,
  ``package.module.function``, ``reward_model:PATH``): ``[my_reward, "think_format"]``.

``reward_weights`` gives one weight per entry (a list for a list, one number per comma entry of a
spec string); a weight may also stand in a spec entry (``"accuracy:2"``) but not both.
:func:`resolve_reward` turns the two into what an environment holds as its reward: a spec string
when every entry is one (so the command line, ``config.yaml`` and a reward model added by
``--reward-model`` keep working as before), else a :class:`CompositeReward`.

``config.yaml`` records a function by its import path (:func:`reward_record`): ``package.module.f``
when a fresh process can import it again, which ``--config`` / ``--resume`` then do; a function
that cannot be imported again (a lambda, one defined in ``__main__`` or inside another function,
a callable object) is recorded as ``{"callable": "module.qualname", ...}``, and reading that file
back is refused with what to do (:func:`refuse_recorded_callable`): a YAML file cannot hold a
Python function, so the run is never resumed on another one silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from textrl.config.reward_option import (
    _entries,
    check_reward_shape,
    refuse_recorded_callable,
    reward_record,
)
from textrl.rewards.base import RewardFn, required_columns, reward_name
from textrl.rewards.composite import CompositeReward
from textrl.rewards.registry import (
    _IMPORT_PATH,
    REWARDS,
    _split_weight,
    check_reward_spec,
    get_reward,
    parse_reward_spec,
)


def check_reward_option(reward: Any, weights: Any) -> None:
    """:func:`textrl.config.reward_option.check_reward_shape`, then each spec entry's names, weights and
    files by :func:`check_reward_spec` (no file imported, no model loaded)."""
    check_reward_shape(reward, weights)
    if reward is None or (isinstance(reward, str) and not reward.strip()):
        return  # '': whether something else scores the episodes is the run's check
    for entry in _entries(reward):
        if isinstance(entry, str):
            check_reward_spec(entry)


def resolve_reward(reward: Any, weights: Sequence[float] | None = None) -> str | RewardFn | None:
    """What a run's environment holds as its reward: None (its own), a spec string when every
    entry is a string (the weights written into it), else a :class:`CompositeReward` of the
    functions and the entries (each built with :func:`get_reward`), or a lone function.

    >>> resolve_reward(["think_format", "accuracy"], [0.5, 2])
    'think_format:0.5,accuracy:2'
    >>> def f(prompts, completions, **kwargs): return [1.0] * len(completions)
    >>> resolve_reward([f, "accuracy"], [0.5, 1])
    CompositeReward(f:0.5, accuracy:1)
    """
    check_reward_option(reward, weights)
    if reward is None or (isinstance(reward, str) and not reward.strip()):
        return reward  # None: the environment's own; '': no rule reward (a reward model or the turns score)
    entries = _entries(reward)
    listed = [float(w) for w in weights] if weights is not None else [None] * len(entries)
    if all(isinstance(e, str) for e in entries):
        if weights is None and isinstance(reward, str):
            return reward
        return ",".join(e if w is None else f"{e}:{w:g}" for e, w in zip(entries, listed))
    if len(entries) == 1 and listed[0] in (None, 1.0):
        return entries[0]
    components: dict[str, tuple[RewardFn, float]] = {}
    for entry, weight in zip(entries, listed):
        if isinstance(entry, str):
            built = parse_reward_spec(entry)  # one entry, its own weight if it has one
            ((name, (fn, own)),) = ((k, (f, built.weights[k])) for k, f in built.functions.items())
            parts = [(name, fn, own if weight is None else weight)]
        else:
            parts = [(reward_name(entry), entry, 1.0 if weight is None else weight)]
        for name, fn, w in parts:
            if name in components:
                raise ValueError(f"reward: two reward functions are named {name!r}; give each a distinct name "
                                 "(def it under its own name, or set fn.name / @textrl.rewards.named)")
            components[name] = (fn, w)
    return CompositeReward(components)


def reward_columns(reward: Any) -> dict[str, list[str]]:
    """Dataset column -> names of the rewards of ``reward`` that read it from every row (their
    ``needs``, :func:`textrl.rewards.base.required_columns`): of a function or composite, of each
    entry of a spec string or list. A spec entry is looked at when that costs no import of a user
    file and no model load: registered names and ``package.module.function`` paths (a
    ``file.py:function`` entry is read when the run builds it, a reward model reads no column).

    >>> reward_columns("think_format,accuracy:2")
    {'answer': ['accuracy']}
    """
    if reward is None:
        return {}
    if not isinstance(reward, (str, list, tuple)):
        return required_columns(reward)
    out: dict[str, list[str]] = {}
    for entry in _entries(reward):
        if isinstance(entry, str):
            key = _split_weight(entry)[0].strip() if entry.strip() else ""
            if key not in REWARDS and not _IMPORT_PATH.match(key):
                continue
            found = required_columns(get_reward(key))
        else:
            found = reward_columns(entry)
        for column, names in found.items():
            out.setdefault(column, []).extend(names)
    return out


__all__ = ["check_reward_option", "refuse_recorded_callable", "resolve_reward", "reward_columns", "reward_record"]
