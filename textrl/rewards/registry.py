"""Reward functions by name: ``get_reward``, ``register_reward`` and ``parse_reward_spec``.

``get_reward`` accepts

- a registered name, with settings as keyword arguments: ``get_reward("length_penalty",
  target_tokens=128)``;
- a callable, returned as it is (or with the keyword arguments bound);
- ``"path/to/file.py:function_name"``: that function, loaded from the file;
- ``"package.module.function"``: that function, imported by its import path (TRL's scripts take
  ``reward_funcs`` this way too);
- ``"<scheme>:<argument>"`` for a scheme in :data:`REWARD_LOADERS`: ``"reward_model:/path"``
  (a local directory, a hub id, or ``tiny``) loads a :class:`~textrl.rewards.neural.NeuralReward`,
  with ``settings`` as its constructor options (``batch_size``, ``clip``, ``device``, ...);
  ``"reward_model:http://host:port"`` scores with a reward model served by vLLM
  (:class:`~textrl.rewards.served.ServedReward`), ``"judge:http://host:port"`` with an LLM judge's
  verdicts (:class:`~textrl.rewards.judge.JudgeReward`), their settings also in the URL's query string.

``parse_reward_spec("think_format:0.5,tag_count,accuracy:2")`` builds a
:class:`~textrl.rewards.composite.CompositeReward` from comma-separated ``name[:weight]`` entries;
``"think_format,reward_model:/path:0.5"`` weights the reward model by 0.5.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import inspect
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from textrl.config.reward_option import split_weight_text
from textrl.registry import Messages, Registry, first_line
from textrl.rewards.base import RewardFn, check_finite_weight, reward_name
from textrl.rewards.composite import CompositeReward
from textrl.rewards.judge import load_judge
from textrl.rewards.math_verify import math_verify_reward
from textrl.rewards.penalties import length_penalty, missing_eos_penalty, repetition_penalty
from textrl.rewards.rules import accuracy_reward, tag_count_reward, think_format_reward
from textrl.rewards.served import load_reward_model


def _callables(module: Any) -> str:
    """The public callables a reward file defines, as a list's repr."""
    return repr(sorted(k for k, v in vars(module).items()
                       if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__))


REGISTRY: Registry[Callable[..., RewardFn]] = Registry(
    "reward", group="textrl.rewards", same=lambda old, new: False, accepts=callable, candidates=_callables,
    register_loaded=lambda name, fn: register_reward(name)(fn), suggestions=3, cutoff=0.5,
    messages=Messages(
        bad_name="reward name {name!r} must be a non-empty str without ':' or ','",
        taken="a reward named {name!r} is already registered; pick another name or pass overwrite=True",
        unknown="unknown reward {name!r}{hint}. Known rewards: {names}; or pass a callable, "
                "'path/to/file.py:function_name', or register one with @register_reward(name)",
        no_file="reward file {where!r} does not exist (looked at {path}); write path/to/file.py:function_name",
        no_name="{attr!r} {what} in reward file {where!r}; callables defined there: {found}",
        not_accepted="is not callable",
        import_failed="importing reward file {where!r} failed with {error_type}: {error}",
        import_exited="reward file {where!r} called sys.exit({code!r}) while it was imported; a reward file "
                      "must only define functions (move the exit under `if __name__ == '__main__':`)"))
"""The rewards' :class:`textrl.registry.Registry` (entry-point group ``textrl.rewards``: a
``[project.entry-points."textrl.rewards"]`` entry names a reward function, registered as
:func:`register_reward` would)."""

REWARDS: dict[str, Callable[..., RewardFn]] = REGISTRY.entries
"""Registered name -> constructor: ``REWARDS[name](**settings)`` returns a reward function."""

REWARD_LOADERS: dict[str, Callable[..., RewardFn]] = {}
"""Scheme -> loader: ``get_reward("scheme:arg", **kw)`` returns ``REWARD_LOADERS[scheme](arg, **kw)``."""

REWARD_LOADERS["reward_model"] = load_reward_model  # a PATH in this process, a URL served (textrl.rewards.served)
REWARD_LOADERS["judge"] = load_judge


F = TypeVar("F", bound=Callable[..., Any])


def _settings(fn: Callable[..., Any]) -> list[str]:
    """Keyword-only parameters of ``fn``: the settings that may be bound."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def bind(fn: RewardFn, name: str | None = None, **settings: Any) -> RewardFn:
    """``fn`` with ``settings`` bound as keyword arguments; ``fn`` itself when there are none.

    Only keyword-only parameters may be bound, so a misspelt setting fails here rather than
    vanishing into ``**kwargs``.
    """
    if not settings:
        return fn
    label = name or reward_name(fn)
    known = _settings(fn)
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ValueError(
            f"reward {label!r} has no setting {', '.join(map(repr, unknown))}; "
            f"its settings are {known or 'none'}"
        )
    bound = functools.partial(fn, **settings)
    bound.name = label  # type: ignore[attr-defined]
    return bound


def register_reward(
    name: str, *, factory: bool = False, overwrite: bool = False
) -> Callable[[F], F]:
    """Decorator: make ``get_reward(name)`` (and reward specs) find the decorated object.

    By default it decorates a reward function, whose keyword-only parameters become the
    settings ``get_reward(name, **settings)`` binds. With ``factory=True`` it decorates a
    constructor, called as ``obj(**settings)`` to build the reward function.

    >>> import torch
    >>> @register_reward("shout")
    ... def shout(prompts, completions, **kwargs):
    ...     return torch.tensor([float(c.isupper()) for c in completions])
    >>> get_reward("shout")(["q", "q"], ["HI", "hi"]).tolist()
    [1.0, 0.0]
    >>> del REWARDS["shout"]
    """
    REGISTRY.check_name(name)

    def register(obj: F) -> F:
        if not callable(obj) and (overwrite or name not in REWARDS):
            raise ValueError(f"register_reward({name!r}) decorates a callable, got {obj!r}")
        if factory:
            REGISTRY.register(name, obj, replace=overwrite)
        else:
            REGISTRY.register(name, functools.partial(bind, obj, name), replace=overwrite,
                              description=first_line(obj.__doc__))
            if not isinstance(getattr(obj, "name", None), str):
                obj.name = name  # type: ignore[attr-defined]
        return obj

    return register


def load_reward_from_file(path: str, function_name: str) -> RewardFn:
    """The callable ``function_name`` defined in the Python file ``path``."""
    return REGISTRY.load_file(path, function_name)


_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
"""``package.module.function``: a reward named by its import path."""


def load_reward_from_import_path(path: str) -> RewardFn:
    """The callable at the import path ``package.module.qualname`` (the longest importable module
    prefix, then attributes); ``ValueError`` says what could not be found."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and not module_name.startswith(err.name):
                raise ValueError(f"reward {path!r}: importing {module_name} failed: {err}") from None
            continue
        except SystemExit as err:
            raise ValueError(f"reward {path!r}: module {module_name} called sys.exit({err.code!r}) while "
                             "it was imported") from None
        except Exception as err:
            raise ValueError(f"reward {path!r}: importing {module_name} failed with "
                             f"{type(err).__name__}: {err}") from err
        obj: Any = module
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute, None)
        if not callable(obj):
            raise ValueError(f"reward {path!r}: module {module_name} has no callable "
                             f"{'.'.join(parts[cut:])!r}")
        return obj
    raise ValueError(f"reward {path!r}: no module {parts[0]!r} can be imported (is it on sys.path / "
                     "PYTHONPATH?); give a registered name, 'path/to/file.py:function' or "
                     "'package.module.function'")


def get_reward(spec: str | RewardFn, **settings: Any) -> RewardFn:
    """A reward function from a name, a callable, ``file.py:function`` or ``scheme:argument``.

    >>> get_reward("tag_count")(["q"], ["<think></think>"]).tolist()
    [0.5]
    >>> penalty = get_reward("length_penalty", target_tokens=1, penalty_per_token=0.5)
    >>> penalty(["q"], ["ab"], completion_ids=[[7, 8, 9]]).tolist()
    [-1.0]
    """
    if callable(spec):
        return bind(spec, None, **settings)
    if not isinstance(spec, str):
        raise ValueError(f"get_reward takes a name, a callable or 'file.py:function', got {spec!r}")
    key = spec.strip()
    constructor = REGISTRY.find(key)
    if constructor is not None:
        return constructor(**settings)
    scheme, sep, argument = key.partition(":")
    if sep and scheme in REWARD_LOADERS:
        return REWARD_LOADERS[scheme](argument, **settings)
    path, sep, function_name = key.rpartition(":")
    if sep and path.endswith(".py"):
        return bind(load_reward_from_file(path, function_name), None, **settings)
    if key.endswith(".py"):
        raise ValueError(f"reward {key!r} is a file: name the function too, as {key}:function_name")
    if _IMPORT_PATH.match(key):
        return bind(load_reward_from_import_path(key), None, **settings)
    raise ValueError(REGISTRY.unknown(key))


_EMPTY_SPEC = ("empty reward spec {spec!r} (--reward / TrainConfig(reward=...)): name at least one reward, "
               "e.g. --reward think_format:0.5,tag_count,accuracy:2, or leave --reward out for the "
               "environment's own reward")


def _split_weight(token: str) -> tuple[str, float]:
    """(reward, weight) of one spec entry ``REWARD[:WEIGHT]`` (:func:`textrl.config.reward_option.split_weight_text`:
    ``file.py:nan`` is the function ``nan``); a weight must be a finite number.

    >>> _split_weight("accuracy:2"), _split_weight("badrew.py:nan")
    (('accuracy', 2.0), ('badrew.py:nan', 1.0))
    """
    head, tail = split_weight_text(token)
    if tail is None:
        return token, 1.0
    head, tail = head.strip(), tail.strip()
    try:
        weight = float(tail)
    except ValueError:
        if head.endswith(".py") or head in REWARD_LOADERS or "://" in token:  # file.py:f, a URL's path
            return token, 1.0
        raise ValueError(
            f"bad weight {tail!r} in reward spec entry {token!r}: write name or name:weight, "
            "e.g. 'accuracy:2'"
        ) from None
    if not head:
        raise ValueError(f"reward spec entry {token!r} has a weight but no reward name")
    if not math.isfinite(weight):
        function = f", or, for a function called {tail!r}, name its file (file.py:{tail})" if tail.isidentifier() else ""
        raise ValueError(f"reward spec entry {token!r}: weight {tail!r} is not finite; give a finite number as the "
                         f"weight ({head}:2){function}")
    return head, check_finite_weight(weight, f"reward spec entry {token!r}")


def parse_reward_spec(spec: str) -> CompositeReward:
    """A :class:`CompositeReward` from ``"name[:weight],..."`` (weight defaults to 1.0).

    Each name is anything :func:`get_reward` accepts; ``file.py:function:weight`` works too.
    Components are keyed by their reward name, which must be unique.

    >>> parse_reward_spec("think_format:0.5, tag_count, accuracy:2")
    CompositeReward(think_format:0.5, tag_count:1, accuracy:2)
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(_EMPTY_SPEC.format(spec=spec))
    components: dict[str, tuple[RewardFn, float]] = {}
    for i, raw in enumerate(spec.split(",")):
        token = raw.strip()
        if not token:
            raise ValueError(f"reward spec {spec!r} has an empty entry at position {i}")
        name, weight = _split_weight(token)
        fn = get_reward(name)
        key = reward_name(fn)
        if key in components:
            raise ValueError(
                f"reward spec {spec!r} names the reward {key!r} twice; merge the weights"
            )
        components[key] = (fn, weight)
    return CompositeReward(components)


def check_reward_spec(spec: str) -> None:
    """Check a reward spec's entries, names and weights without building it.

    No model loads and no reward file is imported, so a config can be checked before anything
    heavy starts; raises the ``ValueError`` :func:`parse_reward_spec` would for an empty entry, a
    bad weight or an unknown name, and names a reward file or local reward model path that does
    not exist. (A hub id cannot be checked offline.)

    >>> check_reward_spec("think_format:0.5,tag_count")
    >>> check_reward_spec("think_fromat")
    Traceback (most recent call last):
    ...
    ValueError: unknown reward 'think_fromat' (did you mean 'think_format'?)...
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(_EMPTY_SPEC.format(spec=spec))
    for i, raw in enumerate(spec.split(",")):
        token = raw.strip()
        if not token:
            raise ValueError(f"reward spec {spec!r} has an empty entry at position {i}")
        key = _split_weight(token)[0].strip()
        scheme, sep, argument = key.partition(":")
        argument = argument.strip()
        file = key.rpartition(":")[0]
        if key in REWARDS or key in REGISTRY.entry_points():  # an entry point is not loaded here
            continue
        if sep and scheme in REWARD_LOADERS:
            if not argument:
                REWARD_LOADERS[scheme](argument)  # raises: the entry names no model or server
            local = Path(argument).expanduser()
            if argument.startswith(("/", ".", "~")) and not local.exists():
                raise ValueError(f"reward {key!r}: {local} does not exist; give an existing folder")
        elif file.endswith(".py"):
            if not Path(file).expanduser().is_file():
                raise ValueError(f"reward file {file!r} does not exist (in reward spec entry {token!r})")
        elif _IMPORT_PATH.match(key):
            load_reward_from_import_path(key)  # importing a module is cheap; a missing one is named now
        else:
            get_reward(key)  # an unknown name: raises with suggestions


for _fn in (
    think_format_reward,
    tag_count_reward,
    accuracy_reward,
    length_penalty,
    repetition_penalty,
    missing_eos_penalty,
    math_verify_reward,
):
    register_reward(_fn.name)(_fn)

__all__ = [
    "REGISTRY",
    "REWARDS",
    "REWARD_LOADERS",
    "bind",
    "check_reward_spec",
    "get_reward",
    "load_reward_from_file",
    "parse_reward_spec",
    "register_reward",
]
