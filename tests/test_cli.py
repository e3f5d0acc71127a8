from __future__ import annotations

import pytest

from textrl.cli import main


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))


def test_tiny_builds_and_prints_paths(capsys, tmp_path):
    assert main(["tiny"]) == 0
    out = capsys.readouterr().out
    for kind in ("causal_lm", "reward_model", "gpt2"):
        assert f"{kind}: {tmp_path / 'cache'}" in out


def test_generate_prints_a_completion_per_prompt(capsys):
    assert main(["generate", "--prompt", "hi", "--prompt", "What is 1+1?", "--max-new-tokens", "4", "--greedy"]) == 0
    out = capsys.readouterr().out
    assert out.count("### completion") == 2 and "What is 1+1?" in out


@pytest.mark.parametrize(("flag", "value"), [("--max-new-tokens", "0"), ("--temperature", "0")])
def test_generate_rejects_bad_settings(flag, value):
    with pytest.raises(SystemExit, match=flag):
        main(["generate", flag, value])


def test_unknown_subcommand_is_an_argparse_error():
    with pytest.raises(SystemExit):
        main(["frobnicate"])


# -- how a user's error looks: one line, the traceback with --debug ---------------------------------


def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("iterations: 3\n  actor_lr: 1e-4\n")
    with pytest.raises(SystemExit) as err:
        main(["train", "--config", str(config)])
    assert str(err.value.code) == (f"textrl train: --config {config}: not valid YAML: mapping values are not "
                                   "allowed here at line 2, column 11")


def _no_model(*args, **kwargs):
    raise AssertionError("a model was loaded before the prompts were checked")


def test_a_missing_prompt_file_is_one_line_before_any_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr("textrl.models.load_causal_lm", _no_model)
    monkeypatch.setattr("textrl.models.load_tokenizer", _no_model)
    missing = tmp_path / "prompts.jsonl"
    with pytest.raises(SystemExit) as err:
        main(["train", "--dataset", str(missing), "--output-dir", str(tmp_path / "run")])
    assert str(err.value.code) == f"textrl train: prompt file '{missing}' does not exist"
    assert not (tmp_path / "run" / "config.yaml").exists()


def _library_fault(*args, **kwargs):  # stands for a library (or a user's file) failing: not textrl's code
    raise ValueError("index 7 is out of bounds for axis 0 with size 3")


def test_an_error_from_outside_textrl_gets_its_type_and_the_debug_hint(tmp_path, monkeypatch):
    monkeypatch.setattr("textrl.trainer.build_agent", _library_fault)
    args = ["train", "--iterations", "1"]
    with pytest.raises(SystemExit) as err:
        main([*args, "--output-dir", str(tmp_path / "a")])
    assert str(err.value.code) == ("textrl train: ValueError: index 7 is out of bounds for axis 0 with size 3\n"
                                   "(for the traceback, rerun with --debug or TEXTRL_DEBUG=1)")
    with pytest.raises(ValueError, match="out of bounds"):
        main([*args, "--output-dir", str(tmp_path / "b"), "--debug"])
    monkeypatch.setenv("TEXTRL_DEBUG", "1")
    with pytest.raises(ValueError, match="out of bounds"):
        main([*args, "--output-dir", str(tmp_path / "c")])


def test_a_reward_function_that_raises_is_named_by_textrl(tmp_path):
    from tests.runs import SMALL

    reward = tmp_path / "my_reward.py"
    reward.write_text("def broken(completions, **kwargs):\n    return [1 / 0 for _ in completions]\n")
    with pytest.raises(SystemExit) as err:
        main(["train", "--reward", f"{reward}:broken", "--iterations", "1", *SMALL, "--output-dir", str(tmp_path / "a")])
    assert str(err.value.code).startswith("textrl train: reward 'broken' raised ZeroDivisionError: division by zero")
    assert "\n" not in str(err.value.code)
