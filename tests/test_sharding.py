"""FSDP set-up checks that need no process group (sharded runs: test_multiprocess.py; DeepSpeed: test_zero.py),
and a rollback of NaN/inf weights over two FSDP processes."""

from __future__ import annotations

import pytest
import torch

from textrl.config import TrainConfig
from textrl.models import ValueModel, build_tiny_causal_lm, build_tiny_tokenizer
from textrl.parallel import check_sharding
from textrl.parallel.fsdp_sharding import is_sharded, local, to_float, unit_classes
from textrl.training.trainer import train


@pytest.mark.parametrize("overrides", [dict(agent="multi_adapter_ppo", reward_adapter="x"), dict(load_in_4bit=True)])
def test_fsdp_refuses_the_single_base_agents(overrides):
    with pytest.raises(ValueError, match="fsdp=True shards full-precision models"):
        TrainConfig(fsdp=True, **overrides).validate()


def test_an_accelerate_fsdp_config_turns_fsdp_on(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    config = TrainConfig()
    assert check_sharding(config) is None and config.fsdp is True and config.fsdp_reshard_after_forward
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    config = TrainConfig()
    check_sharding(config)
    assert config.fsdp is False and config.zero_stage == 0


@pytest.mark.parametrize("env, reshard", [
    ({"FSDP_RESHARD_AFTER_FORWARD": "false"}, False),  # an FSDP2 config
    ({"FSDP_RESHARD_AFTER_FORWARD": "true"}, True),
    ({"FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"}, False),  # FSDP1-style strategy names
    ({"FSDP_SHARDING_STRATEGY": "FULL_SHARD"}, True),
])
def test_the_accelerate_reshard_option_is_read(monkeypatch, env, reshard):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = TrainConfig()
    check_sharding(config)
    assert config.fsdp_reshard_after_forward is reshard


@pytest.mark.parametrize("launcher, name, value, option", [
    ("ACCELERATE_USE_FSDP", "FSDP_OFFLOAD_PARAMS", "true", "fsdp_offload_params"),
    ("ACCELERATE_USE_FSDP", "FSDP_ACTIVATION_CHECKPOINTING", "true", "fsdp_activation_checkpointing"),
    ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu", "offload_optimizer_device"),
    ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "cpu", "offload_param_device"),
])
def test_accelerate_options_textrl_cannot_honour_are_named(monkeypatch, launcher, name, value, option):
    monkeypatch.setenv(launcher, "true")
    monkeypatch.setenv(name, value)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "")  # restored after (check_sharding sets it)
    with pytest.raises(ValueError, match=f"sets {option}: {value}, which textrl train does not support"):
        check_sharding(TrainConfig())


def test_fsdp_in_one_process_says_how_to_launch(tmp_path):
    with pytest.raises(ValueError, match="accelerate launch --num_processes N"):
        train(TrainConfig(output_dir=str(tmp_path / "run"), fsdp=True, device="cpu", iterations=1))


def test_decoder_layers_are_the_fsdp_units_of_policy_and_critic():
    tok = build_tiny_tokenizer()
    policy = build_tiny_causal_lm(tok)
    assert unit_classes(policy) == {"LlamaDecoderLayer"}
    assert unit_classes(ValueModel.from_causal_lm(policy)) == {"LlamaDecoderLayer"}
    assert unit_classes(torch.nn.Linear(2, 2)) == set()


def test_plain_tensors_pass_through_the_shard_helpers():
    t = torch.tensor(2.5)
    assert not is_sharded(t) and local(t) is t and to_float(t) == 2.5


@pytest.mark.slow
def test_fsdp_processes_roll_back_a_step_that_left_nonfinite_weights_together(tmp_path):
    # rank 1's step fills its shards of the policy weights with inf: both processes restore their own
    # shards and AdamW states (DTensors' local parts), bit for bit, and train on as if it never ran
    from tests.test_nonfinite_weights import check_rolled_back_together

    check_rolled_back_together(tmp_path, "fsdp")
