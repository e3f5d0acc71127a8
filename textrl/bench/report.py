"""The statistics, report and plots of ``textrl bench``, from run records (no training here).

A *run record* is a dict with at least ``agent``, ``env``, ``seed``, ``error`` (None for a finished
run) and, when finished, ``reward`` (held-out sampled reward at the end), ``reward_start`` (the
same for the shared warmed-up policy of its (env, seed)) and the curves of
:func:`textrl.bench.jobs.read_run` (``iterations``, ``train_reward``, ``tokens_so_far``).

Normalisation (:func:`normalised_scores`): a run's score is the share of the gap it closed,
``(reward - reward_start) / (high - reward_start)``: 0 = no progress over its warmed-up start,
1 = the environment's ``max_reward``, negative = it got worse. An environment without a known
``max_reward`` (or run with a ``--reward`` other than its own) takes as ``high`` the best final
held-out reward any agent reached on it (so 1 = "as good as the best run seen", a relative
score). An environment where ``high`` does not exceed some seed's start has no gap to close and is
left out of the statistics with a note. The statistics are :func:`textrl.bench.stats.compare` over the
agents' ``[seeds, environments]`` arrays; an agent's seed that failed on any environment is left
out of that agent's array (noted).
"""

from __future__ import annotations

import math
import statistics as pystats
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from textrl.bench import stats

# -- normalisation -------------------------------------------------------------------------------


def normalised_score(reward: float, start: float, high: float) -> float:
    """Share of the gap ``high - start`` closed: ``(reward - start) / (high - start)``.

    ``ValueError`` when ``high`` does not exceed ``start`` (no gap to close)."""
    if not high > start:
        raise ValueError(f"high={high!r} does not exceed start={start!r}: there is no gap to normalise by")
    return (reward - start) / (high - start)


def reference_highs(runs: Sequence[dict[str, Any]], envs: Sequence[str],
                    max_rewards: Mapping[str, float | None]) -> dict[str, tuple[float, str]]:
    """Per environment ``(high, source)``: its ``max_reward`` (source ``"max_reward"``), else the
    best final reward of a finished run on it (``"best run"``); NaN when it has neither."""
    highs = {}
    for env in envs:
        known = max_rewards.get(env)
        if known is not None:
            highs[env] = (float(known), "max_reward")
            continue
        finals = [r["reward"] for r in runs if r["env"] == env and not r["error"] and math.isfinite(r["reward"])]
        highs[env] = (max(finals) if finals else math.nan, "best run")
    return highs


def normalised_scores(
    runs: Sequence[dict[str, Any]], agents: Sequence[str], envs: Sequence[str], seeds: Sequence[int],
    max_rewards: Mapping[str, float | None],
) -> dict[str, Any]:
    """The statistics' input: ``{"scores": {agent: [seeds_kept, envs_kept] array}, "envs": kept,
    "seeds": {agent: seeds kept}, "highs": {env: (high, source)}, "notes": [str]}``.

    Each finished run gets ``run["normalised"]`` (in place). Environments without a gap for some
    seed and agents' seeds with a failed run are left out, each with a note."""
    highs = reference_highs(runs, envs, max_rewards)
    by_key = {(r["agent"], r["env"], r["seed"]): r for r in runs}
    notes, kept_envs = start_disagreements(runs), []
    for env in envs:
        high = highs[env][0]
        starts = [r["reward_start"] for r in runs if r["env"] == env and not r["error"]]
        if not starts or not all(math.isfinite(s) and high > s for s in starts):
            notes.append(f"`{env}` is left out of the statistics: no finished run, or its reference high "
                         f"({high:.3f}, {highs[env][1]}) does not exceed a seed's start")
            continue
        kept_envs.append(env)
        for r in runs:
            if r["env"] == env and not r["error"]:
                r["normalised"] = normalised_score(r["reward"], r["reward_start"], high)
    scores, kept_seeds = {}, {}
    for agent in agents:
        good = [s for s in seeds if all((agent, e, s) in by_key and not by_key[(agent, e, s)]["error"]
                                        for e in kept_envs)]
        if len(good) < len(seeds):
            notes.append(f"`{agent}`: seed(s) {sorted(set(seeds) - set(good))} left out (a run failed or is missing)")
        if good and kept_envs:
            scores[agent] = np.array([[by_key[(agent, e, s)]["normalised"] for e in kept_envs] for s in good])
            kept_seeds[agent] = good
    return {"scores": scores, "envs": kept_envs, "seeds": kept_seeds, "highs": highs, "notes": notes}


def start_disagreements(runs: Sequence[dict[str, Any]], tolerance: float = 1e-9) -> list[str]:
    """A note per (env, seed) whose finished runs measured different start rewards (they all load
    the same warmed-up policy and held-out split, so they should agree)."""
    starts: dict[tuple[str, int], list[float]] = {}
    for r in runs:
        if not r["error"]:
            starts.setdefault((r["env"], r["seed"]), []).append(r["reward_start"])
    return [f"`{env}` seed {seed}: its runs measured different start rewards {sorted(set(values))}; each run "
            "is normalised by its own" for (env, seed), values in starts.items()
            if max(values) - min(values) > tolerance]


def profile_taus(scores: Mapping[str, Any], step: float = 0.05, most: int = 201) -> list[float]:
    """Thresholds of the performance profiles that span every score: from a step below the lowest
    (at most 0) to the highest (at least 1), ``step`` apart (wider when that would exceed ``most``
    points). With scores all below 0, the profiles still fall from 1 to 0 where they can be seen."""
    values = np.concatenate([np.asarray(a, dtype=float).ravel() for a in scores.values()]) if scores else np.zeros(1)
    values = values[np.isfinite(values)]
    low = min(0.0, math.floor(values.min() / step) * step - step) if values.size else 0.0
    high = max(1.0, math.ceil(values.max() / step) * step) if values.size else 1.0
    count = min(most, round((high - low) / step) + 1)
    return np.round(np.linspace(low, high, count), 4).tolist()


def compare_scores(normalised: dict[str, Any], reps: int = 2000, seed: int = 0) -> dict[str, Any] | None:
    """:func:`textrl.bench.stats.compare` of :func:`normalised_scores`'s arrays, its profiles at
    :func:`profile_taus` (None when no agent or environment is left)."""
    if not normalised["scores"] or not normalised["envs"]:
        return None
    return stats.compare(normalised["scores"], task_names=normalised["envs"], reps=reps, seed=seed,
                         taus=profile_taus(normalised["scores"]))


# -- the report's text ---------------------------------------------------------------------------


def significance_summary(report: dict[str, Any]) -> list[str]:
    """Plain-words lines: which pairs differ significantly, which do not (from ``report["pairs"]``)."""
    better = [p for p in report["pairs"] if p["verdict"].endswith(" better")]
    others = [p for p in report["pairs"] if not p["verdict"].endswith(" better")]
    level = f"{round(100 * report['confidence'])}%"
    lines = []
    for p in better:
        winner = p["verdict"].removesuffix(" better")
        loser = p["y"] if winner == p["x"] else p["x"]
        lines.append(f"- **Significant**: `{winner}` beats `{loser}` ({p['reason']}, {level} intervals).")
    for p in others:
        if p["verdict"] == "not enough runs":
            lines.append(f"- Not enough runs: `{p['x']}` vs `{p['y']}` ({p['reason']}).")
            continue
        why = {"not distinguishable": p["reason"],
               "conflicting": "the two criteria disagree",
               "no interval (one run)": "one seed gives no interval; run more seeds"}.get(p["verdict"], p["verdict"])
        lines.append(f"- Not significant: `{p['x']}` vs `{p['y']}` ({why}).")
    if not report["pairs"]:
        lines.append("- One agent only: nothing to compare.")
    elif any(p["verdict"] in ("not enough runs", "no interval (one run)") for p in report["pairs"]):
        runs = sorted(set(report["runs"].values()))
        lines.append(f"- A verdict needs {report['seeds_needed']} seeds a side on {len(report['tasks'])} "
                     f"environment(s) (the exact rank test's smallest p-value must reach "
                     f"{1 - report['confidence']:.2g}); these have {runs[0] if len(runs) == 1 else f'{runs[0]} to {runs[-1]}'}. "
                     "Their bootstrap intervals resample those few runs: narrow ones are not certainty.")
    return lines


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (0 for one value) of the finite values; NaN when none is finite."""
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    return pystats.fmean(finite), pystats.stdev(finite) if len(finite) > 1 else 0.0


COLUMNS = (
    ("normalised", "normalised score", "+.3f"),
    ("reward", "held-out reward", ".3f"),
    ("reward_change", "change from start", "+.3f"),
    ("accuracy", "held-out accuracy", ".3f"),
    ("kl", "KL to reference", ".2g"),
    ("response_length", "response length", ".1f"),
    ("seconds_per_iteration", "s / iteration", ".3f"),
    ("tokens_per_second", "tokens / s", ".0f"),
    ("perf_tokens_per_s", "`perf/tokens_per_s`", ".0f"),
    ("padding_fraction", "`perf/padding_fraction`", ".2f"),
    ("peak_rss_mib", "peak RSS (MiB)", ".0f"),
    ("tokens", "tokens generated", ".0f"),
)
"""(key, column title, format of mean and std) of the raw table. ``tokens / s``: generated tokens a
training second; ``perf/tokens_per_s``: prompt and response tokens a second and process (the median
iteration's); ``perf/padding_fraction``: the share of the rollout's padded batch that is padding
(:func:`textrl.bench.jobs.read_run`); ``-`` where a run did not log it."""
WALL_COLUMN = ("train_s", "training s", ".2f")
"""The raw table's column of a run's training seconds (the sum of its iterations'
``time/iteration_s``), shown when arms cross the agents with ``max_staleness`` or
``rollout_correction`` (:data:`ARM_COLUMNS`), so each arm's wall clock can be read off."""
ARM_COLUMNS = (*COLUMNS[:7], WALL_COLUMN, *COLUMNS[7:])
"""The raw table's columns for arms: :data:`COLUMNS` with :data:`WALL_COLUMN` after the speeds."""


REWARD_WALL_COLUMNS = (("reward_s", "reward wait s"), ("reward_calls_s", "reward calls s"))
"""The wall-clock table's reward columns (a run's sums of ``time/reward_s``, the seconds its loop waited
for rewards, and ``time/reward_calls_s``, the seconds an async or ``does_io`` reward's background calls
ran), each shown when a finished run logged it."""


def aggregate(runs: Sequence[dict[str, Any]],
              columns: Sequence[tuple[str, str, str]] = COLUMNS) -> list[dict[str, Any]]:
    """Per agent or arm (in run order): ``{"agent", "seeds", "errors", key: (mean, std) for columns}``."""
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        row = out.setdefault(run["agent"], {"agent": run["agent"], "runs": [], "errors": []})
        (row["errors"] if run["error"] else row["runs"]).append(run)
    for row in out.values():
        good = row.pop("runs")
        row["seeds"] = len(good)
        for key, _, _ in columns:
            row[key] = mean_std([r.get(key, math.nan) for r in good])
        row["errors"] = [f"seed {r['seed']}: {r['error']}" for r in row["errors"]]
    return list(out.values())


def _cell(value: tuple[float, float], spec: str) -> str:
    mean, std = value
    return "-" if math.isnan(mean) else f"{mean:{spec}} ± {std:{spec.lstrip('+')}}"


def markdown_table(rows: list[dict[str, Any]], skipped: Mapping[str, str] | None = None,
                   columns: Sequence[tuple[str, str, str]] = COLUMNS, name: str = "agent") -> str:
    """The raw table (mean ± std over seeds), a row per agent (or arm: ``name``); failed and
    skipped ones noted."""
    head = [name, "seeds", *(title for _, title, _ in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [f"`{row['agent']}`", str(row["seeds"])] + [_cell(row[key], spec) for key, _, spec in columns]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- `{row['agent']}` failed: {err}" for row in rows for err in row["errors"]]
    notes += [f"- `{name}` skipped: {why}" for name, why in (skipped or {}).items()]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def wall_clock_table(runs: Sequence[dict[str, Any]], arms: Sequence[str],
                     baselines: Mapping[str, str | None] | None = None) -> str:
    """Per arm: its finished runs and their training seconds (``train_s``: the sum of the
    iterations' ``time/iteration_s``), mean ± std over every environment and seed; with
    ``baselines`` ({arm: the arm it is timed against, or None}) a speed-up column: the baseline's
    seconds over the arm's, summed over the (env, seed) pairs both finished (``2.00x``: it took
    half the time; ``-`` without a baseline or a common finished pair). Where the runs logged them,
    the seconds the loop waited for rewards and those background reward calls ran
    (:data:`REWARD_WALL_COLUMNS`) follow the training seconds."""
    finished = {(r["agent"], r["env"], r["seed"]): r["train_s"] for r in runs
                if not r["error"] and isinstance(r.get("train_s"), (int, float)) and math.isfinite(r["train_s"])}
    done = [r for r in runs if (r["agent"], r["env"], r["seed"]) in finished]
    rewards = [(key, title) for key, title in REWARD_WALL_COLUMNS
               if any(isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) for r in done)]
    head = ["arm", "runs", "training s", *(t for _, t in rewards), *(["speed-up"] if baselines is not None else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in arms:
        own = {(e, s): v for (a, e, s), v in finished.items() if a == arm}
        cells = [f"`{arm}`", str(len(own)), _cell(mean_std(list(own.values())), WALL_COLUMN[2])]
        cells += [_cell(mean_std([r.get(key, math.nan) for r in done if r["agent"] == arm]), WALL_COLUMN[2])
                  for key, _ in rewards]
        if baselines is not None:
            cells.append(_speed_up(own, {(e, s): v for (a, e, s), v in finished.items() if a == baselines.get(arm)}))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _speed_up(own: Mapping[tuple[str, int], float], base: Mapping[tuple[str, int], float]) -> str:
    """``base``'s seconds over ``own``'s on their common (env, seed) pairs, e.g. ``"1.52x"``; ``"-"`` when none."""
    pairs = sorted(set(own) & set(base))
    spent = sum(own[p] for p in pairs)
    return f"{sum(base[p] for p in pairs) / spent:.2f}x" if pairs and spent > 0 else "-"


def markdown(setup: str, runs: Sequence[dict[str, Any]], envs: Sequence[str], normalised: dict[str, Any],
             report: dict[str, Any] | None, skipped: Mapping[str, str] | None = None,
             plots: Sequence[str] = (), wall_clock: str | None = None) -> str:
    """``report.md``: set-up line, verdicts in words, the statistics, notes, raw tables per env.
    With arms (``wall_clock``: :func:`wall_clock_table`'s table), the wall clock per arm before
    the raw tables, whose rows are arms with :data:`ARM_COLUMNS`."""
    columns, name = (COLUMNS, "agent") if wall_clock is None else (ARM_COLUMNS, "arm")
    parts = ["# textrl bench", "", setup, ""]
    if report is not None:
        parts += ["## Which differences are significant", "", *significance_summary(report), "",
                  stats.markdown_report(report, label=name)]
    else:
        parts += ["No statistics: no environment or agent has a finished run with a gap to close.", ""]
    highs = "; ".join(f"`{e}`: {h:.3f} ({src})" for e, (h, src) in normalised["highs"].items())
    parts += ["Normalised score = (final held-out reward - start) / (high - start), where start is the "
              f"(env, seed)'s shared warmed-up policy and high: {highs}.", ""]
    parts += [f"- {note}" for note in normalised["notes"]] + ([""] if normalised["notes"] else [])
    if wall_clock is not None:
        parts += ["## Wall clock per arm", "", "Training seconds of a run: the sum of its iterations' "
                  "`time/iteration_s` (loading and the held-out evaluations before and after are not in it).", "",
                  wall_clock]
    for env in envs:
        env_runs = [r for r in runs if r["env"] == env]
        parts += [f"## Raw results on `{env}` (mean ± std over seeds)", "",
                  markdown_table(aggregate(env_runs, columns), columns=columns, name=name)]
    if skipped:
        what = "agents" if wall_clock is None else "agents and arms"
        parts += [f"Skipped {what}:", ""] + [f"- `{n}`: {why}" for n, why in skipped.items()] + [""]
    if plots:
        parts += ["Plots: " + ", ".join(f"`{p}`" for p in plots), ""]
    return "\n".join(parts)


# -- plots ---------------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_learning_curves(runs: Sequence[dict[str, Any]], envs: Sequence[str], path: Path) -> Path:
    """One panel per env: rollout reward (task score) against generated tokens so far, the mean
    over seeds with a ±1 std band (seeds interpolated onto a common token grid)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, max(1, len(envs)), figsize=(5 * max(1, len(envs)), 3.8), squeeze=False)
    for ax, env in zip(axes[0], envs, strict=False):
        by_agent: dict[str, list[dict[str, Any]]] = {}
        for r in runs:
            if r["env"] == env and not r["error"] and r.get("tokens_so_far"):
                by_agent.setdefault(r["agent"], []).append(r)
        for agent, group in by_agent.items():
            low = max(r["tokens_so_far"][0] for r in group)
            high = min(r["tokens_so_far"][-1] for r in group)
            x = np.linspace(low, high, 50) if high > low else np.array([low])
            ys = np.array([np.interp(x, r["tokens_so_far"], r["train_reward"]) for r in group])
            mean, std = ys.mean(0), ys.std(0)
            (line,) = ax.plot(x, mean, marker="o" if len(x) == 1 else None, label=f"{agent} ({len(group)} seeds)")
            ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2)
        ax.set_title(env)
        ax.set_xlabel("generated tokens")
        ax.set_ylabel("rollout reward (mean ± std over seeds)")
        if by_agent:
            ax.legend(fontsize=7)
    return _save(fig, plt, path)


AGGREGATE_TITLES = {"iqm": "IQM", "mean": "mean", "median": "median", "optimality_gap": "optimality gap\n(lower is better)"}
"""Panel titles of :func:`plot_intervals`."""


def interval_layout(agents: Sequence[str]) -> dict[str, float]:
    """Sizes of :func:`plot_intervals` by the number and length of the agents' names: ``width``
    and ``height`` (inches) and ``label_size`` (points), so the panels keep their width beside
    long names and the names keep their line each."""
    label_size = 9.0 if len(agents) <= 12 else 7.0
    longest = max((len(a) for a in agents), default=1)
    names_in = 0.3 + longest * label_size * 0.6 / 72  # ~0.6 em per character
    width = names_in + 2.8 * len(stats.AGGREGATES)
    height = 1.8 + 0.32 * len(agents) * label_size / 9
    return {"width": width, "height": max(2.8, height), "label_size": label_size}


def plot_intervals(report: dict[str, Any], path: Path) -> Path:
    """``intervals.png``: :func:`interval_figure`."""
    return _save(interval_figure(report), _pyplot(), path, tight=False)


def interval_figure(report: dict[str, Any]) -> Any:
    """rliable-style interval plot: per aggregate (IQM, mean, median, optimality gap) a panel with
    each agent's point estimate and its bootstrap interval (a tick alone with one seed); the
    agents' names once, on the left, the figure sized by their number and length, at most four
    slanted ticks per axis."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    agents = report["agents"]
    size = interval_layout(agents)
    fig, axes = plt.subplots(1, len(stats.AGGREGATES), figsize=(size["width"], size["height"]), squeeze=False,
                             sharey=True, layout="constrained")  # room for every label, computed when drawn
    for ax, key in zip(axes[0], stats.AGGREGATES, strict=True):
        for i, agent in enumerate(agents):
            entry = report["aggregates"][agent][key]
            if entry["low"] is not None:
                ax.barh(i, entry["high"] - entry["low"], left=entry["low"], height=0.6, alpha=0.4, color=f"C{i % 10}")
            ax.plot([entry["point"]], [i], "k|", markersize=12)
        ax.set_yticks(range(len(agents)), agents, fontsize=size["label_size"])
        ax.set_ylim(len(agents) - 0.4, -0.6)  # the first agent on top
        ax.set_title(AGGREGATE_TITLES.get(key, key), fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(4))
        ax.tick_params(axis="x", labelsize=8, labelrotation=30)
        ax.set_xlabel("1 - normalised score" if key == "optimality_gap" else "normalised score", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
        ax.margins(x=0.08)
    bands = any(report["aggregates"][a][k]["low"] is not None for a in agents for k in stats.AGGREGATES)
    fig.suptitle(f"{round(100 * report['confidence'])}% stratified-bootstrap intervals" if bands
                 else "point estimates (one run per agent: no interval)", fontsize=9)
    return fig


def plot_profiles(report: dict[str, Any], path: Path) -> Path:
    """``profiles.png``: :func:`profile_figure`."""
    return _save(profile_figure(report), _pyplot(), path)


def profile_figure(report: dict[str, Any]) -> Any:
    """Performance profiles: fraction of runs with normalised score > tau, with bootstrap bands,
    over the taus of the report (:func:`profile_taus` spans every score, negative ones too); the
    x axis covers them all, a dotted line marks tau = 0 (no progress)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    taus: list[float] = []
    for agent in report["agents"]:
        profile = report["profiles"][agent]
        taus += profile["taus"]
        (line,) = ax.plot(profile["taus"], profile["point"], label=agent, drawstyle="steps-post")
        if profile["low"] is not None:
            ax.fill_between(profile["taus"], profile["low"], profile["high"], color=line.get_color(), alpha=0.2,
                            step="post")
    if taus:
        ax.set_xlim(min(taus), max(taus))
    ax.set_ylim(-0.03, 1.03)
    ax.axvline(0.0, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("normalised score tau (0: no progress, 1: the reference high)")
    ax.set_ylabel("fraction of runs with score > tau")
    ax.legend(fontsize=7)
    return fig


def _save(fig: Any, plt: Any, path: Path, tight: bool = True) -> Path:
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(runs: Sequence[dict[str, Any]], envs: Sequence[str], report: dict[str, Any] | None,
                folder: Path) -> list[Path]:
    """``learning_curves.png``, and with statistics ``intervals.png`` and ``profiles.png``."""
    paths = [plot_learning_curves(runs, envs, folder / "learning_curves.png")]
    if report is not None:
        paths += [plot_intervals(report, folder / "intervals.png"), plot_profiles(report, folder / "profiles.png")]
    return paths


__all__ = ["AGGREGATE_TITLES", "ARM_COLUMNS", "COLUMNS", "WALL_COLUMN", "aggregate", "compare_scores",
           "interval_figure", "interval_layout", "markdown", "markdown_table", "mean_std", "normalised_score",
           "normalised_scores", "plot_intervals", "plot_learning_curves", "plot_profiles", "profile_figure",
           "profile_taus", "reference_highs", "significance_summary", "wall_clock_table", "write_plots"]
