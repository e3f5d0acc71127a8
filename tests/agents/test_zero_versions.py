"""Under DeepSpeed ZeRO stages 1 and 2 (a real engine in this process, a gloo group of one, as in
tests/agents/test_zero.py) the engine samples with the learner's current weights at every
iteration. DeepSpeed's step writes the weights through ``.data``, which autograd's counter does not
see; the backend marks them written (:meth:`textrl.parallel.Backend.step`), so the learner's version
moves and every engine that keeps its own copy of the weights by their version takes them again:
the ``textrl`` engine, a stand-in for the ``vllm`` engines (:class:`CopyingEngine`), and the two
``vllm`` engines' own decision to load or send (run without vLLM: what they hand over is recorded).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from tests.agents.conftest import make_agent, target_reward  # noqa: E402
from tests.agents.test_zero import process_group  # noqa: E402, F401  (the module's gloo group of one)
from textrl.agents.forwards import sequence_inputs  # noqa: E402
from textrl.core.versions import VersionCounter  # noqa: E402
from textrl.envs.prompts import encode_prompts  # noqa: E402
from textrl.envs.tasks import make_digits_task  # noqa: E402
from textrl.generation.decode import DecodeEngine  # noqa: E402
from textrl.generation.vllm_engine import VLLMEngine  # noqa: E402
from textrl.generation.vllm_server import VLLMServerEngine  # noqa: E402
from textrl.keys import KEYS  # noqa: E402
from textrl.models import build_tiny_causal_lm  # noqa: E402
from textrl.parallel import DeepSpeedZero  # noqa: E402
from textrl.parallel.distributed import Distributed  # noqa: E402
from textrl.run.rollout import collect  # noqa: E402

ITERATIONS = 3
FP32_GAP = 1e-4
"""The largest gap per token between the engine's log-probs of its own draws and a prefill of the same
float32 weights on the CPU (the decode step and the prefill sum the same products in other orders:
~1e-6 measured); one step at ``actor_lr=1e-2`` moves them by more than 100 times that
(:func:`test_the_copy_is_stale_unmarked`)."""


class CopyingEngine(DecodeEngine):
    """A stand-in for the engines that sample with a copy of the weights of their own (the ``vllm``
    engines, colocated or served): the ``textrl`` engine sampling with ``copy``, into which it loads
    the policy's weights before a call when their version moved since it last did, as the ``vllm``
    engines decide (a :class:`~textrl.core.versions.VersionCounter` over ``model.parameters``). ``loads``
    counts its loads."""

    name = "copying"

    def __init__(self, copy: torch.nn.Module) -> None:
        super().__init__()
        self.copy, self.weights, self.loaded, self.loads = copy, None, None, 0

    def sync(self, model: torch.nn.Module) -> None:
        if self.weights is None:
            self.weights = VersionCounter(model.parameters)
        if self.weights.now() != self.loaded:
            self.copy.load_state_dict(model.state_dict())
            self.loaded, self.loads = self.weights.now(), self.loads + 1

    def generate(self, model, *args, **kwargs):
        self.sync(model)
        return super().generate(self.copy, *args, **kwargs)

    def generate_with_logprobs(self, model, *args, **kwargs):
        self.sync(model)
        return super().generate_with_logprobs(self.copy, *args, **kwargs)


def zero_agent(tok, stage: int):
    """grpo under ZeRO ``stage``, steps large enough to move every log-prob (``actor_lr=1e-2``)."""
    agent = make_agent(tok, "grpo", actor_lr=1e-2, generation_engine="textrl")
    DeepSpeedZero(Distributed(), "cpu", stage).prepare(agent)
    return agent


def rollout(agent, tok, seed: int):
    batch = encode_prompts(make_digits_task(4, seed=seed), tok)[0]
    torch.manual_seed(seed)
    return collect(agent, batch, target_reward)


def engine_gap(td) -> float:
    """The largest |engine log-prob - prefill log-prob| over the agent's tokens: the engine's log-probs
    of its own draws against the actor's prefill with the learner's weights now."""
    mask = td.get(KEYS.mask)
    return float((td.get(KEYS.generation_log_prob) - td.get(KEYS.action_log_prob)).abs()[mask].max())


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("engine", ["textrl", "copying"])
def test_the_engine_samples_with_the_updated_weights_every_iteration(tok, stage, engine):
    agent = zero_agent(tok, stage)
    if engine == "copying":
        agent.actor.engine = CopyingEngine(build_tiny_causal_lm(tok, seed=1))  # other weights until it loads
    first = next(agent.policy.parameters()).detach().clone()
    versions, gaps = [], []
    for iteration in range(ITERATIONS):
        td = rollout(agent, tok, seed=iteration)
        versions.append(agent.learner.version)
        gaps.append(engine_gap(td))
        assert td.get(KEYS.policy_version).tolist() == [versions[-1]] * td.shape[0]
        metrics = agent.update(td)
        assert metrics["nonfinite/skipped_updates"] == 0 and metrics["rollout/staleness"] == 0.0
    assert not torch.equal(first, next(agent.policy.parameters()))  # DeepSpeed's steps wrote the weights ...
    assert versions == sorted(set(versions))  # ... and the version moved with every update
    assert max(gaps) < FP32_GAP, gaps
    if engine == "copying":
        assert agent.actor.engine.loads == ITERATIONS  # once at the start, once after each update but the last


def test_the_copy_is_stale_unmarked(tok, monkeypatch):
    # the same steps without the backend's mark (as before it): DeepSpeed's step moves the weights,
    # not their version, and an engine that keeps a copy by version samples with the old one
    import textrl.parallel.base as backend_base

    monkeypatch.setattr(backend_base, "mark_written", lambda tensors: None)
    agent = zero_agent(tok, 2)
    engine = agent.actor.engine = CopyingEngine(build_tiny_causal_lm(tok, seed=1))
    td = rollout(agent, tok, seed=0)
    version = agent.learner.version
    agent.update(td)
    assert agent.learner.version == version
    engine.sync(agent.policy)
    assert engine.loads == 1  # nothing taken after the update
    inputs, action, mask = sequence_inputs(td), td.get(KEYS.action), td.get(KEYS.mask)
    stale = agent.actor.logprobs(engine.copy, *inputs, action)
    live = agent.actor.logprobs(agent.policy, *inputs, action)
    assert float((stale - live).abs()[mask].max()) > 100 * FP32_GAP  # what its next rollout would be off by


class FakeLLM:
    """What the colocated engine calls on vLLM's ``LLM`` to hand over weights, recorded."""

    def __init__(self) -> None:
        self.reloads = 0

    def collective_rpc(self, function, args):
        """A worker that takes what it is sent (one bucket: the whole model): its load report is the
        sent weights' fingerprint."""
        from textrl.generation.vllm_engine import fingerprint

        self.reloads += 1
        return [{"fingerprint": fingerprint(args[0]), "tensors": len(args[0]), "missing": []}]

    def reset_prefix_cache(self) -> None:
        pass


def started_vllm_engine(model):
    """A :class:`VLLMEngine` as ``_start`` leaves it (vLLM started on ``model``'s weights), over a
    :class:`FakeLLM`."""
    from textrl.generation.vllm_engine import base_state_dict

    engine = VLLMEngine()
    engine.llm, engine._model = FakeLLM(), model
    engine.sync.follow(model, base_state_dict)
    engine.sync.took(engine.sync.wanted())
    return engine


def connected_server_engine(model, sent: list[int]):
    """A :class:`VLLMServerEngine` connected to no server: each weight sync appended to ``sent``."""
    from textrl.generation.vllm_engine import merged_state_dict

    engine = VLLMServerEngine()
    engine._model = model
    engine.sync.follow(model, merged_state_dict)
    engine._sync = lambda model: sent.append(1) or "fingerprint"
    engine._check_versions = lambda: None
    return engine


@pytest.mark.parametrize("stage", [1, 2])
def test_the_vllm_engines_hand_over_the_weights_after_each_zero_step(tok, stage):
    agent = zero_agent(tok, stage)
    colocated, sent = started_vllm_engine(agent.policy), []
    served = connected_server_engine(agent.policy, sent)
    served._ready(agent.policy)
    assert sent == [1]  # the first call sends
    for iteration in range(2):
        agent.update(rollout(agent, tok, seed=iteration))
        for _ in range(2):  # the first call after an update hands the weights over, a second one nothing
            colocated._ready(agent.policy, torch.device("cpu"))
            served._ready(agent.policy)
        assert colocated.llm.reloads == iteration + 1 and len(sent) == iteration + 2
