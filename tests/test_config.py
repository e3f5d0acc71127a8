from __future__ import annotations

import argparse

import pytest

from textrl.config import TrainConfig, add_config_arguments, build_config, field_docs, save_config


def _parse(argv, cls=TrainConfig):
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_config_arguments(parser, cls)
    return build_config(parser.parse_args(argv), cls)


def test_defaults_validate():
    TrainConfig().validate()


def test_every_field_has_a_docstring():
    docs = field_docs(TrainConfig)
    missing = [f for f in TrainConfig.__dataclass_fields__ if not docs.get(f)]
    assert missing == []


def test_shared_fields_are_declared_once_with_one_default_and_help():
    """``textrl train`` and the stages take the fields they declare alike from SharedFields."""
    from dataclasses import fields

    from textrl.config import SharedFields
    from textrl.stages.common import StageConfig
    from textrl.stages.sft import SFTConfig

    shared = {f.name: f.default for f in fields(SharedFields)}
    for cls in (TrainConfig, StageConfig, SFTConfig):
        own = {f.name: f for f in fields(cls)}
        docs = field_docs(cls)
        for name, default in shared.items():
            assert own[name].metadata.get("shared") == name, (cls, name)
            assert own[name].default == default
            assert docs[name] == field_docs(SharedFields)[name]


def test_command_line_overrides_yaml_overrides_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 3\nkl_coef: 0.2\nmax-new-tokens: 7\n")
    cfg = _parse(["--config", str(path), "--kl-coef", "0.3", "--dual_clip", "none", "--adaptive-kl"])
    assert (cfg.seed, cfg.kl_coef, cfg.max_new_tokens, cfg.dual_clip, cfg.adaptive_kl) == (3, 0.3, 7, None, True)


def test_saved_config_loads_back(tmp_path):
    cfg = TrainConfig(seed=5, gamma=0.9)
    save_config(cfg, tmp_path / "config.yaml")
    assert _parse(["--config", str(tmp_path / "config.yaml")]) == cfg


def test_unknown_yaml_key_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("kl_coeff: 0.2\n")
    with pytest.raises(ValueError, match="kl_coeff"):
        _parse(["--config", str(path)])


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"clip_eps": 0.0}, "clip_eps"),
        ({"clip_eps": -0.1}, "clip_eps"),
        ({"gamma": 1.5}, "gamma"),
        ({"lam": -0.1}, "lam"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"kl_kind": "k4"}, "kl_kind"),
        ({"agent": "dqn"}, "agent"),
        ({"num_minibatches": 3}, "num_minibatches"),
        ({"gradient_accumulation_steps": 3}, "gradient_accumulation_steps"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"top_p": 0.0}, "top_p"),
        ({"agent": "grpo", "n_samples_per_prompt": 1}, "n_samples_per_prompt"),
        ({"agent": "rloo", "n_samples_per_prompt": 1}, "n_samples_per_prompt"),
    ],
)
def test_invalid_fields_are_named(overrides, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**overrides).validate()


# -- TRL option names --------------------------------------------------------------------------


@pytest.mark.parametrize(("trl", "ours"), [("learning_rate", "actor_lr"), ("cliprange", "clip_eps"),
                                           ("num_generations", "n_samples_per_prompt"), ("beta", "kl_coef"),
                                           ("num_ppo_epochs", "ppo_epochs")])
def test_a_trl_option_name_says_which_option_we_call_it(tmp_path, trl, ours):
    message = f"{trl} is TRL's name: textrl calls it {ours}"
    with pytest.raises(TypeError, match=message):
        TrainConfig(**{trl: 1})
    path = tmp_path / "c.yaml"
    path.write_text(f"{trl}: 1\n")
    with pytest.raises(ValueError, match=message):
        _parse(["--config", str(path)])
    from textrl.cli import main

    with pytest.raises(SystemExit):
        main(["train", f"--{trl.replace('_', '-')}", "1"])


def test_a_trl_name_on_the_command_line_is_answered_with_ours(capsys):
    from textrl.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--learning-rate", "1e-5"])
    assert "learning_rate is TRL's name: textrl calls it actor_lr" in capsys.readouterr().err


def test_every_trl_option_maps_to_a_field_and_the_doc_holds_the_table():
    from pathlib import Path

    from textrl.config.trl_names import TRL_OPTIONS, markdown_table

    fields_ = set(TrainConfig.__dataclass_fields__)
    assert all(ours in fields_ for _, ours, _ in TRL_OPTIONS.values() if ours)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "migrating-from-trl.md").read_text()
    assert markdown_table() in doc


def test_lora_dropout_is_refused_by_train():
    """textrl train keeps the policy in eval mode (the ratio is exactly 1 before the first step), so a
    LoRA dropout would act on no forward: refused in one line rather than ignored."""
    with pytest.raises(ValueError, match=r"lora_dropout=0.1: textrl train runs the policy in eval mode") as err:
        TrainConfig(lora_dropout=0.1, lora_r=4).validate()
    assert "\n" not in str(err.value)
    TrainConfig(lora_dropout=0.0, lora_r=4).validate()


def test_a_critic_from_a_served_reward_model_is_refused():
    """``critic_init='reward_model'`` copies the reward model's weights; a served one has none here."""
    with pytest.raises(ValueError, match=r"give --reward-model PATH \(a folder or hub id, not a server\) or --critic-init policy") as err:
        TrainConfig(agent="gae_ppo", critic_init="reward_model", reward_model="http://h:8002").validate()
    assert "\n" not in str(err.value)
