"""Config values parse strictly and the same way from YAML, flags and the Python API, before any
model loads: booleans, integers, floats (1e-4 and -1e-4 too), and no NaN/inf."""

from __future__ import annotations

import argparse

import pytest

from textrl.config import TrainConfig, add_config_arguments, build_config, load_yaml
from textrl.stages.sft import SFTConfig


def parse_flags(*argv: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_config_arguments(parser, TrainConfig)
    return build_config(parser.parse_args(list(argv)), TrainConfig)


@pytest.mark.parametrize(("text", "field", "value"), [
    ('adaptive_kl: "no"', "adaptive_kl", False),
    ("adaptive_kl: 'yes'", "adaptive_kl", True),
    ("adaptive_kl: off", "adaptive_kl", False),
    ("actor_lr: 1e-4", "actor_lr", 1e-4),          # PyYAML reads this as a string
    ("actor_lr: 3", "actor_lr", 3.0),
    ("iterations: '12'", "iterations", 12),
    ("lora_r: null", "lora_r", None),
])
def test_yaml_values_parse_as_the_flags_do(tmp_path, text, field, value):
    path = tmp_path / "run.yaml"
    path.write_text(text + "\n")
    parsed = load_yaml(path)[field]
    assert parsed == value and type(parsed) is type(value)
    assert getattr(TrainConfig(**load_yaml(path)).validate(), field) == value


@pytest.mark.parametrize(("text", "message"), [
    ("iterations: 2.5", r"iterations=2.5: must be an integer"),
    ("iterations: true", r"iterations=True: must be an integer"),
    ("adaptive_kl: maybe", r"adaptive_kl='maybe': must be true or false"),
    ("actor_lr: fast", r"actor_lr='fast': must be a number"),
    ("max_new_tokens: null", r"max_new_tokens=None: must be an integer, not null"),
])
def test_bad_yaml_values_name_the_file_and_field(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError, match=rf"--config {path}: {message}"):
        load_yaml(path)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"iterations": 2.5}, r"iterations=2.5: must be an integer"),
    ({"adaptive_kl": "no"}, r"adaptive_kl='no': must be true or false, not str"),
    ({"actor_lr": "1e-4"}, r"actor_lr='1e-4': must be a number, not str"),
    ({"actor_lr": float("inf")}, r"actor_lr=inf: must be a finite number"),
    ({"kl_coef": float("nan")}, r"kl_coef=nan: must be a finite number"),
    ({"max_grad_norm": float("inf")}, r"max_grad_norm=inf: must be a finite number"),
    ({"seed": True}, r"seed=True: must be an integer"),
])
def test_the_python_api_gets_the_same_checks(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs).validate()


def test_the_stages_check_their_values_too():
    with pytest.raises(ValueError, match=r"lr=inf: must be a finite number"):
        SFTConfig(lr=float("inf")).validate()
    with pytest.raises(ValueError, match=r"steps=2.5: must be an integer"):
        SFTConfig(steps=2.5).validate()


def test_flags_take_negative_numbers_with_an_exponent_and_refuse_inf():
    with pytest.raises(ValueError, match=r"actor_lr=-0.0001: must be > 0"):
        parse_flags("--actor-lr", "-1e-4").validate()  # a value, not an unknown option
    assert parse_flags("--kl-coef", "0", "--actor-lr", "1e-4").actor_lr == 1e-4
    with pytest.raises(ValueError, match=r"actor_lr=inf: must be a finite number"):
        parse_flags("--actor-lr", "inf").validate()


@pytest.mark.parametrize("argv", [["--iterations", "2.5"], ["--adaptive-kl", "maybe"]])
def test_bad_flags_are_parser_errors_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit):
        parse_flags(*argv)
    assert f"argument {argv[0]}" in capsys.readouterr().err
