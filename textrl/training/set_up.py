"""``textrl train``'s set-up: :func:`set_up` builds the :class:`~textrl.training.ppo_run.PPORun`
(the backend, the run folder, the seed, the ``--resume`` checkpoint, the environment and its rows,
the agent and its models, the reward, the episode runner, the sampler, the rollout source), with
the parts it is made of: the run's environment (:func:`environment`), its reward spec
(:func:`reward_spec`), the agent (:func:`build_agent`) and the lengths fitted to the models'
context (:func:`check_context`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from textrl.config import TrainConfig, config_values
from textrl.parallel import setup_backend
from textrl.run import check_resume_settings, resume_checkpoint, seed_everything, take_run_folder
from textrl.run.pace import fit_threads_now
from textrl.run.user_code import user_code_digest
from textrl.run.warmup import keeping_warmup
from textrl.training.ppo_run import PPORun
from textrl.training.records import describe_run_start, warmup_record
from textrl.training.rollout_sources import rollout_source


def set_up(config: TrainConfig, device: torch.device) -> PPORun:
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
    if main:  # one writer per run folder, until the run ends (textrl.training.trainer); a second run is refused here
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


def vllm_engine_processes(config: TrainConfig) -> bool:
    """Whether the run's rollouts come from vLLM engine processes (in-process ``vllm``' engine core,
    or servers), busy by design while the run waits for them: its torch threads then stay as they
    are (:mod:`textrl.run.pace`). ``auto`` never resolves to vLLM."""
    from textrl.generation.base import run_engine_name

    return run_engine_name(config.generation_engine, config.vllm_server).startswith("vllm")


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


def build_agent(config: TrainConfig, device: torch.device, log, facts=None):
    """The agent of ``config.agent``, built by its class: models, critic (if any), optimisers;
    ``facts`` (:class:`textrl.core.env_facts.EnvFacts`) is what it reads of the environment."""
    from textrl.agents import agent_class

    return agent_class(config.agent).from_config(config, device, log, env_facts=facts)


__all__ = ["build_agent", "check_context", "environment", "episode_tokens", "reward_spec", "set_up",
           "vllm_engine_processes"]
