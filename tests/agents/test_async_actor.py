"""The asynchronous actor's bookkeeping (textrl.agents.async_actor), with hypothesis drawing schedules
of slow and fast generation and updates: no rollout is drawn from weights older than K updates, every
turn (and token) is drawn with the weights the schedule names and the actor actually held, and a
pipeline saved at any iteration and restored draws what an uninterrupted one draws."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from textrl.agents.async_actor import (
    AsyncRollouts,
    behaviour_iteration,
    policy_copy,
    token_iterations,
    turn_iteration,
)


class FakeActor:
    """Weights = one number, the iteration they were published at; ``draws`` counts rollouts started,
    the stand-in of the RNG a resume restores."""

    def __init__(self) -> None:
        self.held = None
        self.draws = 0

    def load(self, iteration, weights, version):
        assert int(weights["w"]) == iteration and version == 10 * iteration
        self.held = int(weights["w"])


def pipeline(actor, k, partial, turns, delays):
    def produce(n, weights):
        actor.draws += 1
        seen = []
        for t in range(turns):
            need = turn_iteration(n, k, t, partial)
            weights.use(need)
            time.sleep(delays[(n + t) % len(delays)])  # generation of this turn
            seen.append(actor.held)  # the weights the turn was drawn with
        return {"n": n, "turns": seen, "draw": actor.draws}

    return AsyncRollouts(produce, max_staleness=k, load=actor.load, start_state=lambda: actor.draws)


def run(pipe, actor, start, stop, update_delays):
    taken = []
    for i in range(start, stop):
        pipe.publish(i, {"w": torch.tensor(i)}, 10 * i)
        item = pipe.take(i)
        taken.append(item)
        time.sleep(update_delays[i % len(update_delays)])  # the learner's update
    return taken


schedules = st.lists(st.sampled_from([0.0, 0.0, 0.0005, 0.002]), min_size=1, max_size=5)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 4), partial=st.sampled_from(["finish", "continue"]), turns=st.integers(1, 3),
       iterations=st.integers(1, 9), gen=schedules, upd=schedules)
def test_every_turn_is_drawn_with_the_weights_the_schedule_names(k, partial, turns, iterations, gen, upd):
    actor = FakeActor()
    pipe = pipeline(actor, k, partial, turns, gen)
    try:
        taken = run(pipe, actor, 0, iterations, upd)
    finally:
        pipe.close()
    for i, item in enumerate(taken):
        assert item["n"] == i
        assert item["turns"] == [turn_iteration(i, k, t, partial) for t in range(turns)]
        assert all(i - k <= v <= max(0, i - 1) for v in item["turns"])  # at most K updates old, never the learner's
        assert item["turns"][0] == behaviour_iteration(i, k)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 3), partial=st.sampled_from(["finish", "continue"]), turns=st.integers(1, 3),
       cut=st.integers(1, 6), more=st.integers(1, 4), gen=schedules, upd=schedules)
def test_a_pipeline_saved_and_restored_draws_what_an_uninterrupted_one_draws(k, partial, turns, cut, more, gen, upd):
    whole_actor = FakeActor()
    whole = pipeline(whole_actor, k, partial, turns, gen)
    try:
        expected = run(whole, whole_actor, 0, cut + more, upd)
    finally:
        whole.close()

    actor = FakeActor()
    first = pipeline(actor, k, partial, turns, gen)
    try:
        before = run(first, actor, 0, cut, upd)
        state = first.state_dict()  # quiesced: the producer waits for the weights of iteration `cut`
    finally:
        first.close()
    assert all(q[0] >= cut for q in state["queued"])
    resumed_actor = FakeActor()
    resumed = pipeline(resumed_actor, k, partial, turns, gen)

    def restore(draws):
        resumed_actor.draws = draws

    resumed_actor.draws = actor.draws  # the "RNG" as the checkpoint saw it; the in-flight start wins
    resumed.load_state_dict(state, restore)
    try:
        after = run(resumed, resumed_actor, cut, cut + more, upd)
    finally:
        resumed.close()
    assert before + after == expected


def test_a_producer_error_reaches_the_learner():
    def produce(n, weights):
        weights.use(behaviour_iteration(n, 1))
        raise ValueError("the reward failed")

    pipe = AsyncRollouts(produce, max_staleness=1, load=lambda *a: None, start_state=lambda: None)
    pipe.publish(0, {}, 0)
    with pytest.raises(ValueError, match="the reward failed"):
        pipe.take(0)
    pipe.close()


def test_k_zero_is_the_synchronous_loop_and_refused_here():
    with pytest.raises(ValueError, match="K >= 1"):
        AsyncRollouts(lambda n, w: None, max_staleness=0, load=lambda *a: None, start_state=lambda: None)


def _token_iterations_reference(mask, turn_iters):
    out = torch.full(mask.shape, -1, dtype=torch.long)
    for b in range(mask.shape[0]):
        stretch, inside = -1, False
        for t in range(mask.shape[1]):
            if mask[b, t] and not inside:
                stretch += 1
            inside = bool(mask[b, t])
            if inside:
                out[b, t] = turn_iters[stretch]
    return out


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3)), min_size=1, max_size=4),
                     min_size=1, max_size=4),
       turn_iters=st.lists(st.integers(0, 9), min_size=4, max_size=4))
def test_token_iterations_tag_each_turns_tokens_as_a_loop_does(rows, turn_iters):
    width = max(sum(a + o for a, o in row) for row in rows) + 2
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, row in enumerate(rows):
        t = 0
        for agent, obs in row:  # a turn's tokens, then the environment's observation
            mask[b, t:t + agent] = True
            t += agent + obs
    assert torch.equal(token_iterations(mask, turn_iters), _token_iterations_reference(mask, turn_iters))


def test_token_iterations_refuse_more_stretches_than_turns():
    with pytest.raises(ValueError, match="stretches"):
        token_iterations(torch.tensor([[True, False, True]]), [3])


def test_the_actors_copy_shares_the_frozen_weights_and_copies_the_trained():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)
    twin = policy_copy(model)
    assert twin[0].weight is model[0].weight  # frozen: one copy in memory
    assert twin[1].weight is not model[1].weight and torch.equal(twin[1].weight, model[1].weight)
    with torch.no_grad():
        model[1].weight.add_(1.0)
    assert not torch.equal(twin[1].weight, model[1].weight)


@pytest.mark.parametrize("k", [2, 3])
def test_continued_episodes_longer_than_k_turns_are_drawn_beside_the_update(k):
    """'continue' with 2K turns an episode: rollout i + 1 is drawn whole while the learner, having
    published iteration i's weights and taken rollout i, has not published i + 1 yet (its update), so
    the actor never waits for the learner; before, turns from the K-th on waited for iteration i + 1."""
    actor = FakeActor()
    pipe = pipeline(actor, k, "continue", 2 * k, [0.0])
    try:
        for i in range(6):
            pipe.publish(i, {"w": torch.tensor(i)}, 10 * i)
            assert pipe.take(i)["n"] == i
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the update runs until the next rollout is drawn
                with pipe._cond:
                    if any(q.n == i + 1 for q in pipe._queue):
                        break
                time.sleep(0.005)
            else:
                raise AssertionError(f"rollout {i + 1} waited for weights the learner publishes after its update")
    finally:
        pipe.close()


# -- the actor's CUDA stream: what runs where, and the hand-overs (the CUDA side: tests/cuda/test_async_stream.py)


def test_the_actor_gets_a_stream_of_its_own_only_on_cuda_with_an_engine_that_samples_a_module():
    from textrl.agents.async_actor import own_stream
    from textrl.generation.base import REGISTRY

    for name in ("textrl", "hf", "static"):
        engine = REGISTRY.lookup(name)()
        assert own_stream(engine, "cuda") and own_stream(engine, torch.device("cuda", 1))
        assert not own_stream(engine, "cpu")
    for name in ("vllm", "vllm-server"):  # vLLM launches generation's kernels itself (the class: vLLM not needed)
        assert not own_stream(REGISTRY.lookup(name), "cuda") and not own_stream(REGISTRY.lookup(name), "cpu")


def test_on_the_cpu_the_actor_has_no_stream_and_its_rollout_is_the_synchronous_ones(tok):
    from tests.agents.conftest import make_agent
    from textrl.agents.async_actor import AsyncActor, trainable_state

    agent = make_agent(tok)
    async_actor = AsyncActor.of(agent)
    assert async_actor.stream is None
    pipe = AsyncRollouts(lambda n, weights: (weights.use(n), torch.manual_seed(n),
                                             async_actor.actor.sample(ids, mask))[-1],
                         max_staleness=1, load=async_actor.load, start_state=lambda: None,
                         stream=async_actor.stream)
    enc = tok(["What is 1+2?", "hi"], return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    try:
        pipe.publish(0, trainable_state(agent.policy), 0)
        tokens, logps = pipe.take(0)
    finally:
        pipe.close()
    torch.manual_seed(0)
    assert torch.equal(agent.actor.sample(ids, mask)[0], tokens)  # the learner's own actor, the same weights and seed


def test_tensors_in_finds_every_tensor_of_a_rollout_item():
    from tensordict import TensorDict

    from textrl.agents.async_actor import tensors_in

    td = TensorDict({"a": torch.zeros(2), ("n", "b"): torch.ones(2, 3)}, batch_size=[2])
    extra = torch.arange(3)
    found = list(tensors_in((td, {"t": [extra, 1.5]}, 7, "text")))
    assert len(found) == 3 and any(t is extra for t in found)
    assert sorted(t.shape for t in found if t is not extra) == [torch.Size([2]), torch.Size([2, 3])]


class RecordingStream:
    """An :class:`ActorStream`'s protocol without CUDA: the calls in order, with the thread that made
    each and whether it was inside :meth:`entered` there; an event is the number of rollouts produced
    when it was recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, str, bool]] = []
        self.produced = 0
        self._inside = threading.local()

    def inside(self) -> bool:
        return getattr(self._inside, "on", False)

    def _say(self, what: str, arg: Any = None) -> None:
        self.calls.append((what, arg, threading.current_thread().name, self.inside()))

    @contextmanager
    def entered(self):
        self._inside.on = True
        try:
            yield
        finally:
            self._inside.on = False

    def done(self):
        self._say("done", self.produced)
        return self.produced

    def receive(self, item, event):
        self._say("receive", (item["n"], event))

    def learner_waits(self):
        self._say("learner_waits")

    def actor_waits(self):
        self._say("actor_waits")


def test_the_hand_overs_between_the_actors_stream_and_the_learners():
    """Every rollout and weight load of the producer runs inside the stream; each rollout taken is
    received with the event recorded after its own kernels; the learner waits for the actor's stream
    after a quiesce; the held-out evaluation loads and samples inside the stream, after the learner's
    work, and the learner waits for it at the end."""
    stream = RecordingStream()
    loads = []

    def produce(n, weights):
        weights.use(behaviour_iteration(n, 1))
        assert stream.inside(), "the producer ran off the actor's stream"
        stream.produced += 1
        return {"n": n}

    def load(iteration, weights, version):
        loads.append((iteration, stream.inside()))

    pipe = AsyncRollouts(produce, max_staleness=1, load=load, start_state=lambda: None, rewind=lambda s: None,
                         stream=stream)
    learner = threading.current_thread().name
    try:
        for i in range(3):
            pipe.publish(i, {"w": torch.tensor(i)}, i)
            assert pipe.take(i) == {"n": i}
            assert stream.calls[-1] == ("receive", (i, i + 1), learner, False)  # the event after rollout i's
        pipe.quiesce()
        assert stream.calls[-1] == ("learner_waits", None, learner, False)
        assert pipe._idle()
        with pipe.holding(-2, {"w": torch.tensor(-2)}, 0):
            assert stream.inside() and loads[-1] == (-2, True)
            assert stream.calls[-1] == ("actor_waits", None, learner, False)
        assert stream.calls[-1] == ("learner_waits", None, learner, False)
        pipe.publish(3, {"w": torch.tensor(3)}, 3)
        assert pipe.take(3) == {"n": 3}
    finally:
        pipe.close()
    assert all(inside for _, inside in loads)
    produced = [arg for what, arg, thread, inside in stream.calls if what == "done"]
    assert produced == list(range(1, len(produced) + 1))  # one event per rollout, after it
    assert all(inside and thread == "textrl-async-actor" for what, _, thread, inside in stream.calls if what == "done")
