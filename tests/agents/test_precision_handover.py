"""The run's precision is decided once, in textrl.agents.build.from_config, and handed to the hooks
that load the models (``load_policy``, ``build_critic``, the agent's ``__init__``: ``precision=``);
a hook written before it took ``precision`` is called as it was written (build.call_hook reads its
signature) and ends with the same object."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from textrl.agents import GAEPPO
from textrl.agents.build import call_hook
from textrl.config import TrainConfig
from textrl.core import precision as precision_module
from textrl.core.precision import Precision

QUIET = dict(log=lambda *a, **k: None)


def small(**overrides: Any) -> TrainConfig:
    base = dict(prompts_per_iteration=2, n_samples_per_prompt=1, max_new_tokens=4, ppo_epochs=1,
                num_minibatches=1, warmup_sft_steps=0, eval_size=4, eval_every=0, progress=False, iterations=1)
    return TrainConfig(**{**base, **overrides})


class OldHooks(GAEPPO):
    """An agent written against the hooks' signatures before ``precision`` was handed over."""

    calls: list[str] = []

    @classmethod
    def load_policy(cls, config, tokenizer, device, log=print):
        cls.calls.append("load_policy")
        return super().load_policy(config, tokenizer, device, log)

    @classmethod
    def build_critic(cls, config, policy):
        cls.calls.append("build_critic")
        return super().build_critic(config, policy)

    def __init__(self, policy, tokenizer, config=None, *, ref_policy=None, critic=None):
        type(self).calls.append("__init__")
        super().__init__(policy, tokenizer, config, ref_policy=ref_policy, critic=critic)


class NewHooks(GAEPPO):
    """An agent whose hooks take the run's precision."""

    seen: list[Any] = []

    @classmethod
    def load_policy(cls, config, tokenizer, device, log=print, env_facts=None, *, precision=None):
        cls.seen.append(precision)
        return super().load_policy(config, tokenizer, device, log, env_facts, precision=precision)

    @classmethod
    def build_critic(cls, config, policy, precision=None):
        cls.seen.append(precision)
        return super().build_critic(config, policy, precision)

    def __init__(self, policy, tokenizer, config=None, **kwargs):
        type(self).seen.append(kwargs.get("precision"))
        super().__init__(policy, tokenizer, config, **kwargs)


def counted(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every :meth:`Precision.of` call from now on (the decision itself unchanged)."""
    calls: list[Any] = []
    decide = Precision.of.__func__

    def of(cls, config, device):
        calls.append(device)
        return decide(cls, config, device)

    monkeypatch.setattr(precision_module.Precision, "of", classmethod(of))
    return calls


def test_from_config_decides_the_precision_once_and_hands_it_to_the_hooks(monkeypatch):
    NewHooks.seen = []
    calls = counted(monkeypatch)
    agent = NewHooks.from_config(small(agent="gae_ppo"), "cpu", **QUIET)
    assert len(calls) == 1  # the run's set-up; no hook decides it again
    decided = Precision.of(agent.config, "cpu")
    assert len(NewHooks.seen) == 3 and all(seen is decided for seen in NewHooks.seen)  # load_policy, critic, __init__
    assert agent.precision is decided and agent.learner.forwards.precision is decided


def test_hooks_written_without_precision_still_run_and_share_the_same_precision():
    OldHooks.calls = []
    agent = OldHooks.from_config(small(agent="gae_ppo"), "cpu", **QUIET)
    assert OldHooks.calls == ["load_policy", "build_critic", "__init__"]
    assert agent.precision is Precision.of(agent.config, "cpu")
    assert next(agent.critic.parameters()).dtype == torch.float32


def test_call_hook_passes_only_the_keywords_a_hook_takes():
    def old(a, b=1):
        return (a, b)

    def new(a, *, precision=None):
        return (a, precision)

    def open_ended(a, **kwargs):
        return (a, kwargs)

    assert call_hook(old, 1, precision="p") == (1, 1)
    assert call_hook(new, 1, precision="p") == (1, "p")
    assert call_hook(open_ended, 1, precision="p", other=2) == (1, {"precision": "p", "other": 2})
