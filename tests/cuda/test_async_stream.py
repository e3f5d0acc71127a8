"""The asynchronous actor's CUDA stream (:class:`textrl.agents.async_actor.ActorStream`): the producer
runs beside the learner on a stream of its own, and every hand-over between the two is ordered on
the device. Each test here fails with one hand-over left out: the side that writes first is made slow
on the GPU (``torch.cuda._sleep``, the device spins), so a reader that did not wait for it reads
before the write. The protocol itself (which side waits where) is tested on the CPU
(tests/agents/test_async_actor.py); skipped without a GPU (tests/conftest.py).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from textrl.agents.async_actor import (
    ActorStream,
    AsyncActor,
    AsyncRollouts,
    behaviour_iteration,
    trainable_state,
)

pytestmark = pytest.mark.cuda

SPIN = 100_000_000
"""GPU cycles a slow side spins (about 50 ms at 2 GHz): far longer than the host takes to go on."""
ROWS = 1 << 20
"""A rollout's stand-in: 4 MiB of float32, a block of its own in the caching allocator."""


def on_default_stream() -> bool:
    return torch.cuda.current_stream() == torch.cuda.default_stream()


def slow_rollout(value: float, spin: bool = True) -> torch.Tensor:
    """A rollout written late on the current stream: ``value`` everywhere once the spin is over."""
    out = torch.zeros(ROWS, device="cuda")
    if spin:
        torch.cuda._sleep(SPIN)
    out.fill_(value)
    return out


def test_a_rollout_is_complete_when_the_learner_reads_it():
    """The producer returns as soon as its kernels are queued (no synchronisation of its own): the
    learner's stream waits for the rollout's event before reading it."""
    pipe = AsyncRollouts(lambda n, weights: (weights.use(behaviour_iteration(n, 1)), slow_rollout(n + 1))[-1],
                         max_staleness=1, load=lambda *a: None, start_state=lambda: None, stream=ActorStream("cuda"))
    try:
        for i in range(3):
            pipe.publish(i, {}, i)
            got = pipe.take(i)
            assert on_default_stream()
            assert (got.min().item(), got.max().item()) == (i + 1, i + 1)
    finally:
        pipe.close()


def test_a_rollout_the_learner_frees_is_not_reused_while_its_kernels_read_it():
    """The learner reads rollout 0 late (after a spin on its stream) and drops it at once; the actor's
    next rollout of the same size must not get its memory before that read (``record_stream``)."""
    gates = {n: threading.Event() for n in (1, 2)}

    def produce(n, weights):
        weights.use(behaviour_iteration(n, 1))
        if n in gates:
            gates[n].wait(timeout=60)
        return slow_rollout(n + 1, spin=n == 0)

    pipe = AsyncRollouts(produce, max_staleness=1, load=lambda *a: None, start_state=lambda: None,
                         stream=ActorStream("cuda"))
    try:
        pipe.publish(0, {}, 0)
        first = pipe.take(0)
        gates[1].set()
        pipe.take(1)  # the producer holds no reference to rollout 0 from here on
        torch.cuda._sleep(SPIN)  # the learner's stream busy before it reads rollout 0
        read = first.clone()
        del first  # freed while the read is still queued
        pipe.publish(1, {}, 1)
        gates[2].set()
        pipe.take(2)  # written at once on the actor's stream, same size
        assert (read.min().item(), read.max().item()) == (1, 1)
    finally:
        for gate in gates.values():
            gate.set()
        pipe.close()


def test_a_checkpoint_reads_the_queued_rollouts_complete():
    """K=2: three rollouts queued from the first weights, each written late; after a quiesce the
    learner's stream has waited for them all (a checkpoint saves them from there)."""
    pipe = AsyncRollouts(lambda n, weights: (weights.use(behaviour_iteration(n, 2)), slow_rollout(n + 1))[-1],
                         max_staleness=2, load=lambda *a: None, start_state=lambda: None, stream=ActorStream("cuda"))
    try:
        pipe.publish(0, {}, 0)
        deadline = time.monotonic() + 60
        while len(pipe._queue) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        state = pipe.state_dict()  # quiesced first
        assert [(n, t.min().item(), t.max().item()) for n, t in state["queued"]] == [(n, n + 1, n + 1) for n in range(3)]
    finally:
        pipe.close()


def test_the_held_out_evaluation_runs_on_the_actors_stream_after_the_learners_work():
    """What the learner queued before the evaluation is complete when the evaluation (on the actor's
    stream) reads it; what the evaluation queued is complete when the learner reads it after."""
    stream = ActorStream("cuda")
    pipe = AsyncRollouts(lambda n, weights: (weights.use(behaviour_iteration(n, 1)), slow_rollout(n + 1))[-1],
                         max_staleness=1, load=lambda *a: None, start_state=lambda: None, rewind=lambda s: None,
                         stream=stream)
    try:
        pipe.publish(0, {}, 0)
        pipe.take(0)
        learners = slow_rollout(5.0)  # the learner's last work, late on its stream
        with pipe.holding(-2, {}, 0):
            assert torch.cuda.current_stream() == stream.stream
            seen = learners.clone()
            torch.cuda._sleep(SPIN)
            seen.add_(1.0)
        assert on_default_stream()
        assert (seen.min().item(), seen.max().item()) == (6.0, 6.0)
    finally:
        pipe.close()


def draw(tok, stream: bool, iterations: int = 4, move: float = 0.05) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K=1 rollouts of a tiny policy on CUDA with the ``textrl`` engine: rollout ``n`` sampled at seed
    ``100 + n`` with the weights of iteration ``n - 1``, while the learner, between two publications,
    spins and then moves its trained weights in place (a stand-in update, the same in every call);
    the actor on its own stream (``stream``) or on the default stream; ``move`` the update's size."""
    from tests.agents.conftest import PROMPTS, make_agent

    agent = make_agent(tok).to("cuda")
    actor = AsyncActor.of(agent)
    assert (actor.stream is not None) and actor.actor.engine.name == "textrl"
    if not stream:
        actor.stream = None
    actor.actor.engine.graphs.compile = False  # captured, not compiled: three engines, kept short
    enc = tok(list(PROMPTS), return_tensors="pt", padding=True)
    trained = [p for p in agent.policy.parameters() if p.requires_grad]
    steps = [[torch.randn(p.shape, generator=torch.Generator().manual_seed(7 * i + j)).mul_(move).to("cuda")
              for j, p in enumerate(trained)] for i in range(iterations)]

    def produce(n, weights):
        weights.use(behaviour_iteration(n, 1))
        torch.manual_seed(100 + n)
        return actor.actor.sample(enc["input_ids"], enc["attention_mask"])

    pipe = AsyncRollouts(produce, max_staleness=1, load=actor.load, start_state=lambda: None, stream=actor.stream)
    got = []
    try:
        for i in range(iterations):
            pipe.publish(i, trainable_state(agent.policy), i)
            got.append(pipe.take(i))
            torch.cuda._sleep(SPIN)  # the update, on the learner's stream, beside the next rollout
            with torch.no_grad():
                for p, step in zip(trained, steps[i]):
                    p.add_(step)
    finally:
        pipe.close()
    return [(tokens.cpu(), logps.cpu()) for tokens, logps in got]


def test_rollouts_on_the_actors_stream_equal_those_on_the_default_stream_bit_for_bit(tok):
    """K=1, four iterations: the same seeds and weights give the same tokens and log-probs, whichever
    stream the actor samples on; a weight load not ordered before the sampling that reads it (or a
    rollout read before it was written) would show as another token or log-prob."""
    own, default = draw(tok, stream=True), draw(tok, stream=False)
    for n, ((a_tokens, a_logps), (b_tokens, b_logps)) in enumerate(zip(own, default)):
        assert torch.equal(a_tokens, b_tokens), f"rollout {n}"
        assert torch.equal(a_logps, b_logps), f"rollout {n}"
    # against a learner that does not move: rollouts 0 and 1 (weights 0) alike, 2 and 3 drawn with moved weights
    still = draw(tok, stream=True, move=0.0)
    assert all(torch.equal(own[n][1], still[n][1]) for n in (0, 1))
    assert not any(torch.equal(own[n][1], still[n][1]) for n in (2, 3))


@pytest.fixture(scope="module")
def tok():
    from textrl.models import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.mark.slow  # a whole run, compiled; tests/cuda/test_front_door.py's asynchronous run takes the stream too
def test_an_asynchronous_run_samples_on_the_actors_stream(tmp_path, monkeypatch):
    """``textrl train --device cuda --max-staleness 1``: every rollout is sampled in the actor's thread on
    a stream that is not the default one, and so is the held-out evaluation (in the learner's thread,
    inside ``holding``); the run's own weight check (the engine's log-probs against a prefill of the
    actor's copy) passes every iteration."""
    from tests.runs import SMALL, metrics
    from textrl.agents.actor import Actor
    from textrl.cli import main

    seen = []
    generate = Actor._generate

    def recording(self, *args, **kwargs):
        seen.append((threading.current_thread().name, on_default_stream()))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(Actor, "_generate", recording)
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--device", "cuda", "--iterations", "3", "--max-staleness", "1",
                 "--eval-every", "3", "--output-dir", str(out)]) == 0
    rows = metrics(out)
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    threads = {thread for thread, _ in seen}
    assert "textrl-async-actor" in threads and len(threads) == 2, threads  # the rollouts; the evaluation
    assert not any(default for _, default in seen)
