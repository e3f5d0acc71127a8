"""Environments by id: ``register_env``, ``make_env``, ``env_ids``.

``make_env`` accepts

- a registered id (``"digits"``, ``"guess_number"``; ``textrl envs`` lists them), with keyword
  settings passed to the environment's constructor;
- ``"path/to/file.py:ClassName"``: an :class:`~textrl.envs.environment.Environment` subclass (or
  a function returning an environment) defined in a user's file;
- ``"<scheme>:<argument>"`` for a scheme in :data:`ENV_LOADERS` (the adapters register
  ``reasoning_gym:<task>`` and ``textarena:<game id>``);
- an :class:`~textrl.envs.environment.Environment` instance, returned as it is.

Every registered id is also a Gymnasium id, ``textrl/<Id>-v0`` (``gym.make`` builds the token MDP
of that environment, :class:`textrl.envs.TokenMDPEnv`); registration extends this table, nobody
edits a list. The table is a :class:`textrl.registry.Registry` (:data:`REGISTRY`): another package
adds ids through the entry-point group ``textrl.envs`` (``[project.entry-points."textrl.envs"]``
in its ``pyproject.toml``: ``my_game = "my_package.games:MyGame"``), loaded when the id is first
asked for.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from textrl.core.env_facts import EnvFacts, provide_env_facts
from textrl.envs.environment import Environment
from textrl.registry import Messages, Registry


def _env_classes(module: Any) -> str:
    """``; its environments: A, B`` of a user's file (its Environment subclasses), "" without."""
    found = [n for n, v in vars(module).items() if inspect.isclass(v) and issubclass(v, Environment)
             and v is not Environment and v.__module__ == module.__name__]
    return f"; its environments: {', '.join(found)}" if found else ""


REGISTRY: Registry[Callable[..., Environment]] = Registry(
    "env", noun="environment", group="textrl.envs", builtins=("textrl.envs.builtin", "textrl.envs.adapters"),
    valid_name=lambda env_id: isinstance(env_id, str) and bool(env_id) and not {":", ",", "/"} & set(env_id),
    same=lambda old, new: False, candidates=_env_classes,
    register_loaded=lambda env_id, obj: register_env(env_id)(obj),
    messages=Messages(
        bad_name="environment id {name!r} must be a non-empty str without ':', ',' or '/'",
        taken="an environment with id {name!r} is already registered; pick another id or pass overwrite=True",
        unknown="unknown environment {name!r}{hint}; registered: {names}",
        no_file="--env {spec!r}: no file {file!r}; give PATH.py:ClassName of an existing file",
        no_name="--env {spec!r}: {file!r} defines no {attr!r}{found}"))
"""The environments' :class:`textrl.registry.Registry` (entry-point group ``textrl.envs``)."""

ENVS: dict[str, Callable[..., Environment]] = REGISTRY.entries
"""Registered id -> constructor (a class or a function) of the environment."""

ENV_LOADERS: dict[str, Callable[..., Environment]] = {}
"""Scheme -> loader: ``make_env("scheme:arg", **kw)`` returns ``ENV_LOADERS[scheme](arg, **kw)``."""

T = TypeVar("T")


def register_env(env_id: str, *, overwrite: bool = False) -> Callable[[T], T]:
    """Decorator: make ``make_env(env_id)`` (and ``textrl train --env env_id``) build the decorated
    class or function. Ids are lower-case words with ``_``, ``-`` or ``.``; ``:`` is reserved for
    schemes and files."""
    REGISTRY.check_name(env_id)

    def register(obj: T) -> T:
        if not callable(obj) and (overwrite or env_id not in ENVS):
            raise ValueError(f"register_env({env_id!r}) decorates a class or function, got {obj!r}")
        REGISTRY.register(env_id, obj, replace=overwrite)  # a taken id without overwrite: ValueError
        _register_gym_id(env_id)
        return obj

    return register


def register_env_loader(scheme: str) -> Callable[[T], T]:
    """Decorator: ``make_env("scheme:ARG", **kw)`` calls the decorated ``loader(ARG, **kw)``."""

    def register(loader: T) -> T:
        ENV_LOADERS[scheme] = loader  # type: ignore[assignment]
        return loader

    return register


def gym_id(env_id: str) -> str:
    """The Gymnasium id of a registered environment: ``textrl/<Id>-v0`` (``guess_number`` ->
    ``textrl/GuessNumber-v0``)."""
    words = env_id.replace("-", "_").replace(".", "_").split("_")
    return "textrl/" + "".join(w[:1].upper() + w[1:] for w in words) + "-v0"


def _register_gym_id(env_id: str) -> None:
    """``textrl/<Id>-v0`` as a ``TokenMDPEnv`` of the environment, wrapped so a ``gym.make(...,
    max_episode_steps=N)`` cut scores the episode as the environment's own cap does (names as
    strings: this module imports no environment class)."""
    import gymnasium as gym
    from gymnasium.envs.registration import WrapperSpec

    name = gym_id(env_id)
    if name not in gym.registry:
        cap = WrapperSpec("TimeLimitCap", "textrl.envs.gym_ids:TimeLimitCap", {})
        gym.register(id=name, entry_point="textrl.envs.token_mdp:TokenMDPEnv", kwargs={"env": env_id},
                     additional_wrappers=(cap,))


def env_ids() -> list[str]:
    """The registered ids (and ``textrl.envs`` entry points), sorted."""
    return REGISTRY.names()


def _from_file(spec: str, settings: dict[str, Any]) -> Environment:
    return _build(REGISTRY.load_file(spec), settings, spec)


def _build(factory: Callable[..., Any], settings: dict[str, Any], label: str) -> Environment:
    """``factory(**settings)``, checked: an Environment whose attributes have the right types
    (:func:`textrl.envs.environment.check_environment`); its constructor raising is a
    ``ValueError`` naming the environment (an ``ImportError`` naming a missing extra stays one)."""
    from textrl.envs.environment import check_environment

    try:
        env = factory(**settings)
    except TypeError as error:
        if settings and "argument" in str(error):
            raise ValueError(f"--env {label!r} does not take the settings {sorted(settings)}: {error}; its "
                             f"settings: {', '.join(env_settings(factory)) or 'none'}") from error
        raise ValueError(f"--env {label!r}: its constructor raised TypeError: {error}") from error
    except (ValueError, ImportError):
        raise
    except Exception as error:
        raise ValueError(f"--env {label!r}: its constructor raised {type(error).__name__}: {error}; fix the "
                         "environment's __init__ (or its --env-args)") from error
    if not isinstance(env, Environment):
        raise TypeError(f"--env {label!r} built a {type(env).__name__}, not a textrl.envs.Environment; "
                        "subclass textrl.envs.Environment (rows() and step())")
    if not env.id:  # a user's class without an id is named by its spec in messages
        env.id = label  # type: ignore[misc]
    return check_environment(env)


def env_settings(factory: Callable[..., Any]) -> list[str]:
    """The keyword settings an environment's constructor takes."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"]


def make_env(spec: str | Environment, **settings: Any) -> Environment:
    """The environment ``spec`` names (see the module docstring); ``ValueError`` for an unknown id
    lists the registered ones."""
    if isinstance(spec, Environment):
        if settings:
            raise ValueError(f"make_env got an environment instance and settings {sorted(settings)}; "
                             "pass an id with the settings, or the instance alone")
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--env {spec!r}: give a registered id (textrl envs lists them), "
                         "PATH.py:ClassName, or an Environment")
    spec = spec.strip()
    factory = REGISTRY.find(spec)
    if factory is not None:
        return _build(factory, settings, spec)
    scheme, sep, arg = spec.partition(":")
    if REGISTRY.file_spec(spec) is not None:
        return _from_file(spec, settings)
    if sep and scheme in ENV_LOADERS:
        return _build(lambda **kw: ENV_LOADERS[scheme](arg, **kw), settings, spec)
    schemes = ", ".join(f"{s}:NAME" for s in sorted(ENV_LOADERS))
    raise ValueError(REGISTRY.unknown(spec) + (f"; adapters: {schemes}" if schemes else "") + "; or PATH.py:ClassName")


DEFAULT_ENV = "digits"
"""The environment of ``textrl train`` with neither ``--env`` nor ``--dataset``."""
DATASET_REWARD = "think_format,tag_count,accuracy"
"""The reward of a ``--dataset`` without ``--reward``."""


def parse_env_args(text: str | None) -> dict[str, Any]:
    """``"max_n=16,turn_cost=0.1"`` -> ``{"max_n": 16, "turn_cost": 0.1}`` (each value a YAML
    scalar); ``ValueError`` naming a malformed item."""
    import yaml

    settings: dict[str, Any] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"env_args: {item.strip()!r} is not KEY=VALUE; write e.g. 'max_n=16,turn_cost=0.1'")
        settings[key.strip()] = yaml.safe_load(value.strip()) if value.strip() else ""
    return settings


def task_environment(env: str | Environment | None = None, dataset: Any = None,
                     reward: Any = None, env_args: str | None = None) -> Environment:
    """The environment a run trains on: ``env`` (an id, spec or instance), else a
    :class:`~textrl.envs.environment.PromptTask` of ``dataset`` scored by ``reward`` (default
    :data:`DATASET_REWARD`), else :data:`DEFAULT_ENV`. ``dataset='builtin:NAME'`` of a registered
    environment NAME is that environment. A ``reward`` replaces the environment's final reward."""
    from textrl.envs.environment import PromptTask
    from textrl.envs.prompts import load_prompts

    if env is not None and dataset is not None:
        raise ValueError("--env and --dataset are both given: an environment carries its own rows; give one")
    if env is None and isinstance(dataset, str) and dataset.startswith("builtin:"):
        name = dataset.removeprefix("builtin:")
        env = name if name in ENVS or name in env_ids() else None
    settings = parse_env_args(env_args)
    if env is None and dataset is not None:
        if settings:
            raise ValueError(f"env_args {sorted(settings)} given with a --dataset: they are settings of an "
                             "environment; use --env")
        return PromptTask(load_prompts(dataset), DATASET_REWARD if reward is None else reward, id="dataset")
    # a run's own shallow copy: setting its reward leaves the built (or the caller's) instance alone
    environment = copy.copy(_built(DEFAULT_ENV if env is None else env, env_args, settings))
    if reward is not None:
        environment.reward = reward
    return environment


def environment_and_rows(env: Environment | str | None, prompts: Any, reward: Any) -> tuple[Environment, Any]:
    """``(environment, prompt rows)`` of a token environment's arguments (:class:`textrl.envs.TokenMDPEnv`,
    :class:`textrl.envs.TextGenEnv`): ``env=None`` is the single-turn task
    of ``prompts`` (None: the built-in digits task) scored by ``reward`` (None: the default spec);
    otherwise the environment (``make_env(env)`` for an id) over ``prompts`` if given, else its
    own ``rows()``, with ``reward`` (if given) replacing its final reward, as ``textrl train --env
    ID --reward SPEC`` does (on a copy: an environment passed in is left as it is)."""
    from textrl.envs.environment import PromptTask
    from textrl.envs.fast_path import DEFAULT_REWARD

    if env is None:
        return PromptTask(None, DEFAULT_REWARD if reward is None else reward), prompts
    task = make_env(env)
    if not isinstance(task.max_turns, int) or isinstance(task.max_turns, bool) or task.max_turns < 1:
        raise ValueError(f"environment {task.id!r}: max_turns={task.max_turns!r} must be an int >= 1")
    if reward is not None:
        task = copy.copy(task)
        task.reward = reward
    return task, task.rows() if prompts is None else prompts


_BUILT: dict[tuple[str, str | None], Environment] = {}
"""The latest environments built from a spec, their rows generated: a run resolves its environment
several times (its checks, its set-up, the warm-up) and each gets a shallow copy, so each spec is
built, and its rows generated, once per process."""
_BUILT_KEPT = 4


def _built(env: str | Environment, env_args: str | None, settings: dict[str, Any]) -> Environment:
    if not isinstance(env, str):
        return make_env(env, **settings)
    key = (env, env_args)
    if key not in _BUILT:
        if len(_BUILT) >= _BUILT_KEPT:
            _BUILT.pop(next(iter(_BUILT)))
        built = make_env(env, **settings)
        built.rows(), built.eval_rows()  # generated now, on the instance every copy shares
        _BUILT[key] = built
    return _BUILT[key]


CHECKED_ROWS = 20_000
"""Rows of a source whose texts :func:`check_row_texts` reads (a larger file: its first ones)."""


def check_row_texts(env: Environment, rows: Any, method: str) -> None:
    """Every prompt text of ``rows`` (the first :data:`CHECKED_ROWS`) is valid Unicode: a lone
    surrogate (``"\\ud800"``) has no UTF-8 form and no tokenizer takes it. ``ValueError`` naming
    the environment, the row and the field."""
    from textrl.envs.environment import text_problem

    for i in range(min(len(rows), CHECKED_ROWS)):
        for name, text in _row_texts(rows.messages(i)):
            bad = text_problem(text)
            if bad:
                raise ValueError(f"environment {env.id!r}: {method} row {rows.where(i)}: its {name} has {bad}; "
                                 "give valid Unicode text")


def _row_texts(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(f"message {k} ({m.get('role')}) content", m["content"]) for k, m in enumerate(messages)
            if isinstance(m.get("content"), str)]


def split_rows(env: Environment, eval_size: int, seed: int) -> tuple[Any, Any]:
    """``(train, held-out)`` :class:`textrl.envs.PromptDataset` of ``env``: its own held-out rows
    when it has them, else ``eval_size`` of its rows held out (seeded, as ``PromptDataset.split``)."""
    from textrl.envs.prompts import load_prompts

    rows = load_prompts(env.rows())
    check_row_texts(env, rows, "rows()")
    held_out = env.eval_rows()
    if held_out is None:
        return rows.split(eval_size, seed=seed)
    held_out = load_prompts(held_out)
    check_row_texts(env, held_out, "eval_rows()")
    if eval_size < len(held_out):  # the first eval_size of its own held-out rows
        held_out = held_out.select(list(range(eval_size)))
    return rows, held_out


def env_facts(config: Any, env: Environment | None = None, *, warmup: bool = True, train_rows: Any = None) -> EnvFacts:
    """What an agent's construction reads of ``config``'s environment (``env``, else built from
    the config; its training rows ``train_rows``, else split from it): the episode budget
    (``max_episode_tokens``, else the environment's default: ``max_new_tokens`` for a single turn)
    and, with ``warmup`` and ``warmup_sft_steps > 0``, the format warm-up's (prompt, completion)
    pairs, drawn from the training rows (None: it has none, as a plain ``--dataset`` has none). An
    environment whose ``warmup_examples`` takes ``answer_accuracy`` gets ``warmup_answer_accuracy``."""
    from textrl.envs.episodes import default_episode_tokens

    if env is None:
        env = task_environment(config.env, config.dataset, config.reward, config.env_args)
    check_partial_rollouts(config, env)  # before any model loads, in textrl train and in from_config alike
    budget = config.max_episode_tokens
    if budget is None:
        budget = default_episode_tokens(env, config.max_new_tokens)
    pairs = None
    if warmup and config.warmup_sft_steps > 0:
        if train_rows is None:
            train_rows, _ = split_rows(env, config.eval_size, config.seed)
        settings = {}
        if "answer_accuracy" in inspect.signature(env.warmup_examples).parameters:
            settings["answer_accuracy"] = config.warmup_answer_accuracy
        pairs = env.warmup_examples(list(train_rows), config.seed, **settings)
    return EnvFacts(env_id=env.id, episode_budget=int(budget), warmup_pairs=pairs)


def check_partial_rollouts(config: Any, env: Environment) -> None:
    """``ValueError`` in one line for ``partial_rollouts='continue'`` on a single-turn ``env``: it lets
    an episode take newer weights at its next turn, and such an episode has none, so it would change
    nothing (:func:`textrl.envs.episodes.is_multi_turn`)."""
    from textrl.envs.episodes import is_multi_turn

    if getattr(config, "partial_rollouts", "finish") == "continue" and not is_multi_turn(env):
        raise ValueError(f"partial_rollouts='continue' lets a multi-turn episode take newer weights at its next "
                         f"turn, and {env.id} is single-turn (one turn an episode): it would change nothing; drop "
                         "--partial-rollouts, or choose a multi-turn --env")


def check_chat_template(env: Environment, run_tokenizer: Callable[[], Any]) -> None:
    """Refuse the run's chat template when ``env`` is multi-turn and the template is not
    append-only (:func:`textrl.envs.episodes.check_episode_template`, with the tokenizer's EOS, as
    the episode runner will be built): ``textrl train`` calls it before any model loads.
    ``run_tokenizer()`` gives the run's tokenizer; it is called only for a multi-turn environment."""
    from textrl.envs.episodes import check_episode_template, is_multi_turn

    if not is_multi_turn(env):
        return
    tokenizer = run_tokenizer()
    if tokenizer.eos_token_id is not None:  # none: the episode runner names it
        check_episode_template(env, tokenizer, [tokenizer.eos_token_id])


provide_env_facts(env_facts)  # a direct Agent.from_config(config) reads the environment through it


__all__ = ["DATASET_REWARD", "check_chat_template", "check_partial_rollouts", "DEFAULT_ENV", "ENVS", "ENV_LOADERS", "REGISTRY", "env_facts", "env_ids", "gym_id", "make_env", "register_env", "env_settings", "parse_env_args", "register_env_loader", "split_rows",
           "task_environment"]
