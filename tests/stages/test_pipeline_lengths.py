"""`textrl pipeline` takes every length option its stages read and passes each on: SFT's and the
reward model's max_length, PPO's max_prompt_length, max_new_tokens and max_episode_tokens (before,
PPO died on max_prompt_length=64 and told the user to raise --max-prompt-length, which the
pipeline did not accept)."""

from __future__ import annotations

import dataclasses

import pytest

import textrl.stages.pipeline as pipeline
from textrl.config import TrainConfig
from textrl.stages.pipeline import PipelineConfig
from textrl.stages.rm import RMConfig
from textrl.stages.sft import SFTConfig

LENGTHS = {"sft": {"max_length": "sft_max_length"}, "rm": {"max_length": "rm_max_length"},
           "ppo": {"max_prompt_length": "max_prompt_length", "max_new_tokens": "max_new_tokens",
                   "max_episode_tokens": "max_episode_tokens"}}
"""Each stage's length fields -> the pipeline option that sets it."""


def test_every_length_field_of_the_stages_is_a_pipeline_option():
    for stage, config in (("sft", SFTConfig), ("rm", RMConfig), ("ppo", TrainConfig)):
        read = {f.name for f in dataclasses.fields(config) if f.name.startswith("max_") and ("length" in f.name or f.name.endswith("_tokens"))}
        assert read <= set(LENGTHS[stage]), (stage, read - set(LENGTHS[stage]))
    options = {f.name for f in dataclasses.fields(PipelineConfig)}
    assert {o for m in LENGTHS.values() for o in m.values()} <= options


def test_the_pipeline_passes_each_length_on(tmp_path, monkeypatch):
    seen = {}

    def stage(name):
        def run(config):
            seen[name] = config
            return {"before": {}, "after": {}}
        return run

    def ppo(config):
        seen["ppo"] = config
        raise SystemExit("stop after reading the config")

    monkeypatch.setattr(pipeline, "train_sft", stage("sft"))
    monkeypatch.setattr(pipeline, "train_rm", stage("rm"))
    monkeypatch.setattr("textrl.training.trainer.train", ppo)
    asked = {"sft_max_length": 111, "rm_max_length": 122, "max_prompt_length": 133, "max_new_tokens": 9,
             "max_episode_tokens": 44}
    with pytest.raises(SystemExit):
        pipeline.run_pipeline(PipelineConfig(output_dir=str(tmp_path / "p"), progress=False, **asked))
    for name, fields in LENGTHS.items():
        for field, option in fields.items():
            assert getattr(seen[name], field) == asked[option], (name, field)


def test_a_bad_length_option_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"max_episode_tokens=4: must be a number >= 24"):
        PipelineConfig(output_dir=str(tmp_path / "p"), max_episode_tokens=4).validate()
    with pytest.raises(ValueError, match=r"sft_max_length=0: must be a number >= 1"):
        PipelineConfig(output_dir=str(tmp_path / "p"), sft_max_length=0).validate()
