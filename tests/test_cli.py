from __future__ import annotations

import pytest
import torch

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
    monkeypatch.setattr("textrl.training.set_up.build_agent", _library_fault)
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


# -- every error in one or two lines -----------------------------------------------------------------


def _raises(err):
    def fault(*args, **kwargs):
        raise err
    return fault


@pytest.mark.parametrize(("err", "shown"), [
    (RuntimeError("shapes do not match\n  at layer 3\n  in block 7"), "RuntimeError: shapes do not match"),
    (KeyError("reward/mean"), "KeyError: 'reward/mean'"),
    (AttributeError("'list' object has no attribute 'get'"),  # e.g. a JSON record that is a list
     "AttributeError: 'list' object has no attribute 'get'"),
])
def test_any_error_is_its_type_and_first_line_then_the_debug_hint(tmp_path, monkeypatch, err, shown):
    monkeypatch.setattr("textrl.training.set_up.build_agent", _raises(err))
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--iterations", "1", "--output-dir", str(tmp_path / "a")])
    assert str(stopped.value.code) == f"textrl train: {shown}\n(for the traceback, rerun with --debug or TEXTRL_DEBUG=1)"
    with pytest.raises(type(err)):
        main(["train", "--iterations", "1", "--output-dir", str(tmp_path / "b"), "--debug"])


@pytest.mark.parametrize("err", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                 MemoryError()])
def test_out_of_memory_names_the_batch_size_levers(tmp_path, monkeypatch, err):
    monkeypatch.setattr("textrl.training.set_up.build_agent", _raises(err))
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--iterations", "1", "--output-dir", str(tmp_path / "a")])
    first, second = str(stopped.value.code).split("\n")
    assert first.startswith(f"textrl train: {type(err).__name__}: ")
    assert "out of memory: lower --generation-batch-size and --forward-batch-size" in first
    assert "--debug" in second


def test_a_full_disk_in_a_library_names_the_file_and_the_fix(tmp_path, monkeypatch):
    import errno

    monkeypatch.setattr("textrl.training.set_up.build_agent",
                        _raises(OSError(errno.ENOSPC, "No space left on device", "/data/x.bin")))
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--iterations", "1", "--output-dir", str(tmp_path / "a")])
    assert "the disk holding /data/x.bin is full: free space there" in str(stopped.value.code)


def test_a_damaged_model_cache_is_one_line_naming_the_cache_and_the_fix(tmp_path):
    from textrl.models import tiny_model_path

    folder = tiny_model_path("causal_lm")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])  # a build cut short
    with pytest.raises(SystemExit) as stopped:
        main(["generate", "--max-new-tokens", "2"])
    first, second = str(stopped.value.code).split("\n")
    assert first.startswith("textrl generate: SafetensorError: ")
    assert "weights file is damaged or cut short" in first and str(tmp_path / "cache") in first
    (folder / "config.json").write_text("{not json")
    with pytest.raises(SystemExit) as stopped:
        main(["generate", "--max-new-tokens", "2"])
    assert f"a file in the model cache {tmp_path / 'cache'} is damaged" in str(stopped.value.code)


# -- the culprit named -------------------------------------------------------------------------------


def test_an_empty_output_dir_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for command in (["train"], ["sft"], ["pipeline"]):
        with pytest.raises(SystemExit) as refused:
            main([*command, "--output-dir", ""])
        assert str(refused.value.code).startswith(f"textrl {command[0]}: output_dir='': an empty folder name")
    assert list(tmp_path.iterdir()) == []  # nothing written in the working folder


def test_an_output_dir_that_is_a_file_is_named(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("a file")
    with pytest.raises(SystemExit) as refused:
        main(["train", "--output-dir", str(taken)])
    assert str(refused.value.code) == (f"textrl train: output_dir={str(taken)!r} is a file, not a folder; "
                                       "give a folder path (or move the file)")
    with pytest.raises(SystemExit) as refused:
        main(["sft", "--output-dir", str(taken / "run")])
    assert f"runs through the file {str(taken)!r}" in str(refused.value.code)


def test_a_folder_given_for_a_file_is_called_a_folder(tmp_path):
    with pytest.raises(SystemExit) as refused:
        main(["train", "--config", str(tmp_path)])
    assert str(refused.value.code) == f"textrl train: --config {tmp_path}: is a folder, not a file; give the file's path"
    with pytest.raises(SystemExit) as refused:
        main(["train", "--dataset", str(tmp_path), "--output-dir", str(tmp_path / "run")])
    assert "is a folder, not a file" in str(refused.value.code)
    with pytest.raises(SystemExit) as refused:
        main(["sft", "--data", str(tmp_path), "--output-dir", str(tmp_path / "sft")])
    assert "is a folder, not a file" in str(refused.value.code)


def test_a_key_given_twice_in_the_config_is_refused_naming_it_and_its_lines(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("iterations: 3\nactor_lr: 1e-4\niterations: 30\n")
    with pytest.raises(SystemExit) as refused:
        main(["train", "--config", str(config)])
    assert str(refused.value.code) == (f"textrl train: --config {config}: the key 'iterations' is given twice "
                                       "(lines 1 and 3); keep one")


def test_a_full_disk_while_appending_metrics_names_the_file_and_resume():
    from pathlib import Path

    from textrl.errors import user_error_message
    from textrl.run.metrics import MetricsLog

    log = MetricsLog(Path("/dev"), enabled=False, resume_after=None)
    log.enabled, log.path = True, Path("/dev/full")  # every write: ENOSPC
    with pytest.raises(OSError) as err:
        log.write({"iteration": 3, "loss": 1.0})
    assert err.value.errno == 28
    assert user_error_message("train", err.value) == (
        "textrl train: cannot append iteration 3's row to /dev/full: the disk is full; free space (or fix the "
        "folder), then resume with --resume: the rows after the last checkpoint are written again")


def test_a_grouped_run_that_succeeded_ends_its_process_without_the_interpreters_teardown():
    """``entry`` (the ``textrl`` command): after a multi-process run succeeded, ``os._exit`` with
    main's status, output flushed (the teardown of a distributed run's C++ threads could abort it);
    otherwise ``sys.exit`` as usual, atexit handlers run."""
    import subprocess
    import sys

    script = ("import atexit, textrl.cli as c; atexit.register(lambda: print('teardown ran', flush=True)); "
              "c.main = lambda: 3; c._HARD_EXIT = {}; print('ran', end='', flush=False); c.entry()")
    for hard, teardown in ((True, False), (False, True)):
        result = subprocess.run([sys.executable, "-c", script.format(hard)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 3 and result.stdout.startswith("ran")  # the unflushed output kept
        assert ("teardown ran" in result.stdout) is teardown


def test_version_and_python_dash_m_are_the_command(capsys):
    import subprocess
    import sys

    from textrl import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"textrl {__version__}"
    run = subprocess.run([sys.executable, "-m", "textrl", "--version"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == f"textrl {__version__}", run.stderr

