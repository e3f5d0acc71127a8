"""The shape of the ``reward`` / ``reward_weights`` options (TRL's ``reward_funcs`` / ``reward_weights``).

``reward`` is a spec string (``"think_format:0.5,tag_count,accuracy"``), a reward function (any
callable ``fn(prompts, completions, **kwargs)``, TRL's convention) or a list of them, each a
function or one spec entry; ``reward_weights`` gives one weight per entry. This module checks that
shape (:func:`check_reward_shape`, run by ``TrainConfig.validate``) and writes and reads back what
``config.yaml`` records (:func:`reward_record`, :func:`refuse_recorded_callable`). It knows no
specific reward: the names in a spec are checked, and the functions built, by
:mod:`textrl.rewards.options` when the run builds its environment.

``config.yaml`` records a function by its import path: ``package.module.f`` when a fresh process
can import it again, which ``--config`` / ``--resume`` then do; a function that cannot be imported
again (a lambda, one defined in ``__main__`` or inside another function, a callable object) is
recorded as ``{"callable": "module.qualname", "restorable": false}``, and reading that file back
is refused with what to do, so a run is never resumed on another function silently.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from textrl.core.user_files import import_path

_EXAMPLE = "e.g. reward='think_format,accuracy', reward=my_fn or reward=[my_fn, 'accuracy']"


def _entries(reward: Any) -> list[Any]:
    """The entries of ``reward``: a list's items, a spec string's comma entries, or the function."""
    if isinstance(reward, str):
        return [token.strip() for token in reward.split(",")]
    if isinstance(reward, (list, tuple)):
        return list(reward)
    return [reward]


def split_weight_text(entry: str) -> tuple[str, str | None]:
    """(the reward, the text of its weight or None) of one spec entry ``REWARD[:WEIGHT]``.

    The weight is what follows the last ``:``, unless what precedes it is a ``.py`` file and what
    follows is a name: ``PATH.py:NAME`` is a function in a file even when NAME reads as a number
    (a function called ``nan`` or ``inf``). A weight's text is checked by the caller.

    >>> split_weight_text("accuracy:2"), split_weight_text("a.py:f:0.5"), split_weight_text("accuracy")
    (('accuracy', '2'), ('a.py:f', '0.5'), ('accuracy', None))
    >>> split_weight_text("badrew.py:nan"), split_weight_text("accuracy:nan")
    (('badrew.py:nan', None), ('accuracy', 'nan'))
    >>> split_weight_text("judge:http://h:8003"), split_weight_text("judge:http://h:8003:0.5")
    (('judge:http://h:8003', None), ('judge:http://h:8003', '0.5'))
    """
    head, sep, tail = entry.rpartition(":")
    if not sep:
        return entry, None
    if head.strip().endswith(".py") and tail.strip().isidentifier():
        return entry, None
    if _is_port(entry, tail):
        return entry, None
    return head, tail


def _is_port(entry: str, tail: str) -> bool:
    """Whether ``tail``, what follows the last ``:`` of ``entry``, is a server URL's port, not a weight:
    the URL (``scheme://host:port``) ends the entry with nothing after its host but that one ``:``.
    A URL's entry is weighted after its port or path: ``judge:http://h:8003:0.5``.

    >>> _is_port("judge:http://h:8003", "8003"), _is_port("judge:http://h:8003:0.5", "0.5")
    (True, False)
    """
    at = entry.find("://")
    if at < 0 or not tail.strip().isdigit():
        return False
    authority = re.split(r"[/?#]", entry[at + 3:], maxsplit=1)[0]
    return authority.count(":") == 1 and entry.rstrip().endswith(authority.rstrip())


def _has_weight(entry: str) -> bool:
    """Whether a spec entry ends in ``:NUMBER`` (``accuracy:2``, ``a.py:f:0.5``; not ``a.py:nan``)."""
    head, tail = split_weight_text(entry)
    if tail is None or not head:
        return False
    try:
        float(tail)
    except ValueError:
        return False
    return True


def check_reward_shape(reward: Any, weights: Any) -> None:
    """``ValueError`` naming the option when ``reward`` / ``reward_weights`` are not usable
    together: an empty spec or list, an entry that is neither a callable nor a non-empty string,
    a weight that is not a finite number, a count of weights that is not the count of rewards, a
    weight given twice. The names inside a spec string are checked by
    :func:`textrl.rewards.options.check_reward_option`."""
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
        # no rule reward: valid beside --reward-model or an environment that pays its own turns; the
        # run refuses it when nothing else scores the episodes (textrl.training.run_checks.check_run)
        if weights is not None:
            raise ValueError(f"reward_weights={weights!r} given with an empty reward spec {reward!r}: name the "
                             "rewards they weigh (--reward think_format,accuracy), or drop reward_weights")
        return
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
    return ", ".join(e if isinstance(e, str) else _name(e) for e in entries)


def _name(fn: Any) -> str:
    """A function's name as the rewards show it (``fn.name``, else ``__name__``, else its class)."""
    name = getattr(fn, "name", None)
    return name if isinstance(name, str) and name else getattr(fn, "__name__", None) or type(fn).__name__


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


__all__ = ["check_reward_shape", "refuse_recorded_callable", "reward_record", "split_weight_text"]
