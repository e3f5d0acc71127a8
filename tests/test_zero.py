"""DeepSpeed set-up checks that need no process group: `--zero-stage`, `--deepspeed-config` and
accelerate's DeepSpeed environment. The agents under a real engine: tests/agents/test_zero.py;
runs over two processes: tests/test_multiprocess.py."""

from __future__ import annotations

import json
import os

import pytest

from textrl.config import TrainConfig
from textrl.parallel import check_sharding
from textrl.parallel.deepspeed_engine import deepspeed_config, read_zero_section
from textrl.training.trainer import train


@pytest.fixture(autouse=True)
def no_accelerate_env(monkeypatch):
    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_DEEPSPEED_CONFIG_FILE",
                 "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
                 "ACCELERATE_USE_FSDP", "ACCELERATE_DEEPSPEED_ZERO3_INIT"):
        monkeypatch.setenv(name, "")  # recorded, so that whatever a test sets is undone ...
        monkeypatch.delenv(name)  # ... and absent during the test


def write_config(tmp_path, zero: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 64, "bf16": {"enabled": True}, "zero_optimization": zero}))
    return str(path)


@pytest.mark.parametrize("overrides, message", [
    (dict(zero_stage=4), "zero_stage=4: must be one of 0, 1, 2, 3"),
    (dict(zero_stage=2, fsdp=True), "choose one"),
    (dict(zero_stage=3, load_in_4bit=True), "drop --zero-stage"),
    (dict(zero_stage=1, agent="multi_adapter_ppo", reward_adapter="x"), "drop --zero-stage"),
])
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**overrides).validate()


def test_the_engine_config_is_textrl_s_own_plus_the_zero_section():
    config = deepspeed_config(3, 1.0, {"stage": 1, "reduce_bucket_size": 1000})
    assert config["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 1000}  # the stage given wins
    assert config["gradient_clipping"] == 1.0 and config["managed_gradient_accumulation"] is False
    assert deepspeed_config(2, 0.0)["gradient_clipping"] == 0.0  # max_grad_norm=0: no clipping


def test_bucket_sizes_follow_the_model_width_unless_the_section_sets_them():
    # DeepSpeed's defaults (a 5e8-element reduce bucket) are for billion-weight models; accelerate's "auto"
    zero = deepspeed_config(3, 1.0, {"reduce_bucket_size": 1000, "stage3_prefetch_bucket_size": "auto"},
                            hidden_size=64)["zero_optimization"]
    assert zero == {"reduce_bucket_size": 1000, "stage3_prefetch_bucket_size": int(0.9 * 64 * 64),
                    "stage3_param_persistence_threshold": 640, "stage": 3}
    assert deepspeed_config(2, 1.0)["zero_optimization"] == {"stage": 2}  # no width known: DeepSpeed's own


@pytest.mark.parametrize("env, stage", [
    ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, 3),
    ({}, 2),  # accelerate's default stage
])
def test_an_accelerate_deepspeed_config_sets_the_stage(monkeypatch, env, stage):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = TrainConfig()
    assert check_sharding(config) == {} and config.zero_stage == stage


def test_accelerate_s_zero3_init_is_turned_off(monkeypatch):
    # models load whole and are partitioned by the engine; zero.Init inside from_pretrained would
    # partition them before the warm-up and the reference copy
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "true")
    check_sharding(TrainConfig())
    assert os.environ["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "false"


def test_an_accelerate_deepspeed_config_file_gives_stage_and_section(monkeypatch, tmp_path):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", write_config(tmp_path, {"stage": 3, "overlap_comm": False}))
    config = TrainConfig()
    assert check_sharding(config) == {"stage": 3, "overlap_comm": False}
    assert config.zero_stage == 3 and config.deepspeed_config.endswith("ds.json")


def test_a_deepspeed_config_file_alone_gives_the_stage(tmp_path):
    pytest.importorskip("deepspeed")
    config = TrainConfig(deepspeed_config=write_config(tmp_path, {"stage": 1}))
    assert check_sharding(config) == {"stage": 1} and config.zero_stage == 1
    config = TrainConfig(zero_stage=2, deepspeed_config=write_config(tmp_path, {"stage": 1}))
    check_sharding(config)
    assert config.zero_stage == 2  # --zero-stage wins over the file


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json", "is not valid JSON"),
    (json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}),
     "zero_optimization.offload_param.device='cpu'; textrl train does not support offload"),
    (json.dumps({"zero_optimization": {"stage": 5}}), "ZeRO stage 5 is not one of"),
])
def test_a_bad_deepspeed_config_file_is_named(tmp_path, content, message):
    path = tmp_path / "ds.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_zero_section(path)


def test_a_deepspeed_config_without_a_stage_asks_for_one(tmp_path):
    config = TrainConfig(deepspeed_config=write_config(tmp_path, {"overlap_comm": True}))
    with pytest.raises(ValueError, match="names no zero_optimization.stage; add one or pass --zero-stage"):
        check_sharding(config)


def test_offload_set_to_none_is_accepted(tmp_path):
    section = read_zero_section(write_config(tmp_path, {"stage": 2, "offload_optimizer": {"device": "none"}}))
    assert section == {"stage": 2}


def test_zero_in_one_process_says_how_to_launch(tmp_path):
    pytest.importorskip("deepspeed")
    with pytest.raises(ValueError, match="zero_stage=2 shards over several processes; launch with `accelerate launch"):
        train(TrainConfig(output_dir=str(tmp_path / "run"), zero_stage=2, device="cpu", iterations=1))


def test_a_missing_deepspeed_says_how_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_deepspeed(name, *args, **kwargs):
        if name == "deepspeed" or name.startswith("deepspeed."):
            raise ImportError("No module named 'deepspeed'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_deepspeed)
    with pytest.raises(ImportError, match=r"pip install 'textrl\[deepspeed\]'"):
        check_sharding(TrainConfig(zero_stage=2))
