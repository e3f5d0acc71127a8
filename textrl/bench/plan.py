"""What ``textrl bench`` runs: its defaults, the agents and environments it compares, and every
job (the shared warm-ups and the runs) with its config and fingerprint; which jobs are pending.

A job's folder, record and lock are :mod:`textrl.bench.jobs`'; running the jobs and the report are
:mod:`textrl.bench.compare`'s. This module resolves agent and environment names through their
registries (imported where used), so it is orchestration (docs/design.md, "Layers"); it trains
nothing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from textrl.bench import jobs as bench_jobs
from textrl.config import TrainConfig

DEFAULT_BENCH: dict[str, Any] = {
    "agents": "gae_ppo,rloo,grpo,cispo",
    "envs": "digits",
    "seeds": "0,1,2",
    "token_budget": 300 * 64 * 24,  # 300 iterations of 64 responses of at most 24 tokens on digits
    "settings": {"eval_every": 0},
}
"""What ``textrl bench`` with no arguments runs, as its options would be typed (sized to finish
within 15 minutes on 2 CPU cores with ``--jobs 2 --threads 1``): agents, environments, seeds,
generated tokens per run, and TrainConfig overrides for every run (on top of the embedded default
``TrainConfig()``)."""
WARMUP_FIELDS = ("model", "tokenizer", "env", "env_args", "dataset", "reward", "seed", "eval_size",
                 "max_prompt_length", "warmup_sft_steps", "warmup_sft_lr", "warmup_sft_batch_size",
                 "warmup_answer_accuracy", "device")
"""The config fields a warm-up depends on (its fingerprint)."""
ALL_AGENTS = "all"
BENCH_OUTPUT_DIR = "runs/bench"
"""Where ``textrl bench`` writes when ``--output-dir`` is not given."""


# -- set-up --------------------------------------------------------------------------------------


def resolve_agents(names: Sequence[str] | None, settings: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """``(agent specs, {skipped: why})``. Named agents must all resolve and validate with
    ``settings`` (else ``ValueError`` naming the culprit); ``["all"]`` is every registered agent,
    skipping (with the reason) those that do not validate. A file spec comes back absolute."""
    from textrl.agent_registry import absolute_spec
    from textrl.agents import agent_names

    if names is None:
        names = comma_list(DEFAULT_BENCH["agents"])
    every = list(names) == [ALL_AGENTS]
    ok, skipped = [], {}
    for name in agent_names() if every else names:
        try:
            spec = absolute_spec(name)
            TrainConfig(**{**settings, "agent": spec}).validate()
        except ValueError as err:
            if not every:
                raise ValueError(str(err) if name in str(err) else f"agent {name!r}: {err}") from None
            skipped[name] = str(err)
            continue
        ok.append(spec)
    if not ok:
        raise ValueError(f"none of the agents {list(names)} can run with these settings: {skipped}")
    if len({run_label(a) for a in ok}) < len(ok):
        raise ValueError(f"agents {ok}: two share a name; give each once")
    return ok, skipped


def describe_envs(envs: Sequence[str], settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per environment spec ``{"max_turns", "max_reward"}`` (``max_reward`` None when unknown or
    when ``settings`` replace its reward); ``ValueError`` naming an unknown one."""
    from textrl.envs.registry import task_environment

    if not envs:
        raise ValueError("envs is empty; give at least one environment (textrl envs lists them)")
    if len(set(envs)) < len(envs):
        raise ValueError(f"envs {list(envs)}: an environment is named twice")
    out = {}
    for spec in envs:
        try:
            env = task_environment(spec, env_args=settings.get("env_args"))
        except (ValueError, TypeError) as err:
            raise ValueError(f"environment {spec!r}: {err}") from None
        own_reward = settings.get("reward") is None
        out[spec] = {"max_turns": int(env.max_turns),
                     "max_reward": env.max_reward if own_reward else None}
    return out


def run_label(agent: str) -> str:
    """An agent's name in tables, plots and folders: its registered name, or the class of a spec."""
    return agent.rpartition(":")[2]


def env_label(env: str) -> str:
    """An environment spec as a folder name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", env).strip("_") or "env"


def run_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The TrainConfig fields every run gets: the default bench settings, no progress bar, one
    checkpoint at the end, then ``settings``. Unknown names are an error naming them."""
    unknown = sorted(set(settings) - {f.name for f in fields(TrainConfig)})
    if unknown:
        raise ValueError(f"unknown TrainConfig field(s) {unknown}; see `textrl train --help`")
    return {**DEFAULT_BENCH["settings"], "checkpoint_every": 0, "keep_checkpoints": 1, **settings,
            "progress": False}


def episode_token_cap(config: TrainConfig, max_turns: int) -> int:
    """The most tokens the agent can generate in one episode: ``max_new_tokens`` per turn for
    ``max_turns`` turns, at most ``max_episode_tokens``."""
    cap = config.max_new_tokens * max_turns
    return min(cap, config.max_episode_tokens) if config.max_episode_tokens else cap


def iterations_for(token_budget: int, config: TrainConfig, max_turns: int) -> int:
    """Iterations that spend ``token_budget`` generated tokens at most-length episodes (rounded up)."""
    return max(1, math.ceil(token_budget / (config.rollout_batch_size * episode_token_cap(config, max_turns))))


def plan(agents: Sequence[str], envs: dict[str, dict[str, Any]], seeds: Sequence[int], output_dir: Path,
         settings: dict[str, Any], token_budget: int | None, warm: bool) -> dict[str, Any]:
    """Every job of the comparison: ``{"warmups": [...], "runs": [...], "token_budget"}``; a job is
    a dict with ``kind``, ``config`` (TrainConfig), ``fingerprint``, ``folder`` (and a run's
    ``agent``, ``env``, ``seed``, ``warmup`` folder or None)."""
    base = run_settings(settings)
    warmups, runs = [], []
    for env, info in envs.items():
        probe = TrainConfig(**{**base, "env": env})
        iterations = iterations_for(token_budget, probe, info["max_turns"]) if token_budget else probe.iterations
        for seed in seeds:
            config = TrainConfig(**{**base, "env": env, "seed": seed, "iterations": iterations})
            warm_job = warmup_job(config, output_dir / "warmup" / env_label(env) / f"seed{seed}") if warm else None
            warmups += [warm_job] if warm_job else []
            runs += [run_job(config, agent, output_dir, warm_job) for agent in agents]
    return {"warmups": warmups, "runs": runs, "token_budget": token_budget}


def job_key(described: dict[str, Any]) -> str:
    """A job's fingerprint: ``described`` plus, when it names user Python files, the sha256 of each
    (:func:`textrl.run.user_code.user_code_digest`), so editing an environment, reward or agent
    file reruns the jobs that use it; a job naming none keeps the key it had before."""
    from textrl.run.user_code import user_code_digest

    code = user_code_digest(described)
    return bench_jobs.fingerprint({**described, "user_code": code} if code else described)


def warmup_job(config: TrainConfig, folder: Path) -> dict[str, Any]:
    """The shared warm-up of ``config``'s (env, seed): fingerprinted by :data:`WARMUP_FIELDS`."""
    print_ = job_key({k: getattr(config, k) for k in WARMUP_FIELDS})
    return {"kind": "warmup", "config": replace(config, output_dir=str(folder)), "fingerprint": print_,
            "folder": folder}


def run_job(config: TrainConfig, agent: str, output_dir: Path, warm_job: dict[str, Any] | None) -> dict[str, Any]:
    """The run of ``agent`` on ``config``'s (env, seed), validated; its fingerprint covers every
    field but the folder, and its warm-up's fingerprint; it loads the warm-up's policy."""
    folder = output_dir / "runs" / env_label(config.env) / run_label(agent) / f"seed{config.seed}"
    run_config = replace(config, agent=agent, output_dir=str(folder)).validate()
    described = {k: v for k, v in run_config.to_dict().items() if k != "output_dir"}
    print_ = job_key({**described, "warmup": warm_job["fingerprint"] if warm_job else None})
    if warm_job:
        run_config = replace(run_config, model=str(warm_job["folder"]), warmup_sft_steps=0)
    return {"kind": "run", "config": run_config, "fingerprint": print_, "folder": folder, "agent": run_label(agent),
            "env": config.env, "seed": config.seed, "warmup": warm_job["folder"] if warm_job else None}


def job_state(job: dict[str, Any], rerun_warmups: set[Path] = frozenset()) -> str:
    """The state of ``job`` (:func:`textrl.bench_jobs.job_state`), ``"warmup_rerun"`` for a finished
    run whose warm-up (in ``rerun_warmups``) was just rerun."""
    required = bench_jobs.RUN_OUTPUTS if job["kind"] == "run" else ("config.json",)
    state = bench_jobs.job_state(job["folder"], job["fingerprint"], required)
    return "warmup_rerun" if state == "done" and job.get("warmup") in rerun_warmups else state


def pending(jobs: Sequence[dict[str, Any]], fresh: bool, threads: int | None, log: Any,
            rerun_warmups: set[Path] = frozenset()) -> list[Path]:
    """Prepare the folders of the jobs to (re)run and return their job files; log each job's state."""
    files = []
    for job in jobs:
        state = "fresh" if fresh else job_state(job, rerun_warmups)
        log(f"  {job['folder']}: {'--fresh, rerunning' if fresh else bench_jobs.STATE_WORDS[state]}")
        if state == "done":
            continue
        description = {"kind": job["kind"], "config": job["config"].to_dict(), "fingerprint": job["fingerprint"],
                       "threads": threads}
        files.append(bench_jobs.prepare(job["folder"], description))
    return files


def comma_list(text: str) -> list[str]:
    """The items of a comma-separated option (``"a, b,"`` -> ``["a", "b"]``)."""
    return [t.strip() for t in text.split(",") if t.strip()]
