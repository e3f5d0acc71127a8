"""``textrl train``: PPO on a language model, iteration after iteration.

The PPO iteration is :meth:`PPORun.step`, in named phases: *collect* (generate, score) and
*estimate* (the agent's ``process_rollout``: log-probs, values, KL shaping, advantages; both
inside :func:`textrl.run.rollout.collect`), *update* (``agent.update``: K epochs of minibatches),
*log* (the metrics row); then :meth:`PPORun.evaluate` and :meth:`PPORun.checkpoint` when due
(:mod:`textrl.training.ppo_run`). :func:`train` checks the run before any model loads
(:mod:`textrl.training.run_checks`), sets it up (:mod:`textrl.training.set_up`), then
:class:`textrl.run.RunLoop` drives it, as it drives the supervised stages: timing, cadence,
progress, signals and the stop live there, checkpoints, logs and resume in :mod:`textrl.run`.

Everything a run writes goes under ``config.output_dir``: ``config.yaml`` (the resolved config),
``metrics.jsonl`` (one flat JSON object per iteration), TensorBoard events in ``tb/``,
``curves.png`` (reward and KL), ``samples.jsonl`` (held-out completions at each evaluation),
``checkpoints/iter_NNNNNN/`` (:mod:`textrl.run.checkpoints`) and ``summary.json``. ``--resume``
continues from the newest checkpoint whose manifest verifies. SIGINT / SIGTERM stop after the
current iteration with a checkpoint; NaN/inf updates are skipped, and an update that leaves
NaN/inf weights is rolled back (``nonfinite_weights``), so no evaluation or checkpoint sees
NaN/inf weights (docs/reliability.md).

The same loop runs in one process or several (``accelerate launch`` / ``torchrun``), replicated,
FSDP-sharded or under DeepSpeed ZeRO: its backend (:mod:`textrl.parallel`) owns what differs.
Only the main process writes files, holding the run folder's lock (:mod:`textrl.run.lock`).
"""

from __future__ import annotations

from typing import Any

from textrl.config import TrainConfig
from textrl.run import (
    CheckpointError,
    ResumeRefused,
    RunLoop,
    StopSignals,
    TrainingStopped,
    holds_run_folder,
    latest_checkpoint,
    resolve_device,
)
from textrl.run.resume import checkpoint_iteration
from textrl.run.signals import StopRequested, stop_before_loop
from textrl.training.ppo_run import PPORun
from textrl.training.records import (  # noqa: F401 - also importable from here, as before
    describe_run_start,
    engine_stop_message,
    format_summary,
    gap_closed,
    iteration_metrics,
    nonfinite_rows,
    peak_memory_mib,
    run_end,
    run_records,
    stop_message,
    warmup_record,
)
from textrl.training.run_checks import check_run
from textrl.training.set_up import set_up, vllm_engine_processes

# -- the run -------------------------------------------------------------------------------------


def train(config: TrainConfig) -> dict[str, Any]:
    """Run ``config.iterations`` PPO iterations; return the before/after held-out summary.

    SIGINT / SIGTERM finish the current iteration, save a checkpoint and raise
    :class:`TrainingStopped` (its message says how to resume); so does a run of
    ``config.max_nonfinite_updates`` consecutive NaN/inf updates (skipped or rolled back). With
    ``nonfinite_weights='stop'`` an update that leaves NaN/inf weights raises it at once, without
    a checkpoint. A signal before the first iteration (while models load, in the supervised
    warm-up, in the held-out evaluation before it) stops at the next warm-up step or evaluation
    batch, with nothing new saved: the same command starts over (or resumes).
    """
    with StopSignals("the set-up (loading the models)", "stopping before the first iteration") as signals:
        try:
            return _train(config, signals)
        except StopRequested as err:
            newest = latest_checkpoint(config.output_dir) if config.resume else None
            raise stop_before_loop("train", err, checkpoint_iteration(newest) if newest else 0, newest) from None


@holds_run_folder  # the run folder's lock, taken in set_up, is given back at the end
def _train(config: TrainConfig, signals: StopSignals) -> dict[str, Any]:
    """Set up, resume, evaluate before, iterate (:class:`RunLoop` over :class:`PPORun`), summarise."""
    check_run(config)
    if config.vllm_server:
        from textrl.generation.vllm_server import release_servers
    try:
        run = set_up(config, resolve_device(config.device))
    except BaseException:
        if config.vllm_server:
            release_servers(config)  # what set_up claimed (nothing, where it stopped before the claims)
        raise
    try:
        start = run.resume()
        before = run.evaluate_before(start)
        loop = RunLoop(
            "PPO", config.iterations, run.metrics, eval_every=config.eval_every,
            checkpoint_every=config.checkpoint_every, evaluates=run.evaluates, throughput="tokens",
            progress=config.progress and run.main, plot=run.output_dir / "curves.png", main=run.main, dist=run.dist,
            fit_threads=not vllm_engine_processes(config),
        )
        try:
            loop.run(run, start, signals)
        except BaseException:
            if loop.end is not None:  # stopped or failed in the loop: summary.json says how and where
                try:
                    run.summary(before, loop.end)
                except Exception as err:  # the stop's message or the failure goes on up, not this
                    run.log(f"summary.json not written: {type(err).__name__}: {err}")
            raise
        return run.summary(before, loop.end)
    finally:
        run.source.close()  # an asynchronous actor's producer thread and its engine
        actor = getattr(run.agent, "actor", None)
        if actor is not None:
            actor.engine.close()  # vLLM's engine, before the process group goes
        if config.vllm_server:
            release_servers(config)  # the next run may take the servers at once


__all__ = [
    "CheckpointError",
    "PPORun",
    "ResumeRefused",
    "TrainingStopped",
    "check_run",
    "format_summary",
    "train",
]
