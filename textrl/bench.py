"""Agent comparison: several agents x seeds on one task, reward, prompt split and token budget.

:func:`compare_agents` trains every (agent, seed) pair with :func:`textrl.trainer.train` (each in
its own subprocess by default, so that its peak memory is its own), reads each run's
``metrics.jsonl`` and ``summary.json``, and writes to ``output_dir``:

- ``results.md``: one row per agent, mean +- std over seeds of the final held-out reward (sampled,
  and its change from the start), held-out accuracy, KL to the reference, response length,
  seconds per iteration, generated tokens per second and peak memory (RSS high-water);
- ``reward_vs_iteration.png`` and ``reward_vs_time.png``: the rollout reward (task score, before
  KL shaping) per iteration and against training wall-clock, mean over seeds with a +-1 std band;
- ``results.json``: every run's figures and the aggregates;
- ``runs/<agent>/seed<k>/``: each run's own outputs (``metrics.jsonl``, ``summary.json``, ...).

Fairness: for a seed, every agent starts from the same policy (one supervised format warm-up per
seed, saved under ``warmup/seed<k>/`` and loaded by every agent's run), sees the same prompt
split and reward, and samples the same number of responses per iteration of at most
``max_new_tokens`` tokens for the same number of iterations: the same budget of generated tokens
(``iterations x rollout_batch_size x max_new_tokens``; the table also gives the tokens actually
generated, which differ with response length). An agent is a registered name (by default every
registered agent runs) or ``path/to/file.py:Class`` (passed as given to each run's subprocess);
agents that resolve to nothing (or are rejected by :meth:`TrainConfig.validate` with the common
settings) are skipped with a note; a run that fails is reported in the table, and the other runs go on.

Command line (``textrl bench`` wires :func:`add_arguments` and :func:`run`)::

    python -m textrl.bench --agents gae_ppo,one_step_ppo --seeds 0,1,2 --iterations 40
    python -m textrl.bench --agents gae_ppo,my_agent.py:MyAgent --seeds 0
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from textrl.config import TrainConfig

DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_SETTINGS: dict[str, Any] = {"iterations": 40, "eval_every": 10}
"""Overrides of the embedded default (``TrainConfig()``) for a run that fits ~10 min on 2 CPU cores."""
RUN_RECORD = "bench_run.json"
"""What a run's process writes next to its outputs: wall-clock seconds and peak RSS."""


# -- one run -------------------------------------------------------------------------------------


def peak_rss_mib() -> float:
    """This process's resident-set high-water mark in MiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _train_and_record(config: TrainConfig, threads: int | None = None) -> dict[str, float]:
    """Train in this process (with ``threads`` torch threads); write and return ``{"wall_s", "peak_rss_mib"}``."""
    import torch

    from textrl.trainer import train

    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    start = time.perf_counter()
    try:
        train(config)
    finally:
        torch.set_num_threads(previous)
    record = {"wall_s": time.perf_counter() - start, "peak_rss_mib": peak_rss_mib()}
    (Path(config.output_dir) / RUN_RECORD).write_text(json.dumps(record))
    return record


def run_training(config: TrainConfig, isolate: bool = True, threads: int | None = None) -> dict[str, Any]:
    """Train one run; return ``{"wall_s", "peak_rss_mib", "error"}`` (error None on success).

    ``isolate``: in a fresh ``python -m textrl.bench --worker`` process (peak memory is the run's
    own); otherwise in this process (peak memory is this process's high-water mark so far).
    The run's folder is emptied first; its console output goes to ``bench_log.txt`` there.
    ``threads``: torch intra-op threads of the run (None: torch's default, one per core).
    """
    out = Path(config.output_dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if not isolate:
        try:
            return {**_train_and_record(config, threads), "error": None}
        except Exception as err:  # noqa: BLE001 - reported in the table, the other runs go on
            return {"wall_s": math.nan, "peak_rss_mib": math.nan, "error": f"{type(err).__name__}: {err}"}
    config_path = out / "bench_config.json"
    config_path.write_text(json.dumps({"config": config.to_dict(), "threads": threads}))
    with (out / "bench_log.txt").open("w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "textrl.bench", "--worker", str(config_path)],
            stdout=log, stderr=subprocess.STDOUT, check=False,
        )
    record_path = out / RUN_RECORD
    if proc.returncode != 0 or not record_path.is_file():
        lines = (out / "bench_log.txt").read_text(errors="replace").strip().splitlines()
        return {"wall_s": math.nan, "peak_rss_mib": math.nan,
                "error": f"exit {proc.returncode}: {lines[-1] if lines else 'no output'} (see {out / 'bench_log.txt'})"}
    return {**json.loads(record_path.read_text()), "error": None}


def read_run(output_dir: str | Path) -> dict[str, Any]:
    """A finished run's figures from its ``metrics.jsonl`` and ``summary.json``.

    Scalars: ``reward`` / ``accuracy`` / ``response_length`` (held-out, sampled, at the end),
    ``reward_start`` (held-out before training), ``kl`` (``kl/before_update`` of the last
    iteration), ``seconds_per_iteration`` (median, evaluation time excluded), ``tokens_per_second``
    and ``tokens`` (generated, in total). Curves: ``iterations``, ``train_reward`` (the rollout's
    task score per iteration) and ``elapsed_s`` (cumulative training seconds, evaluations included).
    """
    out = Path(output_dir)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{out / 'metrics.jsonl'} is empty: the run logged no iteration")
    summary = json.loads((out / "summary.json").read_text())
    after, before = summary.get("after") or {}, summary.get("before") or {}
    nan = math.nan
    train_s = [r["time/iteration_s"] - r.get("time/eval_s", 0.0) for r in rows]
    elapsed, total = [], 0.0
    for r in rows:
        total += r["time/iteration_s"]
        elapsed.append(total)
    return {
        "reward": after.get("eval/sampled/reward/mean", nan),
        "reward_start": before.get("eval/sampled/reward/mean", nan),
        "accuracy": after.get("eval/sampled/accuracy", nan),
        "response_length": after.get("eval/sampled/response_length/mean", nan),
        "kl": rows[-1].get("kl/before_update", nan),
        "seconds_per_iteration": statistics.median(train_s),
        "tokens_per_second": sum(r["tokens"] for r in rows) / sum(train_s),
        "tokens": sum(r["tokens"] for r in rows),
        "iterations": [r["iteration"] for r in rows],
        "train_reward": [r["reward/mean"] for r in rows],
        "elapsed_s": elapsed,
    }


# -- set-up --------------------------------------------------------------------------------------


def default_agents() -> list[str]:
    """Agents compared by default: every registered one (:func:`textrl.agents.agent_names`)."""
    from textrl.agents import agent_names

    return agent_names()


def available_agents(names: Sequence[str], settings: dict[str, Any] | None = None) -> tuple[list[str], dict[str, str]]:
    """``(agents that can run, {skipped agent: why})``: each a registered name or ``file.py:Class``
    that resolves (:func:`textrl.agents.agent_class`) and is valid (:meth:`TrainConfig.validate`)
    with ``settings`` (TrainConfig fields). A file spec comes back with its file's absolute path, so
    that a run's subprocess finds it."""
    from textrl.agent_registry import absolute_spec

    ok, skipped = [], {}
    for name in names:
        try:
            spec = absolute_spec(name)
            TrainConfig(**{**(settings or {}), "agent": spec}).validate()
        except ValueError as err:
            skipped[name] = str(err)
            continue
        ok.append(spec)
    return ok, skipped


def run_label(agent: str) -> str:
    """An agent's name in tables, plots and folders: its registered name, or the class of a spec."""
    return agent.rpartition(":")[2]


def warm_start(config: TrainConfig, folder: Path, log: Any = print, threads: int | None = None) -> str:
    """The trainer's supervised format warm-up for ``config.seed``, saved once to ``folder``.

    Every agent of that seed then loads this policy (``model=folder``, ``warmup_sft_steps=0``),
    so all start from the same weights, multi_adapter_ppo included (it skips the warm-up itself).
    """
    import torch

    from textrl.agents import PPOAgent
    from textrl.run import resolve_device, seed_everything

    seed_everything(config.seed)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        tokenizer = PPOAgent.load_tokenizer(config)
        policy = PPOAgent.load_policy(config, tokenizer, resolve_device(config.device), log)
    finally:
        torch.set_num_threads(previous)
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def run_configs(
    agents: Sequence[str], seeds: Sequence[int], output_dir: Path, settings: dict[str, Any]
) -> list[TrainConfig]:
    """One validated config per (agent, seed): the same settings, its own output folder."""
    base = run_settings(settings)
    return [
        TrainConfig(**{**base, "agent": agent, "seed": seed,
                       "output_dir": str(output_dir / "runs" / run_label(agent) / f"seed{seed}")}).validate()
        for agent in agents for seed in seeds
    ]


def run_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The TrainConfig fields every run gets: :data:`DEFAULT_SETTINGS`, no progress bar, one
    checkpoint at the end, then ``settings``. Unknown names are an error naming them."""
    unknown = sorted(set(settings) - {f.name for f in fields(TrainConfig)})
    if unknown:
        raise ValueError(f"unknown TrainConfig field(s) {unknown}; see `textrl train --help`")
    return {**DEFAULT_SETTINGS, "checkpoint_every": 0, "keep_checkpoints": 1, **settings, "progress": False}


# -- report --------------------------------------------------------------------------------------

COLUMNS = (
    ("reward", "held-out reward", ".3f"),
    ("reward_change", "change from start", "+.3f"),
    ("accuracy", "held-out accuracy", ".3f"),
    ("kl", "KL to reference", ".2g"),
    ("response_length", "response length", ".1f"),
    ("seconds_per_iteration", "s / iteration", ".3f"),
    ("tokens_per_second", "tokens / s", ".0f"),
    ("peak_rss_mib", "peak RSS (MiB)", ".0f"),
)
"""(key, column title, format of mean and std) of the table."""


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (0 for one value) of the finite values; NaN when none is finite."""
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per agent (in run order): ``{"agent", "seeds", "failed", key: (mean, std) for COLUMNS}``."""
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        row = out.setdefault(run["agent"], {"agent": run["agent"], "runs": [], "errors": []})
        (row["errors"] if run["error"] else row["runs"]).append(run)
    for row in out.values():
        good = row.pop("runs")
        row["seeds"] = len(good)
        row["tokens"] = mean_std([r["tokens"] for r in good])
        for key, _, _ in COLUMNS:
            row[key] = mean_std([r.get(key, math.nan) for r in good])
        row["errors"] = [f"seed {r['seed']}: {r['error']}" for r in row["errors"]]
    return list(out.values())


def _cell(value: tuple[float, float], spec: str) -> str:
    mean, std = value
    return "-" if math.isnan(mean) else f"{mean:{spec}} ± {std:{spec.lstrip('+')}}"


def markdown_table(rows: list[dict[str, Any]], skipped: dict[str, str] | None = None) -> str:
    """The results table (mean ± std over seeds), a row per agent; failed and skipped agents noted."""
    head = ["agent", "seeds", *(title for _, title, _ in COLUMNS), "tokens generated"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [f"`{row['agent']}`", str(row["seeds"])]
        cells += [_cell(row[key], spec) for key, _, spec in COLUMNS]
        cells.append(_cell(row["tokens"], ".0f"))
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- `{row['agent']}` failed: {err}" for row in rows for err in row["errors"]]
    notes += [f"- `{name}` skipped: {why}" for name, why in (skipped or {}).items()]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def plot_curves(runs: list[dict[str, Any]], output_dir: Path) -> list[Path]:
    """``reward_vs_iteration.png`` and ``reward_vs_time.png``: mean over seeds, +-1 std band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    by_agent: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        if not run["error"]:
            by_agent.setdefault(run["agent"], []).append(run)
    paths = []
    for x_key, name, label in (("iterations", "reward_vs_iteration.png", "iteration"),
                               ("elapsed_s", "reward_vs_time.png", "training wall-clock (s)")):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for agent, group in by_agent.items():
            n = min(len(r["train_reward"]) for r in group)
            if x_key == "iterations":
                x = np.asarray(group[0]["iterations"][:n], dtype=float)
                ys = np.array([r["train_reward"][:n] for r in group])
            else:  # seeds run at different speeds: interpolate onto a common time grid
                x = np.linspace(max(r["elapsed_s"][0] for r in group), min(r["elapsed_s"][n - 1] for r in group), 100)
                ys = np.array([np.interp(x, r["elapsed_s"][:n], r["train_reward"][:n]) for r in group])
            mean, std = ys.mean(0), ys.std(0)
            (line,) = ax.plot(x, mean, label=f"{agent} ({len(group)} seeds)")
            ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2)
        ax.set_xlabel(label)
        ax.set_ylabel("rollout reward (task score)")
        if by_agent:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = output_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


# -- the comparison ------------------------------------------------------------------------------


def compare_agents(
    agents: Sequence[str] | None = None,
    seeds: Sequence[int] = DEFAULT_SEEDS,
    output_dir: str | Path = "runs/bench",
    *,
    token_budget: int | None = None,
    isolate: bool = True,
    threads: int | None = 1,
    warm_start_policy: bool = True,
    log: Any = print,
    **settings: Any,
) -> dict[str, Any]:
    """Train each agent with each seed on the same set-up; write the table and plots.

    Args:
        agents: registered agent names or ``file.py:Class`` specs (default: every registered
            agent, keeping those that run with ``settings``).
        seeds: seeds; each agent runs once per seed.
        output_dir: where everything goes (see the module docstring); runs are overwritten.
        token_budget: generated tokens per run; sets ``iterations`` to
            ``ceil(token_budget / (rollout_batch_size * max_new_tokens))`` (default: the
            ``iterations`` setting, 40 unless given).
        isolate: one subprocess per run (its own peak memory); False trains in this process.
        threads: torch threads per run (None: torch's default, one per core). 1 by default: on a
            CPU shared with other jobs, OpenMP threads competing for busy cores slow a run down
            many times over; on an idle 2-core machine, None is ~1.5x faster with the tiny model.
        warm_start_policy: one shared warm-up per seed (see :func:`warm_start`); False lets each
            run warm up itself (multi_adapter_ppo then starts unwarmed).
        log: progress messages (``print``; ``lambda *a: None`` for silence).
        **settings: :class:`TrainConfig` fields for every run (e.g. ``iterations=40``,
            ``prompts_per_iteration=16``, ``reward="think_format,tag_count"``).

    Returns ``{"agents": aggregates, "runs": per-run figures, "skipped": {name: why},
    "table": markdown, "files": [paths], "wall_s": seconds}``.
    """
    start = time.perf_counter()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    wanted = list(agents) if agents is not None else default_agents()
    names, skipped = available_agents(wanted, run_settings(settings))
    for name, why in skipped.items():
        log(f"skipping {name}: {why}")
    if not names:
        raise ValueError(f"none of the agents {wanted} can run here: {skipped}")
    if not seeds:
        raise ValueError("seeds is empty; give at least one seed")
    if token_budget is not None:
        probe = TrainConfig(**{k: v for k, v in settings.items() if k != "iterations"})
        settings["iterations"] = max(1, math.ceil(token_budget / (probe.rollout_batch_size * probe.max_new_tokens)))
    configs = run_configs(names, seeds, output_dir, settings)
    warm: dict[int, str] = {}
    runs = []
    for i, config in enumerate(configs, 1):
        if warm_start_policy and config.seed not in warm:
            log(f"warm-up for seed {config.seed}")
            folder = output_dir / "warmup" / f"seed{config.seed}"
            shutil.rmtree(folder, ignore_errors=True)
            warm[config.seed] = warm_start(config, folder, log, threads)
        if warm_start_policy:
            config = replace(config, model=warm[config.seed], warmup_sft_steps=0)
        log(f"[{i}/{len(configs)}] {config.agent} seed {config.seed}: {config.iterations} iterations")
        record = run_training(config, isolate=isolate, threads=threads)
        run = {"agent": run_label(config.agent), "seed": config.seed, "output_dir": config.output_dir, **record}
        if not run["error"]:
            try:
                figures = read_run(config.output_dir)
            except (OSError, ValueError, KeyError) as err:  # e.g. a run stopped before its first iteration
                run["error"] = f"unreadable outputs: {type(err).__name__}: {err}"
            else:
                run.update(figures, reward_change=figures["reward"] - figures["reward_start"])
        if run["error"]:
            log(f"  failed: {run['error']}")
        runs.append(run)

    rows = aggregate(runs)
    c = configs[0]
    budget = c.iterations * c.rollout_batch_size * c.max_new_tokens
    table = (
        f"{len(seeds)} seeds per agent; each run: {c.iterations} iterations x {c.rollout_batch_size} responses "
        f"({c.prompts_per_iteration} prompts x {c.n_samples_per_prompt}) of at most {c.max_new_tokens} tokens "
        f"a turn = a budget of {budget} generated tokens a turn; {_task(c)}, "
        f"{c.eval_size} held-out prompts.\n\n" + markdown_table(rows, skipped)
    )
    (output_dir / "results.md").write_text(table)
    files = [output_dir / "results.md", *plot_curves(runs, output_dir), output_dir / "results.json"]
    wall_s = time.perf_counter() - start
    result = {"agents": rows, "runs": runs, "skipped": skipped, "table": table,
              "files": [str(p) for p in files], "wall_s": wall_s}
    (output_dir / "results.json").write_text(json.dumps(result, indent=1, default=str))
    log(table)
    log(f"wrote {', '.join(str(p) for p in files)} in {wall_s:.0f} s")
    return result


def _task(config: TrainConfig) -> str:
    """The task of the runs, for the table: the environment (or dataset) and the reward."""
    task = f"environment {config.env}" if config.env else f"dataset {config.dataset or 'builtin:digits'}"
    return f"{task}, reward {config.reward or 'its own'}"


# -- command line --------------------------------------------------------------------------------


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``textrl bench`` options, plus every ``textrl train`` option (``--iterations 40``, ...)
    applied to all runs (``--agent`` and ``--seed`` are the comparison's own: use ``--agents``,
    ``--seeds``)."""
    from textrl.config import add_config_arguments

    parser.add_argument("--agents", type=_names, default=None,
                        help="comma-separated agents: registered names or path/to/file.py:Class "
                             "(default: every registered agent that runs with the given options)")
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in _names(s)], default=list(DEFAULT_SEEDS),
                        help="comma-separated seeds (default: 0,1,2)")
    parser.add_argument("--token-budget", type=int, default=None,
                        help="generated tokens per run; sets --iterations from the rollout size")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per run (default 1; 0: torch's default, one per core)")
    parser.add_argument("--in-process", action="store_true",
                        help="train in this process instead of one subprocess per run (peak memory is then shared)")
    parser.add_argument("--no-warm-start", action="store_true",
                        help="let every run do its own warm-up instead of one shared warm-up per seed")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    add_config_arguments(parser)  # --output-dir among them: the comparison's folder (default runs/bench)


def run(args: argparse.Namespace) -> int:
    """Run the comparison (or, with ``--worker``, one run of it) from parsed arguments; exit status."""
    if args.worker:
        job = json.loads(Path(args.worker).read_text())
        _train_and_record(TrainConfig(**job["config"]), job["threads"])
        return 0
    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    output_dir = overrides.pop("output_dir", "runs/bench")
    overrides.pop("progress", None)
    try:
        for name in ("agent", "seed"):
            if name in overrides:
                raise ValueError(f"--{name} is set per run by the comparison; use --{name}s")
        compare_agents(args.agents, args.seeds, output_dir, token_budget=args.token_budget,
                       isolate=not args.in_process, threads=args.threads or None, warm_start_policy=not args.no_warm_start,
                       **overrides)
    except ValueError as err:
        print(f"textrl bench: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="textrl bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
