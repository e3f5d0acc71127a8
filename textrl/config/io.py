"""The general machinery of textrl's config dataclasses, apart from the configs themselves.

A config is a dataclass whose fields are documented by attribute docstrings (the string right
after each field; :func:`field_docs`). This module turns such a class into command-line options
(:func:`add_config_arguments`: ``--max-new-tokens`` and ``--max_new_tokens``, help text with the
default), reads and writes it as YAML (:func:`load_yaml`: duplicate and unknown keys refused;
:func:`save_config` / :func:`config_values`), builds it with the precedence defaults <
``--config file.yaml`` < flags (:func:`build_config`), and checks values (:func:`check_values`,
:func:`check_at_least`, ...). It names no config: :class:`textrl.config.TrainConfig` (``textrl
train``) and :class:`textrl.stages.common.StageConfig` (``textrl sft`` / ``rm`` / ``dpo``) both use
it, and declare the fields they share once (:func:`copy_field`).
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import math
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml

from textrl.config.reward_option import refuse_recorded_callable, reward_record
from textrl.config.trl_names import trl_hint


@dataclass(frozen=True)
class ResumeRules:
    """What ``--resume`` may change, for one config class (:mod:`textrl.run.resume` applies it).
    A field not in ``applied`` or ``invocation`` is fixed: a change is refused."""

    applied: frozenset[str]
    """Fields that take effect from the resumed iteration on; a change is applied, logged and
    recorded in ``resumes.jsonl``."""
    fixed: frozenset[str] | None = None
    """Fields that define the run (the checkpoint's weights, data position or objective depend on
    them), listed to make every field a decision (:meth:`check_covers`); None: every field not
    applied or invocation."""
    invocation: frozenset[str] = frozenset({"output_dir", "resume", "progress"})
    """Fields about this command only (where, whether resuming, the progress bar); not compared."""

    def check_covers(self, cls: type) -> None:
        """``ValueError`` unless ``fixed``, ``applied`` and ``invocation`` partition ``cls``'s fields."""
        fixed = self.fixed or frozenset()
        names = {f.name for f in fields(cls)}
        listed = fixed | self.applied | self.invocation
        twice = (fixed & self.applied) | ((fixed | self.applied) & self.invocation)
        if names != listed or twice:
            raise ValueError(f"{cls.__name__}.RESUME_RULES: not classified {sorted(names - listed)}, "
                             f"in two sets {sorted(twice)}, not fields {sorted(listed - names)}")


# -- value checks ---------------------------------------------------------------------------------


def check_bitsandbytes(field_name: str) -> None:
    """Raise ``ValueError`` naming ``field_name`` when bitsandbytes 4-bit is not importable."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(
            f"{field_name}=True needs bitsandbytes for 4-bit NF4: `pip install bitsandbytes`, "
            f"or set {field_name}=false"
        )


def check_choice(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    """``ValueError`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: must be one of {', '.join(map(str, allowed))}")


def check_at_least(name: str, value: float, low: float) -> None:
    """``ValueError`` unless ``value`` is a number (not a bool, not NaN) >= ``low``."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) or value < low:
        raise ValueError(f"{name}={value!r}: must be a number >= {low}")


def check_positive(name: str, value: float) -> None:
    """``ValueError`` unless ``value`` is a number > 0."""
    if not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be > 0")


def check_in_range(name: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    """``ValueError`` unless ``low <= value <= high`` (``low < value`` when ``low_open``)."""
    ok = isinstance(value, (int, float)) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name}={value!r}: must lie in {bracket}{low}, {high}]")


# -- attribute docstrings, YAML and the command line -------------------------------------------------


def field_docs(cls: type) -> dict[str, str]:
    """Each field's documentation: the attribute docstring (the string literal right after the
    annotated field) in ``cls`` or in a dataclass it derives from (a subclass's wins), else the
    ``doc`` a field made by :func:`copy_field` carries."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name not in docs and "doc" in f.metadata:
            docs[f.name] = f.metadata["doc"]
    return docs


@functools.cache
def _own_field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings written in ``cls``'s own body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(getattr(nxt, "value", None), ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return dict(docs)


def copy_field(source: type, name: str) -> Any:
    """A new dataclass field with the default and the documentation of field ``name`` of the
    dataclass ``source``: a field several configs share is declared once, in ``source``
    (``device: str = copy_field(SharedFields, "device")``), and shows the same default and help
    text in each (:func:`field_docs` reads the doc from the field's ``metadata``)."""
    declared = {f.name: f for f in fields(source)}[name]  # type: ignore[arg-type]
    return field(default=declared.default, metadata={"doc": field_docs(source)[name], "shared": name})


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, optional) of a field annotation such as ``float | None``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _of_type(tp: type, value: Any) -> bool:
    """``value`` is already of the field's type: a bool only for a bool field, an int for a float."""
    if isinstance(value, bool):
        return tp is bool
    return isinstance(value, tp) or (tp is float and isinstance(value, int))


def parse_value(tp: type, optional: bool, value: Any) -> Any:
    """A field's value from a flag or a YAML file, parsed the same way: text is read as the field's
    type (``"no"`` -> False, ``"1e-4"`` -> 0.0001: PyYAML reads ``1e-4`` as text), numbers must
    fit it (2.5 is not an integer; a bool is not a number). ``ValueError`` says what is expected."""
    kind = _KINDS.get(tp, tp.__name__)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ValueError(f"must be {kind}, not null")
    if tp is list and isinstance(value, str):  # reward_weights: 1.0,0.5 (or [1.0, 0.5])
        try:
            return [float(item) for item in value.strip().strip("[]").split(",") if item.strip()]
        except ValueError:
            raise ValueError("must be a comma-separated list of numbers") from None
    if isinstance(value, str) and tp is not str:
        try:
            return _parse_bool(value) if tp is bool else tp(value)
        except (ValueError, argparse.ArgumentTypeError):
            raise ValueError(f"must be {kind}") from None
    if not _of_type(tp, value):
        raise ValueError(f"must be {kind}")
    return float(value) if tp is float else value


def _converter(tp: type, optional: bool):
    def convert(text: str):
        try:
            return parse_value(tp, optional, text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{err}, got {text!r}") from None

    convert.__name__ = tp.__name__  # argparse names the type in its error
    return convert


def check_values(config: Any, skip: tuple[str, ...] = ()) -> None:
    """Every field of a config dataclass holds a value of its type (no text standing for one:
    the Python API and YAML get the checks the flags get), finite where it is a number;
    ``ValueError`` names the field."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        if f.name not in skip:
            check_value(f.name, hints[f.name], getattr(config, f.name))


def check_value(name: str, hint: Any, value: Any) -> None:
    """One field of :func:`check_values`: ``value`` is of the type ``hint`` names, finite where it
    is a number (None where the field is optional; fields of other types are not checked)."""
    tp, optional = _base_type(hint)
    if tp not in _KINDS or (value is None and optional):
        return
    if value is None:
        raise ValueError(f"{name}=None: must be {_KINDS[tp]}, not null")
    if not _of_type(tp, value):
        text = f", not {type(value).__name__}" if isinstance(value, str) else ""
        raise ValueError(f"{name}={value!r}: must be {_KINDS[tp]}{text}")
    if tp is float and not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: must be a finite number")


NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
"""What argparse should take for a negative number (``-1e-4`` too), not for an option."""


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--field-name`` / ``--field_name`` option per dataclass field, default: not given,
    under the heading of its topic (:mod:`textrl.config.help_topics`: the topics and the fields in each in
    its order; a field without one stays among the command's own options)."""
    from textrl.config.help_topics import FIELD_TOPIC, TOPICS, topic_of

    parser._negative_number_matcher = NEGATIVE_NUMBER  # argparse's own misses -1e-4
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    topics = {topic_of(f.name) for f in fields(cls)}
    groups = {title: parser.add_argument_group(title, textwrap.fill(description, 76))  # stages' help is raw
              for title, (description, _) in TOPICS.items() if title in topics}
    listed = {name: i for i, name in enumerate(FIELD_TOPIC)}
    for f in sorted(fields(cls), key=lambda f: listed.get(f.name, len(listed))):
        target = groups.get(topic_of(f.name) or "", parser)
        tp, optional = _base_type(hints[f.name])
        names = [f"--{f.name.replace('_', '-')}"]
        if "_" in f.name:
            names.append(f"--{f.name}")
        help_text = f"{docs.get(f.name, '')} (default: {f.default!r})"
        if tp is bool:
            target.add_argument(
                *names, dest=f.name, nargs="?", const=True, default=argparse.SUPPRESS,
                type=_converter(bool, optional), help=help_text, metavar="BOOL",
            )
        else:
            target.add_argument(
                *names, dest=f.name, default=argparse.SUPPRESS, type=_converter(tp, optional),
                help=help_text, metavar=tp.__name__.upper(),
            )


class _TRLOption(argparse.Action):
    """A TRL option name that is not ours: the parser error says which option we call it."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[override]
        parser.error(f"{option_string}: {trl_hint(self.dest)}")


def add_trl_names(parser: argparse.ArgumentParser, cls: type) -> None:
    """Hidden ``--trl-name`` options for TRL option names ``cls`` lacks; each is an error that names
    our option (``--learning-rate`` -> ``actor_lr``)."""
    from textrl.config.trl_names import TRL_OPTIONS

    taken = {name for action in parser._actions for name in action.option_strings}
    for name in TRL_OPTIONS:
        if name in cls.__dataclass_fields__:
            continue
        flags = [f for f in dict.fromkeys([f"--{name.replace('_', '-')}", f"--{name}"]) if f not in taken]
        if flags:
            parser.add_argument(*flags, dest=name, nargs="?", action=_TRLOption, default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is an error naming the key and
    both lines (PyYAML would keep the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in seen:
                raise ValueError(f"the key {key!r} is given twice (lines {seen[key]} and {line}); keep one")
            if isinstance(key, typing.Hashable):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def check_input_file(path: Path, what: str) -> None:
    """``ValueError`` naming ``path`` (``what``: "--config") when it is a folder or does not exist."""
    if path.is_dir():
        raise ValueError(f"{what} {path}: is a folder, not a file; give the file's path")
    if not path.is_file():
        raise ValueError(f"{what} {path}: no such file")


def check_output_dir(value: Any) -> None:
    """``ValueError`` for an ``output_dir`` that cannot be a run folder: empty (it would write into
    the working folder), or a path that is, or runs through, a file."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"output_dir={value!r}: an empty folder name would write the run into the working "
                         "folder; give a folder, e.g. --output-dir runs/x (or '.' to mean this folder)")
    path = Path(value).expanduser()
    for part in (path, *path.parents):
        if part.exists() and not part.is_dir():
            what = "is a file" if part == path else f"runs through the file {str(part)!r}"
            raise ValueError(f"output_dir={value!r} {what}, not a folder; give a folder path (or move the file)")


def load_yaml(path: str | Path, cls: type) -> dict[str, Any]:
    """Read a YAML mapping of field -> value; unknown keys, and a key given twice, are an error
    naming them."""
    path = Path(path)
    check_input_file(path, "--config")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as err:
        raise ValueError(f"--config {path}: not valid YAML: {_yaml_problem(err)}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"--config {path}: not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    except ValueError as err:  # a key given twice
        raise ValueError(f"--config {path}: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of option: value, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    data = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"--config {path}: {_unknown_options(unknown)}; see `textrl train --help`")
    hints = typing.get_type_hints(cls)
    for name, value in data.items():
        try:
            refuse_saved_object(name, value)
            tp, optional = _base_type(hints[name])
            if tp in _KINDS and not (name in OBJECT_FIELDS and not isinstance(value, str)):
                data[name] = parse_value(tp, optional, value)
                check_value(name, hints[name], data[name])
        except ValueError as err:
            message = str(err) if str(err).startswith(f"{name}=") else f"{name}={value!r}: {err}"
            raise ValueError(f"--config {path}: {message}") from None
    return data


def _yaml_problem(err: Exception) -> str:
    """PyYAML's error as one line with the 1-based line and column (it names no file)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def build_config(namespace: argparse.Namespace, cls: type) -> Any:
    """Defaults, then the YAML file of ``namespace.config`` (if any), then explicit flags. A run's
    own ``config.yaml`` read from a folder the run was moved or copied to resumes the run in that
    folder (:func:`moved_run_folder`). ``namespace.config_sources`` is set to ``{field: YAML file}``
    for each setting the file gave and no flag overrode (:func:`name_config_sources`; not the
    fields that describe one invocation, ``output_dir``, ``resume``, ...)."""
    values: dict[str, Any] = {}
    config_path = getattr(namespace, "config", None)
    if config_path:
        values.update(load_yaml(config_path, cls))
    known = {f.name for f in fields(cls)}
    flags = {k: v for k, v in vars(namespace).items() if k in known}
    invocation = getattr(getattr(cls, "RESUME_RULES", None), "invocation", frozenset())  # what this command asks
    namespace.config_sources = {name: str(config_path) for name in values if name not in flags and name not in invocation}
    from_file = set(values) - set(flags)
    values.update(flags)
    if config_path and "output_dir" in from_file:
        values["output_dir"] = moved_run_folder(Path(config_path), values["output_dir"], bool(values.get("resume")))
    try:
        return cls(**values)
    except TypeError as err:  # pragma: no cover - dataclass signature mismatch
        raise ValueError(str(err)) from err


RUN_RECORD = "config.yaml"
"""The name of the record a run folder keeps of its settings (and each checkpoint of a run:
:data:`textrl.run.SETTINGS_FILE` is this name)."""


def moved_run_folder(config_path: Path, output_dir: Any, resume: bool) -> Any:
    """The run folder a ``--config`` file asks for: ``output_dir`` as it says, unless the file is a
    run's own record (``config.yaml`` beside a ``checkpoints/`` folder) whose ``output_dir`` names
    another folder (the run was moved or copied there, or is read from another working folder):
    then ``--resume`` continues the run in the folder the file is in (said in a line), and a fresh
    run is refused in one line naming both folders, rather than written to the recorded one."""
    folder = config_path.parent
    if config_path.name != RUN_RECORD or not (folder / "checkpoints").is_dir() or not isinstance(output_dir, str):
        return output_dir
    if Path(output_dir).expanduser().resolve() == folder.resolve():
        return output_dir
    if resume:
        print(f"--config {config_path}: this run's record names output_dir={output_dir!r}, and the run is in "
              f"{folder}: resuming it there (pass --output-dir to choose another folder)")
        return str(folder)
    raise ValueError(f"--config {config_path} is the record of the run in {folder}, written when it was in "
                     f"{output_dir!r}: pass --resume to continue that run in {folder}, or --output-dir "
                     "for a new run with its settings")


def name_config_sources(message: str, sources: dict[str, str]) -> str:
    """An error ``message`` that names flags (``drop --critic``) reworded for the values that came
    from a YAML file (``sources``: field -> file): ``drop --critic`` becomes ``remove critic: from
    FILE``, and any other flag it names is followed by where its value is set."""
    for name in sorted(sources, key=len, reverse=True):
        flag = "--" + name.replace("_", "-")
        pattern = re.compile(re.escape(flag) + r"(?![\w-])")
        if not pattern.search(message):
            continue
        message = re.sub(r"drop " + re.escape(flag) + r"(?![\w-])", f"remove {name}: from {sources[name]}", message)
        if pattern.search(message):
            message = pattern.sub(f"{flag} ({name}: is set in {sources[name]})", message, count=1)
    return message


OBJECT_FIELDS = ("model", "tokenizer", "dataset", "env", "reward")
"""Fields the Python API may set to an object (a model, a tokenizer, a dataset or list of rows, an
environment, a reward function or list of them)."""


def describe_object(value: Any) -> dict[str, Any]:
    """What ``config.yaml`` says of an object given for a field: its class, ``name_or_path`` and
    length where it has them (``{"object": "transformers...LlamaForCausalLM", ...}``)."""
    cls = type(value)
    out: dict[str, Any] = {"object": f"{cls.__module__}.{cls.__qualname__}"}
    name = getattr(value, "name_or_path", None) or getattr(getattr(value, "config", None), "_name_or_path", None)
    if name:
        out["name_or_path"] = str(name)
    if isinstance(value, (list, tuple)) or hasattr(value, "column_names"):
        out["rows"] = len(value)
    return out


def yaml_value(value: Any) -> Any:
    """A field's value as YAML can hold it: itself, or :func:`describe_object` of an object."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return describe_object(value)


def refuse_saved_object(name: str, value: Any) -> None:
    """A field read back from a config.yaml that recorded an object: say to pass the object again."""
    if name == "reward" and isinstance(value, (dict, list)):  # a recorded function: re-imported or refused
        refuse_recorded_callable(value)
        return
    if isinstance(value, dict) and "object" in value:
        what = value["object"] + (f" ({value['name_or_path']})" if value.get("name_or_path") else "")
        raise ValueError(
            f"{name}: this config was saved from a run given a {what} object, which a YAML file cannot hold; "
            f"pass the object again (TrainConfig({name}=...) in Python) or a path / hub id for {name}"
        )


def save_config(config: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (loadable again with ``--config``); an object given to the
    Python API is recorded by :func:`describe_object` (loading that file back asks for it again)."""
    Path(path).write_text(config_yaml(config))


def config_values(config: Any) -> dict[str, Any]:
    """Each field of a config dataclass as ``config.yaml`` holds it (:func:`yaml_value`)."""
    from textrl.core.user_files import absolute_paths

    recorded = {"reward": reward_record, "reward_weights": lambda w: None if w is None else [float(x) for x in w]}
    # relative local paths recorded absolute: the record names the same files from any working folder
    return absolute_paths({f.name: recorded.get(f.name, yaml_value)(getattr(config, f.name)) for f in fields(config)})


def config_yaml(config: Any) -> str:
    """The text of ``config.yaml`` (:func:`config_values`, in field order)."""
    return yaml.safe_dump(config_values(config), sort_keys=False)


def _unknown_options(names: typing.Iterable[str]) -> str:
    """``unknown option(s) a, b`` with, for a TRL name, the option textrl calls it."""
    hints = [trl_hint(name) for name in names if trl_hint(name)]
    listed = ", ".join(names)
    return f"unknown option(s) {listed}" + (f"; {'; '.join(hints)}" if hints else "")


def with_trl_hints(cls: type) -> type:
    """Make ``cls(**kwargs)`` name the option textrl uses for a TRL option name."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unknown = [name for name in kwargs if name not in cls.__dataclass_fields__]
        if unknown:
            raise TypeError(_unknown_options(unknown) + "; see `textrl train --help`")
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


__all__ = [
    "NEGATIVE_NUMBER",
    "OBJECT_FIELDS",
    "RUN_RECORD",
    "ResumeRules",
    "add_config_arguments",
    "add_trl_names",
    "build_config",
    "check_at_least",
    "check_bitsandbytes",
    "check_choice",
    "check_in_range",
    "check_input_file",
    "check_output_dir",
    "check_positive",
    "check_value",
    "check_values",
    "config_values",
    "config_yaml",
    "copy_field",
    "describe_object",
    "field_docs",
    "load_yaml",
    "moved_run_folder",
    "name_config_sources",
    "parse_value",
    "refuse_saved_object",
    "save_config",
    "with_trl_hints",
    "yaml_value",
]
