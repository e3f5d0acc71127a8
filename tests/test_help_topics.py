"""A quiet and fast command line (issue 42): help grouped by topic and built without torch, other
libraries' chatter left out unless ``--debug``, a closed pipe ends quietly, ``textrl generate`` on a
run's checkpoint, and training from Python with ``from textrl import TrainConfig, train``."""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import fields

import pytest

from tests.runs import SMALL
from textrl.cli import build_parser, main
from textrl.config import TrainConfig
from textrl.config.help_topics import FIELD_TOPIC, TOPICS, topic_of
from textrl.stages.common import StageConfig


def _config_classes():
    from textrl.stages import dpo, merge, pipeline, rm, sft

    return [TrainConfig, StageConfig, sft.SFTConfig, rm.RMConfig, dpo.DPOConfig, merge.MergeConfig,
            pipeline.PipelineConfig]


@pytest.mark.parametrize("cls", _config_classes(), ids=lambda c: c.__name__)
def test_every_config_field_has_a_topic(cls):
    missing = [f.name for f in fields(cls) if topic_of(f.name) is None]
    assert not missing, f"give these fields a topic in textrl/config/help_topics.py: {missing}"


def test_a_field_is_in_one_topic():
    listed = [name for _, names in TOPICS.values() for name in names]
    assert len(listed) == len(set(listed)) == len(FIELD_TOPIC)


def test_train_help_lists_each_option_under_its_topic():
    parser = build_parser("train")
    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    titles = [g.title for g in train._action_groups]
    assert titles[2:] == list(TOPICS)  # after argparse's positionals and options, in TOPICS' order
    for group in train._action_groups[2:]:
        dests = [a.dest for a in group._group_actions]
        assert dests and all(FIELD_TOPIC[d] == group.title for d in dests)
        assert dests == [name for name in TOPICS[group.title][1] if name in dests]  # in the order listed
    agent = next(g for g in train._action_groups if g.title == "agent")
    dests = [a.dest for a in agent._group_actions]
    at = dests.index("critic")
    assert dests[at:at + 3] == ["critic", "critic_init", "critic_type"]  # side by side, as the description tells them
    assert "--critic-type" in train.format_help() and "each for another case" in train.format_help()


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def test_train_help_and_the_top_level_help_import_neither_torch_nor_transformers():
    code = ("import sys\nfrom textrl.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('LOADED', sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    for args in (["train", "--help"], ["--help"]):
        out = _python(code, *args)
        assert "LOADED []" in out.stdout, (args, out.stdout[-300:], out.stderr[-500:])
        assert "usage: textrl" in out.stdout


def test_the_agents_help_lists_are_the_registry_s():
    from textrl.core.agent_registry import BUILTIN_AGENTS, agent_names

    assert sorted(BUILTIN_AGENTS) == agent_names()  # no entry points are installed here


def test_other_libraries_chatter_is_left_out_and_errors_stay_within_the_command_only(monkeypatch):
    from textrl.core import quiet

    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    logger = logging.getLogger("DeepSpeed")
    warn = logger.makeRecord("DeepSpeed", logging.WARNING, "f", 1, "Setting accelerator to CPU.", None, None)
    error = logger.makeRecord("DeepSpeed", logging.ERROR, "f", 1, "a real failure", None, None)
    with quiet.quiet_libraries(debug=True):
        assert logger.filter(warn) and "TRANSFORMERS_VERBOSITY" not in os.environ
    with quiet.quiet_libraries():
        assert not logger.filter(warn) and logger.filter(error)
        assert os.environ["TRANSFORMERS_VERBOSITY"] == "error"
        assert logging.getLogger("textrl").filters == []
    assert logger.filter(warn) and "TRANSFORMERS_VERBOSITY" not in os.environ  # as before, after the command


def test_vllm_s_log_is_quiet_in_the_command_and_its_server_gets_the_user_s_environment(monkeypatch):
    """The command sets vLLM's log level to errors and turns progress bars off (the colocated engine
    reads :func:`textrl.core.quiet.progress_bars`); a program it hands over to (``textrl vllm-serve``'s
    server) gets the environment the user had, a value the user set kept either way."""
    from textrl.core import quiet

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")  # the user's own
    assert quiet.progress_bars()
    with quiet.quiet_libraries():
        assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR" and not quiet.progress_bars()
        before = quiet.environment_before_quiet()
        assert "VLLM_LOGGING_LEVEL" not in before and "HF_HUB_DISABLE_PROGRESS_BARS" not in before
        assert before["TRANSFORMERS_VERBOSITY"] == "info" == os.environ["TRANSFORMERS_VERBOSITY"]
    assert "VLLM_LOGGING_LEVEL" not in os.environ and quiet.progress_bars()
    assert quiet.environment_before_quiet() == dict(os.environ)


def test_vllm_s_rotary_reload_warning_is_left_out_and_its_other_reload_warnings_stay():
    """At every weight hand-over vLLM warns ``RotaryEmbedding: Failed to load weights`` (a table
    computed from the config, put back as it was); another layer's failure is a real one and stays."""
    from textrl.generation.vllm_worker import RELOAD_LOGGER, quiet_rotary_reloads

    logger = logging.getLogger(RELOAD_LOGGER)

    def record(layer: str) -> logging.LogRecord:
        return logger.makeRecord(RELOAD_LOGGER, logging.WARNING, "f", 1, "%s: Failed to load weights", (layer,), None)

    quiet_rotary_reloads()
    quiet_rotary_reloads()  # once
    assert len(logger.filters) == 1
    assert not logger.filter(record("RotaryEmbedding")) and not logger.filter(record("Llama3RotaryEmbedding"))
    assert logger.filter(record("QKVParallelLinear"))
    other = logger.makeRecord(RELOAD_LOGGER, logging.WARNING, "f", 1, "%s: Delayed processing", ("RotaryEmbedding",), None)
    assert logger.filter(other)


def test_other_libraries_deprecations_are_left_out_and_textrl_s_stay():
    from textrl.core import quiet

    def warn(category: type[Warning], module: str) -> None:
        warnings.warn_explicit(f"from {module}", category, "f.py", 1, module=module)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet.quiet_libraries():
            warn(FutureWarning, "transformers.modeling_utils")  # peft reading a deprecated property
            warn(DeprecationWarning, "peft.peft_model")
            warn(UserWarning, "transformers.generation.utils")  # not a deprecation: stays
            warn(FutureWarning, "textrl.training.trainer")  # textrl's own: stays
            warn(FutureWarning, "transformers_addon")  # another package whose name starts alike: stays
        warn(FutureWarning, "transformers.modeling_utils")  # after the command: as before
    assert [str(w.message) for w in seen] == ["from transformers.generation.utils", "from textrl.training.trainer",
                                              "from transformers_addon", "from transformers.modeling_utils"]


def test_a_command_prints_no_third_party_chatter_unless_debug(tmp_path):
    out = tmp_path / "run"
    # a LoRA policy: peft imports bitsandbytes (its CPU kernel message) and reads a deprecated
    # transformers property (a FutureWarning)
    args = ["-m", "textrl", "train", *SMALL, "--lora-r", "4", "--iterations", "1", "--output-dir", str(out)]
    quiet = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0, quiet.stderr[-800:]
    text = quiet.stdout + quiet.stderr
    for noise in ("Setting accelerator to CPU", "Loading weights", "Writing model shards", "gemm_4bit_forward",
                  "FutureWarning"):
        assert noise not in text, noise
    assert "running on cpu" in text and "held-out metric" in text  # textrl's own lines stay
    loud = subprocess.run([sys.executable, *args, "--output-dir", str(tmp_path / "loud"), "--debug"],
                          capture_output=True, text=True, timeout=300)
    assert loud.returncode == 0 and "Loading weights" in loud.stdout + loud.stderr


@pytest.mark.parametrize("args", [["envs"], ["--help"], ["--version"]], ids=" ".join)
def test_a_closed_pipe_ends_the_command_quietly(args):
    # the reader is gone before the command writes (`textrl envs | head -1` once head has exited);
    # stdout block-buffered as in a user's shell, so the write fails when the buffer is flushed
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "textrl", *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120, env=env)
    finally:
        os.close(write)
    assert proc.stderr == "" and proc.returncode == 141


def test_generate_takes_a_runs_checkpoint_or_the_run_folder(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--iterations", "1", "--checkpoint-every", "1", "--output-dir", str(out)]) == 0
    checkpoint = next((out / "checkpoints").iterdir())
    capsys.readouterr()
    newest = f"the policy of {out}'s newest checkpoint: {checkpoint / 'policy'}"
    for given, said in ((checkpoint, f"the policy of checkpoint {checkpoint}: {checkpoint / 'policy'}"),
                        (out, newest), (out / "checkpoints", newest)):
        assert main(["generate", "--model", str(given), "--max-new-tokens", "4", "--greedy"]) == 0
        captured = capsys.readouterr()
        assert said in captured.err and "### completion" in captured.out
    with pytest.raises(SystemExit, match="no complete checkpoint"):
        (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
        main(["generate", "--model", str(tmp_path / "empty")])
    partial = tmp_path / "partial" / "checkpoints" / checkpoint.name  # a save that did not finish
    shutil.copytree(checkpoint, partial)
    (partial / "manifest.json").unlink()
    with pytest.raises(SystemExit, match=f"without manifest.json .*--model {re.escape(str(partial / 'policy'))} to load"):
        main(["generate", "--model", str(partial)])
    with pytest.raises(SystemExit, match="no complete checkpoint"):
        main(["generate", "--model", str(partial.parent.parent)])


def test_generate_has_the_tokenizer_option_its_errors_suggest(tmp_path):
    from textrl.models import tiny_model_path

    assert main(["generate", "--tokenizer", str(tiny_model_path("causal_lm")), "--max-new-tokens", "2"]) == 0


def test_train_is_importable_from_textrl_without_loading_torch_first():
    out = _python("import sys, textrl\nprint('torch' in sys.modules)\nfrom textrl import TrainConfig, train\n"
                  "print(TrainConfig.__module__, train.__module__)")
    assert out.stdout.split() == ["False", "textrl.config.train_config", "textrl.training.trainer"], out.stderr[-500:]
    with pytest.raises(ImportError):
        exec("from textrl import not_a_name", {})
