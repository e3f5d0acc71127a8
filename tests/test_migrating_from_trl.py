"""docs/migrating-from-trl.md, claim by claim: its code runs, its command lines answer what it shows,
its agent table names agents and options that exist, its option table is textrl.config.trl_names', and every
TRL option name gets a hint naming textrl's option (or saying there is none) in the three places a
user may write it: the command line, a --config YAML file and TrainConfig(**kwargs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from textrl.cli import build_parser, main
from textrl.config import TrainConfig, load_yaml
from textrl.config.trl_names import TRL_OPTIONS, markdown_table, trl_hint
from textrl.core.agent_registry import agent_names

DOC = (Path(__file__).resolve().parents[1] / "docs" / "migrating-from-trl.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC, re.DOTALL)


def _train_options() -> set[str]:
    parser = build_parser()
    train = next(a for a in parser._actions if a.dest == "command").choices["train"]
    return {name for action in train._actions for name in action.option_strings}


def test_the_option_table_is_trl_names():
    assert markdown_table() in DOC
    fields = set(TrainConfig.__dataclass_fields__)
    assert all(ours in fields for _, ours, _ in TRL_OPTIONS.values() if ours)


def test_epsilon_high_is_clip_eps_high():
    assert TRL_OPTIONS["epsilon_high"][1] == "clip_eps_high" and "--clip-eps-high" in _train_options()
    assert "`--clip-eps-high` on any token-level agent" in DOC


@pytest.mark.parametrize("block", _blocks("text"))
def test_each_command_line_shown_answers_as_shown(block, capsys):
    command, expected = block.strip().splitlines()
    args = command.removeprefix("$ textrl ").split()
    with pytest.raises(SystemExit):
        main(args)
    assert capsys.readouterr().err.strip().splitlines()[-1] == expected


@pytest.mark.parametrize("name", sorted(TRL_OPTIONS))
def test_every_trl_name_gets_a_hint_on_the_command_line_in_yaml_and_in_python(name, tmp_path, capsys):
    hint = trl_hint(name)
    ours = TRL_OPTIONS[name][1]
    assert (f"textrl calls it {ours}" if ours else "textrl has no counterpart") in hint
    if name in TrainConfig.__dataclass_fields__:
        return  # the same name is ours
    flag = f"--{name.replace('_', '-')}"
    with pytest.raises(SystemExit):
        main(["train", flag, "1"])
    assert hint in capsys.readouterr().err
    file = tmp_path / "run.yaml"
    file.write_text(yaml.safe_dump({name: 1}))
    with pytest.raises(ValueError, match=re.escape(hint)):
        load_yaml(file)
    with pytest.raises(TypeError, match=re.escape(hint)):
        TrainConfig(**{name: 1})


@pytest.mark.parametrize("flag, says", [
    ("--bf16", "textrl calls it mixed_precision"), ("--fp16", "use bf16"),
    ("--torch-dtype", "textrl calls it dtype"),
    ("--use-vllm", "textrl calls it vllm_server"), ("--vllm-mode", "textrl calls it generation_engine"),
    ("--vllm-server-base-url", "textrl calls it vllm_server"),
    ("--per-device-train-batch-size", "textrl calls it prompts_per_iteration"),
])
def test_trl_precision_memory_and_vllm_flags_get_a_hint(flag, says, capsys):
    with pytest.raises(SystemExit):
        main(["train", flag])
    err = capsys.readouterr().err
    assert says in err and "unrecognized arguments" not in err


@pytest.mark.parametrize("trl, says, ours, engine", [
    (["--use-vllm", "--vllm-mode", "colocate"], "colocate is --generation-engine vllm",
     ["--generation-engine", "vllm"], "vllm"),
    (["--vllm-mode", "colocate"], "colocate -> --generation-engine vllm", ["--generation-engine", "vllm"], "vllm"),
    (["--vllm-mode", "server", "--vllm-server-base-url", "http://h:8000"], "server (TRL's default) -> --vllm-server",
     ["--vllm-server", "http://h:8000"], "vllm-server"),
    (["--vllm-server-host", "h", "--vllm-server-port", "8000"], "--vllm-server http://HOST:PORT",
     ["--vllm-server", "http://h:8000"], "vllm-server"),
    (["--use-vllm"], "no default (TRL's 0.0.0.0:8000 is http://localhost:8000)",
     ["--vllm-server", "http://localhost:8000"], "vllm-server"),
])
def test_trl_vllm_options_name_the_textrl_options_that_pick_the_same_engine(trl, says, ours, engine, capsys):
    """TRL's vLLM options are refused in one line naming textrl's (no vLLM starts); the options it
    names resolve to the engine TRL's mode runs: colocated vLLM, or the served one at that URL."""
    from textrl.config import build_config
    from textrl.generation.base import run_engine_name

    with pytest.raises(SystemExit) as stopped:
        main(["train", *trl])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert stopped.value.code == 2 and len(errors) == 1 and says in errors[0]
    config = build_config(build_parser("train").parse_args(["train", *ours]), TrainConfig).validate()
    assert run_engine_name(config.generation_engine, config.vllm_server) == engine
    assert config.vllm_server == (ours[1] if engine == "vllm-server" else None)


@pytest.mark.parametrize("argv, says", [
    (["--generation-engine", "hf", "--vllm-server", "http://h:8000"],
     "--vllm-server samples from vLLM servers, but --generation-engine hf asks for another engine; drop one of the two"),
    (["--vllm-gpu-memory-utilization", "0"], "vllm_gpu_memory_utilization=0.0: a share of the GPU's memory, in (0, 1]"),
])
def test_a_vllm_combination_textrl_cannot_run_is_one_line_before_any_model_loads(argv, says):
    with pytest.raises(SystemExit) as stopped:
        main(["train", *argv])
    assert stopped.value.code == f"textrl train: {says}"


def test_the_agent_table_names_registered_agents_and_existing_options():
    section = DOC.split("## Choosing the agent")[1].split("## Models and data")[0]
    agents = set(re.findall(r"--agent (\w+)", section))
    assert agents and agents <= set(agent_names())
    flags = set(re.findall(r"(--[a-z][a-z0-9_-]*[a-z0-9])", DOC))
    trl_flags = {f"--{name.replace('_', '-')}" for name in TRL_OPTIONS}
    unknown = flags - _train_options() - trl_flags
    assert not unknown, f"the doc names options `textrl train` does not have: {sorted(unknown)}"


def test_the_python_snippets_run_and_build_what_they_say():
    from textrl.rewards.options import resolve_reward
    from textrl.training.set_up import environment

    blocks = _blocks("python")
    assert len(blocks) == 2
    namespace: dict = {}
    exec(blocks[0], namespace)  # noqa: S102 - the doc's own code
    config = namespace["config"].validate()
    reward = resolve_reward(config.reward, config.reward_weights)
    assert reward.weights == {"brevity": 1.0, "think_format": 0.5}
    scores = reward(["q"], ["<think>\nx\n</think>\n<answer>\n4\n</answer>"])
    assert scores.tolist() == pytest.approx([-0.39 + 0.25])
    exec(blocks[1], namespace)  # noqa: S102
    config = namespace["config"].validate()
    env = environment(config)
    assert env.reward is namespace["brevity"] and len(env.rows()) == 3


def test_reward_functions_are_called_as_trl_calls_them():
    """The 'Reward functions' bullets: keyword call with every column, None = does not apply,
    NaN is a fault, the columns a reward reads are checked on every row."""
    from textrl.envs.prompts import check_reward_columns
    from textrl.rewards import RewardError, evaluate_reward

    seen = {}

    def by_keyword(completions, **kwargs):
        seen.update(kwargs, completions=completions)
        return [None, 1.0]

    scores, applies = evaluate_reward(by_keyword, ["p", "q"], ["a", "b"], answer=["1", "2"], solution=["x", "y"])
    assert seen["answer"] == ["1", "2"] and seen["solution"] == ["x", "y"] and seen["prompts"] == ["p", "q"]
    assert applies.tolist() == [False, True] and torch.isnan(scores[0])
    with pytest.raises(RewardError, match="non-finite"):
        evaluate_reward(lambda p, c, **k: [float("nan")], ["p"], ["a"])
    with pytest.raises(ValueError, match=r"list\[1\]: row has no 'answer', which reward 'accuracy' reads; "
                                         r"add it or choose another reward"):
        check_reward_columns([{"prompt": "a", "answer": "1"}, {"prompt": "b"}], "accuracy")
