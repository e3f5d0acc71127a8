"""Precision chosen once (textrl.core.precision) and every model on the run's device, in its dtype.

On a CPU, bfloat16 weights stand in for a CUDA device: a module built beside the loaded models
(a value head, a reward model, a critic from a reward model) that ignores where and how they live
shows up in the wrong dtype here exactly as it would on the wrong device there; the ``meta``
device checks the device itself.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch

from textrl.agents import AGENTS
from textrl.agents.build import task_reward
from textrl.config import TrainConfig
from textrl.core.precision import Precision, check_precision
from textrl.models import (
    ValueModel,
    build_tiny_causal_lm,
    build_tiny_reward_model,
    build_tiny_tokenizer,
)

QUIET = dict(log=lambda *a, **k: None)


def small(**overrides) -> TrainConfig:
    agent = overrides.get("agent", "gae_ppo")
    base = dict(prompts_per_iteration=2, n_samples_per_prompt=2 if AGENTS[agent].min_samples_per_prompt > 1 else 1,
                max_new_tokens=4, ppo_epochs=1, num_minibatches=1, warmup_sft_steps=0, eval_size=4, eval_every=0,
                progress=False, iterations=1)
    base.update(overrides)
    return TrainConfig(**base)


# -- the decision -----------------------------------------------------------------------------------


def test_precision_defaults_to_float32_weights_and_autocast_only_on_cuda():
    cpu = Precision.of(small(), "cpu")
    assert (cpu.dtype, cpu.autocast_dtype, cpu.attn_implementation) == (torch.float32, None, None)
    bf16 = Precision.of(small(dtype="bfloat16", mixed_precision="bf16", attn_implementation="eager"), "cpu")
    assert (bf16.dtype, bf16.autocast_dtype, bf16.attn_implementation) == (torch.bfloat16, torch.bfloat16, "eager")
    assert bf16.model_kwargs() == {"dtype": torch.bfloat16, "attn_implementation": "eager"}
    assert bf16.record() == {"dtype": "bfloat16", "autocast": "bfloat16", "attn_implementation": "eager",
                             "device": "cpu", "frozen_dtype": "bfloat16"}


def test_the_autocast_context_is_the_runs_and_shuts_out_an_outer_one():
    x = torch.randn(4, 4)
    with Precision.of(small(mixed_precision="bf16"), "cpu").autocast():
        assert (x @ x).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16), Precision.of(small(mixed_precision="no"), "cpu").autocast():
        assert (x @ x).dtype == torch.float32


@pytest.mark.parametrize("field, value, message", [
    ("dtype", "float16", "float16 weights need loss scaling"),
    ("dtype", "int8", "dtype='int8': must be one of float32, bfloat16"),
    ("mixed_precision", "fp16", "fp16 autocast needs loss scaling"),
    ("mixed_precision", "yes", "mixed_precision='yes'"),
    ("attn_implementation", "flash", "attn_implementation='flash': must be one of sdpa, eager, flash_attention_2"),
])
def test_a_precision_textrl_does_not_run_is_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        small(**{field: value}).validate()


def test_flash_attention_is_refused_without_the_package_or_off_cuda(monkeypatch):
    import transformers.utils

    config = small(attn_implementation="flash_attention_2")
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    with pytest.raises(ValueError, match="needs the flash-attn package"):
        check_precision(config)
    with pytest.raises(ValueError, match="runs on CUDA only"):
        Precision.of(config, "cpu")


def test_the_same_fields_on_the_same_device_are_one_frozen_precision():
    import dataclasses

    one = Precision.of(small(dtype="bfloat16", mixed_precision="bf16"), "cpu")
    assert Precision.of(small(dtype="bfloat16", mixed_precision="bf16", max_new_tokens=8), torch.device("cpu")) is one
    assert Precision.of(small(dtype="bfloat16", mixed_precision="no"), "cpu") is not one
    assert Precision.of(small(dtype="bfloat16", mixed_precision="bf16"), "meta") is not one
    assert Precision.of(small(dtype="bfloat16", mixed_precision="bf16", frozen_dtype="float32"), "cpu") is not one
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.dtype = torch.float32


def test_a_cuda_precision_follows_the_devices_bfloat16_support(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert Precision.of(small(), "cuda").autocast_dtype == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert Precision.of(small(), "cuda").autocast_dtype is None


def test_the_stages_decide_their_precision_in_one_function():
    from textrl.stages import common, policy, rm
    from textrl.stages.sft import SFTConfig

    assert policy.stage_precision(SFTConfig(), "cpu") is Precision.of(SFTConfig(), "cpu")
    for module in (common, rm):
        assert "Precision.of(" not in Path(module.__file__).read_text(), module.__name__


def test_the_stages_take_the_same_fields():
    from textrl.stages.sft import SFTConfig

    with pytest.raises(ValueError, match="dtype='float16'"):
        SFTConfig(dtype="float16").validate()
    assert Precision.of(SFTConfig(dtype="bfloat16"), "cpu").dtype == torch.bfloat16


def test_the_command_line_takes_the_flags_and_answers_trls_names(capsys):
    from textrl.cli import main

    for flags, hint in ((["--bf16"], "mixed_precision"), (["--torch-dtype", "bfloat16"], "calls it dtype")):
        with pytest.raises(SystemExit):
            main(["train", *flags])
        assert hint in capsys.readouterr().err


# -- every model on the run's device, in its dtype -----------------------------------------------------


def _tensors(agent):
    """``(name, tensor, is_parameter)`` of every parameter and buffer the agent reaches, the shared
    LoRA base's too."""
    seen = {}
    modules = [("", agent)] + ([("base.", agent.stack.model)] if getattr(agent, "stack", None) is not None else [])
    for prefix, module in modules:
        for name, t in module.named_parameters():
            seen.setdefault(id(t), (prefix + name, t, True))
        for name, t in module.named_buffers():
            seen.setdefault(id(t), (prefix + name, t, False))
    return list(seen.values())


@pytest.mark.parametrize("name", sorted(AGENTS))
def test_every_registered_agent_builds_every_model_on_its_device_in_the_run_dtype(name):
    config = small(agent=name, dtype="bfloat16", optim="adamw_anyprecision")
    agent = AGENTS[name].from_config(config, "cpu", **QUIET)
    assert agent.precision.dtype == torch.bfloat16
    lora = {n for n, _ in getattr(agent, "stack", None) and
            [(n, p) for params in agent.stack.lora.values() for n, p in params] or []}
    for tensor_name, tensor, is_parameter in _tensors(agent):
        assert tensor.device == agent.device, tensor_name
        if not is_parameter or not tensor.is_floating_point() or tensor_name.removeprefix("base.") in lora:
            continue  # buffers such as rotary frequencies stay float32 (transformers' choice); peft keeps
            # its adapter weights (and the adapter critic its head) in float32
        if "value_head" in tensor_name and getattr(agent, "stack", None) is not None:
            continue
        assert tensor.dtype == torch.bfloat16, f"{name}: {tensor_name} is {tensor.dtype}"


def test_a_critic_from_a_reward_model_and_a_reward_model_of_the_spec_run_in_the_run_precision():
    config = small(agent="gae_ppo", dtype="bfloat16", critic_init="reward_model", reward_model="tiny",
                   optim="adamw_anyprecision")
    agent = AGENTS["gae_ppo"].from_config(config, "cpu", **QUIET)
    assert {p.dtype for p in agent.critic.parameters()} == {torch.bfloat16}
    reward = task_reward(agent, "think_format,reward_model:tiny")
    neural = reward.functions["reward_model"]
    assert {p.dtype for p in neural.model.parameters()} == {torch.bfloat16}
    assert neural.autocast == agent.precision.autocast


def test_a_critic_is_built_where_its_backbone_lives():
    tok = build_tiny_tokenizer()
    for source, build in ((build_tiny_causal_lm, ValueModel.from_causal_lm),
                          (build_tiny_reward_model, ValueModel.from_reward_model)):
        critic = build(source(tok).to("meta"))
        assert {p.device.type for p in critic.parameters()} == {"meta"}
        critic = build(source(tok).to(dtype=torch.bfloat16))
        assert {p.dtype for p in critic.parameters()} == {torch.bfloat16}


@pytest.mark.slow
def test_textrl_train_in_bfloat16_runs_and_records_the_precision(tmp_path):
    from textrl.training.trainer import train

    out = tmp_path / "run"
    with contextlib.redirect_stdout(None):
        train(small(agent="gae_ppo", output_dir=str(out), dtype="bfloat16", mixed_precision="bf16", iterations=2,
                    optim="adamw_anyprecision"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["precision"] == {"dtype": "bfloat16", "autocast": "bfloat16", "attn_implementation": "default",
                                    "device": "cpu", "frozen_dtype": "bfloat16"}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["nonfinite/skipped_updates"] == 0 for r in rows)


def test_a_stage_trains_and_saves_in_the_run_dtype(tmp_path):
    from textrl.stages.sft import SFTConfig, train_sft

    with contextlib.redirect_stdout(None):
        summary = train_sft(SFTConfig(output_dir=str(tmp_path / "sft"), steps=1, batch_size=4, eval_size=4,
                                      dtype="bfloat16", mixed_precision="bf16", progress=False))
    assert summary["precision"]["dtype"] == "bfloat16" and summary["precision"]["autocast"] == "bfloat16"
    saved = json.loads((tmp_path / "sft" / "model" / "config.json").read_text())
    assert saved.get("dtype", saved.get("torch_dtype")) == "bfloat16"
    assert math.isfinite(summary["after"]["loss"])
