"""``textrl bench``: agents x environments x seeds at an equal token budget, with honest statistics.

:func:`compare_agents` trains every (agent, environment, seed) with :func:`textrl.trainer.train`,
each run in its own process, ``--jobs`` at a time, and writes to ``output_dir``:

- ``report.md``: the set-up line, which differences between agents are significant (in words),
  the statistics of Agarwal et al. 2021 ("Deep RL at the Edge of the Statistical Precipice", via
  :mod:`textrl.stats`): per environment the mean normalised score with stratified-bootstrap 95%
  intervals; across environments the interquartile mean (IQM), mean, median and optimality gap
  with intervals, the probability of improvement of each pair with its interval; then the raw
  table per environment (mean ± std over seeds);
- ``learning_curves.png`` (a panel per environment: rollout reward against generated tokens, mean
  ± std over seeds), ``intervals.png`` (each agent's aggregates with their intervals) and
  ``profiles.png`` (performance profiles with bootstrap bands);
- ``results.json``: every run's figures, the statistics' report, the config fingerprints;
- ``warmup/<env>/seed<k>/`` and ``runs/<env>/<agent>/seed<k>/``: the jobs' own folders.

Scores (:mod:`textrl.bench_report`): a run's normalised score is the share of the gap it closed,
``(final held-out reward - start) / (max_reward - start)``, where start is its (env, seed)'s shared
warmed-up policy's held-out reward: 0 = no progress, 1 = the environment's maximum. An environment
without ``max_reward`` (or run with another ``--reward``) is normalised by the best final reward any
agent reached on it.

Fairness: every agent of an (env, seed) starts from the same policy (one supervised format
warm-up per (env, seed), saved under ``warmup/`` and loaded by its runs), sees the same prompt
split and reward, and runs the same number of iterations: the budget of generated tokens
(``--token-budget``) divided by the rollout size (``prompts_per_iteration x n_samples_per_prompt``)
and the per-episode cap (``max_new_tokens x`` the environment's ``max_turns``, at most
``max_episode_tokens``), rounded up.

Resuming: a job whose folder holds a complete record with the same config fingerprint (which
covers the contents of the user's ``PATH.py`` files the config names) and all its outputs is
reused; one with another config, incomplete (killed, failed), with deleted outputs, or whose
warm-up was rerun, is rerun (the log says which); ``--fresh`` reruns everything. A malformed record
is an error naming its file. The output folder is locked for the whole comparison: a second
``textrl bench`` on it is refused with a message naming the holder. Each job folder has its own
lock, held by its worker, and a worker dies with the bench that started it (Linux), so a killed
bench leaves no worker behind to write beside the rerun.

Exit status of ``textrl bench``: 0 when every job finished, 1 when one failed (the report is still
written, without it; a line on stderr names each failed job and its log), 2 for bad input.

Command line (``textrl bench`` wires :func:`add_arguments` and :func:`run`)::

    textrl bench                                    # DEFAULT_BENCH: within 15 min on 2 CPU cores
    textrl bench --agents gae_ppo,grpo --envs digits,guess_number --seeds 0,1,2 --token-budget 100000
    textrl bench --agents all --envs arithmetic --jobs 4 --threads 1 --fresh
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from textrl import bench_report, bench_runs
from textrl.bench_runs import read_run
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


# -- the worker: one job in this process ---------------------------------------------------------


def warm_start(config: TrainConfig, folder: Path, log: Any = print, threads: int | None = None) -> str:
    """The trainer's supervised format warm-up for ``config`` (its env and seed), saved to ``folder``.

    Every agent of that (env, seed) then loads this policy (``model=folder``,
    ``warmup_sft_steps=0``), so all start from the same weights."""
    from textrl.agents import PPOAgent
    from textrl.run import resolve_device, seed_everything, torch_threads

    seed_everything(config.seed)
    with torch_threads(threads):
        tokenizer = PPOAgent.load_tokenizer(config)
        policy = PPOAgent.load_policy(config, tokenizer, resolve_device(config.device), log)
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _train(config: TrainConfig, threads: int | None) -> None:
    from textrl.run import torch_threads
    from textrl.trainer import train

    with torch_threads(threads):
        train(config)


def execute_job(job_file: Path) -> None:
    """Run the job described in ``job_file`` (a warm-up or a training run) in this process, holding
    its folder's :class:`~textrl.bench_runs.JobLock`, then write its record (fingerprint, wall
    clock, peak RSS, the sizes of its outputs) to mark it finished."""
    job = json.loads(Path(job_file).read_text())
    config = TrainConfig(**job["config"])
    folder = Path(config.output_dir)
    with bench_runs.JobLock(folder):
        start = time.perf_counter()
        if job["kind"] == "warmup":
            warm_start(config, folder, print, job["threads"])
            outputs = bench_runs.output_sizes(folder)
        else:
            _train(config, job["threads"])
            outputs = bench_runs.output_sizes(folder, bench_runs.RUN_OUTPUTS)
        bench_runs.write_record(folder, job["fingerprint"], wall_s=time.perf_counter() - start,
                                peak_rss_mib=bench_runs.peak_rss_mib(), outputs=outputs)


def _execute_in_process(job_file: Path) -> str | None:
    execute_job(job_file)
    return None


# -- set-up --------------------------------------------------------------------------------------


def resolve_agents(names: Sequence[str] | None, settings: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """``(agent specs, {skipped: why})``. Named agents must all resolve and validate with
    ``settings`` (else ``ValueError`` naming the culprit); ``["all"]`` is every registered agent,
    skipping (with the reason) those that do not validate. A file spec comes back absolute."""
    from textrl.agent_registry import absolute_spec
    from textrl.agents import agent_names

    if names is None:
        names = _names(DEFAULT_BENCH["agents"])
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
    return bench_runs.fingerprint({**described, "user_code": code} if code else described)


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
    """The state of ``job`` (:func:`textrl.bench_runs.job_state`), ``"warmup_rerun"`` for a finished
    run whose warm-up (in ``rerun_warmups``) was just rerun."""
    required = bench_runs.RUN_OUTPUTS if job["kind"] == "run" else ("config.json",)
    state = bench_runs.job_state(job["folder"], job["fingerprint"], required)
    return "warmup_rerun" if state == "done" and job.get("warmup") in rerun_warmups else state


def pending(jobs: Sequence[dict[str, Any]], fresh: bool, threads: int | None, log: Any,
            rerun_warmups: set[Path] = frozenset()) -> list[Path]:
    """Prepare the folders of the jobs to (re)run and return their job files; log each job's state."""
    files = []
    for job in jobs:
        state = "fresh" if fresh else job_state(job, rerun_warmups)
        log(f"  {job['folder']}: {'--fresh, rerunning' if fresh else bench_runs.STATE_WORDS[state]}")
        if state == "done":
            continue
        description = {"kind": job["kind"], "config": job["config"].to_dict(), "fingerprint": job["fingerprint"],
                       "threads": threads}
        files.append(bench_runs.prepare(job["folder"], description))
    return files


# -- the comparison ------------------------------------------------------------------------------


def default_jobs(threads: int | None) -> int:
    """Parallel runs the cores allow: ``cpu_count // threads`` (at least 1)."""
    return max(1, (os.cpu_count() or 1) // (threads or os.cpu_count() or 1))


def compare_agents(
    agents: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    output_dir: str | Path = BENCH_OUTPUT_DIR,
    *,
    envs: Sequence[str] | None = None,
    token_budget: int | None = None,
    jobs: int | None = None,
    isolate: bool = True,
    threads: int | None = 1,
    warm_start_policy: bool = True,
    fresh: bool = False,
    reps: int = 2000,
    log: Any = print,
    **settings: Any,
) -> dict[str, Any]:
    """Train each agent on each environment with each seed; write the report, plots and results.

    Args:
        agents: registered names or ``file.py:Class`` specs, or ``["all"]`` (every registered agent
            that validates); default ``DEFAULT_BENCH["agents"]``.
        seeds: seeds (default ``DEFAULT_BENCH["seeds"]``); each agent runs once per env and seed.
        output_dir: where everything goes (see the module docstring).
        envs: environment specs (default ``DEFAULT_BENCH["envs"]``; ``env=`` in ``settings`` is
            one environment).
        token_budget: generated tokens per run (sets ``iterations`` per env; None: the
            ``iterations`` setting).
        jobs: runs at a time (default :func:`default_jobs`); ``isolate=False`` runs in this
            process, one at a time.
        threads: torch threads per run (None: torch's default).
        warm_start_policy: one shared warm-up per (env, seed); False: each run warms up itself.
        fresh: rerun every job, finished or not.
        reps: bootstrap resamples of the statistics.
        log: progress messages.
        **settings: :class:`TrainConfig` fields for every run.

    Returns ``{"agents": [{"agent", "spec"}], "tables": {env: raw table rows}, "runs": every run's
    figures, "report": the statistics (None when none), "normalisation", "skipped", "markdown",
    "fingerprints", "files", "wall_s"}``.
    """
    from textrl.run.lock import RunFolderLock

    start = time.perf_counter()
    seeds = _seeds(DEFAULT_BENCH["seeds"]) if seeds is None else list(seeds)
    if not seeds:
        raise ValueError("seeds is empty; give at least one seed (--seeds 0,1,2)")
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise ValueError(f"seeds {seeds}: seed(s) {repeated} repeated; give each seed once (--seeds 0,1,2): "
                         "a seed run twice is the same run, and would count twice in the statistics")
    env_setting = settings.pop("env", None)
    if env_setting is not None:
        if envs is not None:
            raise ValueError("both env and envs are given; list every environment in envs (--envs)")
        envs = [env_setting]
    if token_budget is None and "iterations" not in settings:
        token_budget = DEFAULT_BENCH["token_budget"]
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps={reps!r}: must be an int >= 1, the bootstrap resamples (--reps 2000)")
    if token_budget is not None and (isinstance(token_budget, bool) or not isinstance(token_budget, int)
                                     or token_budget < 1):
        raise ValueError(f"token_budget={token_budget!r}: must be an int >= 1, the generated tokens per run "
                         "(--token-budget 460800), or leave it out and give --iterations")
    env_list = _names(DEFAULT_BENCH["envs"]) if envs is None else list(envs)
    common = run_settings(settings)
    names, skipped = resolve_agents(agents, common)
    for name, why in skipped.items():
        log(f"skipping {name}: {why}")
    env_info = describe_envs(env_list, common)
    output_dir = Path(output_dir)
    with RunFolderLock(output_dir):
        jobs_plan = plan(names, env_info, seeds, output_dir, settings, token_budget, warm_start_policy)
        runs = _execute(jobs_plan, fresh, jobs, isolate, threads, log)
        return _report(runs, names, env_list, env_info, seeds, jobs_plan, skipped, output_dir, reps,
                       time.perf_counter() - start, log)


def _execute(jobs_plan: dict[str, Any], fresh: bool, jobs: int | None, isolate: bool, threads: int | None,
             log: Any) -> list[dict[str, Any]]:
    """Run the warm-ups, then the runs; every run's figures (or its error). First, a job folder a
    live process still writes in (a worker of a killed bench) is refused, naming it."""
    execute = bench_runs.run_worker if isolate else _execute_in_process
    parallel = (jobs or default_jobs(threads)) if isolate else 1
    everything = jobs_plan["warmups"] + jobs_plan["runs"]
    bench_runs.refuse_busy_jobs([job["folder"] for job in everything if fresh or job_state(job) != "done"])
    warm_errors, rerun_warmups = {}, set()
    if jobs_plan["warmups"]:
        log(f"warm-ups ({len(jobs_plan['warmups'])}):")
        done = bench_runs.run_jobs(pending(jobs_plan["warmups"], fresh, threads, log), parallel, execute, log)
        warm_errors = {path.parent: err for path, err in done.items() if err}
        rerun_warmups = {path.parent for path in done}
    log(f"runs ({len(jobs_plan['runs'])}, {parallel} at a time):")
    todo = [job for job in jobs_plan["runs"] if job["warmup"] not in warm_errors]
    done = bench_runs.run_jobs(pending(todo, fresh, threads, log, rerun_warmups), parallel, execute, log)
    errors = {path.parent: err for path, err in done.items() if err}
    return [_figures(job, warm_errors, errors) for job in jobs_plan["runs"]]


def _figures(job: dict[str, Any], warm_errors: dict[Path, str], errors: dict[Path, str]) -> dict[str, Any]:
    """One run's record for the report: identity, fingerprint, figures or error."""
    folder = job["folder"]
    run: dict[str, Any] = {"agent": job["agent"], "env": job["env"], "seed": job["seed"],
                           "output_dir": str(folder), "fingerprint": job["fingerprint"], "error": None}
    if job["warmup"] in warm_errors:
        run["error"] = f"its warm-up failed: {warm_errors[job['warmup']]}"
        run["failed_job"] = str(job["warmup"])
    elif folder in errors:
        run["error"] = errors[folder]
        run["failed_job"] = str(folder)
    else:
        try:
            record = bench_runs.read_record(folder)
            figures = read_run(folder)
        except (OSError, ValueError, KeyError) as err:
            run["error"] = f"unreadable outputs: {type(err).__name__}: {err}"
            run["failed_job"] = str(folder)
        else:
            run.update(wall_s=record.get("wall_s"), peak_rss_mib=record.get("peak_rss_mib"), **figures,
                       reward_change=figures["reward"] - figures["reward_start"])
    return run


def failure_summary(runs: Sequence[dict[str, Any]]) -> str | None:
    """One line naming every failed job (a run, or the warm-up its runs needed) and its log, or
    None when every run finished."""
    failed = [r for r in runs if r["error"]]
    if not failed:
        return None
    jobs: dict[str, list[dict[str, Any]]] = {}
    for r in failed:
        jobs.setdefault(r.get("failed_job") or r["output_dir"], []).append(r)
    parts = []
    for job, group in jobs.items():
        log = Path(job) / bench_runs.LOG_FILE
        where = f"log {log}" if log.is_file() else "no log: it ran in this process, see the output above"
        warmup = group[0]["error"].startswith("its warm-up failed")
        parts.append(f"{job} ({f'the warm-up of {len(group)} runs; ' if warmup else ''}{where})")
    return (f"{len(failed)} of {len(runs)} runs failed, left out of the report: {'; '.join(parts)}; "
            "rerun the same command to retry only these")


def setup_line(jobs_plan: dict[str, Any], env_list: Sequence[str], seeds: Sequence[int], wall_s: float) -> str:
    """The report's set-up sentence: agents, seeds, environments with iterations, budget, wall clock."""
    runs, token_budget = jobs_plan["runs"], jobs_plan["token_budget"]
    c = runs[0]["config"]
    per_env = ", ".join(f"`{env}` {next(r['config'].iterations for r in runs if r['env'] == env)} iterations"
                        for env in env_list)
    agents = list(dict.fromkeys(r["agent"] for r in runs))
    return (f"{len(agents)} agents x {len(env_list)} environments x {len(seeds)} seeds (seeds {list(seeds)}); "
            f"each iteration {c.rollout_batch_size} episodes ({c.prompts_per_iteration} prompts x "
            f"{c.n_samples_per_prompt}) of at most {c.max_new_tokens} tokens a turn; {per_env} ("
            + (f"a budget of {token_budget} generated tokens per run at most-length episodes" if token_budget
               else "iterations as set") + f"); {c.eval_size} held-out prompts; "
            f"wall clock {wall_s / 60:.1f} min ({_run_minutes(jobs_plan)} of runs and warm-ups, one core each).")


def _run_minutes(jobs_plan: dict[str, Any]) -> str:
    """The summed wall clock of the jobs' records (reused jobs included), e.g. ``"12.3 min"``."""
    total = 0.0
    for job in jobs_plan["warmups"] + jobs_plan["runs"]:
        try:
            total += bench_runs.read_record(job["folder"]).get("wall_s") or 0.0
        except (OSError, ValueError):
            continue
    return f"{total / 60:.1f} min"


def _report(runs: list[dict[str, Any]], names: Sequence[str], env_list: Sequence[str],
            env_info: dict[str, dict[str, Any]], seeds: Sequence[int], jobs_plan: dict[str, Any],
            skipped: dict[str, str], output_dir: Path, reps: int, elapsed: float, log: Any) -> dict[str, Any]:
    """Normalise, compare, write ``report.md``, the plots and ``results.json``."""
    agents = [run_label(a) for a in names]
    normalised = bench_report.normalised_scores(runs, agents, env_list, seeds,
                                                {e: i["max_reward"] for e, i in env_info.items()})
    report = bench_report.compare_scores(normalised, reps=reps)
    plots = bench_report.write_plots(runs, env_list, report, output_dir)
    text = bench_report.markdown(setup_line(jobs_plan, env_list, seeds, elapsed), runs, env_list, normalised,
                                 report, skipped, [p.name for p in plots])
    (output_dir / "report.md").write_text(text)
    files = [output_dir / "report.md", *plots, output_dir / "results.json"]
    result = {
        "agents": [{"agent": run_label(spec), "spec": spec} for spec in names],
        "tables": {env: bench_report.aggregate([r for r in runs if r["env"] == env]) for env in env_list},
        "runs": runs, "report": report, "skipped": skipped, "markdown": text, "wall_s": elapsed,
        "normalisation": {"envs": normalised["envs"], "highs": normalised["highs"], "notes": normalised["notes"],
                          "seeds": normalised["seeds"]},
        "fingerprints": {"runs": {str(j["folder"]): j["fingerprint"] for j in jobs_plan["runs"]},
                         "warmups": {str(j["folder"]): j["fingerprint"] for j in jobs_plan["warmups"]}},
        "files": [str(p) for p in files], "failed": failure_summary(runs),
    }
    (output_dir / "results.json").write_text(json.dumps(result, indent=1, default=str))
    log(text)
    log(f"wrote {', '.join(str(p) for p in files)} in {elapsed:.0f} s")
    return result


# -- command line --------------------------------------------------------------------------------


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _seeds(text: str) -> list[int]:
    try:
        return [int(x) for x in _names(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``textrl bench`` options, plus every ``textrl train`` option applied to all runs
    (``--agent``, ``--seed`` and ``--env`` are the comparison's own: use ``--agents``, ``--seeds``,
    ``--envs``)."""
    from textrl.config import add_config_arguments

    d = DEFAULT_BENCH
    parser.add_argument("--agents", type=_names, default=None,
                        help=f"comma-separated agents: registered names, path/to/file.py:Class, or 'all' "
                             f"(default: {d['agents']})")
    parser.add_argument("--envs", type=_names, default=None,
                        help=f"comma-separated environments: registered ids or any --env spec "
                             f"(default: {d['envs']})")
    parser.add_argument("--seeds", type=_seeds, default=None,
                        help=f"comma-separated seeds (default: {d['seeds']})")
    parser.add_argument("--token-budget", type=int, default=None,
                        help=f"generated tokens per run; sets the iterations per environment "
                             f"(default: {d['token_budget']} unless --iterations is given)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="runs at a time, each its own process (default: CPU cores // --threads)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per run (default 1; 0: torch's default, one per core)")
    parser.add_argument("--fresh", action="store_true", help="rerun every job, even finished ones")
    parser.add_argument("--reps", type=int, default=2000, help="bootstrap resamples (default 2000)")
    parser.add_argument("--in-process", action="store_true",
                        help="train in this process, one run at a time, instead of one subprocess per run")
    parser.add_argument("--no-warm-start", action="store_true",
                        help="let every run do its own warm-up instead of one shared warm-up per (env, seed)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    add_config_arguments(parser)
    _bench_defaults_in_help(parser)


def _bench_defaults_in_help(parser: argparse.ArgumentParser) -> None:
    """The ``textrl train`` options whose default differs in the comparison say so in their help:
    ``--output-dir`` (the comparison's folder), the settings :func:`run_settings` gives every run,
    ``--iterations`` (set by the token budget), and ``--agent`` / ``--seed`` (per run)."""
    bench_values = run_settings({})
    for action in parser._actions:
        if action.help is None or "(default: " not in action.help:
            continue
        text = action.help.rsplit(" (default: ", 1)[0]
        if action.dest == "output_dir":
            action.help = f"the comparison's folder (default: {BENCH_OUTPUT_DIR!r})"
        elif action.dest == "progress":
            action.help = f"not used: the comparison's runs show no progress bar (default: {bench_values['progress']!r})"
        elif action.dest in bench_values:
            action.help = f"{text} (default: {bench_values[action.dest]!r} in the comparison's runs)"
        elif action.dest == "iterations":
            action.help = (f"{text} Given (and --token-budget not), every run does this many (default: "
                           "set per environment by --token-budget)")
        elif action.dest in ("agent", "seed"):
            action.help = f"set per run by the comparison: use --{action.dest}s"
        elif action.dest == "env":
            action.help = f"one environment to compare on, the same as --envs ENV (default: {DEFAULT_BENCH['envs']})"


def run(args: argparse.Namespace) -> int:
    """Run the comparison (or, with ``--worker``, one job of it) from parsed arguments; exit status."""
    if args.worker:
        parent = os.environ.get(bench_runs.PARENT_ENV)
        if parent:
            bench_runs.die_with_parent(int(parent))
        execute_job(Path(args.worker))
        return 0
    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    output_dir = overrides.pop("output_dir", BENCH_OUTPUT_DIR)
    overrides.pop("progress", None)
    try:
        for name in ("agent", "seed"):
            if name in overrides:
                raise ValueError(f"--{name} is set per run by the comparison; use --{name}s")
        if args.jobs is not None and args.jobs < 1:
            raise ValueError(f"--jobs {args.jobs}: give at least 1")
        result = compare_agents(args.agents, args.seeds, output_dir, envs=args.envs,
                                token_budget=args.token_budget, jobs=args.jobs, isolate=not args.in_process,
                                threads=args.threads or None, warm_start_policy=not args.no_warm_start,
                                fresh=args.fresh, reps=args.reps, **overrides)
    except ValueError as err:
        print(f"textrl bench: {err}", file=sys.stderr)
        return 2
    if result["failed"]:
        print(f"textrl bench: {result['failed']}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="textrl bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


# names kept for callers of the earlier single-task comparison
aggregate = bench_report.aggregate
markdown_table = bench_report.markdown_table
peak_rss_mib = bench_runs.peak_rss_mib

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
