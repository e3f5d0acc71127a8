"""The agent registry and the agents' declarations: one list of names, agents of one's own (a
registration call, an entry point, ``--agent file.py:Class``) in train / bench / pipeline, and
checks made from what an agent declares, not from its name."""

from __future__ import annotations

import ast
import json
import textwrap
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from tests.agents.conftest import collect, make_config
from textrl import registry
from textrl.agents import AGENTS, GRPO, GroupPPO, PPOAgent, agent_class, agent_names, register_agent
from textrl.config import AGENT_OPTIONS, TrainConfig
from textrl.models import build_tiny_causal_lm

ROOT = Path(__file__).resolve().parents[2]

NON_DEFAULT = {
    "ppo_epochs": 3, "num_minibatches": 4, "gradient_accumulation_steps": 2, "clip_eps": 0.3, "dual_clip": 3.0,
    "value_clip_eps": None, "vf_coef": 0.25, "entropy_coef": 0.1, "gamma": 0.9, "lam": 0.9,
    "whiten_advantages": False, "loss_aggregation": "seq_mean", "kl_coef": 0.1, "kl_kind": "k3",
    "kl_in": "loss", "adaptive_kl": True, "kl_target": 0.2, "kl_horizon": 100, "kl_hinge": True,
    "kl_early_stop": "target", "reward_placement": "uniform", "ratio_threshold": 0.0, "kl_after_update": True,
    "ref_refresh_every": 2, "old_policy_refresh_every": 2, "actor_lr": 1e-3, "critic_lr": 1e-4,
    "lr_schedule": "cosine", "lr_warmup_steps": 2, "max_grad_norm": 0.5, "critic_init": "reward_model",
    "reward_adapter": "x", "load_in_4bit": True, "lora_r": 4, "lora_alpha": 8,
    "lora_target_modules": "q_proj", "critic_type": "lora", "critic": "shared", "clip_eps_high": 0.3, "lam_critic": 1.0,
    "lam_length_alpha": 0.05, "critic_warmup_iterations": 2, "dynamic_sampling": False, "overlong_buffer": 4,
    "rollout_correction": "tis", "rollout_correction_upper": 3.0, "rollout_correction_lower": 0.5,
    "teacher": "tiny", "teacher_coef": 0.5,
}
"""A valid value other than the default for every option an agent may read."""


@pytest.fixture
def registered():
    """Register classes for one test only: ``registered(name, cls)`` (removed afterwards)."""
    added = []

    def register(name, cls):
        added.append(name)
        return register_agent(name)(cls)

    yield register
    for name in added:
        AGENTS.pop(name, None)


class MeanBaseline(GroupPPO):
    """A group agent of one's own: advantage = reward - group mean (no std)."""

    def group_advantage(self, rewards, group_size):
        groups = rewards.view(-1, group_size)
        return (groups - groups.mean(1, keepdim=True)).view(-1)


def test_every_option_in_the_table_has_a_non_default_example():
    assert set(NON_DEFAULT) == AGENT_OPTIONS
    assert all(not TrainConfig(**{k: v}).is_default(k) for k, v in NON_DEFAULT.items())


def test_the_registry_is_the_list_of_agent_names():
    assert agent_names() == sorted(AGENTS) == [
        "cispo", "dapo", "dr_grpo", "gae_ppo", "grpo", "gspo", "multi_adapter_ppo", "one_step_ppo", "reinforce_pp",
        "reinforce_pp_baseline", "rloo", "vapo"]
    assert all(agent_class(name).name == name for name in agent_names())
    with pytest.raises(ValueError, match=r"agent='dqn': must be one of cispo, dapo, .*file.py:Class"):
        agent_class("dqn")


@pytest.mark.parametrize("name", agent_names())
def test_an_option_the_agent_does_not_read_is_refused_naming_agent_option_and_fix(name):
    cls = agent_class(name)
    ignored = sorted(AGENT_OPTIONS - cls.options)
    assert ignored, f"{name} reads every option"
    for option in ignored:
        flag = "--" + option.replace("_", "-")
        with pytest.raises(ValueError, match=rf"^{name} does not read {option}=.*drop {flag}"):
            TrainConfig(**make_config(agent=name).__dict__ | {option: NON_DEFAULT[option]}).validate()


def test_one_step_ppo_refuses_entropy_coef_with_the_reason_and_the_agents_that_read_it():
    with pytest.raises(ValueError, match=r"one_step_ppo does not read entropy_coef=0.1 \(it has no entropy bonus\)"
                                         r".*drop --entropy-coef or choose --agent gae_ppo"):
        TrainConfig(agent="one_step_ppo", entropy_coef=0.1).validate()


def test_options_read_by_the_agent_at_their_default_pass():
    for name in agent_names():
        make_config(agent=name).validate()


def test_a_custom_group_agent_with_one_sample_per_prompt_is_refused(tok, registered):
    registered("mean_baseline", MeanBaseline)
    assert MeanBaseline.min_samples_per_prompt == 2 and not MeanBaseline.needs_critic
    with pytest.raises(ValueError, match=r"n_samples_per_prompt=1: agent='mean_baseline' .* needs n_samples_per_prompt >= 2"):
        TrainConfig(agent="mean_baseline", n_samples_per_prompt=1).validate()
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 2"):  # built directly: the same check
        MeanBaseline(build_tiny_causal_lm(tok), tok, make_config(agent="mean_baseline", n_samples_per_prompt=1))
    agent = MeanBaseline(build_tiny_causal_lm(tok), tok, make_config(agent="mean_baseline", n_samples_per_prompt=2,
                                                                      prompts_per_iteration=2))
    td = collect(agent, tok)
    assert agent.update(td)["ppo/epochs_run"] == 1.0


def test_checks_come_from_the_declarations_not_the_name(registered):
    class NeedsGroupsOfFour(GRPO):
        min_samples_per_prompt = 4

    registered("grpo4", NeedsGroupsOfFour)
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 4"):
        TrainConfig(agent="grpo4", n_samples_per_prompt=2).validate()
    TrainConfig(agent="grpo4", n_samples_per_prompt=4).validate()


def test_a_name_registered_twice_for_another_class_is_refused(registered):
    registered("mean_baseline", MeanBaseline)

    class Other(MeanBaseline):
        pass

    with pytest.raises(ValueError, match="'mean_baseline' is taken"):
        register_agent("mean_baseline")(Other)


def test_an_entry_point_agent_is_found_by_name(monkeypatch, registered):
    point = EntryPoint(name="ep_mean", value="tests.agents.test_registry:MeanBaseline", group="textrl.agents")
    monkeypatch.setattr(registry, "entry_points", lambda group: [point] if group == "textrl.agents" else [])
    assert "ep_mean" in agent_names()
    try:
        assert agent_class("ep_mean") is MeanBaseline
        TrainConfig(agent="ep_mean").validate()
    finally:
        AGENTS.pop("ep_mean", None)


AGENT_FILE = '''
from textrl.agents import GroupPPO


class HalfBaseline(GroupPPO):
    """Advantage = reward - half the group mean."""

    def group_advantage(self, rewards, group_size):
        groups = rewards.view(-1, group_size)
        return (groups - 0.5 * groups.mean(1, keepdim=True)).view(-1)
'''


@pytest.fixture
def agent_file(tmp_path):
    path = tmp_path / "my_agent.py"
    path.write_text(AGENT_FILE)
    return f"{path}:HalfBaseline"


def test_a_file_agent_is_loaded_and_checked_from_its_declarations(agent_file, tmp_path):
    cls = agent_class(agent_file)
    assert cls.__name__ == "HalfBaseline" and issubclass(cls, PPOAgent) and agent_class(agent_file) is cls
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 2"):
        TrainConfig(agent=agent_file, n_samples_per_prompt=1).validate()
    with pytest.raises(ValueError, match="no such file"):
        agent_class(f"{tmp_path / 'none.py'}:HalfBaseline")
    with pytest.raises(ValueError, match="has no agent class 'Nope'"):
        agent_class(agent_file.replace("HalfBaseline", "Nope"))


TRAIN = ["--iterations", "1", "--warmup-sft-steps", "0", "--prompts-per-iteration", "2", "--n-samples-per-prompt",
         "2", "--max-new-tokens", "4", "--eval-size", "2", "--eval-every", "0", "--progress", "false",
         "--ppo-epochs", "1", "--num-minibatches", "1"]


def test_textrl_train_runs_a_file_agent(agent_file, tmp_path, monkeypatch):
    from textrl.cli import main

    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(["train", "--agent", agent_file, "--output-dir", str(out), *TRAIN]) == 0
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["iteration"] == 1
    assert f"agent: {agent_file}" in (out / "config.yaml").read_text()


def test_textrl_bench_passes_a_file_agent_to_its_subprocess(agent_file, tmp_path, monkeypatch):
    from textrl.bench import compare_agents

    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # a relative spec is made absolute for the subprocess
    tiny = dict(iterations=1, prompts_per_iteration=2, n_samples_per_prompt=2, max_new_tokens=4, eval_size=2,
                warmup_sft_steps=0, eval_every=0, ppo_epochs=1, num_minibatches=1)
    result = compare_agents(["my_agent.py:HalfBaseline"], [0], tmp_path / "bench", envs=["digits"], isolate=True,
                            warm_start_policy=False, log=lambda *a: None, **tiny)
    assert [r["agent"] for r in result["agents"]] == ["HalfBaseline"]
    assert result["runs"][0]["error"] is None, result["runs"][0]["error"]
    job = json.loads((tmp_path / "bench" / "runs" / "digits" / "HalfBaseline" / "seed0" / "bench_config.json").read_text())
    assert job["config"]["agent"] == agent_file


def test_the_pipeline_reads_the_registry(registered):
    from textrl.stages.pipeline import PipelineConfig, pipeline_agents

    class FullRewardModelAgent(MeanBaseline):
        pipeline_reward = "reward_model"

    assert pipeline_agents() == ["gae_ppo", "one_step_ppo", "multi_adapter_ppo"]
    registered("mean_pipeline", FullRewardModelAgent)
    assert "mean_pipeline" in pipeline_agents()
    assert not PipelineConfig(agent="mean_pipeline").lora


def test_a_critic_free_agent_builds_no_critic(monkeypatch):
    from textrl.models.value import ValueModel

    def no_critic(*args, **kwargs):
        raise AssertionError("a critic was built for a critic-free agent")

    monkeypatch.setattr(ValueModel, "from_causal_lm", no_critic)
    config = TrainConfig(agent="grpo", warmup_sft_steps=0, iterations=1)
    agent = GRPO.from_config(config, "cpu", log=lambda *a: None)
    assert agent.critic is None and agent.critic_optimizer is None
    assert {name for name, _ in agent.named_children()} == {"policy", "ref_policy"}
    monkeypatch.undo()
    gae = agent_class("gae_ppo").from_config(TrainConfig(warmup_sft_steps=0, iterations=1), "cpu", log=lambda *a: None)
    assert gae.critic is not None and {n for n, _ in gae.named_children()} == {"policy", "ref_policy", "critic"}


def agent_literals(path: Path) -> list[str]:
    """Registered agent names compared against, or listed, in ``path``'s code (docstrings aside)."""
    names = set(agent_names())
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            operands = node.elts
        else:
            continue
        for operand in operands:
            for sub in ast.walk(operand):
                if isinstance(sub, ast.Constant) and sub.value in names:
                    found.append(f"line {sub.lineno}: {sub.value!r}")
    return found


@pytest.mark.parametrize("rel", ["textrl/config/train_config.py", "textrl/config/validation.py", "textrl/training/trainer.py",
                                 "textrl/training/set_up.py", "textrl/training/run_checks.py", "textrl/training/ppo_run.py",
                                 "textrl/stages/pipeline.py",
                                 "textrl/bench/plan.py", "textrl/bench/compare.py", "textrl/cli.py"])
def test_orchestration_names_no_specific_agent(rel):
    assert agent_literals(ROOT / rel) == [], f"{rel} branches on or lists agent names; ask the registry"


def test_the_name_check_sees_a_branch(tmp_path):
    path = tmp_path / "x.py"
    path.write_text(textwrap.dedent('''
        if config.agent == "multi_adapter_ppo":
            pass
        AGENTS = ("gae_ppo", "grpo")
    '''))
    assert len(agent_literals(path)) == 3
