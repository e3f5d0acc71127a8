"""The Python API takes objects as TRL's trainers do: a loaded model, a tokenizer, a
``datasets.Dataset`` or a list of rows; ``config.yaml`` records what they were, and loading that
file back asks for the objects again."""

from __future__ import annotations

import argparse

import datasets
import pytest
import yaml

from textrl.config import TrainConfig, add_config_arguments, build_config, load_yaml
from textrl.envs.tasks import make_digits_task
from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer
from textrl.training.trainer import train

SMALL = dict(iterations=1, warmup_sft_steps=0, prompts_per_iteration=2, n_samples_per_prompt=2, max_new_tokens=4,
             eval_size=2, eval_every=0, progress=False, ppo_epochs=1, num_minibatches=1, reward="think_format")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("as_dataset", [True, False])
def test_train_takes_a_model_a_tokenizer_and_a_dataset_object(tmp_path, as_dataset):
    tok = build_tiny_tokenizer()
    model = build_tiny_causal_lm(tok, seed=0)
    rows = [{"prompt": row["prompt"], "answer": row["answer"]} for row in make_digits_task()[:8]]
    dataset = datasets.Dataset.from_list(rows) if as_dataset else rows
    out = tmp_path / "run"
    summary = train(TrainConfig(output_dir=str(out), model=model, tokenizer=tok, dataset=dataset, **SMALL))
    assert summary["after"]
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["object"] == f"{type(model).__module__}.{type(model).__qualname__}"
    assert saved["tokenizer"]["object"].endswith(type(tok).__qualname__)
    assert saved["dataset"]["rows"] == 8
    assert saved["dataset"]["object"] == ("datasets.arrow_dataset.Dataset" if as_dataset else "builtins.list")
    with pytest.raises(ValueError, match=r"model: this config was saved from a run given a .* object.*pass the object again"):
        load_yaml(out / "config.yaml")
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_config_arguments(parser)
    with pytest.raises(ValueError, match="pass the object again"):
        build_config(parser.parse_args(["--config", str(out / "config.yaml")]))
    with pytest.raises(ValueError, match="dataset: this config was saved from a run given a"):
        TrainConfig(dataset=saved["dataset"]).validate()
