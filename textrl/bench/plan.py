"""What ``textrl bench`` runs: its defaults, the agents and environments it compares, the arms
(each agent, optionally crossed with the ``max_staleness`` and ``rollout_correction`` axes), and
every job (the shared warm-ups and the runs) with its config and fingerprint; which jobs are
pending.

A job's folder, record and lock are :mod:`textrl.bench.jobs`'; running the jobs and the report are
:mod:`textrl.bench.compare`'s. This module resolves agent and environment names through their
registries (imported where used), so it is orchestration (docs/design.md, "Layers"); it trains
nothing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
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
AXES = ("max_staleness", "rollout_correction")
"""The TrainConfig fields ``textrl bench`` can cross with the agents (``--max-staleness 0,1,4``,
``--rollout-correction none,tis``): each value is an arm of every agent (:class:`Arm`)."""
BENCH_OUTPUT_DIR = "runs/bench"
"""Where ``textrl bench`` writes when ``--output-dir`` is not given."""


# -- set-up --------------------------------------------------------------------------------------


def resolve_agents(names: Sequence[str] | None, settings: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """``(agent specs, {skipped: why})``. Named agents must all resolve and validate with
    ``settings`` (else ``ValueError`` naming the culprit); ``["all"]`` is every registered agent,
    skipping (with the reason) those that do not validate. A file spec comes back absolute."""
    from textrl.agents import agent_names
    from textrl.core.agent_registry import absolute_spec

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


@dataclass(frozen=True)
class Arm:
    """One compared configuration: an agent spec and, on each axis that is given, its value
    (None: that axis is off, the run keeps the common setting). An arm with both None is the agent
    alone, exactly as without axes: same label, folder, config and fingerprint."""

    agent: str
    max_staleness: int | None = None
    rollout_correction: str | None = None

    @property
    def label(self) -> str:
        """Its name in tables, plots and folders (:func:`arm_label`)."""
        return arm_label(self.agent, self.max_staleness, self.rollout_correction)

    def overrides(self) -> dict[str, Any]:
        """The TrainConfig fields it sets: those of the axes that are on."""
        values = {"max_staleness": self.max_staleness, "rollout_correction": self.rollout_correction}
        return {name: value for name, value in values.items() if value is not None}


def arm_label(agent: str, max_staleness: int | None = None, rollout_correction: str | None = None) -> str:
    """An arm's name, safe as a folder name: the agent's (:func:`run_label`), then ``@K<k>`` when
    the staleness axis is on and ``+<correction>`` when the correction axis is: ``grpo``,
    ``grpo@K1``, ``grpo+tis``, ``grpo@K1+tis``."""
    label = run_label(agent)
    label += f"@K{max_staleness}" if max_staleness is not None else ""
    return label + (f"+{rollout_correction}" if rollout_correction is not None else "")


def as_arm(agent: str | Arm) -> Arm:
    """``agent`` as an :class:`Arm` (an agent spec is the arm of that agent alone)."""
    return agent if isinstance(agent, Arm) else Arm(agent)


def check_axes(max_staleness: Sequence[int] | None, rollout_correction: Sequence[str] | None) -> None:
    """``ValueError`` naming the option when an axis is empty, repeats a value or has one that no
    run could take (``max_staleness`` an int >= 0, ``rollout_correction`` one of
    :data:`textrl.functional.MISMATCH_KINDS`); None is an axis that is off."""
    from textrl.functional import MISMATCH_KINDS

    for name, values in zip(AXES, (max_staleness, rollout_correction), strict=True):
        if values is None:
            continue
        option = f"--{name.replace('_', '-')}"
        example = "0,1,4" if name == "max_staleness" else "none,tis"
        if isinstance(values, (str, int)):
            raise ValueError(f"{name}={values!r}: give a list of values, each an arm of every agent "
                             f"({option} {example})")
        values = list(values)
        if not values:
            raise ValueError(f"{name} is empty; give at least one value ({option} {example}), or leave {option} out")
        repeated = sorted({str(v) for v in values if values.count(v) > 1})
        if repeated:
            raise ValueError(f"{name} {values}: {', '.join(repeated)} repeated; give each value once "
                             f"({option} {example})")
        for value in values:
            if name == "max_staleness" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"max_staleness {value!r}: each value must be an integer >= 0, the most updates "
                                 f"a rollout's weights may lag (0: synchronous; {option} {example})")
            if name == "rollout_correction" and value not in MISMATCH_KINDS:
                raise ValueError(f"rollout_correction {value!r}: must be one of {', '.join(MISMATCH_KINDS)} "
                                 f"({option} {example})")


def resolve_arms(agents: Sequence[str], settings: dict[str, Any], max_staleness: Sequence[int] | None = None,
                 rollout_correction: Sequence[str] | None = None,
                 every: bool = False) -> tuple[list[Arm], dict[str, str]]:
    """``(arms, {skipped arm: why})``: every agent spec of ``agents`` (resolved by
    :func:`resolve_agents`) crossed with the values of each axis given (agent, then staleness,
    then correction). With no axis, one arm per agent, checked already. With axes, each arm must
    validate with ``settings`` (else ``ValueError`` naming the arm), or, when ``every`` (agents
    were ``"all"``), is skipped with the reason."""
    check_axes(max_staleness, rollout_correction)
    if max_staleness is None and rollout_correction is None:
        return [Arm(agent) for agent in agents], {}
    arms, skipped = [], {}
    for agent in agents:
        for k in max_staleness if max_staleness is not None else [None]:
            for kind in rollout_correction if rollout_correction is not None else [None]:
                arm = Arm(agent, k, kind)
                try:
                    TrainConfig(**{**settings, "agent": agent, **arm.overrides()}).validate()
                except ValueError as err:
                    if not every:
                        raise ValueError(f"arm {arm.label!r}: {err}") from None
                    skipped[arm.label] = str(err)
                    continue
                arms.append(arm)
    if not arms:
        raise ValueError(f"none of the arms of agents {list(agents)} can run with these settings: {skipped}")
    return arms, skipped


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


def plan(agents: Sequence[str | Arm], envs: dict[str, dict[str, Any]], seeds: Sequence[int], output_dir: Path,
         settings: dict[str, Any], token_budget: int | None, warm: bool) -> dict[str, Any]:
    """Every job of the comparison: ``{"warmups": [...], "runs": [...], "token_budget"}``; a job is
    a dict with ``kind``, ``config`` (TrainConfig), ``fingerprint``, ``folder`` (and a run's
    ``agent`` (its arm's label), ``arm``, ``env``, ``seed``, ``warmup`` folder or None). ``agents``:
    agent specs or :class:`Arm` s; every arm of an (env, seed) shares its warm-up and iterations."""
    base = run_settings(settings)
    warmups, runs = [], []
    for env, info in envs.items():
        probe = TrainConfig(**{**base, "env": env})
        iterations = iterations_for(token_budget, probe, info["max_turns"]) if token_budget else probe.iterations
        for seed in seeds:
            config = TrainConfig(**{**base, "env": env, "seed": seed, "iterations": iterations})
            warm_job = warmup_job(config, output_dir / "warmup" / env_label(env) / f"seed{seed}") if warm else None
            warmups += [warm_job] if warm_job else []
            runs += [run_job(config, as_arm(agent), output_dir, warm_job) for agent in agents]
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


def run_job(config: TrainConfig, agent: str | Arm, output_dir: Path, warm_job: dict[str, Any] | None) -> dict[str, Any]:
    """The run of ``agent`` (a spec or an :class:`Arm`, whose axes' fields it sets) on ``config``'s
    (env, seed), validated, in ``runs/<env>/<arm label>/seed<k>``; its fingerprint covers every
    field but the folder, and its warm-up's fingerprint; it loads the warm-up's policy."""
    arm = as_arm(agent)
    folder = output_dir / "runs" / env_label(config.env) / arm.label / f"seed{config.seed}"
    run_config = replace(config, agent=arm.agent, **arm.overrides(), output_dir=str(folder)).validate()
    described = {k: v for k, v in run_config.to_dict().items() if k != "output_dir"}
    print_ = job_key({**described, "warmup": warm_job["fingerprint"] if warm_job else None})
    if warm_job:
        run_config = replace(run_config, model=str(warm_job["folder"]), warmup_sft_steps=0)
    return {"kind": "run", "config": run_config, "fingerprint": print_, "folder": folder, "agent": arm.label,
            "arm": arm, "env": config.env, "seed": config.seed, "warmup": warm_job["folder"] if warm_job else None}


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
