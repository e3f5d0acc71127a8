"""``textrl train``: PPO on a language model, iteration after iteration.

The PPO iteration is :meth:`PPORun.step`, in named phases: *collect* (generate, score) and
*estimate* (the agent's ``process_rollout``: log-probs, values, KL shaping, advantages; both
inside :func:`textrl.run.rollout.collect`), *update* (``agent.update``: K epochs of minibatches),
*log* (the metrics row); then :meth:`PPORun.evaluate` and :meth:`PPORun.checkpoint` when due.
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

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from textrl.config import TrainConfig, config_values, config_yaml, save_config
from textrl.core.timing import timed
from textrl.keys import KEYS
from textrl.parallel import Backend, setup_backend
from textrl.parallel.distributed import Distributed
from textrl.run import (
    SETTINGS_FILE,
    CheckpointError,
    MetricsLog,
    ResumeRefused,
    RunLoop,
    SamplesLog,
    StopSignals,
    TrainingStopped,
    atomic,
    check_resume_settings,
    complete_checkpoints,
    holds_run_folder,
    latest_checkpoint,
    load_checkpoint,
    record_resume,
    refuse_busy_folder,
    refuse_earlier_run,
    resolve_device,
    resume_checkpoint,
    rng_state,
    save_checkpoint,
    seed_everything,
    take_run_folder,
)
from textrl.run.metrics import EVAL_BEFORE_FILE, json_text, loads_row
from textrl.run.pace import fit_threads_now
from textrl.run.records import set_aside_earlier_records
from textrl.run.resume import checkpoint_iteration, refuse_shorter_run
from textrl.run.signals import Stoppable, StopRequested, stop_before_loop, stop_phase
from textrl.run.user_code import USER_CODE_FILE, user_code_digest, user_code_json
from textrl.run.warmup import keeping_warmup
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
from textrl.training.rollout_sources import rollout_source

BEFORE_FILE = EVAL_BEFORE_FILE
"""The held-out evaluation before the first iteration (kept so a resumed run's summary has it)."""


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


@holds_run_folder  # the run folder's lock, taken in _set_up, is given back at the end
def _train(config: TrainConfig, signals: StopSignals) -> dict[str, Any]:
    """Set up, resume, evaluate before, iterate (:class:`RunLoop` over :class:`PPORun`), summarise."""
    check_run(config)
    if config.vllm_server:
        from textrl.generation.vllm_server import release_servers
    try:
        run = _set_up(config, resolve_device(config.device))
    except BaseException:
        if config.vllm_server:
            release_servers(config)  # what _set_up claimed (nothing, where it stopped before the claims)
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


@dataclass
class PPORun:
    """One ``textrl train`` run after set-up: what the PPO iteration works on, and the
    :class:`~textrl.run.LoopBody` that :class:`RunLoop` drives."""

    config: TrainConfig
    agent: Any
    sampler: Any
    episodes: Any
    """The :class:`textrl.envs.collector.EpisodeRunner` of the run's environment: it runs a batch of
    episodes (every turn generated by the agent) and scores them."""
    eval_batches: list[Any]
    backend: Backend
    """How the models train over the processes (:mod:`textrl.parallel`)."""
    dist: Distributed
    main: bool
    evaluates: bool
    """Whether this process runs the held-out evaluation (the main one; all under FSDP / ZeRO-3)."""
    output_dir: Path
    resume_from: Path | None
    """The verified checkpoint ``--resume`` continues from (None: a fresh run)."""
    resumed_changes: dict[str, tuple[Any, Any]]
    """Settings this resumed run changes from the checkpoint's, ``{name: (old, new)}``."""
    log: Any = print
    weights_poisoned: bool = False
    """The weights are NaN/inf after the last update (``nonfinite_weights='stop'``, or an agent that
    does not roll back): no evaluation, no checkpoint, the run stops."""
    metrics: MetricsLog | None = None
    samples: SamplesLog | None = None
    user_code: dict[str, str | None] | None = None
    """sha256 of the user's files the run imported (:func:`textrl.run.user_code.user_code_digest`),
    read at set-up: each checkpoint records these, not a later edit."""
    source: Any = None
    """Where the rollouts come from (:mod:`textrl.training.rollout_sources`): drawn in the step, or with
    ``max_staleness`` > 0 by the actor beside the learner; a checkpoint saves it as the sampler."""

    # -- the PPO iteration ---------------------------------------------------------------------

    def step(self, iteration: int, timings: dict[str, float]) -> dict[str, Any]:
        """One PPO iteration: collect, estimate, update, log; its metrics row."""
        config, agent = self.config, self.agent
        # collect: the rollout (generated and scored in the step, or drawn beside the last updates
        # with --max-staleness), then estimated (agent.process_rollout: log-probs, values, KL
        # shaping, advantages); timed inside as generation, reward, forward, advantages
        td, n_rows = self.source.next_rollout(iteration, timings)
        # update: K epochs of minibatch steps; one that left NaN/inf weights is rolled back inside
        # it (before the reference refresh), or with nonfinite_weights='stop' stops the run here
        with timed(timings, "update", agent.device):
            update_metrics = agent.update(td)
            self.weights_poisoned = not self.backend.weights_finite(agent)
        self.source.updated(timings)  # every process: the weights copied for an actor that deals the rollouts
        timings["guard"] = self.backend.rollback_seconds()  # the NaN rollback's copy and checks, within the above
        if update_metrics.get("nonfinite/rolled_back"):
            self.log(f"iteration {iteration}: its update left NaN/inf weights and was rolled back "
                     f"({self.nonfinite_streak} of at most {config.max_nonfinite_updates} consecutive "
                     "skipped updates)")
        # log: the metrics row over every process
        with timed(timings, "bookkeeping", agent.device):
            return self.metrics_row(iteration, td, n_rows, update_metrics)

    def evaluate(self, iteration: int, timings: dict[str, float]) -> dict[str, float]:
        """Held-out rewards (``eval/*``) and greedy samples (``samples.jsonl``); none from NaN/inf weights."""
        if self.weights_poisoned:
            return {}
        from textrl.envs.prompts import placing_rows

        with timed(timings, "eval", self.agent.device), self.sampling_agent() as agent:
            batches = self.stoppable_batches()
            with placing_rows(f"the held-out evaluation of iteration {iteration}", batches.rows):
                row = evaluate(agent, batches, self.episodes, self.config.seed + iteration,
                               reward_nonfinite=self.config.reward_nonfinite)
            self.samples.write(iteration, sample_completions(agent, self.eval_batches[0], self.episodes))
        return row

    @contextmanager
    def sampling_agent(self) -> Iterator[Any]:
        """What the held-out evaluation samples with (the source's: the agent, or with
        ``max_staleness`` > 0 the asynchronous actor holding the learner's weights, quiesced)."""
        with self.source.sampling_agent() as agent:
            yield agent

    def stoppable_batches(self) -> Any:
        """The held-out batches, in one process ended between two by a stop signal
        (:func:`textrl.run.signals.until_stopped`); under several processes all of them (the
        evaluation's forwards may be collectives every process must join); a
        :class:`~textrl.envs.prompts.TrackedBatches`, which names the rows of a batch a reward fails on."""
        from textrl.envs.prompts import TrackedBatches

        batches = self.eval_batches
        if not self.dist.enabled:
            batches = Stoppable(self.eval_batches, "the held-out evaluation", unit="batch")
        return TrackedBatches(batches, getattr(self.sampler, "held_out", None))

    def checkpoint(self, iteration: int, stopping: bool) -> Path | None:
        """Every process's RNGs and (FSDP, ZeRO) the gathered state; the main process saves.
        Stopping with NaN/inf weights saves nothing (the last good checkpoint stays newest)."""
        dist, agent = self.dist, self.agent
        self.source.quiesce()  # an asynchronous actor's RNG and prompts stand still while they are saved
        rng_per_process = dist.gather_object(rng_state()) if dist.enabled else None
        if stopping and not self.backend.weights_finite(agent):
            return None
        state = agent.state_dict() if self.backend.gathers_state else None  # a gather all processes join
        if not self.main:
            return None
        return save_checkpoint(self.output_dir, iteration, agent, self.source, self.config.keep_checkpoints,
                               rng_per_process=rng_per_process, agent_state=state,
                               files=self.record_files())

    def record_files(self) -> dict[str, str]:
        """The run's record in each checkpoint: ``config.yaml`` and ``user_code.json``."""
        return {SETTINGS_FILE: config_yaml(self.config), USER_CODE_FILE: user_code_json(self.user_code or {})}

    def faulted(self) -> bool:
        """``max_nonfinite_updates`` consecutive updates were skipped (or rolled back) for NaN/inf,
        or the last update left NaN/inf weights (not rolled back: ``nonfinite_weights='stop'``)."""
        return self.weights_poisoned or self.nonfinite_streak >= self.config.max_nonfinite_updates

    def stop_message(self, iteration: int, signum: int | None, saved: Path | None) -> str:
        """:func:`stop_message`: why the run stopped, where its checkpoint is, how to resume."""
        return stop_message(self.config, iteration, signum, self.nonfinite_streak, saved, self.weights_poisoned,
                            getattr(getattr(self.agent, "learner", None), "nonfinite_cause", None))

    def rewind(self, iteration: int) -> bool:
        """After an engine failed collecting ``iteration``'s rollout: the source as the iteration found
        it (:mod:`textrl.training.rollout_sources`), so a checkpoint now is that of ``iteration - 1`` and a
        resume repeats the run exactly. Under several processes every process comes here together: a
        failure of any one's engine is shared at the end of the rollout's episodes
        (:func:`textrl.run.rollout.ended_together`), before any collective, so the checkpoint's gathers
        find them all."""
        return self.source.rewind(iteration)

    def engine_message(self, err: BaseException, done: int, saved: Path | None) -> str:
        """The engine's line, then what was saved and how to resume (:func:`engine_stop_message`)."""
        return engine_stop_message(self.config, err, done, saved)

    def postfix(self, row: dict[str, Any]) -> dict[str, str]:
        """The progress bar's rollout reward and KL at collection (left out where no reference is kept)."""
        shown = {"reward": f"{row['reward/mean']:.3f}"}
        if "kl/collection" in row:
            shown["kl"] = f"{row['kl/collection']:.3f}"
        return shown

    @property
    def nonfinite_streak(self) -> int:
        """Consecutive updates the agent skipped for NaN/inf (0 for an agent that never skips)."""
        return getattr(self.agent, "nonfinite_streak", 0)

    def metrics_row(self, iteration: int, td, n_rows: int, update_metrics: dict[str, float]) -> dict[str, float]:
        """:func:`iteration_metrics` plus the NaN/inf reward rows over every process and the
        largest process's peak memory so far (checkpoints of earlier iterations included)."""
        dist = self.dist
        row = iteration_metrics(iteration, td, update_metrics, dist)
        row["reward/nonfinite_rows"] = dist.mean({"n": nonfinite_rows(td, n_rows)})["n"] * dist.world_size
        row["memory/peak_mib"] = max(dist.gather_object(peak_memory_mib(self.agent.device)))
        return row

    # -- before and after the iterations -------------------------------------------------------

    def resume(self) -> int:
        """Load the ``--resume`` checkpoint (verified and its settings compared already), apply
        the changed settings, then write the run's record (``config.yaml``, ``resumes.jsonl``) and
        open the logs, cut back to it; the iteration the run continues after (0 for a fresh
        run). Nothing is written before the checkpoint loaded: a refused resume changes nothing."""
        from textrl.agents.state import take_changed_settings

        start = 0
        if self.resume_from is not None:
            start = load_checkpoint(self.resume_from, self.agent, self.source, verify=False, dist=self.dist)
            self.source.restored()  # an asynchronous rollout in flight at the checkpoint is drawn again from its start
            take_changed_settings(self.agent.learner, set(self.resumed_changes))
            if self.edited_rows():  # rows fixed since the checkpoint (as many, in the same order)
                from textrl.envs.prompts import describe_edited

                self.log(describe_edited(self.edited_rows(), self.resume_from))
            self.log(f"resumed from {self.resume_from} (iteration {start})")
            if start >= self.config.iterations:
                self.log(f"--resume: the run is complete (iteration {start} of {self.config.iterations}): "
                         f"nothing to train; pass --iterations above {start} to continue it")
        if self.main:  # the record of what runs from here on
            if self.resume_from is None:  # a fresh run: an earlier run's records are set aside, not mixed in
                set_aside_earlier_records(self.output_dir, self.log)
            save_config(self.config, self.output_dir / SETTINGS_FILE)
            (self.output_dir / USER_CODE_FILE).write_text(user_code_json(self.user_code or {}))
            if self.resume_from is not None:
                record_resume(self.output_dir, start, self.resume_from, self.resumed_changes, rows=self.edited_rows())
        resume_after = start if self.resume_from is not None else None
        self.metrics = MetricsLog(self.output_dir, self.main, resume_after=resume_after,
                                  kl_kind=self.config.kl_kind)
        self.samples = SamplesLog(self.output_dir, self.main, resume_after=resume_after)
        return start

    def edited_rows(self) -> list[dict[str, Any]]:
        """The data rows whose contents changed since the resumed checkpoint (the sampler's
        :attr:`~textrl.envs.PromptSampler.edited`; none for a sampler without per-row digests)."""
        return getattr(self.sampler, "edited", [])

    def evaluate_before(self, start: int) -> dict[str, float] | None:
        """The held-out evaluation before the first iteration (and its samples, as iteration 0);
        a resumed run reads it back from ``eval_before.json``."""
        from textrl.envs.prompts import placing_rows

        path = self.output_dir / BEFORE_FILE
        if start > 0:
            return loads_row(path.read_text()) if path.is_file() else None  # null read back as NaN
        if not self.evaluates:
            return None
        with stop_phase("the current batch of the held-out evaluation before iteration 1",
                        "stopping (nothing is saved before iteration 1)"), self.sampling_agent() as agent:
            batches = self.stoppable_batches()
            with placing_rows("the held-out evaluation before iteration 1", batches.rows):
                before = evaluate(agent, batches, self.episodes, self.config.seed,
                                  reward_nonfinite=self.config.reward_nonfinite)
            self.samples.write(0, sample_completions(agent, self.eval_batches[0], self.episodes))
        if self.main:
            path.write_text(json_text(before, indent=2) + "\n")  # strict JSON: a NaN as null
        return before

    def max_reward(self) -> float | None:
        """The environment's maximum reward when the run scores with the environment's own reward
        (no ``--reward``, no ``--reward-model``); None otherwise."""
        if self.config.reward is not None or self.config.reward_model:
            return None
        return getattr(self.episodes.env, "max_reward", None)

    def summary(self, before: dict[str, float] | None, end: dict[str, Any] | None = None) -> dict[str, Any]:
        """``summary.json``: held-out metrics before and after (and the share of the gap to the
        environment's maximum closed), processes, sharding, peak memory per process, the precision,
        the generation engine and the device that ran, the check that data-parallel processes ended
        with the same weights, how the run ended and the updates it skipped (``end``:
        :attr:`textrl.run.RunLoop.end`, :func:`run_end`). The table (and the skipped updates) is
        printed at a completed end; a failure in this process joins no collective (the others may not be here)."""
        rows = self.metrics.rows
        after = {k: v for k, v in (rows[-1] if rows else {}).items() if k.startswith("eval/")}
        together = end is None or end["ended"] != "failed"  # every process is here
        summary: dict[str, Any] = {"before": before, "after": after, "processes": self.dist.world_size,
                                   "fsdp": self.config.fsdp, "zero_stage": self.config.zero_stage}
        peak = peak_memory_mib(self.agent.device)
        summary["peak_memory_mib"] = self.dist.gather_object(peak) if together else [peak]  # one per process
        summary.update(run_records(self))  # the lengths and the warm-up that ran
        if getattr(self.agent, "precision", None) is not None:
            summary["precision"] = self.agent.precision.record()  # what ran: dtype, autocast, attention
        if together:
            summary.update(self.backend.end_of_run(self.agent))  # weights held (sharded) or the replicas' checksum
        gap = gap_closed(before, after, self.max_reward())
        if gap is not None:
            summary["gap_closed"] = gap
        summary.update(run_end(rows, end))  # ended, iteration (reason, ...), skipped_updates
        if self.main:
            if summary["ended"] == "completed":
                self.log(format_summary(before, after, gap, summary["skipped_updates"]))
            atomic.write_text(self.output_dir / "summary.json", json_text(summary, indent=2))
        if together:
            self.dist.barrier()  # every process ends together, after the main one wrote its files
        return summary


def _set_up(config: TrainConfig, device: torch.device) -> PPORun:
    """The backend (processes, sharding), the output folder (locked), the seed, the ``--resume``
    checkpoint (verified and its settings compared), the environment and its rows (all before any
    model loads), the agent (it builds its models), the reward, the episode runner, the sampler,
    then the agent prepared for the backend, in this order
    (every process holds the same weights before FSDP / ZeRO partition them). ``config.yaml`` is
    written by :meth:`PPORun.resume`, once the checkpoint has loaded."""
    from textrl.agents.build import load_tokenizer, task_reward
    from textrl.envs import PromptSampler
    from textrl.envs.collector import EpisodeRunner
    from textrl.envs.registry import check_chat_template, env_facts, split_rows

    backend = setup_backend(config, device)  # single, replicated, FSDP or ZeRO
    dist, device, main = backend.dist, backend.device, backend.is_main
    output_dir = Path(config.output_dir)
    log = print if main else (lambda *a, **k: None)
    if main:  # one writer per run folder, until _train returns; a second run is refused here
        take_run_folder(output_dir)
    if config.vllm_server:
        from textrl.generation.vllm_server import check_servers

        # each server identified and claimed before any model loads; after the folder's lock, so that
        # a second run on the folder never touches the first one's claims (a run's id is its folder)
        check_servers(config)
    seed_everything(config.seed)
    if not vllm_engine_processes(config):
        fit_threads_now(log)  # the warm-up and the first evaluation too run on the cores others leave
    checkpoint = resume_checkpoint(config, log)  # verified before any model loads
    changes = {} if checkpoint is None else check_resume_settings(config, config_values(config), checkpoint,
                                                                    "train", log)
    user_code = user_code_digest(config)  # the files as this run imports them (compared above)

    # the environment and its rows before any model loads: a bad file or row is named in seconds
    env = environment(config)
    check_chat_template(env, lambda: load_tokenizer(config))  # multi-turn: one not append-only is refused
    train_rows, eval_rows = split_rows(env, config.eval_size, config.seed)
    facts = env_facts(config, env, train_rows=train_rows)  # the warm-up pairs and the episode budget
    # its models, critic (if any) and optimisers; the warm-up, or on --resume the start the run kept after it
    with keeping_warmup(output_dir, load=config.resume, save=main):
        agent = build_agent(config, device, log, facts)
    warmup = warmup_record(config, agent, env)
    if warmup["ran_steps"] == 0 and warmup["asked_steps"] > 0:
        log(f"warm-up: none ({warmup['reason']}; warmup_sft_steps={warmup['asked_steps']} asked, 0 steps ran)")
    # the prompts' cap and the episode's budget, fitted to the models' context: every prompt + episode fits
    lengths = check_context(config, agent, train_rows, eval_rows, env=env, log=log)
    budget = lengths.max_episode_tokens
    if hasattr(agent, "env_facts"):  # the length terms (Dr. GRPO, DAPO) count the budget that runs
        agent.env_facts = replace(facts, episode_budget=budget, max_prompt_length=lengths.max_prompt_length)
    tokenizer = agent.tokenizer
    env.reward = task_reward(agent, reward_spec(config, env), env.reward)  # plus the agent's own reward model
    episodes = EpisodeRunner(
        env, tokenizer=tokenizer, eos_token_id=agent.eos_token_id, pad_token_id=agent.pad_token_id,
        max_new_tokens=config.max_new_tokens, max_episode_tokens=budget,
        reward_placement=config.reward_placement, reward_nonfinite=config.reward_nonfinite, env_timeout=config.env_timeout,
        generation_batch_size=config.generation_batch_size, reward_concurrency=config.reward_concurrency,
    )
    sampler = PromptSampler(
        train_rows, tokenizer, prompts_per_batch=config.prompts_per_iteration,
        n_samples_per_prompt=config.n_samples_per_prompt, seed=config.seed,
        max_prompt_length=lengths.max_prompt_length, truncate=lengths.truncate, held_out=eval_rows,
    )
    eval_batches = sampler.encode_eval(eval_rows, batch_size=config.generation_batch_size)
    backend.prepare(agent)  # identical weights everywhere, this process's seed, models sharded
    agent.actor  # built once, for this backend: the generation engine is chosen (and checked against it) here  # noqa: B018
    log(describe_run_start(config, agent))  # the device, the precision and the engine that run
    source = rollout_source(config, agent, sampler, episodes, backend)
    if note := source.note():
        log(note)  # K >= 1 without a correction: what the objective then is, once
    # held-out evaluation: the main process alone, unless the forwards are collectives (FSDP, ZeRO-3)
    evaluates = source.evaluates(main, backend.partitions_weights)
    return PPORun(config=config, agent=agent, sampler=sampler, episodes=episodes, eval_batches=eval_batches,
                  backend=backend, dist=dist, main=main, evaluates=evaluates, output_dir=output_dir,
                  resume_from=checkpoint, resumed_changes=changes, log=log, user_code=user_code, source=source)


# -- set-up --------------------------------------------------------------------------------------


def vllm_engine_processes(config: TrainConfig) -> bool:
    """Whether the run's rollouts come from vLLM engine processes (in-process ``vllm``' engine core,
    or servers), busy by design while the run waits for them: its torch threads then stay as they
    are (:mod:`textrl.run.pace`). ``auto`` never resolves to vLLM."""
    from textrl.generation.base import run_engine_name

    return run_engine_name(config.generation_engine, config.vllm_server).startswith("vllm")


def check_run(config: TrainConfig) -> None:
    """Everything checkable before a model loads or a file is written: every config field, that
    no other run writes to the folder, that a fresh run would not overwrite an earlier run's
    checkpoints, that a resume changes no setting that defines the run, the environment (its id,
    settings and rows) and the reward names. ``ValueError`` says what to fix."""
    from textrl.agents.teacher import check_teacher
    from textrl.envs import Environment
    from textrl.envs.registry import check_partial_rollouts
    from textrl.rewards import check_reward_spec

    config.validate()
    refuse_async_processes(config)
    refuse_vllm_processes(config)
    refuse_busy_folder(config.output_dir)  # another run writes there now: say that first
    refuse_earlier_run(config)
    refuse_changed_settings(config)
    env = environment(config)  # an unknown --env lists the registered ids; a dataset file loads
    check_partial_rollouts(config, env)  # 'continue' on a single-turn environment changes nothing
    check_teacher(config)  # its temperature and tokenizer, before any model loads
    check_env_reward_columns(env)  # every row holds the columns its rewards read (FILE:LINE of one that does not)
    spec = reward_spec(config, env)
    pays_turns = type(env).step is not Environment.step or callable(env.reward)  # rewards of its own
    if spec.strip() or not (pays_turns or _agent_scores_alone(config, spec)):
        check_reward_spec(spec)  # an empty spec with nothing else to score the episodes is refused


def launched_processes() -> int:
    """How many training processes this one is of, known before it joins their process group: the
    size of a group already joined, else ``WORLD_SIZE`` as torchrun and ``accelerate launch`` set it
    for :func:`textrl.parallel.setup.process_group` to read (1 when unset or not a number)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    size = os.environ.get("WORLD_SIZE", "").strip()
    return int(size) if size.isdigit() else 1


def refuse_async_processes(config: TrainConfig) -> None:
    """``max_staleness`` > 0 under several processes (:func:`launched_processes`) runs an actor beside
    the learner in each, which holds the policy's weights whole (data parallel, ZeRO-1/2), or with
    served rollouts one actor on the main process that the learners hand the weights whole after each
    update (:func:`textrl.training.rollout_sources.one_actor`: any backend, FSDP and ZeRO-3 included, for a
    policy that trains every weight: no LoRA policy, no agent whose policy is adapters). A
    ``ValueError`` for the rest, said before any model loads."""
    from textrl.core.agent_registry import agent_class
    from textrl.training.rollout_sources import one_actor

    processes = launched_processes()
    if not config.max_staleness or processes <= 1:
        return
    partitioned = "--fsdp" if config.fsdp else "--zero-stage 3" if config.zero_stage == 3 else None
    if partitioned and not one_actor(config):
        raise ValueError(f"--max-staleness {config.max_staleness} runs an actor beside the learner in each of the "
                         f"{processes} training processes, and under {partitioned} none holds the policy's weights "
                         "whole; serve the rollouts (--vllm-server: one actor on the main process), train data "
                         "parallel (no --fsdp, --zero-stage 0 to 2), or drop --max-staleness")
    lora_agent = getattr(agent_class(config.agent), "lora", "no") == "required"  # its policy is adapters on a base
    frozen = "--lora-r" if config.lora_r is not None else f"--agent {config.agent}" if lora_agent else None
    if partitioned and frozen:
        raise ValueError(f"--max-staleness {config.max_staleness} under {partitioned} hands the actor the learner's "
                         f"weights whole, and with {frozen} the actor keeps a copy of the policy's frozen base, "
                         f"which {partitioned} does not hold whole; train data parallel (no --fsdp, --zero-stage 0 "
                         "to 2) or drop --max-staleness")
    if config.vllm_server and config.reward_nonfinite == "drop":
        raise ValueError(f"--max-staleness {config.max_staleness} with --vllm-server under {processes} processes deals "
                         "each process its share of the main process's rollouts, which reward_nonfinite='drop' would "
                         "leave uneven; use --reward-nonfinite zero (or raise)")



def refuse_vllm_processes(config: TrainConfig) -> None:
    """The colocated ``vllm`` engine under several processes (:func:`launched_processes`), a vLLM of
    its own in each: what it cannot run there refused before any model loads
    (:func:`textrl.generation.vllm_engine.check_processes`)."""
    from textrl.generation.base import run_engine_name

    if run_engine_name(config.generation_engine, config.vllm_server) == "vllm":
        from textrl.generation.vllm_engine import EngineOptions, check_processes

        check_processes(EngineOptions.of(config), launched_processes())


def check_env_reward_columns(env) -> None:
    """Every training and held-out row of ``env`` holds the columns its reward reads
    (:func:`textrl.envs.prompts.check_reward_columns`), checked before any model loads."""
    from textrl.envs.prompts import check_reward_columns

    for rows in (env.rows(), env.eval_rows()):
        if rows is not None:
            check_reward_columns(rows, env.reward)


def refuse_changed_settings(config: TrainConfig) -> None:
    """:class:`ResumeRefused` when ``--resume`` changes a fixed setting or a user code file of the
    newest checkpoint (compared again, on the verified checkpoint, under the run folder's lock in
    set-up), or asks for fewer ``--iterations`` than it already ran."""
    newest = complete_checkpoints(Path(config.output_dir) / "checkpoints") if config.resume else []
    if newest:
        check_resume_settings(config, config_values(config), newest[-1], "train", log=lambda *a, **k: None)
        refuse_shorter_run(newest[-1], config.iterations)


def environment(config: TrainConfig):
    """The run's environment (:func:`textrl.envs.registry.task_environment`): ``--env``, else a
    ``--dataset`` scored by ``--reward``, else the built-in digits task."""
    from textrl.envs.registry import task_environment
    from textrl.rewards.options import resolve_reward

    reward = resolve_reward(config.reward, config.reward_weights)  # a spec string, or functions (TRL's reward_funcs)
    return task_environment(config.env, config.dataset, reward, config.env_args)


def episode_tokens(config: TrainConfig, env) -> int:
    """The cap of an episode's tokens after the prompt: ``max_episode_tokens``, else the
    environment's default (``max_new_tokens`` for a single turn)."""
    from textrl.envs.episodes import default_episode_tokens

    if config.max_episode_tokens is not None:
        return config.max_episode_tokens
    return default_episode_tokens(env, config.max_new_tokens)


def check_context(config: TrainConfig, agent, *prompt_sets, env=None, log=print):
    """Right after the models load, before any training: the run's lengths
    (:func:`textrl.envs.lengths.resolve_lengths`: ``max_prompt_length`` and the episode budget, set
    or fitted to the environment's prompts and the context; a bounded one said in a line through
    ``log``), then every prompt of ``prompt_sets`` (the ``PromptDataset`` s set-up loaded) plus the
    episode budget fits the context of the models that read the policy's sequences, the policy
    and its critic (a reward model's body with ``critic_init='reward_model'``); the smallest
    context counts (:func:`textrl.envs.check_prompts_fit` names the row, its length and the limit).
    Returns the :class:`textrl.envs.lengths.Lengths`."""
    from textrl.envs import check_prompts_fit
    from textrl.envs.lengths import resolve_lengths
    from textrl.models.checks import context_length, name_of

    critic_source = config.reward_model if config.critic_init == "reward_model" else config.model
    limits = []
    for model, source in ((agent.policy, config.model), (getattr(agent, "critic", None), critic_source)):
        found = context_length(model) if model is not None else None
        if found is not None:
            limits.append((found, source if isinstance(source, str) else name_of(model)))
    # without a known context, the prompts are still held to max_prompt_length here, before
    # training, rather than by the batch that first draws a long one
    (context, field), name = min(limits, key=lambda limit: limit[0][0]) if limits else ((None, "none"), "")
    lengths = resolve_lengths(environment(config) if env is None else env, prompt_sets, agent.tokenizer,
                              max_new_tokens=config.max_new_tokens, max_prompt_length=config.max_prompt_length,
                              max_episode_tokens=config.max_episode_tokens, context=context, model=name,
                              context_field=field, seed=config.seed)
    for note in lengths.notes:
        log(note)
    for prompts in prompt_sets:
        check_prompts_fit(prompts, agent.tokenizer, context=2**62 if context is None else context,
                          context_field=field, model=name, max_new_tokens=lengths.max_episode_tokens,
                          max_prompt_length=lengths.max_prompt_length, truncate=lengths.truncate)
    return lengths


def reward_spec(config: TrainConfig, env) -> str:
    """The reward spec of the run's environment (``--reward`` when given, which
    :func:`environment` already set as its reward; '' when its reward is not a spec string) plus
    ``--reward-model`` (as 'reward_model:PATH')."""
    spec = env.reward if isinstance(env.reward, str) else ""
    if config.reward_model:
        spec = f"{spec},reward_model:{config.reward_model}" if spec else f"reward_model:{config.reward_model}"
    return spec


def _agent_scores_alone(config: TrainConfig, spec: str) -> bool:
    """An empty reward spec with an agent that brings its own reward model (``brings_reward``)."""
    from textrl.agents import agent_class

    return not spec.strip() and agent_class(config.agent).brings_reward(config)


def build_agent(config: TrainConfig, device: torch.device, log, facts=None):
    """The agent of ``config.agent``, built by its class: models, critic (if any), optimisers;
    ``facts`` (:class:`textrl.core.env_facts.EnvFacts`) is what it reads of the environment."""
    from textrl.agents import agent_class

    return agent_class(config.agent).from_config(config, device, log, env_facts=facts)


# -- the iteration's parts -----------------------------------------------------------------------


def evaluate(agent, eval_batches, episodes, seed: int, reward_nonfinite: str = "raise") -> dict[str, float]:
    """Held-out reward, greedy and sampled, under ``eval/greedy/`` and ``eval/sampled/``.

    Sampling runs under a forked RNG seeded with ``seed``: evaluating (or not) never changes the
    training run's random stream, so a resumed run matches an uninterrupted one.
    """
    from textrl.run.rollout import evaluate_prompts

    out: dict[str, float] = {}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for mode, greedy in (("greedy", True), ("sampled", False)):
            metrics = evaluate_prompts(agent, eval_batches, episodes, greedy=greedy,
                                       reward_nonfinite=reward_nonfinite)
            for key, value in metrics.items():
                out[f"eval/{mode}/{key}"] = value
    return out


def sample_completions(agent, batch, episodes, n: int = 4) -> list[dict[str, Any]]:
    """Greedy episodes of the first ``n`` prompts of an eval batch, for ``samples.jsonl``: the
    completion is every token after the prompt (the environment's observations included), and
    ``turns`` the same text apart, ``{"role": "agent" | "environment", "text": ...}`` per stretch
    (:func:`textrl.envs.collector.episode_turns`)."""
    from textrl.envs.collector import episode_turns
    from textrl.run.rollout import run_episodes

    td = run_episodes(agent, batch.select(slice(0, n)), episodes, greedy=True, timings=None)
    seen = td.get(KEYS.response_mask, td.get(KEYS.mask))
    ids = [row[m].tolist() for row, m in zip(td.get(KEYS.action).cpu(), seen.cpu())]
    texts = agent.tokenizer.batch_decode(ids, skip_special_tokens=True)
    turns = episode_turns(td, agent.tokenizer)  # the agent's and the environment's text apart (the mask)
    return [{"prompt": p, "completion": c, "turns": t} for p, c, t in zip(batch.prompt_texts[:n], texts, turns)]


__all__ = [
    "CheckpointError",
    "PPORun",
    "ResumeRefused",
    "TrainingStopped",
    "check_run",
    "format_summary",
    "train",
]
