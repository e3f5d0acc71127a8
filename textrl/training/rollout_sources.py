"""Where a run's rollouts come from: one seam, so the trainer's iteration reads the same whether the
rollouts are drawn in its own step (:class:`SyncRollouts`, ``max_staleness=0``) or by an actor beside
the learner (:class:`textrl.training.async_training.AsyncTraining`, ``--max-staleness K``).

A rollout source has:

- ``next_rollout(iteration, timings) -> (td, rows)``: the rollout ``iteration`` trains on, estimated
  (``agent.process_rollout``: log-probs, values, KL shaping, advantages) and checked with NaN/inf let
  through (the update skips such an update), and the rows of its prompt batch this process took; the
  seconds of its phases go to ``timings``;
- ``sampling_agent()``: a context whose value the held-out evaluation samples with (the learner's
  weights now);
- ``updated(timings)``: after the learner's update, every process (a source that copies the
  weights for its actor there: seconds to ``timings["weight_sync"]``);
- ``evaluates(main, partitions_weights) -> bool``: whether this process runs the held-out evaluation;
- ``quiesce()``: nothing of the source moves until the run goes on (before a checkpoint);
- ``rewind(iteration) -> bool``: after an engine failed in ``next_rollout(iteration)``, the random
  state and the prompts as the iteration found them, so a checkpoint now is that of ``iteration - 1``
  and a resume repeats the run exactly; False where the failure came after the collection;
- ``state_dict()`` / ``load_state_dict(state)``: what a checkpoint holds of it (it is the
  checkpoint's ``sampler``), and ``restored()`` after the checkpoint's RNGs were set;
- ``note()``: a line the run starts with, or None; ``close()``.

:func:`textrl.run.rng.draw_start` and :func:`~textrl.run.rng.put_back` are the one notion of
"where a rollout's draw starts" (the process's RNGs and the prompt sampler's position), for both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from textrl.run.rng import draw_start, put_back


class SyncRollouts:
    """The synchronous source: each iteration's rollout drawn in its step with the learner's weights
    now (every process draws the same global prompt batch and takes its whole prompt groups,
    ``shard``), then estimated (:func:`textrl.run.rollout.collect`)."""

    def __init__(self, agent: Any, sampler: Any, episodes: Any, shard: Any) -> None:
        self.agent, self.sampler, self.episodes, self.shard = agent, sampler, episodes, shard
        self._start: dict[str, Any] | None = None
        """Where the iteration under way started drawing (None once its rollout was collected)."""

    def next_rollout(self, iteration: int, timings: dict[str, float]) -> tuple[Any, int]:
        from textrl.envs.prompts import placing_rows
        from textrl.run.rollout import collect

        self._start = draw_start(self.sampler)
        batch = self.sampler.next_batch()
        batch = batch.select(self.shard(len(batch)))
        with placing_rows(f"iteration {iteration}", lambda: self.sampler.batch_rows(batch)):  # a reward's error: FILE:LINE
            td = collect(self.agent, batch, self.episodes, timings=timings, check_finite=False)  # update() skips NaN
        self._start = None
        return td, len(batch)

    @contextmanager
    def sampling_agent(self) -> Iterator[Any]:
        yield self.agent

    def updated(self, timings: dict[str, float]) -> None:
        """After the learner's update: nothing (the next rollout samples the learner's module)."""

    def evaluates(self, main: bool, partitions_weights: bool) -> bool:
        """Whether this process runs the held-out evaluation: the main one, and every one where the
        forwards are collectives (FSDP, ZeRO-3)."""
        return main or partitions_weights

    def quiesce(self) -> None:
        """Nothing runs beside the learner."""

    def rewind(self, iteration: int) -> bool:
        if self._start is None:
            return False
        put_back(self.sampler, self._start)
        self._start = None
        return True

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "async" in state:
            raise ValueError("this checkpoint was saved by a run with --max-staleness; resume it with its own "
                             "max_staleness (a fixed setting)")
        self.sampler.load_state_dict(state)

    def restored(self) -> None:
        """Nothing was in flight."""

    def note(self) -> str | None:
        return None

    def close(self) -> None:
        """Nothing to stop."""


def rollout_source(config: Any, agent: Any, sampler: Any, episodes: Any, backend: Any) -> Any:
    """The run's source: :class:`SyncRollouts`, or with ``max_staleness`` > 0 the asynchronous actor
    (:class:`textrl.training.async_training.AsyncTraining`: one actor per process; or, where
    :func:`one_actor`, :class:`textrl.training.async_training.DealtRollouts`)."""
    if int(config.max_staleness) == 0:
        return SyncRollouts(agent, sampler, episodes, backend.dist.shard)
    from textrl.training.async_training import AsyncTraining, DealtRollouts

    if backend.dist.enabled and one_actor(config):
        return DealtRollouts(config, agent, sampler, episodes, backend.dist)
    return AsyncTraining(config, agent, sampler, episodes, backend.dist)


def one_actor(config: Any) -> bool:
    """Whether an asynchronous run of several processes has one actor, on the main process, dealing
    every process its share (:class:`textrl.training.async_training.DealtRollouts`): when its rollouts come
    from vLLM servers (shared by all, one weight push per change). Otherwise an actor per process,
    each drawing its share with an engine of its own."""
    return bool(getattr(config, "vllm_server", None))


__all__ = ["SyncRollouts", "one_actor", "rollout_source"]
