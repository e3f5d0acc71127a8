"""``textrl pipeline`` end to end at reduced sizes: the reward model ranks, PPO raises its reward."""

from __future__ import annotations

import json

import pytest

from textrl.cli import main
from textrl.stages.pipeline import PipelineConfig


@pytest.mark.slow
def test_pipeline_reduced(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["pipeline", "--output-dir", str(out), "--sft-steps", "200", "--rm-steps", "40",
            "--ppo-iterations", "40", "--progress", "false"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "== summary (held-out, before -> after) ==" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rm"]["eval_accuracy"][1] >= 0.9
    before, after = summary["ppo"]["eval"]["sampled/reward_components/reward_model"]
    assert after > before + 0.5
    for stage in ("sft/model", "rm/model", "ppo/metrics.jsonl", "data/prompts.jsonl", "config.yaml"):
        assert (out / stage).exists(), stage
    assert (out / "ppo" / "checkpoints" / "iter_000040" / "policy" / "config.json").is_file()
    with pytest.raises(ValueError, match="holds an earlier pipeline run"):
        PipelineConfig(output_dir=str(out)).validate()
