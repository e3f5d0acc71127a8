"""The comparison of ``textrl bench`` (its description for users is :mod:`textrl.bench`'s
docstring): :func:`compare_agents` runs the plan's jobs (:mod:`textrl.bench.plan`), each in a
worker process (:mod:`textrl.bench.jobs`) or in this one, reads their figures back and writes the
report (:mod:`textrl.bench.report`); :func:`execute_job` is the worker's side; :func:`main` /
:func:`run` are the command line. Orchestration (docs/design.md, "Layers"): the worker trains.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from textrl.bench import jobs as bench_jobs
from textrl.bench import report as bench_report
from textrl.bench import stats
from textrl.bench.jobs import read_run
from textrl.bench.plan import (
    ALL_AGENTS,
    AXES,
    BENCH_OUTPUT_DIR,
    DEFAULT_BENCH,
    Arm,
    check_axes,
    comma_list,
    describe_envs,
    job_state,
    pending,
    plan,
    resolve_agents,
    resolve_arms,
    run_settings,
)
from textrl.config import TrainConfig

# -- the worker: one job in this process ---------------------------------------------------------


def warm_start(config: TrainConfig, folder: Path, log: Any = print, threads: int | None = None) -> str:
    """The trainer's supervised format warm-up for ``config`` (its env and seed), saved to ``folder``.

    Every agent of that (env, seed) then loads this policy (``model=folder``,
    ``warmup_sft_steps=0``), so all start from the same weights."""
    from textrl.agents import PPOAgent
    from textrl.agents.build import load_tokenizer
    from textrl.run import resolve_device, seed_everything, torch_threads

    seed_everything(config.seed)
    with torch_threads(threads):
        tokenizer = load_tokenizer(config)
        policy = PPOAgent.load_policy(config, tokenizer, resolve_device(config.device), log)
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _train(config: TrainConfig, threads: int | None) -> None:
    from textrl.run import torch_threads
    from textrl.training.trainer import train

    with torch_threads(threads):
        train(config)


def execute_job(job_file: Path) -> None:
    """Run the job described in ``job_file`` (a warm-up or a training run) in this process, holding
    its folder's :class:`~textrl.bench_jobs.JobLock`, then write its record (fingerprint, wall
    clock, peak RSS, the sizes of its outputs) to mark it finished."""
    job = json.loads(Path(job_file).read_text())
    config = TrainConfig(**job["config"])
    folder = Path(config.output_dir)
    with bench_jobs.JobLock(folder):
        start = time.perf_counter()
        if job["kind"] == "warmup":
            warm_start(config, folder, print, job["threads"])
            outputs = bench_jobs.output_sizes(folder)
        else:
            _train(config, job["threads"])
            outputs = bench_jobs.output_sizes(folder, bench_jobs.RUN_OUTPUTS)
        bench_jobs.write_record(folder, job["fingerprint"], wall_s=time.perf_counter() - start,
                                peak_rss_mib=bench_jobs.peak_rss_mib(), outputs=outputs)


def _execute_in_process(job_file: Path) -> str | None:
    execute_job(job_file)
    return None


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
    staleness: Sequence[int] | None = None,
    corrections: Sequence[str] | None = None,
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
    """Train each agent (or arm) on each environment with each seed; write the report, plots and results.

    Args:
        agents: registered names or ``file.py:Class`` specs, or ``["all"]`` (every registered agent
            that validates); default ``DEFAULT_BENCH["agents"]``.
        seeds: seeds (default ``DEFAULT_BENCH["seeds"]``); each agent runs once per env and seed.
        output_dir: where everything goes (see the module docstring).
        envs: environment specs (default ``DEFAULT_BENCH["envs"]``; ``env=`` in ``settings`` is
            one environment).
        staleness: the ``max_staleness`` axis (``--max-staleness 0,1,4``): each value an arm of
            every agent, labelled ``<agent>@K<k>``; None: no axis (``max_staleness=`` in
            ``settings`` then applies to every run, unlabelled, as before).
        corrections: the ``rollout_correction`` axis (``--rollout-correction none,tis``): each
            value an arm of every agent, labelled ``<agent>+<kind>`` (``<agent>@K<k>+<kind>`` with
            ``staleness``); None: no axis. An arm that does not validate is an error naming it
            (with ``agents=["all"]``: skipped with the reason). Arms are compared as agents are.
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

    Returns ``{"agents": [{"agent", "spec", and an arm's axis fields}], "tables": {env: raw table
    rows}, "runs": every run's figures, "report": the statistics (None when none), "normalisation",
    "skipped", "markdown", "fingerprints", "files", "wall_s"}``.
    """
    from textrl.run.lock import RunFolderLock

    start = time.perf_counter()
    seeds, env_list, token_budget = _bench_axes(seeds, envs, token_budget, reps, settings)
    axes = _axes(settings, staleness, corrections)
    common = run_settings(settings)
    names, skipped = resolve_agents(agents, common)
    arms, skipped_arms = resolve_arms(names, common, axes.get("max_staleness"), axes.get("rollout_correction"),
                                      every=agents is not None and list(agents) == [ALL_AGENTS])
    skipped.update(skipped_arms)
    for name, why in skipped.items():
        log(f"skipping {name}: {why}")
    if len(arms) > 1 and seeds_too_few(len(seeds), len(env_list)):
        log(seeds_too_few(len(seeds), len(env_list)))
    env_info = describe_envs(env_list, common)
    output_dir = Path(output_dir)
    with RunFolderLock(output_dir):
        jobs_plan = plan(arms, env_info, seeds, output_dir, settings, token_budget, warm_start_policy)
        runs = _execute(jobs_plan, fresh, jobs, isolate, threads, log)
        return _report(runs, arms, env_list, env_info, seeds, jobs_plan, skipped, output_dir, reps,
                       time.perf_counter() - start, log, axes)


def _bench_axes(seeds: Sequence[int] | None, envs: Sequence[str] | None, token_budget: int | None, reps: Any,
                settings: dict[str, Any]) -> tuple[list[int], list[str], int | None]:
    """:func:`compare_agents`' seeds, environments and token budget, checked, defaults filled in
    (``settings``' ``env`` is popped: one environment)."""
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
    return seeds, comma_list(DEFAULT_BENCH["envs"]) if envs is None else list(envs), token_budget


def seeds_too_few(seeds: int, envs: int, alpha: float = 0.05) -> str | None:
    """The line a bench starts with when its seeds cannot support any verdict on its environments
    (:func:`textrl.bench.stats.seeds_needed`); None when they can, or with no environment (refused
    by name elsewhere)."""
    if envs < 1 or seeds < 1:
        return None
    needed = stats.seeds_needed(envs, alpha)
    if seeds >= needed:
        return None
    return (f"note: {seeds} seed(s) on {envs} environment(s) can tell no two agents apart at {alpha:g}: the exact "
            f"rank test reaches p >= {stats.smallest_p(seeds, seeds, envs):.3g} at best; a verdict needs {needed} "
            "seeds a side (the report gives the figures, without verdicts)")


def _axes(settings: dict[str, Any], staleness: Sequence[int] | None,
          corrections: Sequence[str] | None) -> dict[str, list[Any]]:
    """The axes given, ``{TrainConfig field: values}`` (checked by :func:`textrl.bench.plan.check_axes`);
    ``ValueError`` when a field is both an axis and a setting of every run."""
    check_axes(staleness, corrections)
    given = dict(zip(AXES, (staleness, corrections), strict=True))
    axes = {name: list(values) for name, values in given.items() if values is not None}
    for name, values in axes.items():
        if name in settings:
            raise ValueError(f"{name}={settings[name]!r} for every run and the {name} axis {values} are both "
                             f"given; list every value in the axis (--{name.replace('_', '-')} "
                             f"{','.join(map(str, values))})")
    return axes


def _execute(jobs_plan: dict[str, Any], fresh: bool, jobs: int | None, isolate: bool, threads: int | None,
             log: Any) -> list[dict[str, Any]]:
    """Run the warm-ups, then the runs; every run's figures (or its error). First, a job folder a
    live process still writes in (a worker of a killed bench) is refused, naming it."""
    execute = bench_jobs.run_worker if isolate else _execute_in_process
    parallel = (jobs or default_jobs(threads)) if isolate else 1
    everything = jobs_plan["warmups"] + jobs_plan["runs"]
    bench_jobs.refuse_busy_jobs([job["folder"] for job in everything if fresh or job_state(job) != "done"])
    warm_errors, rerun_warmups = {}, set()
    if jobs_plan["warmups"]:
        log(f"warm-ups ({len(jobs_plan['warmups'])}):")
        done = bench_jobs.run_jobs(pending(jobs_plan["warmups"], fresh, threads, log), parallel, execute, log)
        warm_errors = {path.parent: err for path, err in done.items() if err}
        rerun_warmups = {path.parent for path in done}
    log(f"runs ({len(jobs_plan['runs'])}, {parallel} at a time):")
    todo = [job for job in jobs_plan["runs"] if job["warmup"] not in warm_errors]
    done = bench_jobs.run_jobs(pending(todo, fresh, threads, log, rerun_warmups), parallel, execute, log)
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
            record = bench_jobs.read_record(folder)
            figures = read_run(folder)
        except (OSError, ValueError, KeyError) as err:
            run["error"] = f"unreadable outputs: {type(err).__name__}: {err}"
            run["failed_job"] = str(folder)
        else:
            run.update(wall_s=record.get("wall_s"), peak_rss_mib=record.get("peak_rss_mib"), **figures,
                       reward_change=figures["reward"] - figures["reward_start"], train_s=figures["elapsed_s"][-1])
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
        log = Path(job) / bench_jobs.LOG_FILE
        where = f"log {log}" if log.is_file() else "no log: it ran in this process, see the output above"
        warmup = group[0]["error"].startswith("its warm-up failed")
        parts.append(f"{job} ({f'the warm-up of {len(group)} runs; ' if warmup else ''}{where})")
    return (f"{len(failed)} of {len(runs)} runs failed, left out of the report: {'; '.join(parts)}; "
            "rerun the same command to retry only these")


def setup_line(jobs_plan: dict[str, Any], env_list: Sequence[str], seeds: Sequence[int], wall_s: float,
               axes: dict[str, list[Any]] | None = None) -> str:
    """The report's set-up sentence: agents (or arms and their axes), seeds, environments with
    iterations, budget, wall clock."""
    runs, token_budget = jobs_plan["runs"], jobs_plan["token_budget"]
    c = runs[0]["config"]
    per_env = ", ".join(f"`{env}` {next(r['config'].iterations for r in runs if r['env'] == env)} iterations"
                        for env in env_list)
    agents = list(dict.fromkeys(r["agent"] for r in runs))
    compared = f"{len(agents)} agents"
    if axes:
        specs = list(dict.fromkeys(r["config"].agent for r in runs))
        crossed = "".join(f" x {name} {values}" for name, values in axes.items())
        compared = f"{len(agents)} arms ({len(specs)} agents{crossed}, labelled {_label_scheme(axes)})"
    return (f"{compared} x {len(env_list)} environments x {len(seeds)} seeds (seeds {list(seeds)}); "
            f"each iteration {c.rollout_batch_size} episodes ({c.prompts_per_iteration} prompts x "
            f"{c.n_samples_per_prompt}) of at most {c.max_new_tokens} tokens a turn; {per_env} ("
            + (f"a budget of {token_budget} generated tokens per run at most-length episodes" if token_budget
               else "iterations as set") + f"); {c.eval_size} held-out prompts; "
            f"wall clock {wall_s / 60:.1f} min ({_run_minutes(jobs_plan)} of runs and warm-ups, one core each).")


def what_ran(runs: Sequence[dict[str, Any]]) -> str:
    """The report's sentence on the generation engine and precision its runs ran with: one for all
    (a fair comparison), or each with its count (runs of different engines or precisions can
    differ in their greedy text: docs/generation.md, "Comparing engines")."""
    kinds: dict[str, int] = {}
    for r in runs:
        if not r.get("error"):
            key = f"`{r.get('engine') or 'unrecorded'}` in {r.get('precision') or 'unrecorded precision'}"
            kinds[key] = kinds.get(key, 0) + 1
    if not kinds:
        return ""
    if len(kinds) == 1:
        return f"Generation engine {next(iter(kinds))} in every run."
    listed = ", ".join(f"{k} ({n} runs)" for k, n in kinds.items())
    return (f"**The runs differ in generation engine or precision**: {listed}; greedy text can differ between "
            "them, so compare runs of one engine and precision.")


def _label_scheme(axes: dict[str, list[Any]]) -> str:
    """How the arms of ``axes`` are named, e.g. ``AGENT@K<max_staleness>+<rollout_correction>``."""
    return "`AGENT" + ("@K<max_staleness>" if "max_staleness" in axes else "") + (
        "+<rollout_correction>" if "rollout_correction" in axes else "") + "`"


def _run_minutes(jobs_plan: dict[str, Any]) -> str:
    """The summed wall clock of the jobs' records (reused jobs included), e.g. ``"12.3 min"``."""
    total = 0.0
    for job in jobs_plan["warmups"] + jobs_plan["runs"]:
        try:
            total += bench_jobs.read_record(job["folder"]).get("wall_s") or 0.0
        except (OSError, ValueError):
            continue
    return f"{total / 60:.1f} min"


def _report(runs: list[dict[str, Any]], arms: Sequence[Arm], env_list: Sequence[str],
            env_info: dict[str, dict[str, Any]], seeds: Sequence[int], jobs_plan: dict[str, Any],
            skipped: dict[str, str], output_dir: Path, reps: int, elapsed: float, log: Any,
            axes: dict[str, list[Any]] | None = None) -> dict[str, Any]:
    """Normalise, compare (arms as agents), write ``report.md``, the plots and ``results.json``."""
    labels = [arm.label for arm in arms]
    normalised = bench_report.normalised_scores(runs, labels, env_list, seeds,
                                                {e: i["max_reward"] for e, i in env_info.items()})
    report = bench_report.compare_scores(normalised, reps=reps)
    plots = bench_report.write_plots(runs, env_list, report, output_dir)
    wall_clock = bench_report.wall_clock_table(runs, labels, _baselines(arms, axes)) if axes else None
    setup = f"{setup_line(jobs_plan, env_list, seeds, elapsed, axes)} {what_ran(runs)}"
    text = bench_report.markdown(setup, runs, env_list, normalised,
                                 report, skipped, [p.name for p in plots], wall_clock=wall_clock)
    (output_dir / "report.md").write_text(text)
    files = [output_dir / "report.md", *plots, output_dir / "results.json"]
    columns = bench_report.ARM_COLUMNS if axes else bench_report.COLUMNS
    result = {
        "agents": [{"agent": arm.label, "spec": arm.agent, **arm.overrides()} for arm in arms],
        "tables": {env: bench_report.aggregate([r for r in runs if r["env"] == env], columns) for env in env_list},
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


def _baselines(arms: Sequence[Arm], axes: dict[str, list[Any]]) -> dict[str, str | None] | None:
    """With the staleness axis, ``{arm: the arm of the same agent and correction at K=0, or None
    when K=0 is not compared}`` (what its speed-up is against); None without that axis."""
    if "max_staleness" not in axes:
        return None
    labels = {arm.label for arm in arms}
    synchronous = {arm.label: Arm(arm.agent, 0, arm.rollout_correction).label for arm in arms}
    return {label: base if base in labels else None for label, base in synchronous.items()}


# -- command line --------------------------------------------------------------------------------


def _seeds(text: str) -> list[int]:
    """The integers of a comma-separated option (``--seeds``, ``--max-staleness``)."""
    try:
        return [int(x) for x in comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``textrl bench`` options, plus every ``textrl train`` option applied to all runs
    (``--agent``, ``--seed`` and ``--env`` are the comparison's own: use ``--agents``, ``--seeds``,
    ``--envs``)."""
    from textrl.config import add_config_arguments

    d = DEFAULT_BENCH
    parser.add_argument("--agents", type=comma_list, default=None,
                        help=f"comma-separated agents: registered names, path/to/file.py:Class, or 'all' "
                             f"(default: {d['agents']})")
    parser.add_argument("--envs", type=comma_list, default=None,
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
    _axes_options(parser)


AXIS_HELP = {
    "max_staleness": ("K,K", _seeds,
                      "comma-separated max_staleness values to compare (0: synchronous): each an arm of "
                      "every agent, labelled AGENT@K<k> (grpo@K1), its runs in runs/<env>/AGENT@K<k>/ "
                      "(default: 0; no axis, every run synchronous and labelled by its agent)"),
    "rollout_correction": ("KIND,KIND", comma_list,
                           "comma-separated rollout corrections to compare (none, tis, mis, geo_mean, icepop): "
                           "each an arm of every agent, labelled AGENT+KIND (grpo+tis; with --max-staleness "
                           "grpo@K1+tis); an arm its agent cannot run is refused, or skipped with --agents all "
                           "(default: 'none'; no axis, every run uncorrected and labelled by its agent)"),
}
"""The ``textrl train`` options that ``textrl bench`` makes axes: metavar, type, help."""


def _axes_options(parser: argparse.ArgumentParser) -> None:
    """``--max-staleness`` and ``--rollout-correction`` take comma lists: the arms' axes
    (:data:`AXIS_HELP`) instead of one value for every run."""
    for action in parser._actions:
        if action.dest in AXIS_HELP:
            action.metavar, action.type, action.help = AXIS_HELP[action.dest]


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
        parent = os.environ.get(bench_jobs.PARENT_ENV)
        if parent:
            bench_jobs.die_with_parent(int(parent))
        execute_job(Path(args.worker))
        return 0
    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    output_dir = overrides.pop("output_dir", BENCH_OUTPUT_DIR)
    overrides.pop("progress", None)
    staleness, corrections = (overrides.pop(name, None) for name in AXES)
    try:
        for name in ("agent", "seed"):
            if name in overrides:
                raise ValueError(f"--{name} is set per run by the comparison; use --{name}s")
        if args.jobs is not None and args.jobs < 1:
            raise ValueError(f"--jobs {args.jobs}: give at least 1")
        result = compare_agents(args.agents, args.seeds, output_dir, envs=args.envs, staleness=staleness,
                                corrections=corrections, token_budget=args.token_budget, jobs=args.jobs,
                                isolate=not args.in_process, threads=args.threads or None,
                                warm_start_policy=not args.no_warm_start, fresh=args.fresh, reps=args.reps,
                                **overrides)
    except ValueError as err:
        print(f"textrl bench: {err}", file=sys.stderr)
        return 2
    if result["failed"]:
        print(f"textrl bench: {result['failed']}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    import textrl.bench  # the package: its docstring is the command's description

    parser = argparse.ArgumentParser(prog="textrl bench", description=textrl.bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
