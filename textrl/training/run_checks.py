"""What ``textrl train`` checks before any model loads or a file is written: :func:`check_run`
(every config field, the run folder, an earlier run, a resume's settings, the environment and its
rows, the reward names) and the launches it refuses under several processes
(:func:`refuse_async_processes`, :func:`refuse_vllm_processes`). ``ValueError`` says what to fix.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from textrl.config import TrainConfig, config_values
from textrl.run import (
    check_resume_settings,
    complete_checkpoints,
    refuse_busy_folder,
    refuse_earlier_run,
)
from textrl.run.resume import refuse_shorter_run
from textrl.training.set_up import environment, reward_spec


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


def _agent_scores_alone(config: TrainConfig, spec: str) -> bool:
    """An empty reward spec with an agent that brings its own reward model (``brings_reward``)."""
    from textrl.agents import agent_class

    return not spec.strip() and agent_class(config.agent).brings_reward(config)


__all__ = ["check_env_reward_columns", "check_run", "launched_processes", "refuse_async_processes",
           "refuse_changed_settings", "refuse_vllm_processes"]
