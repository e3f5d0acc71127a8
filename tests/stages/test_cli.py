"""Every stage subcommand end to end on tiny settings, and the errors of bad arguments."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from textrl.cli import main

FAST = ["--progress", "false", "--eval-every", "0"]


@pytest.mark.slow
def test_stage_commands_end_to_end(tmp_path, capsys):
    sft, rm, dpo = tmp_path / "sft", tmp_path / "rm", tmp_path / "dpo"
    assert main(["sft", "--output-dir", str(sft), "--steps", "3", "--eval-size", "4", *FAST]) == 0
    assert "held-out metric" in capsys.readouterr().out
    model = str(sft / "model")
    assert main(["rm", "--output-dir", str(rm), "--model", model, "--steps", "2", "--eval-size", "8", *FAST]) == 0
    assert main(["dpo", "--output-dir", str(dpo), "--model", model, "--steps", "2", "--eval-size", "8", *FAST]) == 0
    assert "logp_margin" in capsys.readouterr().out
    for stage in (sft, rm, dpo):
        for name in ("config.yaml", "metrics.jsonl", "summary.json", "model/config.json"):
            assert (stage / name).is_file(), stage / name
    assert AutoConfig.from_pretrained(rm / "model").num_labels == 1


@pytest.mark.slow
def test_lora_commands_merge_and_generate(tmp_path, capsys):
    lora, rm_lora, merged = tmp_path / "lora", tmp_path / "rm_lora", tmp_path / "merged"
    assert main(["sft", "--output-dir", str(lora), "--steps", "2", "--eval-size", "4", "--lora", *FAST]) == 0
    assert (lora / "model" / "adapter_model.safetensors").is_file()
    assert main(["rm", "--output-dir", str(rm_lora), "--steps", "2", "--eval-size", "4", "--lora", *FAST]) == 0
    assert (rm_lora / "model" / "score_head.safetensors").is_file()
    assert main(["merge", "--adapter", str(lora / "model"), "--output-dir", str(merged)]) == 0
    assert (merged / "textrl_merged.json").is_file() and (merged / "model.safetensors").is_file()
    capsys.readouterr()
    for model in (lora / "model", merged):
        assert main(["generate", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "3", "--greedy"]) == 0
    assert capsys.readouterr().out.count("### completion") == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sft", "--steps", "0"], "textrl sft: steps=0: must be a number >= 1"),
        (["sft", "--load-in-4bit"], "load_in_4bit=True needs lora=True"),
        (["sft", "--model", ""], "model=''"),
        (["rm", "--format", "csv"], "format='csv': must be one of auto, generic, hh, pku"),
        (["rm", "--lr", "-1"], "lr=-1.0: must be > 0"),
        (["dpo", "--beta", "0"], "beta=0.0: must be > 0"),
        (["merge", "--output-dir", "x"], "textrl merge: adapter='': pass --adapter"),
        (["pipeline", "--agent", "ppo"], "textrl pipeline: agent='ppo': must be one of gae_ppo, one_step_ppo, multi_adapter_ppo"),
        (["pipeline", "--ppo-iterations", "0"], "ppo_iterations=0"),
    ],
)
def test_bad_arguments_exit_with_a_message(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_data_errors_exit_naming_the_row(tmp_path):
    data = tmp_path / "prefs.jsonl"
    data.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n{"prompt": "p", "chosen": "a"}\n')
    with pytest.raises(SystemExit, match=r"textrl rm: .*row 1 \(line 2\): missing field 'rejected'"):
        main(["rm", "--data", str(data), "--output-dir", str(tmp_path / "rm"), "--eval-size", "0"])
    with pytest.raises(SystemExit, match="textrl dpo: preference data .*no such file"):
        main(["dpo", "--data", str(tmp_path / "missing.jsonl"), "--output-dir", str(tmp_path / "dpo")])
    with pytest.raises(SystemExit, match="eval_size=300: the preference data has only 256 rows"):
        main(["rm", "--output-dir", str(tmp_path / "rm2"), "--eval-size", "300"])


def test_stage_model_that_is_an_adapter_folder_is_rejected(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(SystemExit, match="is a LoRA adapter folder; merge it into its base first"):
        main(["dpo", "--model", str(tmp_path)])


def test_yaml_config_then_flags(tmp_path):
    from textrl.cli import build_parser
    from textrl.config import build_config
    from textrl.stages.rm import RMConfig

    path = tmp_path / "rm.yaml"
    path.write_text("steps: 7\nlr: 0.01\nlora: true\n")
    args = build_parser().parse_args(["rm", "--config", str(path), "--lr", "0.02"])
    config = build_config(args, RMConfig)
    assert (config.steps, config.lr, config.lora) == (7, 0.02, True)
    path.write_text("stepz: 7\n")
    with pytest.raises(SystemExit, match="unknown option"):
        main(["rm", "--config", str(path)])


def test_help_documents_inherited_fields(capsys):
    with pytest.raises(SystemExit):
        main(["dpo", "--help"])
    out = capsys.readouterr().out
    assert "LoRA rank. (default: 8)" in out and "DPO temperature" in out
