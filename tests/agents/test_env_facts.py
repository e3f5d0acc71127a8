"""What an agent reads of the environment (``textrl.core.env_facts``): handed over by the trainer, or
read through the provider registered in ``textrl.core.env_facts.REGISTRY``, whose built-in module
(``textrl.envs.registry``) a direct ``from_config`` imports on the first lookup when nothing has
imported it yet."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from textrl.config import TrainConfig
from textrl.core.env_facts import PROVIDER, REGISTRY, EnvFacts, env_facts_of, provide_env_facts

SCRIPT = """
import sys
from textrl.agents import GAEPPO
from textrl.agents.build import episode_budget
from textrl.config import TrainConfig
assert "textrl.envs" not in sys.modules, "importing textrl.agents imported textrl.envs"
agent = GAEPPO.from_config(TrainConfig(warmup_sft_steps=2, iterations=1))
print(episode_budget(agent.config, agent.env_facts), agent.warmup_record["ran_steps"])
"""


def test_a_script_that_never_imports_the_envs_builds_an_agent_from_its_config():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-2:] == ["24", "2"]


def test_the_provider_reads_the_configs_environment():
    facts = env_facts_of(TrainConfig(max_new_tokens=24), warmup=False)
    assert isinstance(facts, EnvFacts) and facts.episode_budget == 24 and facts.warmup_pairs is None
    with_pairs = env_facts_of(TrainConfig(), warmup=True)
    assert with_pairs.warmup_pairs and all(isinstance(c, str) for _, c in with_pairs.warmup_pairs)


@pytest.mark.parametrize("tokens", [8, 40])
def test_max_episode_tokens_is_the_budget(tokens):
    assert env_facts_of(TrainConfig(max_episode_tokens=tokens, max_new_tokens=8), warmup=False).episode_budget == tokens


def test_the_provider_is_the_registry_entry_its_builtin_module_registers():
    from textrl.envs.registry import env_facts

    assert REGISTRY.builtins == ("textrl.envs.registry",)
    assert REGISTRY.find(PROVIDER) is env_facts


def test_a_provider_registered_later_replaces_the_one_before():
    from textrl.envs.registry import env_facts

    facts = EnvFacts(env_id="mine", episode_budget=3)
    provide_env_facts(lambda config, warmup: facts)
    try:
        assert env_facts_of(TrainConfig(), warmup=False) is facts
    finally:
        provide_env_facts(env_facts)
