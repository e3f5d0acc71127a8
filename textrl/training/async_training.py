"""``textrl train --max-staleness K``: the run's rollouts drawn by an actor beside the learner.

:class:`AsyncTraining` is what the trainer holds when K > 0 (docs/async.md): the actor with its own
copy of the policy and its own engine (:class:`textrl.agents.async_actor.AsyncActor`), the producer
thread (:class:`textrl.agents.async_actor.AsyncRollouts`) that draws rollout ``n`` with the weights
of iteration ``max(0, n - K)`` (each turn's with ``partial_rollouts='continue'``), and what a
checkpoint holds of it. The trainer's iteration then reads as the synchronous one: publish the
weights, take the rollout, estimate, update.

Rollout ``n`` is the one ``textrl train``'s iteration ``n + 1`` trains on (iterations count from 1);
"the weights of iteration ``i``" are the learner's after ``i`` updates.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from textrl.agents.async_actor import (
    AsyncActor,
    AsyncRollouts,
    Weights,
    token_iterations,
    trainable_state,
    turn_iteration,
)
from textrl.agents.forwards import micro_batches
from textrl.core.checks import check_rollout
from textrl.generation.base import EngineFailed, EngineFailedElsewhere
from textrl.keys import KEYS
from textrl.run.rng import draw_start, put_back, set_rng_state
from textrl.run.rollout import RolloutFailedElsewhere, ended_together

LEARNER_SEED_OFFSET = 7919
"""The learner's minibatch generator is seeded with ``seed + LEARNER_SEED_OFFSET`` (the actor's draws
keep the global RNG seeded with ``seed``)."""


HELD_OUT = -2
"""The iteration the actor says it holds while the held-out evaluation samples with the learner's
weights: none the producer asks for, so it loads its own again."""


class ActorView:
    """The agent as :func:`textrl.run.rollout.run_episodes` and the held-out evaluation read it, sampling
    through the asynchronous actor (its engine: one engine per run)."""

    def __init__(self, agent: Any, actor: Any) -> None:
        self._agent, self._actor = agent, actor
        self.config, self.tokenizer, self.device = agent.config, agent.tokenizer, actor.device
        self.eos_token_id, self.pad_token_id = agent.eos_token_id, agent.pad_token_id

    def rollout(self, *, greedy: bool = False) -> Any:
        return self._actor.rollout(greedy=greedy)

    def act(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, greedy: bool = False) -> torch.Tensor:
        return self._actor.act(input_ids, attention_mask, greedy=greedy)


class AsyncTraining:
    """The asynchronous actor of one run (module docstring). ``sampler`` the run's
    :class:`textrl.envs.PromptSampler` (the actor's alone from here on), ``episodes`` its
    :class:`textrl.envs.collector.EpisodeRunner`, ``dist`` the run's processes
    (:class:`textrl.parallel.distributed.Distributed`): each process has an actor of its own, which draws its
    share of every prompt batch (``dist.shard``), with no collective in the actor's thread."""

    def __init__(self, config: Any, agent: Any, sampler: Any, episodes: Any, dist: Any) -> None:
        self.config, self.agent, self.sampler, self.episodes, self.dist = config, agent, sampler, episodes, dist
        self.shard = dist.shard
        self._gathered: list[dict[str, Any]] = []
        """Every process's :meth:`process_state`, gathered by :meth:`quiesce` under several processes."""
        self.max_staleness = int(config.max_staleness)
        self.actor = AsyncActor.of(agent)
        self.view = ActorView(agent, self.actor.actor)
        generator = torch.Generator(device=agent.device)
        generator.manual_seed(int(config.seed) + LEARNER_SEED_OFFSET)
        agent.learner.generator = generator  # the learner's shuffles leave the global RNG to the actor
        self._restored_start: Any = None
        self._taking = False
        """Whether the learner is taking its rollout (from the weights' publication to the take's end)."""
        self.pipeline = self._pipeline()

    def _pipeline(self) -> AsyncRollouts:
        return AsyncRollouts(self._produce, max_staleness=self.max_staleness, load=self.actor.load,
                             start_state=self._start_state, rewind=self._rewind, stream=self.actor.stream)

    # -- the learner's side ---------------------------------------------------------------------
    def next_rollout(self, iteration: int, timings: dict[str, float]) -> tuple[Any, int]:
        """:meth:`take_rollout`, its weight check judged and the rollout estimated here
        (``agent.process_rollout``)."""
        td, rows = self.take_rollout(iteration, timings)
        self.actor.actor.judge_weight_gap(td, drawn_with(td))
        return check_rollout(self.agent.process_rollout(td, timings=timings), finite=False), rows

    def take_rollout(self, iteration: int, timings: dict[str, float],
                     weights: dict[str, torch.Tensor] | None = None) -> tuple[Any, int]:
        """Publish the learner's weights (``iteration - 1`` updates done; ``weights``, where the caller
        gathered them, else copied here), then take the rollout that iteration trains on, as drawn:
        ``(rollout, rows of its prompt batch)`` (the rollout with ``KEYS.policy_iteration``, and
        ``KEYS.token_iteration`` with partial rollouts); its generation and reward seconds go to
        ``timings``, and ``wait``, the seconds the learner waited for it."""
        learner = self.agent.learner
        self._taking = True
        self.pipeline.publish(iteration - 1, trainable_state(learner.policy) if weights is None else weights,
                              learner.version)
        started = time.perf_counter()

        def take() -> Any:
            try:
                return self.pipeline.take(iteration - 1)
            except EngineFailed:
                raise
            except Exception as err:  # the producer died: the learner's state stands, and is saved (as an engine's failure)
                raise ProducerFailed(producer_failure(err)) from err

        td, drawn, rows = ended_together(self.dist, take)  # under several processes, a failure anywhere stops all
        self._taking = False
        timings["wait"] = time.perf_counter() - started
        timings.update(drawn)
        return td, rows

    @contextmanager
    def sampling_agent(self, weights: dict[str, torch.Tensor] | None = None) -> Iterator[ActorView]:
        """The actor sampling with the learner's weights now (``weights`` where the caller gathered
        them; the held-out evaluation), the producer quiesced; it loads its own again when it goes on."""
        learner = self.agent.learner
        with self.pipeline.holding(HELD_OUT, trainable_state(learner.policy) if weights is None else weights,
                                   learner.version):
            yield self.view

    def updated(self, timings: dict[str, float]) -> None:
        """After the learner's update: nothing (the weights are copied when they are published)."""

    def evaluates(self, main: bool, partitions_weights: bool) -> bool:
        """Whether this process runs the held-out evaluation: the main one, and every one where the
        forwards are collectives (FSDP, ZeRO-3)."""
        return main or partitions_weights

    def quiesce(self) -> None:
        """Before a checkpoint: the producer at rest (:meth:`AsyncRollouts.quiesce`), the actor's RNG
        and prompts standing still; under several processes every process's :meth:`process_state`
        gathered (a collective), for the main one to save."""
        self.pipeline.quiesce()
        if self.dist.enabled:
            self._gathered = self.dist.gather_object(self.process_state(snapshots=False))

    def rewind(self, iteration: int) -> bool:
        """After the engine failed in :meth:`next_rollout`: nothing to put back in the learner's
        process (the rollout in flight keeps its start, and a checkpoint says it is drawn again from
        there); False past the take."""
        return self._taking

    def note(self) -> str | None:
        """The lines the run starts with (:func:`staleness_note`; the actor's, where it keeps no copy of
        the policy: :meth:`AsyncActor.note`), or None."""
        lines = [line for line in (staleness_note(self.config), self.actor.note()) if line]
        return "\n".join(lines) or None

    def close(self) -> None:
        """Stop the producer and the actor's engine."""
        self.pipeline.close()
        self.actor.actor.engine.close()

    # -- the producer's side --------------------------------------------------------------------
    def _start_state(self) -> dict[str, Any]:
        return draw_start(self.sampler)

    def _rewind(self, start: dict[str, Any]) -> None:
        """A cancelled rollout's start put back (the producer draws it again from there)."""
        put_back(self.sampler, start)

    def _produce(self, n: int, weights: Weights) -> tuple[Any, dict[str, float], int]:
        """Rollout ``n``: the next prompt batch (this process's rows), its episodes, every turn drawn
        with the weights :func:`turn_iteration` names; the engine's rollout context is re-opened
        when the weights change between two turns (a carried KV cache is of the old ones)."""
        from textrl.envs.prompts import placing_rows

        cfg, actor = self.config, self.actor.actor
        timings: dict[str, float] = {}
        turns: list[int] = []  # the iteration of each turn's weights
        versions: list[int] = []  # their weight version, once per change
        context = ExitStack()  # the engine's rollout context over the turns of one set of weights

        def generate(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            weights.check()  # the learner asked for rest (a checkpoint, an evaluation, a stop): drawn again later
            if len(turns) <= getattr(self.episodes, "turn", len(turns)):  # a turn's first call (a reward scored
                # in the background has the runner draw each turn in parts: EpisodeRunner.turn says which)
                need = turn_iteration(n, self.max_staleness, len(turns), cfg.partial_rollouts)
                if not turns or need != turns[-1]:
                    context.close()
                    versions.append(weights.use(need))
                    context.enter_context(actor.engine.rollout())
                turns.append(need)
            parts = []
            for sl in micro_batches(input_ids.shape[0], cfg.generation_batch_size):  # the actor's own calls
                if parts:
                    weights.check()  # and between two calls of a turn: a single-turn rollout is one turn
                parts.append(actor.sample(input_ids[sl].to(actor.device), attention_mask[sl].to(actor.device)))
            return joined(parts, actor.pad_token_id)

        batch = self.sampler.next_batch()
        batch = batch.select(self.shard(len(batch)))
        with context, placing_rows(f"the rollout of iteration {n + 1}", lambda: self.sampler.batch_rows(batch)):
            td = self.episodes.run(generate, batch.to(actor.device), timings=timings)
        drawn_now = None if len(set(turns)) == 1 else token_iterations(td.get(KEYS.mask), turns) == turns[-1]
        actor.measure_weight_gap(td, drawn_now)  # the engine drew with the weights the actor holds (the last
        # turn's): measured here, judged by the learner when it takes the rollout (a collective there)
        rows = td.batch_size
        td.set(KEYS.policy_version, torch.full(rows, versions[0], dtype=torch.long, device=td.device))
        td.set(KEYS.policy_iteration, torch.full(rows, turns[0], dtype=torch.long, device=td.device))
        if cfg.partial_rollouts == "continue":
            td.set(KEYS.token_iteration, token_iterations(td.get(KEYS.mask), turns))
        if td.device is not None and td.device.type == "cuda":
            torch.cuda.current_stream(td.device).synchronize()
        timings["weight_sync"] = self.actor.take_sync_seconds()  # within its generation seconds
        return td, timings, len(batch)

    # -- checkpoints ----------------------------------------------------------------------------
    def process_state(self, snapshots: bool = True) -> dict[str, Any]:
        """What a checkpoint holds of this process's actor (quiesced first): the prompt sampler's
        position, the rollouts drawn and not trained on, the start of the one in flight, the
        learner's generator, and (``snapshots``) the published weights they read (the same in every
        process); weight versions kept relative to the learner's now (a resumed learner counts its
        versions from another start). Another process's part is kept on the CPU."""
        now = self.agent.learner.version
        state = self.pipeline.state_dict()
        state["queued"] = [(n, (rebased(td, -now), drawn, rows)) for n, (td, drawn, rows) in state["queued"]]
        if snapshots:
            state["snapshots"] = {i: (w, v - now) for i, (w, v) in state["snapshots"].items()}
        else:
            del state["snapshots"]
            state["queued"] = [(n, (td.to("cpu"), drawn, rows)) for n, (td, drawn, rows) in state["queued"]]
        return {"prompts": self.sampler.state_dict(), "async": state,
                "learner_generator": self.agent.learner.generator.get_state()}

    def state_dict(self) -> dict[str, Any]:
        """The main process's :meth:`process_state` and, under several processes, the other
        processes' (``"processes"``, in rank order from rank 1, gathered by :meth:`quiesce`)."""
        state = self.process_state()
        if self.dist.enabled:
            state["processes"] = self._gathered[1:]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """:meth:`state_dict` back (this process's part), with the producer not started: the
        in-flight rollout's start (its RNGs and prompts) is applied by :meth:`restored`, after the
        checkpoint's RNGs."""
        if "async" not in state:
            raise ValueError("this checkpoint was saved by a run without --max-staleness; resume it with its own "
                             "max_staleness (a fixed setting)")
        saved = 1 + len(state.get("processes", []))
        if saved != self.dist.world_size:
            raise ValueError(f"this checkpoint was saved by an asynchronous run of {saved} training process(es) (each "
                             f"with its actor's rollouts in flight), and this run has {self.dist.world_size}; resume "
                             "it with as many")
        if self.dist.rank > 0:
            own = state["processes"][self.dist.rank - 1]
            own["async"]["snapshots"] = state["async"]["snapshots"]
            own["async"]["queued"] = [(n, (td.to(self.agent.device), drawn, rows))
                                      for n, (td, drawn, rows) in own["async"]["queued"]]
            state = own
        now = self.agent.learner.version
        pipe = state["async"]
        pipe["queued"] = [(n, (rebased(td, now), drawn, rows)) for n, (td, drawn, rows) in pipe["queued"]]
        pipe["snapshots"] = {i: (w, v + now) for i, (w, v) in pipe["snapshots"].items()}
        self.sampler.load_state_dict(state["prompts"])
        self.agent.learner.generator.set_state(state["learner_generator"])
        self.pipeline = self._pipeline()
        self.pipeline.load_state_dict(pipe, self._restore_start)

    def _restore_start(self, start: dict[str, Any]) -> None:
        self.sampler.load_state_dict(start["sampler"])
        self._restored_start = start["rng"]

    def restored(self) -> None:
        """After the checkpoint's RNGs were set: the in-flight rollout's RNGs at its start."""
        if self._restored_start is not None:
            set_rng_state(self._restored_start)
            self._restored_start = None


class DealtRollouts:
    """``--max-staleness K`` under several processes whose rollouts come from vLLM servers: one
    actor, on the main process (:class:`AsyncTraining` of this process alone), draws every prompt
    batch whole (the servers generate it; one weight push for each change of weights, where actors
    of their own in each process would push to the same servers on their own schedules), and deals
    each process its share when the learners take it (a broadcast, in the step's order); each
    judges its share's weight check with the others and estimates it. A checkpoint holds the one
    actor's state. Same interface as :mod:`textrl.training.rollout_sources`' sources.

    The actor's weights are the learner's, whole, copied on the main process where every process is
    (at the start, after a resume's load and after each update: :meth:`updated`): under a backend
    that partitions them (FSDP, ZeRO-3) a gather all join (``backend.trained_weights``), so the actor's
    thread holds no collective and the learners can be sharded. Only the main process evaluates
    (its actor samples; the others hold no engine weights)."""

    def __init__(self, config: Any, agent: Any, sampler: Any, episodes: Any, dist: Any) -> None:
        from textrl.parallel.distributed import Distributed

        self.agent, self.dist = agent, dist
        self.actor = AsyncTraining(config, agent, sampler, episodes, Distributed.single(agent.device)) \
            if dist.is_main else None
        if self.actor is None:  # the learner's shuffles: the same private generator as the main one's
            generator = torch.Generator(device=agent.device)
            generator.manual_seed(int(config.seed) + LEARNER_SEED_OFFSET)
            agent.learner.generator = generator
        self._taking = False
        self._weights: dict[str, torch.Tensor] | None = None
        """The learner's trained weights now, whole, on the main process's CPU (None elsewhere)."""
        self._take_weights()

    def _take_weights(self) -> float:
        """Copy the learner's trained weights whole for the main process's actor (every process calls:
        a gather where the backend partitions them); the seconds it took."""
        started = time.perf_counter()
        weights = self.agent.backend.trained_weights(self.agent.learner.policy, keep=self.actor is not None)
        self._weights = weights if self.actor is not None else None
        return time.perf_counter() - started

    def next_rollout(self, iteration: int, timings: dict[str, float]) -> tuple[Any, int]:
        """The main process takes the whole rollout and broadcasts it (or what stopped its actor);
        each process keeps its share (``dist.shard``: whole prompt groups), judges the weight check
        with the others, and estimates its share."""
        self._taking = True
        sent: Any = None
        if self.actor is not None:
            try:
                td, rows = self.actor.take_rollout(iteration, timings, self._weights)
                sent = ("rollout", td.to("cpu"), rows, dict(timings))
            except EngineFailed as err:
                self.dist.broadcast_object(("engine", str(err)))
                raise
            except Exception as err:
                self.dist.broadcast_object(("error", f"{type(err).__name__}: {err}"))
                raise
        kind, *got = self.dist.broadcast_object(sent)
        if kind == "engine":
            raise EngineFailedElsewhere("the actor of the main process failed in this iteration's rollout (its line "
                                        "is in that process's output)")
        if kind == "error":
            raise RolloutFailedElsewhere("the actor of the main process stopped on an error (its line is in that "
                                         "process's output)")
        whole, rows, drawn = got
        self._taking = False
        timings.update(drawn)
        td = whole[self.dist.shard(whole.shape[0], "rollout rows")].to(self.agent.device)
        self.agent.actor.judge_weight_gap(td, drawn_with(td))
        return check_rollout(self.agent.process_rollout(td, timings=timings), finite=False), rows // self.dist.world_size

    @contextmanager
    def sampling_agent(self) -> Iterator[Any]:
        """The main process's actor with the learner's weights (only the main process evaluates)."""
        if self.actor is None:
            raise RuntimeError("only the main process evaluates an asynchronous run whose actor deals the rollouts")
        with self.actor.sampling_agent(self._weights) as view:
            yield view

    def updated(self, timings: dict[str, float]) -> None:
        """After the learner's update (every process): its weights copied for the actor
        (:meth:`_take_weights`), the seconds added to ``timings["weight_sync"]``."""
        timings["weight_sync"] = timings.get("weight_sync", 0.0) + self._take_weights()

    def evaluates(self, main: bool, partitions_weights: bool) -> bool:
        """The main process alone evaluates: its actor samples with the learner's weights."""
        return main

    def quiesce(self) -> None:
        if self.actor is not None:
            self.actor.quiesce()

    def rewind(self, iteration: int) -> bool:
        return self.actor.rewind(iteration) if self.actor is not None else self._taking

    def state_dict(self) -> dict[str, Any]:
        """The one actor's (the main process's; only it saves)."""
        if self.actor is None:
            raise RuntimeError("only the main process saves the actor's state")
        return self.actor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.actor is not None:
            self.actor.load_state_dict(state)
        else:
            if "async" not in state:
                raise ValueError("this checkpoint was saved by a run without --max-staleness; resume it with its "
                                 "own max_staleness (a fixed setting)")
            self.agent.learner.generator.set_state(state["learner_generator"])

    def restored(self) -> None:
        """After a resume's load (every process): the loaded weights copied for the actor, and the
        actor's in-flight rollout's RNGs at its start."""
        self._take_weights()
        if self.actor is not None:
            self.actor.restored()

    def note(self) -> str | None:
        return self.actor.note() if self.actor is not None else None

    def close(self) -> None:
        if self.actor is not None:
            self.actor.close()


def staleness_note(config: Any) -> str | None:
    """The line a run with ``max_staleness`` K >= 1 and no rollout correction starts with: what its
    objective is (the rollout drawn by weights up to K updates old, the ratio's denominator the
    learner's proximal policy, no importance weight for the staleness) and the correction to weigh
    it with; None with K=0, a correction or the bypass objective (``old_logprobs='engine'``)."""
    k = int(config.max_staleness)
    if k < 1 or config.rollout_correction != "none" or config.old_logprobs != "recompute":
        return None
    return (f"--max-staleness {k} without a correction: each rollout is drawn by weights up to {k} "
            f"update{'s' if k > 1 else ''} older than the learner's, the PPO ratio's denominator is the learner's "
            "own log-probs before the update (the proximal policy), and nothing weighs the tokens for the staleness; "
            "--rollout-correction tis does (docs/async.md, \"Staleness without a correction\")")


def joined(parts: list[tuple[torch.Tensor, torch.Tensor | None]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The micro-batches' ``(tokens [b, T_i], log-probs [b, T_i] or None)`` as one ``[B, max T_i]``
    pair, as :meth:`textrl.agents.actor.Actor.sample` joins its own: tokens padded with
    ``pad_token_id``, log-probs with 0 (None if any part has none)."""
    width = max(tokens.shape[1] for tokens, _ in parts)
    tokens = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=pad_token_id) for t, _ in parts])
    if any(logp is None for _, logp in parts):
        return tokens, None
    return tokens, torch.cat([torch.nn.functional.pad(lp.float(), (0, width - lp.shape[1])) for _, lp in parts])


class ProducerFailed(EngineFailed):
    """The asynchronous actor stopped on an error of its own (an environment's, a reward's, a check's)
    while it drew a rollout: the run saves its last finished iteration, as for an engine that failed."""


def producer_failure(err: BaseException) -> str:
    """The line that names what stopped the actor: its error's type and first line."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"the asynchronous actor stopped drawing rollouts ({type(err).__name__}{': ' + first if first else ''})"


def drawn_with(td: Any) -> int:
    """The iteration of the newest weights that drew rollout ``td`` (its last turn's with partial
    rollouts): those the weight check measured."""
    per_token = td.get(KEYS.token_iteration, None)
    return int(per_token.max()) if per_token is not None else int(td.get(KEYS.policy_iteration).max())


def rebased(td: Any, offset: int) -> Any:
    """A copy of rollout ``td`` whose ``KEYS.policy_version`` is moved by ``offset`` (the live one untouched)."""
    td = td.clone()
    td.set(KEYS.policy_version, td.get(KEYS.policy_version) + offset)
    return td


__all__ = ["ActorView", "AsyncTraining", "DealtRollouts", "ProducerFailed", "producer_failure", "staleness_note"]
