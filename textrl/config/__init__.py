"""The run's options: ``textrl train``'s :class:`TrainConfig`, and how every config is read and checked.

- :mod:`~textrl.config.train_config`: :class:`TrainConfig` (every knob of ``textrl train``) and the
  fields it shares with the stages;
- :mod:`~textrl.config.validation`: the checks :meth:`TrainConfig.validate` runs;
- :mod:`~textrl.config.io`: the machinery of config dataclasses (flags from fields, YAML in and
  out, precedence, value checks), for ``TrainConfig`` and the stages' ``StageConfig`` alike;
- :mod:`~textrl.config.reward_option`: the shape of ``--reward`` and how ``config.yaml`` records it;
- :mod:`~textrl.config.trl_names`: TRL's option names and ours (one table: the hint and the docs);
- :mod:`~textrl.config.help_topics`: the topics ``--help`` groups the options under.

The names users import from ``textrl.config`` (``TrainConfig``, ``build_config``, ``load_yaml``,
``save_config``, ...) are importable from here.
"""

from __future__ import annotations

from textrl.config.train_config import (
    AGENT_OPTIONS,
    FORMER_DEFAULTS,
    OBJECT_FIELDS,
    ResumeRules,
    SharedFields,
    TrainConfig,
    add_config_arguments,
    add_trl_names,
    build_config,
    check_bitsandbytes,
    check_output_dir,
    check_value,
    check_values,
    config_values,
    config_yaml,
    describe_object,
    field,
    field_docs,
    load_yaml,
    parse_value,
    save_config,
    shared,
    yaml_value,
)
from textrl.config.validation import KL_KINDS

__all__ = [
    "AGENT_OPTIONS",
    "FORMER_DEFAULTS",
    "KL_KINDS",
    "OBJECT_FIELDS",
    "ResumeRules",
    "SharedFields",
    "TrainConfig",
    "add_config_arguments",
    "add_trl_names",
    "build_config",
    "check_bitsandbytes",
    "check_output_dir",
    "check_value",
    "check_values",
    "config_values",
    "config_yaml",
    "describe_object",
    "field",
    "field_docs",
    "load_yaml",
    "parse_value",
    "save_config",
    "shared",
    "yaml_value",
]
