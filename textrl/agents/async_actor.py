"""Asynchronous rollouts: the actor generates the next rollouts while the learner updates, never
from weights more than ``max_staleness`` (K) updates old.

The schedule is exact, so a run is reproducible and a comparison measures the cost of exactly K:

- rollout ``n`` (the one iteration ``n`` trains on) is drawn with the weights of iteration
  :func:`behaviour_iteration` ``(n, K) = max(0, n - K)`` (the weights after that many updates);
- with ``partial_rollouts='continue'``, turn ``t`` of a multi-turn episode is drawn with the
  weights of iteration :func:`turn_iteration` ``= max(n - K, min(n - 1, n - K + t))`` (``n - K``
  at least 0): an episode in flight when the learner's weights move on continues with the newer
  ones (verl's partial rollouts), never with iteration ``n``'s, which the learner publishes only when
  it takes rollout ``n``, so every turn of an episode longer than K turns is still drawn beside the
  learner's update; each token is tagged with the iteration that sampled it
  (:func:`token_iterations`); with ``'finish'`` (the default) every turn keeps the episode's first
  weights.

So while the learner runs update ``j`` the actor draws rollout ``j + K`` from the weights the
learner had before it (one step off-policy at K=1, as prime-rl and verl's one-step overlap). The
machinery is :class:`AsyncRollouts`: a producer thread that calls ``produce(n, weights)`` for
``n = first, first + 1, ...``, where ``weights.use(i)`` blocks until the learner has published the
weights of iteration ``i`` (:meth:`AsyncRollouts.publish`, at the start of each iteration) and
loads them into the actor's own copy of the policy (:class:`AsyncActor`); the learner takes
rollout ``n`` with :meth:`AsyncRollouts.take`. :meth:`AsyncRollouts.quiesce` brings the producer
to rest, the one state in which the held-out evaluation and a checkpoint may run (nothing else
touches the actor's RNG then): a rollout in flight is cancelled at its next generation call
(between two requests or turns: :meth:`Weights.check`), its RNG and prompt sampler put back as it
found them, and drawn again from there once the learner goes on (:meth:`AsyncRollouts.publish`, or
the end of :meth:`AsyncRollouts.holding`), so a checkpoint, an evaluation or a SIGTERM waits for
one generation call, not for up to K rollouts, and the run draws what it would have drawn
uncancelled; :meth:`AsyncRollouts.state_dict`
holds the rollouts done and not yet trained on, the start of the one in flight (its RNG and prompt
sampler state: a resume draws it again, identically) and the weights it and the queued turns need.

The producer owns the process's global RNG (the engines draw from it); with K > 0 the learner
shuffles its minibatches with a private generator (:attr:`textrl.agents.learner.Learner.generator`).

On CUDA, with an engine that samples a module in this process (``textrl``, ``hf``, ``static``), the
producer launches its kernels on a stream of its own (:class:`ActorStream`), so that generation and
the learner's update overlap on the device, not only on the host; its hand-overs with the learner's
stream are events and stream waits (:class:`ActorStream`). With a vLLM engine, in this process or
served, vLLM runs generation's kernels itself (its engine core, or another device): nothing of ours to
move, no stream (:func:`own_stream`). On the CPU nothing of this runs.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn


def behaviour_iteration(n: int, max_staleness: int) -> int:
    """The learner iteration whose weights draw rollout ``n``: ``max(0, n - K)``."""
    return max(0, int(n) - int(max_staleness))


def turn_iteration(n: int, max_staleness: int, turn: int, partial_rollouts: str = "finish") -> int:
    """The iteration whose weights draw turn ``turn`` (0-based) of rollout ``n``: the rollout's
    (:func:`behaviour_iteration`) with ``'finish'``; with ``'continue'`` one newer per turn, never
    newer than ``n - 1``: the newest weights published while the learner updates on rollout ``n - 1``
    (iteration ``n``'s come only when it takes rollout ``n``, so a turn that waited for them would
    wait for the learner: no overlap)."""
    first = behaviour_iteration(n, max_staleness)
    if partial_rollouts == "continue":
        return max(first, min(int(n) - 1, first + int(turn)))
    return first


def token_iterations(mask: Tensor, turn_iters: list[int]) -> Tensor:
    """``mask`` bool ``[B, T]`` (the agent's tokens, one contiguous stretch per turn, the environment's
    observations between) -> int64 ``[B, T]``: the iteration of the weights that sampled each agent
    token, ``turn_iters[k]`` on a row's ``k``-th stretch, -1 off the agent's tokens. ``ValueError``
    when a row has more stretches than turns were drawn."""
    starts = mask & ~torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)  # [B, T] first token of a stretch
    stretch = starts.long().cumsum(1) - 1  # [B, T]
    if bool(mask.any()) and int(stretch[mask].max()) >= len(turn_iters):
        raise ValueError(f"a row has {int(stretch[mask].max()) + 1} stretches of agent tokens and {len(turn_iters)} "
                         "turns were drawn")
    table = torch.tensor(list(turn_iters) or [-1], dtype=torch.long, device=mask.device)
    return torch.where(mask, table[stretch.clamp(min=0)], -1)


# -- the actor's own copy of the policy ---------------------------------------------------------------


def trainable_state(policy: nn.Module) -> dict[str, Tensor]:
    """A detached copy of ``policy``'s trained weights (``requires_grad``), what the learner publishes,
    kept off the device: on the CPU, in pinned memory for weights on CUDA (copied without blocking,
    then one wait for them all), so that the K + 1 snapshots an asynchronous run keeps cost no device
    memory and load back without blocking (:meth:`AsyncActor.load`)."""
    out: dict[str, Tensor] = {}
    cuda = set()
    for name, p in policy.named_parameters():
        if not p.requires_grad:
            continue
        if p.device.type == "cuda":
            out[name] = torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p.detach(), non_blocking=True)
            cuda.add(p.device)
        else:
            out[name] = p.detach().to("cpu", copy=True)
    for device in cuda:
        torch.cuda.current_stream(device).synchronize()  # the copies are done before the learner writes the weights
    return out


def policy_copy(policy: nn.Module) -> nn.Module:
    """A copy of ``policy`` for the actor: its trained weights copied, its frozen weights and buffers
    shared (a LoRA policy's base, a 4-bit base: one copy in memory)."""
    memo: dict[int, Any] = {id(p): p for p in policy.parameters() if not p.requires_grad}
    memo.update({id(b): b for b in policy.buffers()})
    twin = copy.deepcopy(policy, memo)
    return twin.eval().requires_grad_(False)


def receives_directly(engine: Any, policy: nn.Module) -> bool:
    """Whether the asynchronous actor hands each published snapshot straight to its engine and keeps
    no copy of the policy: an engine that holds its own weights and takes them pushed
    (:attr:`~textrl.generation.base.GenerationEngine.receives_weights`: the ``vllm`` engines) and a
    policy that trains every weight (full fine-tuning: a LoRA or 4-bit policy's frozen base is not in
    the snapshots, and its adapter goes to vLLM from a copy that shares the base; textrl's view of one
    adapter lists only the adapter's weights, by their LoRA names)."""
    from textrl.generation.vllm_engine import is_lora_name

    return bool(getattr(engine, "receives_weights", False)) and all(
        p.requires_grad and not is_lora_name(name) for name, p in policy.named_parameters())


def device_bytes(tensors: Iterable[Tensor], device: torch.device | str) -> int:
    """The bytes of the distinct storages of ``tensors`` that live on ``device`` (a storage several of
    them share is counted once)."""
    device = torch.device(device)
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor.device.type == device.type and (device.index is None or tensor.device.index == device.index):
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class WholeWeights:
    """The learner's backend as an actor handed the weights whole sees it (:func:`receives_directly`):
    nothing to gather and no forward a collective, whatever the learner's backend partitions (its
    thread joins no collective); everything else is the backend's."""

    partitions_weights = False

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def gathered(self, model: nn.Module) -> AbstractContextManager[Any]:
        return nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


# -- the actor's CUDA stream ----------------------------------------------------------------------------


def own_stream(engine: Any, device: torch.device | str) -> bool:
    """Whether the asynchronous actor's thread launches its kernels on a CUDA stream of its own
    (:class:`ActorStream`): on a CUDA device with an engine that samples a module in this process
    (``textrl``, ``hf``, ``static``). Not on the CPU (no streams: there the two threads overlap on the
    host alone), nor with an engine that holds its own weights
    (:attr:`~textrl.generation.base.GenerationEngine.receives_weights`: the ``vllm`` engines), whose
    kernels vLLM launches itself, in its engine core or on a server's device."""
    return torch.device(device).type == "cuda" and not getattr(engine, "receives_weights", False)


def tensors_in(item: Any) -> Iterator[Tensor]:
    """The tensors of ``item``: a tensor, a TensorDict's leaves, and those inside tuples, lists and
    dicts of them, recursively (anything else holds none)."""
    if isinstance(item, Tensor):
        yield item
    elif isinstance(item, (tuple, list)):
        for part in item:
            yield from tensors_in(part)
    elif isinstance(item, dict):
        for part in item.values():
            yield from tensors_in(part)
    elif hasattr(item, "batch_size") and hasattr(item, "values"):  # a TensorDict
        yield from (t for t in item.values(include_nested=True, leaves_only=True) if isinstance(t, Tensor))


class ActorStream:
    """The asynchronous actor's CUDA stream on ``device``, beside the learner's (the current stream of
    the learner's thread: the device's default stream), and the hand-overs between the two, so that
    generation's kernels and the update's overlap on one GPU instead of queueing behind each other:

    - the producer's thread runs on it (:meth:`entered`): it loads the published weights into the
      actor's copy (from pinned memory, without blocking: the copies are queued on this stream before
      the kernels that read them), samples, prefills the weight check and assembles the rollout; the
      actor's copy and its engine's buffers are only ever used on this stream;
    - a rollout done gets an event recorded after its kernels (:meth:`done`); when the learner takes
      it, its stream waits for that event before anything it queues next, and each of the rollout's
      tensors is marked as used by the learner's stream (:meth:`receive`), so the allocator gives its
      memory to no later rollout while the learner's kernels may still read it;
    - the learner reads the actor's state only while the producer rests (a checkpoint's queued
      rollouts, the held-out evaluation): its stream first waits for this one (:meth:`learner_waits`);
      the held-out evaluation samples on this stream, after the learner's work queued so far
      (:meth:`actor_waits`), and the learner's stream waits for it when it ends.

    Built after the actor's copy (made on the learner's stream), which it waits for."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.actor_waits()  # the actor's copy of the policy, made on the learner's stream, before any use here

    def entered(self) -> AbstractContextManager[Any]:
        """The block's kernels on the actor's stream (in the thread that enters it)."""
        return torch.cuda.stream(self.stream)

    def done(self) -> Any:
        """An event recorded on the actor's stream now: it completes when the work queued so far does."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def receive(self, item: Any, event: Any) -> None:
        """The learner takes ``item``: its current stream waits for ``event`` (:meth:`done`; None: an
        item restored from a checkpoint), and every CUDA tensor of ``item`` is marked as used by it."""
        learner = torch.cuda.current_stream(self.device)
        if event is not None:
            learner.wait_event(event)
        for tensor in tensors_in(item):
            if tensor.is_cuda:
                tensor.record_stream(learner)

    def learner_waits(self) -> None:
        """The learner's current stream waits for the work queued on the actor's so far."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def actor_waits(self) -> None:
        """The actor's stream waits for the work queued on the learner's current stream so far."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))


def on_stream(stream: ActorStream | None) -> AbstractContextManager[Any]:
    """``stream`` entered, or nothing (None: the CPU, a vLLM engine)."""
    return stream.entered() if stream is not None else nullcontext()


PREFILL_CHECK_SKIPPED = (
    "the asynchronous actor hands each published snapshot straight to {engine} and keeps no copy of the policy, so "
    "it cannot prefill the weights its engine samples with: the rollouts' prefill weight check is off; the engine's "
    "check of what its workers took (fingerprints of every hand-over) stands in (docs/async.md, \"What runs where\")")
"""The line an asynchronous run whose actor keeps no copy of the policy says once (:meth:`AsyncActor.note`)."""


@dataclass
class AsyncActor:
    """The actor that draws the asynchronous rollouts: an :class:`textrl.agents.actor.Actor` with its
    own generation engine, loaded with the weights of one learner iteration at a time (:meth:`load`).
    ``iteration`` is the one it holds.

    Where the engine holds its own weights (:func:`receives_directly`: the ``vllm`` engines, full
    fine-tuning) the actor keeps no copy of the policy: each snapshot goes to the engine
    (``engine.load_weights``), and the learner's module only describes the model to it (its weights are
    not read); the prefill weight check, which needs a module at the weights sampled with, is off
    (:data:`PREFILL_CHECK_SKIPPED`). Otherwise it samples its own copy (:func:`policy_copy`), the
    snapshot copied into its trained weights (:attr:`trained`)."""

    actor: Any
    trained: dict[str, nn.Parameter] | None = field(default_factory=dict, repr=False)
    """The copy's trained weights, which :meth:`load` writes; None: no copy, the engine receives the weights."""
    iteration: int = -1
    sync_seconds: float = 0.0
    """Seconds :meth:`load` spent since :meth:`take_sync_seconds` last read them."""
    skipped_check: bool = False
    """Whether the run's prefill weight check is off because the actor keeps no copy (it was on)."""
    stream: ActorStream | None = None
    """The CUDA stream the producer's thread runs on (:func:`own_stream`); None on the CPU and with a vLLM
    engine."""

    @classmethod
    def of(cls, agent: Any) -> AsyncActor:
        """``agent``'s actor (:attr:`PPOAgent.actor`) re-built with no reference and no critic (the
        learner evaluates the rollouts) and an engine of its own, over a copy of the policy unless the
        engine receives the weights (:func:`receives_directly`); on CUDA a stream of its own
        (:func:`own_stream`)."""
        from textrl.agents import build
        from textrl.agents.actor import Actor
        from textrl.agents.weight_check import weight_gap_bound
        main = agent.actor
        engine = build.build_actor(agent).engine  # a new engine of the run's kind, configured and checked
        if receives_directly(engine, main.policy):
            # the learner's module, never read for its weights; no module at the sampled weights to prefill;
            # the snapshots come whole (gathered by the learners where the backend partitions them)
            engine.check_backend(False)
            checked = not math.isinf(weight_gap_bound(main.config, main.precision.compute_dtype))
            actor = Actor(replace(main.config, max_weight_gap=0), main.policy, None, None, main.forwards, engine,
                          WholeWeights(main.backend), eos_token_id=main.eos_token_id, pad_token_id=main.pad_token_id,
                          device=main.device)
            actor.start_engine()  # here, on every process together (vLLM under several), not in the actor's thread
            return cls(actor, None, skipped_check=checked)
        twin = policy_copy(main.policy)
        actor = Actor(main.config, twin, None, None, main.forwards, engine, main.backend,
                      eos_token_id=main.eos_token_id, pad_token_id=main.pad_token_id, device=main.device)
        names = {name for name, p in main.policy.named_parameters() if p.requires_grad}
        actor.start_engine()  # here, on every process together (vLLM under several), not in the actor's thread
        stream = ActorStream(main.device) if own_stream(engine, main.device) else None  # after the copy: it waits for it
        return cls(actor, {name: p for name, p in twin.named_parameters() if name in names}, stream=stream)

    @torch.no_grad()
    def load(self, iteration: int, weights: dict[str, Tensor], version: int) -> None:
        """Sample with the published ``weights`` of ``iteration`` (``version``: the learner's weight
        version then, stamped on the rows as ``KEYS.policy_version``); nothing when it holds them. With
        no copy the engine takes them (by reference; moved to its device in buckets at its next call);
        else they are copied into the copy's trained weights (without blocking from pinned memory)."""
        if iteration == self.iteration:
            return
        started = time.perf_counter()
        if self.trained is None:
            self.actor.engine.load_weights(weights.items(), int(version))
        else:
            for name, param in self.trained.items():
                param.copy_(weights[name], non_blocking=True)
        self.sync_seconds += time.perf_counter() - started
        self.iteration, self.actor.version, self.actor.updates = iteration, int(version), iteration

    def take_sync_seconds(self) -> float:
        """The seconds spent giving the engine its weights since the last call (``time/weight_sync_s``):
        :meth:`load`'s and the engine's own hand-overs (``take_weight_sync_seconds``)."""
        seconds = self.sync_seconds + self.actor.engine.take_weight_sync_seconds()
        self.sync_seconds = 0.0
        return seconds

    def device_bytes(self, device: torch.device | str) -> int:
        """The bytes of the actor's own copy of the trained weights on ``device`` (0 without a copy; the
        frozen weights it shares with the learner are not its own)."""
        return 0 if self.trained is None else device_bytes(self.trained.values(), device)

    def note(self) -> str | None:
        """The line a run says once where the actor keeps no copy and so skips the prefill check it
        would have run (:data:`PREFILL_CHECK_SKIPPED`), else None."""
        if not self.skipped_check:
            return None
        return PREFILL_CHECK_SKIPPED.format(engine=f"the {self.actor.engine.name!r} engine")


# -- the pipeline --------------------------------------------------------------------------------------


class Weights:
    """What ``produce(n, weights)`` gets: :meth:`use` blocks until iteration ``i``'s weights are
    published, then loads them (``load(i, weights, version)``) and records the iteration."""

    def __init__(self, pipeline: AsyncRollouts) -> None:
        self._pipeline = pipeline

    def use(self, iteration: int) -> int:
        """Sample with the weights of ``iteration`` from now on; returns the learner's weight version."""
        return self._pipeline._use(iteration)

    def check(self) -> None:
        """Before each generation call: raises :class:`Cancelled` when the learner asked the producer
        to rest (:meth:`AsyncRollouts.quiesce`); the rollout is then drawn again from its start."""
        if self._pipeline._cancel:
            raise Cancelled


@dataclass
class Queued:
    """A rollout done and not yet trained on: its index, the item ``produce`` returned."""

    n: int
    item: Any
    ready: Any = None
    """On the actor's CUDA stream: the event recorded after the rollout's kernels (:meth:`ActorStream.done`)."""


class AsyncRollouts:
    """The producer thread and its hand-over (module docstring).

    ``produce(n, weights) -> item`` draws rollout ``n`` (in the producer thread); ``load(i, weights,
    version)`` loads published weights into the actor; ``start_state()`` / ``restore_start(state)``
    capture and restore what a rollout's draw depends on besides the weights (the RNGs, the prompt
    sampler): taken before each rollout, so one in flight at a checkpoint is drawn again on resume;
    ``rewind(state)`` puts it back in this process (a cancelled rollout, drawn again at once).
    ``stream`` (:class:`ActorStream`, CUDA) the stream the producer runs on, and the held-out
    evaluation (:meth:`holding`); the rollouts are handed to the learner's stream as the class says.
    It draws from rollout 0, or where :meth:`load_state_dict` (a resume) says."""

    def __init__(self, produce: Callable[[int, Weights], Any], *, max_staleness: int,
                 load: Callable[[int, dict[str, Tensor], int], None], start_state: Callable[[], Any],
                 rewind: Callable[[Any], None] | None = None, stream: ActorStream | None = None) -> None:
        if max_staleness < 1:
            raise ValueError(f"max_staleness={max_staleness}: asynchronous rollouts need K >= 1 (K=0 is the synchronous loop)")
        self.max_staleness = int(max_staleness)
        self._produce, self._load, self._start_state, self._rewind = produce, load, start_state, rewind
        self.stream = stream
        self._cond = threading.Condition()
        self._queue: list[Queued] = []
        self._next = 0  # the rollout the producer draws next
        self._snapshots: dict[int, tuple[dict[str, Tensor], int]] = {}
        self._published = -1
        self._waiting_for: int | None = None  # the iteration whose weights the producer waits for
        self._in_flight: tuple[int, Any] | None = None  # (n, start state) of the rollout being drawn
        self._error: BaseException | None = None
        self._error_raised = False  # the learner was told (take / quiesce): the producer is gone
        self._cancel = False  # the learner asks the producer to rest: the rollout in flight is cancelled
        self._resting = False  # the producer rests after a cancelled rollout, its start put back
        self.cancelled = 0
        """Rollouts cancelled so far (each drawn again from its start)."""
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- the learner's side -------------------------------------------------------------------------
    def publish(self, iteration: int, weights: dict[str, Tensor], version: int) -> None:
        """The weights of ``iteration`` (after that many updates; ``version`` the learner's weight
        version), a copy the learner will not write; starts the producer at the first call."""
        with self._cond:
            if iteration > self._published:  # a resumed pipeline may hold it already (saved after it was published)
                self._snapshots[iteration] = (weights, int(version))
                self._published = iteration
                self._prune()
            self._cancel = False  # a producer resting since the last quiesce draws again
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="textrl-async-actor", daemon=True)
            self._thread.start()

    def take(self, n: int) -> Any:
        """Rollout ``n`` (in order), waiting for the producer; re-raises the producer's error."""
        with self._cond:
            while not (self._queue and self._queue[0].n == n):
                self._raise_error()
                if self._queue and self._queue[0].n != n:
                    raise RuntimeError(f"asynchronous rollouts: rollout {n} asked, {self._queue[0].n} is next")
                self._cond.wait(timeout=1.0)
            queued = self._queue.pop(0)
            self._cond.notify_all()
        if self.stream is not None:
            self.stream.receive(queued.item, queued.ready)
        return queued.item

    def quiesce(self) -> None:
        """Bring the producer to rest: it waits for weights not yet published, or a rollout in
        flight is cancelled at its next generation call and its start put back (module docstring);
        it touches nothing then, until :meth:`publish` or the end of :meth:`holding`. The
        producer's error is raised here or by :meth:`take`, once: after that the producer is gone,
        nothing moves, and this returns (a checkpoint of the learner's state may follow). On CUDA the
        learner's stream then waits for the actor's (what the producer left is read there)."""
        with self._cond:
            if self._rewind is not None:
                self._cancel = True
            while self._thread is not None and not self._idle() and not self._error_raised:
                self._raise_error(once=True)
                self._cond.wait(timeout=1.0)
            self._raise_error(once=True)
        if self.stream is not None:
            self.stream.learner_waits()

    @contextmanager
    def holding(self, iteration: int, weights: dict[str, Tensor], version: int) -> Iterator[None]:
        """The actor holds ``weights`` (the learner's now, for a held-out evaluation) inside; the
        producer, quiesced first, loads its own again when it goes on. On CUDA the block runs on the
        actor's stream (its copy and its engine's buffers are used there alone), after the learner's
        work queued so far; the learner's stream waits for it at the end."""
        self.quiesce()
        if self.stream is not None:
            self.stream.actor_waits()
        try:
            with on_stream(self.stream):
                self._load(iteration, weights, version)
                yield
        finally:
            if self.stream is not None:
                self.stream.learner_waits()
            with self._cond:
                self._cancel = False
                self._cond.notify_all()

    def close(self) -> None:
        """Stop the producer (a rollout in flight is left unfinished) and wait for it."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def state_dict(self) -> dict[str, Any]:
        """Quiesced: the rollouts done and not trained on, the start state of the one in flight, and
        the published weights it and the next rollouts still read."""
        self.quiesce()
        with self._cond:
            return {"queued": [(q.n, q.item) for q in self._queue], "in_flight": self._in_flight,
                    "snapshots": dict(self._snapshots), "published": self._published, "next": self._next}

    def load_state_dict(self, state: dict[str, Any], restore_start: Callable[[Any], None]) -> None:
        """Before the producer starts: the queued rollouts and kept weights of :meth:`state_dict`; the
        in-flight rollout's start state restored by ``restore_start`` (it is drawn again)."""
        with self._cond:
            self._queue = [Queued(n, item) for n, item in state["queued"]]
            self._snapshots.update(state["snapshots"])
            self._published = int(state["published"])
            in_flight = state["in_flight"]
            self._next = in_flight[0] if in_flight is not None else state["next"]
        if in_flight is not None:
            restore_start(in_flight[1])

    # -- the producer's side ------------------------------------------------------------------------
    def _idle(self) -> bool:
        return self._resting or (self._waiting_for is not None and self._waiting_for > self._published)

    def _raise_error(self, once: bool = False) -> None:
        """The producer's error, if it failed (``once``: unless the learner was told already)."""
        if self._error is not None and not (once and self._error_raised):
            self._error_raised = True
            raise self._error

    def _use(self, iteration: int) -> int:
        with self._cond:
            self._waiting_for = iteration
            self._cond.notify_all()
            while iteration > self._published and not self._closed:
                self._cond.wait()
            if self._closed:
                raise _Closed
            self._waiting_for = None
            weights, version = self._snapshots[iteration]
        self._load(iteration, weights, version)
        return version

    def _rest(self, n: int) -> None:
        """Rollout ``n`` was cancelled: its start put back (``rewind``), then rest until the learner
        goes on; the loop draws it again from that start."""
        with self._cond:
            start = self._in_flight[1]
            self.cancelled += 1
        self._rewind(start)
        with self._cond:
            self._resting = True
            self._cond.notify_all()
            while self._cancel and not self._closed:
                self._cond.wait()
            self._resting = False

    def _prune(self) -> None:
        """Drop the weights no rollout from the next one on reads (each reads iterations >= n - K)."""
        first = self._next if self._in_flight is None else self._in_flight[0]
        oldest = behaviour_iteration(first, self.max_staleness)
        for i in [i for i in self._snapshots if i < oldest]:
            del self._snapshots[i]

    def _run(self) -> None:
        with on_stream(self.stream):
            self._draw()

    def _draw(self) -> None:
        try:
            while True:
                with self._cond:  # the weights it waits for bound the queue: at most K + 1 rollouts ahead
                    if self._closed:
                        return
                    n = self._next
                    self._in_flight = (n, self._start_state())
                try:
                    item = self._produce(n, Weights(self))
                except Cancelled:
                    self._rest(n)
                    continue
                ready = self.stream.done() if self.stream is not None else None
                with self._cond:
                    self._queue.append(Queued(n, item, ready))
                    self._next, self._in_flight = n + 1, None
                    self._prune()
                    self._cond.notify_all()
        except _Closed:
            return
        except BaseException as err:  # handed to the learner's next take / quiesce
            with self._cond:
                self._error = err
                self._cond.notify_all()


class _Closed(Exception):
    """The pipeline closed while the producer waited."""


class Cancelled(BaseException):  # noqa: N818 - a request, not an error; not an Exception, so no handler in an environment or reward takes it
    """Raised in the producer by :meth:`Weights.check`: the learner asked it to rest."""


__all__ = ["ActorStream", "AsyncActor", "AsyncRollouts", "Cancelled", "PREFILL_CHECK_SKIPPED", "Queued", "Weights",
           "behaviour_iteration", "device_bytes", "on_stream", "own_stream", "policy_copy", "receives_directly",
           "tensors_in", "token_iterations", "trainable_state", "turn_iteration"]
