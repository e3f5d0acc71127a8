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

import math
from collections.abc import Sequence
from typing import Any

from textrl.rewards.base import RewardFn, required_columns, reward_name
from textrl.rewards.composite import CompositeReward
from textrl.rewards.registry import (
    _IMPORT_PATH,
    REWARDS,
    _split_weight,
    check_reward_spec,
    get_reward,
    import_path,
    parse_reward_spec,
)

_EXAMPLE = "e.g. reward='think_format,accuracy', reward=my_fn or reward=[my_fn, 'accuracy']"


def _entries(reward: Any) -> list[Any]:
    """The entries of ``reward``: a list's items, a spec string's comma entries, or the function."""
    if isinstance(reward, str):
        return [token.strip() for token in reward.split(",")]
    if isinstance(reward, (list, tuple)):
        return list(reward)
    return [reward]


def _has_weight(entry: str) -> bool:
    """Whether a spec entry ends in ``:NUMBER`` (``accuracy:2``, ``a.py:f:0.5``)."""
    head, sep, tail = entry.rpartition(":")
    if not sep or not head:
        return False
    try:
        float(tail)
    except ValueError:
        return False
    return True


def check_reward_option(reward: Any, weights: Any) -> None:
    """``ValueError`` naming the option when ``reward`` / ``reward_weights`` are not usable
    together: an empty spec or list, an entry that is neither a callable nor a non-empty string,
    a weight that is not a finite number, a count of weights that is not the count of rewards, a
    weight given twice. Spec strings are checked by :func:`check_reward_spec` (no file imported)."""
    if reward is None:
        if weights is not None:
            raise ValueError(f"reward_weights={weights!r} given without reward: give reward=[...] with one "
                             "weight per reward function, or drop reward_weights")
        return
    if isinstance(reward, (list, tuple)) and not reward:
        raise ValueError(f"reward=[]: name at least one reward function ({_EXAMPLE}), or leave reward out for "
                         "the environment's own reward")
    if not isinstance(reward, (str, list, tuple)) and not callable(reward):
        raise ValueError(f"reward={reward!r}: must be a spec string, a callable or a list of them ({_EXAMPLE})")
    if isinstance(reward, str) and not reward.strip():
        raise ValueError(f"reward={reward!r} (--reward): an empty reward spec; name at least one reward "
                         "(--reward think_format:0.5,tag_count,accuracy:2), or leave --reward out for the "
                         "environment's own reward")
    entries = _entries(reward)
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            if not entry.strip() or (isinstance(reward, (list, tuple)) and "," in entry):
                raise ValueError(f"reward entry {i} is {entry!r}: a list holds one reward per entry, a "
                                 f"non-empty name or spec entry without ',' ({_EXAMPLE})")
        elif not callable(entry):
            raise ValueError(f"reward entry {i} is {entry!r}: each entry is a callable or a reward name")
    if weights is not None:
        _check_weights(entries, weights)
    for entry in entries:
        if isinstance(entry, str):
            check_reward_spec(entry)


def _check_weights(entries: list[Any], weights: Any) -> None:
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise ValueError(f"reward_weights={weights!r}: give a list of numbers, one per reward")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"reward_weights={list(weights)!r}: {w!r} is not a finite number")
    if len(weights) != len(entries):
        raise ValueError(f"reward_weights has {len(weights)} weights for {len(entries)} rewards "
                         f"({_described(entries)}): give one weight per reward")
    twice = [e for e in entries if isinstance(e, str) and _has_weight(e)]
    if twice:
        raise ValueError(f"reward entry {twice[0]!r} carries a weight and reward_weights gives another: give "
                         "each weight once (drop ':WEIGHT' from the entry, or drop reward_weights)")


def _described(entries: list[Any]) -> str:
    return ", ".join(e if isinstance(e, str) else reward_name(e) for e in entries)


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
    if reward is None:
        return None
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


def reward_record(reward: Any) -> Any:
    """``reward`` as ``config.yaml`` holds it: a string as it is; a function by its import path
    (``package.module.f``, which ``--config`` imports again), else as ``{"callable":
    "module.qualname", "restorable": False}``; a list entry by entry."""
    if reward is None or isinstance(reward, str):
        return reward
    if isinstance(reward, (list, tuple)):
        return [reward_record(entry) for entry in reward]
    path = import_path(reward)
    if path is not None:
        return path
    module = getattr(reward, "__module__", None) or type(reward).__module__
    qualname = getattr(reward, "__qualname__", None) or type(reward).__qualname__
    return {"callable": f"{module}.{qualname}", "restorable": False}


def refuse_recorded_callable(value: Any) -> None:
    """``ValueError`` when a ``reward`` read back from a YAML file holds a function that could not
    be recorded by its import path (:func:`reward_record`), saying how to pass it again."""
    entries = value if isinstance(value, list) else [value]
    for entry in entries:
        if isinstance(entry, dict) and "callable" in entry:
            raise ValueError(
                f"reward: this config was saved from a run given the Python function {entry['callable']}, "
                "which a YAML file cannot hold and which cannot be imported again (a lambda, or defined in "
                "__main__ or inside a function); pass it again in Python (TrainConfig(reward=...), "
                "resume=True), move it to an importable module (reward: package.module.function), or "
                "use --reward path/to/file.py:function"
            )
        if isinstance(entry, dict):
            raise ValueError(f"reward: {entry!r} is neither a reward name nor a recorded function")


__all__ = ["check_reward_option", "refuse_recorded_callable", "resolve_reward", "reward_columns", "reward_record"]
