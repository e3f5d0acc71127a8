"""Writes that autograd's counter does not see (through ``.data``, a kernel through the memory) are
stated by their writer (:func:`textrl.core.versions.mark_written`), and every reader of the weights'
version sees them: the version counter, the weight casts, the carried KV cache and the learner's
version after a step whatever the optimiser did. DeepSpeed ZeRO's steps and the engines that hold
their own copy of the weights: tests/agents/test_zero_versions.py."""

from __future__ import annotations

import torch

from tests.agents.conftest import collect, make_agent
from textrl.core.versions import VersionCounter, mark_written, tensor_versions
from textrl.generation.carry import TurnCarry
from textrl.generation.casts import WeightCasts
from textrl.models import build_tiny_causal_lm
from textrl.parallel import SingleProcess


def write_through_data(model: torch.nn.Module) -> None:
    """Add 1 to every weight of ``model`` the way DeepSpeed's step writes them: through ``.data``."""
    with torch.no_grad():
        for p in model.parameters():
            p.data.add_(1.0)


def test_a_write_through_data_is_seen_once_its_writer_marks_it():
    w = torch.nn.Parameter(torch.zeros(3))
    counter = VersionCounter(lambda: [w])
    before = tensor_versions([w])
    w.data.copy_(torch.ones(3))
    assert counter.now() == 0 and tensor_versions([w]) == before  # autograd's counter did not move
    mark_written([w])
    assert counter.now() == 1 and tensor_versions([w]) != before
    mark_written([w, w])  # marked twice between two reads: one change seen
    assert counter.now() == 2 == counter.now()


def test_an_inference_tensor_has_no_counter_to_mark():
    with torch.inference_mode():
        t = torch.zeros(2)
    w = torch.zeros(2)
    mark_written([t, w])  # the inference tensor is skipped, the other one marked
    assert w._version == 1


def test_marked_weights_refresh_the_casts_and_drop_the_carried_cache(tok):
    model = build_tiny_causal_lm(tok)
    casts = WeightCasts(model, torch.bfloat16)
    casts.refresh()
    carry = TurnCarry()
    carry.remember(model, cache=None, cols=[list(range(10))], tokens=[tuple(range(10))])
    longer = [tuple(range(12))]
    assert not casts.changed() and carry.plan(model, longer) is not None
    write_through_data(model)
    assert not casts.changed() and carry.plan(model, longer) is not None  # unmarked: unseen
    mark_written(model.parameters())
    assert casts.changed() and carry.plan(model, longer) is None


class DataWritingSGD(torch.optim.SGD):
    """SGD that writes its update through ``.data`` (as DeepSpeed's step and bitsandbytes' kernels
    do): autograd's counter does not see it. ``steps`` counts its steps."""

    steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def test_the_backend_marks_every_step_whatever_the_optimiser_wrote(tok, monkeypatch):
    agent = make_agent(tok, "grpo", num_minibatches=2, actor_lr=1e-2)
    SingleProcess(device="cpu").prepare(agent)
    sgd = DataWritingSGD([p for p in agent.policy.parameters() if p.requires_grad], lr=1e-2)
    agent.learner.optimizers, agent.learner.actor_optimizer = [sgd], sgd
    agent.learner.schedulers = [torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 1.0)]
    first, version = next(agent.policy.parameters()).detach().clone(), agent.learner.version
    agent.update(collect(agent, tok))
    assert sgd.steps >= 1 and not torch.equal(first, next(agent.policy.parameters()))  # the steps wrote the weights
    assert agent.learner.version == version + sgd.steps  # and the version counts them

    import textrl.parallel.base as backend_base  # the same steps unmarked: the version stands still

    monkeypatch.setattr(backend_base, "mark_written", lambda tensors: None)
    version = agent.learner.version
    agent.update(collect(agent, tok, seed=1))
    assert agent.learner.version == version
