"""Benchmark statistics after Agarwal et al. 2021, "Deep RL at the Edge of the Statistical Precipice".

Scores of one agent are a float array shaped ``[runs, tasks]`` (runs: seeds; tasks: environments),
normalised per task so that 0 is a reference low score (random policy, start of training) and 1 a
reference high score (:func:`normalise`). Every aggregate reduces the last two axes of an array
shaped ``[..., runs, tasks]``, so that a stack of bootstrap replicates is aggregated in one call:

- :func:`iqm`: interquartile mean over all runs x tasks (``scipy.stats.trim_mean(x, 0.25)`` of the
  flattened scores: ``int(0.25 n)`` scores cut from each end, as rliable does);
- :func:`mean`, :func:`median`: mean and median over tasks of the per-task mean over runs;
- :func:`optimality_gap`: ``threshold - mean(min(scores, threshold))`` over all runs x tasks;
- :func:`per_task_mean`: the per-task mean over runs, shaped ``[..., tasks]``;
- :func:`probability_of_improvement`: P(X > Y) per task in the Mann-Whitney U form (ties 1/2),
  averaged over tasks;
- :func:`run_score_profile`: fraction of runs scoring above each tau, averaged over tasks.

Whether a difference is *significant* is gated by an exact test (:func:`rank_test`): the stratified
permutation test of P(X > Y) (a rank-sum test per task, ties at mid-rank, summed over tasks), whose
p-value cannot fall below ``2 / C(n_x + n_y, n_x) ** tasks`` (:func:`smallest_p`). Below the runs
that bound allows (:func:`seeds_needed`) no pair is called significant, whatever the bootstrap
intervals say: with 2 runs a side they resample 2 values and can read ``[1.000, 1.000]``.

Uncertainty comes from the stratified bootstrap (:func:`stratified_bootstrap_ci`,
:func:`probability_of_improvement_ci`, :func:`performance_profile`): runs are resampled with
replacement within each task independently (never across tasks), and the interval is the
percentile interval of the replicates. Each agent (and each pair of agents) draws from its own
generator seeded with ``(seed, crc32(name))``, so results are deterministic given the seed and do
not depend on which other agents are compared. :func:`compare` gathers everything into a
JSON-ready report and :func:`markdown_report` states in words which differences are significant.

Typical use (``raw[agent]``: final held-out rewards ``[seeds, environments]``)::

    scores = {agent: normalise(raw[agent], low=start_reward, high=1.0) for agent in raw}
    report = compare(scores, task_names=environments, seed=0)   # JSON-ready dict
    text = markdown_report(report)
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

Statistic = Callable[[np.ndarray], np.ndarray]
"""Maps scores ``[..., runs, tasks]`` to ``[...]`` or ``[..., k]`` (reduces only the last two axes)."""

AGGREGATES = ("iqm", "mean", "median", "optimality_gap")
DEFAULT_TAUS = tuple(np.round(np.linspace(0.0, 1.0, 21), 4).tolist())
"""Score thresholds of the performance profile: 0, 0.05, ..., 1."""


# -- inputs --------------------------------------------------------------------------------------


def as_scores(scores: Any, name: str = "scores") -> np.ndarray:
    """``scores`` as a finite float array ``[..., runs, tasks]`` with at least one run and task."""
    array = np.asarray(scores, dtype=float)
    if array.ndim < 2:
        raise ValueError(
            f"{name} must be shaped [runs, tasks], got shape {array.shape}; "
            "for a single task pass scores[:, None]"
        )
    if array.shape[-2] < 1 or array.shape[-1] < 1:
        raise ValueError(f"{name} needs at least one run and one task, got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(
            f"{name} holds NaN or infinite scores; drop the failed run (seed) from every task "
            "of that agent, or rerun it"
        )
    return array


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence}")


def _check_reps(reps: int) -> None:
    if int(reps) != reps or reps < 1:
        raise ValueError(f"reps must be a positive integer, got {reps}")


def normalise(scores: Any, low: Any, high: Any) -> np.ndarray:
    """Scores ``[runs, tasks]`` mapped per task to ``(scores - low) / (high - low)``.

    ``low`` and ``high`` are scalars or ``[tasks]`` arrays (e.g. a random policy's score and the
    best attainable score). Results are not clipped: a run can score below 0 or above 1.
    """
    array = as_scores(scores)
    low_, high_ = np.asarray(low, dtype=float), np.asarray(high, dtype=float)
    for label, bound in (("low", low_), ("high", high_)):
        if bound.ndim > 1 or (bound.ndim == 1 and bound.shape[0] != array.shape[-1]):
            raise ValueError(
                f"{label} must be a scalar or one value per task ({array.shape[-1]}), got shape {bound.shape}"
            )
    span = np.broadcast_to(high_ - low_, (array.shape[-1],))
    if not np.all(np.isfinite(span)) or np.any(span <= 0):
        bad = [int(i) for i in np.flatnonzero(~(span > 0))]
        raise ValueError(f"high must exceed low for every task; it does not for task(s) {bad}")
    return (array - low_) / (high_ - low_)


# -- point statistics (reduce the last two axes of [..., runs, tasks]) ---------------------------


def iqm(scores: Any) -> np.ndarray:
    """Interquartile mean over all runs x tasks: ``[..., runs, tasks] -> [...]``.

    The flattened ``n = runs * tasks`` scores are sorted and ``int(0.25 * n)`` are cut from each
    end (scipy.stats.trim_mean with proportiontocut 0.25, rliable's ``aggregate_iqm``); the rest
    are averaged. With fewer than 4 scores nothing is cut and it is the plain mean.
    """
    array = as_scores(scores)
    flat = np.sort(array.reshape(*array.shape[:-2], -1), axis=-1)
    cut = int(0.25 * flat.shape[-1])
    return flat[..., cut : flat.shape[-1] - cut].mean(axis=-1)


def per_task_mean(scores: Any) -> np.ndarray:
    """Mean over runs of each task: ``[..., runs, tasks] -> [..., tasks]``."""
    return as_scores(scores).mean(axis=-2)


def mean(scores: Any) -> np.ndarray:
    """Mean over tasks of the per-task mean score: ``[..., runs, tasks] -> [...]``."""
    return per_task_mean(scores).mean(axis=-1)


def median(scores: Any) -> np.ndarray:
    """Median over tasks of the per-task mean score: ``[..., runs, tasks] -> [...]``."""
    return np.median(per_task_mean(scores), axis=-1)


def optimality_gap(scores: Any, threshold: float = 1.0) -> np.ndarray:
    """How far scores fall short of ``threshold``: ``threshold - mean(min(scores, threshold))``.

    Averaged over all runs x tasks, ``[..., runs, tasks] -> [...]``; lower is better, and scores
    above the threshold earn nothing more.
    """
    array = as_scores(scores)
    return threshold - np.minimum(array, threshold).mean(axis=(-2, -1))


def probability_of_improvement(x: Any, y: Any) -> np.ndarray:
    """P(X > Y): the chance a run of X beats a run of Y on the same task, averaged over tasks.

    ``x`` is ``[..., runs_x, tasks]`` and ``y`` is ``[..., runs_y, tasks]`` (same tasks); result
    ``[...]``. Per task it is the Mann-Whitney U of X over Y divided by ``runs_x * runs_y``: the
    fraction of (x, y) pairs with x > y, a tie counting 1/2. 1 when every X run beats every Y run,
    0.5 for identical samples.
    """
    xs, ys = as_scores(x, "x"), as_scores(y, "y")
    if xs.shape[-1] != ys.shape[-1]:
        raise ValueError(f"x and y must cover the same tasks, got {xs.shape[-1]} and {ys.shape[-1]} tasks")
    left, right = xs[..., :, None, :], ys[..., None, :, :]
    wins = (left > right).mean(axis=(-3, -2)) + 0.5 * (left == right).mean(axis=(-3, -2))
    return wins.mean(axis=-1)


def run_score_profile(scores: Any, taus: Sequence[float] = DEFAULT_TAUS) -> np.ndarray:
    """Fraction of runs with score > tau, per task then averaged over tasks.

    ``[..., runs, tasks] -> [..., len(taus)]``; a non-increasing step function of tau (rliable's
    run-score distribution).
    """
    array = as_scores(scores)
    thresholds = np.asarray(taus, dtype=float)
    if thresholds.ndim != 1 or thresholds.size == 0:
        raise ValueError(f"taus must be a non-empty 1-D sequence, got shape {thresholds.shape}")
    above = array[..., None] > thresholds  # [..., runs, tasks, taus]
    return above.mean(axis=-3).mean(axis=-2)


# -- stratified bootstrap ------------------------------------------------------------------------


def generator(seed: int, *names: str) -> np.random.Generator:
    """The generator of one agent (or pair): seeded with ``seed`` and the crc32 of each name."""
    return np.random.default_rng([int(seed), *(zlib.crc32(name.encode()) for name in names)])


def stratified_resample(scores: Any, reps: int, rng: np.random.Generator) -> np.ndarray:
    """``reps`` bootstrap replicates of ``[runs, tasks]`` scores: ``[reps, runs, tasks]``.

    Replicate ``b`` holds, for each task ``t``, ``runs`` draws with replacement from that task's
    own runs ``scores[:, t]`` (strata are tasks: runs of different tasks never mix).
    """
    array = as_scores(scores)
    if array.ndim != 2:
        raise ValueError(f"scores must be shaped [runs, tasks], got shape {array.shape}")
    _check_reps(reps)
    runs, tasks = array.shape
    rows = rng.integers(0, runs, size=(int(reps), runs, tasks))
    return array[rows, np.arange(tasks)]


def percentile_interval(replicates: np.ndarray, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """The ``confidence`` percentile interval of ``replicates`` ``[reps, ...]``: (low, high) ``[...]``."""
    _check_confidence(confidence)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(replicates, [tail, 1.0 - tail], axis=0)
    return low, high


def _need_two_runs(array: np.ndarray, name: str) -> None:
    if array.shape[-2] < 2:
        raise ValueError(
            f"{name} has a single run per task: a bootstrap interval needs at least 2 runs (seeds); "
            "run more seeds, or report the point estimate without an interval"
        )


def _interval(point: np.ndarray, low: np.ndarray, high: np.ndarray) -> dict[str, Any]:
    return {"point": point.tolist(), "low": low.tolist(), "high": high.tolist()}


def _apply(statistic: Statistic, batch: np.ndarray, reps: int) -> np.ndarray:
    result = np.asarray(statistic(batch), dtype=float)
    if result.ndim == 0 or result.shape[0] != reps:
        raise ValueError(
            "statistic must reduce only the last two axes of [..., runs, tasks] "
            f"(called on shape {batch.shape} it returned shape {result.shape})"
        )
    return result


def stratified_bootstrap_ci(
    scores_by_agent: Mapping[str, Any],
    statistic: Statistic,
    reps: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Point estimate and stratified-bootstrap percentile interval of ``statistic`` per agent.

    ``scores_by_agent`` maps a name to ``[runs, tasks]`` scores (runs may differ between agents).
    ``statistic`` maps ``[..., runs, tasks]`` to ``[...]`` or ``[..., k]`` (e.g. :func:`iqm`,
    :func:`per_task_mean`, ``functools.partial(run_score_profile, taus=...)``). Returns, per agent,
    ``{"point", "low", "high"}`` as floats (or lists of ``k`` floats). Needs at least 2 runs per
    agent; deterministic given ``seed``.
    """
    _check_confidence(confidence)
    result = {}
    for name, scores in scores_by_agent.items():
        array = as_scores(scores, f"scores of {name!r}")
        if array.ndim != 2:
            raise ValueError(f"scores of {name!r} must be shaped [runs, tasks], got shape {array.shape}")
        _need_two_runs(array, f"scores of {name!r}")
        replicates = _apply(statistic, stratified_resample(array, reps, generator(seed, name)), reps)
        point = np.asarray(statistic(array), dtype=float)
        result[name] = _interval(point, *percentile_interval(replicates, confidence))
    return result


def probability_of_improvement_ci(
    x: Any, y: Any, reps: int = 2000, confidence: float = 0.95, seed: int = 0,
    names: tuple[str, str] = ("x", "y"),
) -> dict[str, Any]:
    """P(X > Y) (:func:`probability_of_improvement`) with its stratified-bootstrap interval.

    X's and Y's runs are resampled independently, each within task; ``names`` seed the generator.
    Returns ``{"point", "low", "high"}``.
    """
    xs, ys = as_scores(x, "x"), as_scores(y, "y")
    _need_two_runs(xs, "x")
    _need_two_runs(ys, "y")
    rng = generator(seed, *names)
    replicates = probability_of_improvement(stratified_resample(xs, reps, rng), stratified_resample(ys, reps, rng))
    return _interval(probability_of_improvement(xs, ys), *percentile_interval(replicates, confidence))


def difference_ci(
    x: Any, y: Any, statistic: Statistic = iqm, reps: int = 2000, confidence: float = 0.95,
    seed: int = 0, names: tuple[str, str] = ("x", "y"),
) -> dict[str, Any]:
    """``statistic(x) - statistic(y)`` with the percentile interval of independent stratified resamples."""
    xs, ys = as_scores(x, "x"), as_scores(y, "y")
    _need_two_runs(xs, "x")
    _need_two_runs(ys, "y")
    rng = generator(seed, *names)
    replicates = _apply(statistic, stratified_resample(xs, reps, rng), reps) - _apply(
        statistic, stratified_resample(ys, reps, rng), reps
    )
    point = np.asarray(statistic(xs), dtype=float) - np.asarray(statistic(ys), dtype=float)
    return _interval(point, *percentile_interval(replicates, confidence))


def performance_profile(
    scores: Any, taus: Sequence[float] = DEFAULT_TAUS, reps: int = 2000, confidence: float = 0.95,
    seed: int = 0, name: str = "agent",
) -> dict[str, Any]:
    """Run-score profile (:func:`run_score_profile`) at ``taus`` with stratified-bootstrap bands.

    Returns ``{"taus", "point", "low", "high"}``, lists of ``len(taus)`` floats; ``name`` seeds the
    generator (the same stream :func:`stratified_bootstrap_ci` uses for that agent).
    """
    taus = [float(t) for t in taus]
    band = stratified_bootstrap_ci({name: scores}, lambda s: run_score_profile(s, taus), reps, confidence, seed)
    return {"taus": taus, **band[name]}


# -- the exact rank test that gates a verdict -----------------------------------------------------


def doubled_midranks(values: Any) -> np.ndarray:
    """Twice the rank of each of ``values`` ``[N]`` in their pooled order, tied values sharing
    their mean rank (integers, so that sums compare exactly): ``[N]`` ints.

    >>> doubled_midranks([0.3, 0.1, 0.3, 0.2]).tolist()
    [7, 2, 7, 4]
    """
    _, inverse, counts = np.unique(np.asarray(values, dtype=float), return_inverse=True, return_counts=True)
    before = np.concatenate([[0], np.cumsum(counts)[:-1]])  # values below each distinct value
    return (2 * before + counts + 1)[inverse.reshape(-1)]


def rank_sum_distribution(doubled: Any, n_x: int) -> np.ndarray:
    """The exact null distribution of the sum of ``n_x`` of the ``doubled`` mid-ranks ``[N]``
    (:func:`doubled_midranks`) drawn without replacement, every draw equally likely (labels
    permuted): ``[top + 1]`` probabilities, entry ``s`` being P(sum = s). Counted by groups of tied
    ranks (``C(c, m)`` ways to take ``m`` of ``c`` tied ones), so ties are exact and the cost is
    ``N * n_x * top``, not ``C(N, n_x)``."""
    ranks = np.asarray(doubled, dtype=np.int64)
    if not 0 <= n_x <= ranks.size:
        raise ValueError(f"n_x={n_x} must lie between 0 and the {ranks.size} pooled values")
    top = int(np.sort(ranks)[::-1][:n_x].sum())
    ways = np.zeros((n_x + 1, top + 1))  # ways[k, s]: draws of k ranks summing to s, over the groups so far
    ways[0, 0] = 1.0
    values, counts = np.unique(ranks, return_counts=True)
    for rank, count in zip(values.tolist(), counts.tolist(), strict=True):
        grown = ways.copy()  # none of this group taken
        for m in range(1, min(count, n_x) + 1):
            shift = m * rank
            if shift > top:
                break
            grown[m:, shift:] += math.comb(count, m) * ways[: n_x + 1 - m, : top + 1 - shift]
        ways = grown
    return ways[n_x] / math.comb(ranks.size, n_x)


def smallest_p(n_x: int, n_y: int, tasks: int = 1) -> float:
    """The smallest two-sided p-value :func:`rank_test` can give with ``n_x`` and ``n_y`` runs on
    each of ``tasks`` tasks: ``2 / C(n_x + n_y, n_x) ** tasks`` (every run of one side above every
    run of the other on every task, untied; one arrangement of the labels in that many), at most 1.

    >>> round(smallest_p(2, 2), 4), round(smallest_p(4, 4), 4), round(smallest_p(2, 2, tasks=2), 4)
    (0.3333, 0.0286, 0.0556)
    """
    return min(1.0, 2 / math.comb(n_x + n_y, n_x) ** tasks)


def seeds_needed(tasks: int = 1, alpha: float = 0.05) -> int:
    """The fewest runs a side (seeds) with which :func:`rank_test` can reach ``alpha`` on ``tasks``
    tasks: the smallest ``n`` with ``smallest_p(n, n, tasks) <= alpha`` (4 for one task at 5%)."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie strictly between 0 and 1, got {alpha}")
    if tasks < 1:
        raise ValueError(f"tasks={tasks}: a comparison needs at least one task (environment)")
    n = 1
    while smallest_p(n, n, tasks) > alpha:
        n += 1
    return n


def rank_test(x: Any, y: Any, alpha: float = 0.05) -> dict[str, Any]:
    """The exact two-sided permutation test of P(X > Y) (:func:`probability_of_improvement`)
    stratified by task: within each task the labels of the pooled ``x`` ``[runs_x, tasks]`` and
    ``y`` ``[runs_y, tasks]`` runs are permuted (never across tasks), and the statistic is the sum
    over tasks of x's rank sum, an affine function of P(X > Y). Its null distribution is the
    convolution of the tasks' exact ones (:func:`rank_sum_distribution`); with one task it is the
    exact Mann-Whitney (Wilcoxon rank-sum) test. ``p = min(1, 2 min(P(S >= s), P(S <= s)))``, as
    ``scipy.stats.permutation_test`` has it.

    Returns ``{"p", "runs", "min_p", "seeds_needed", "alpha"}``: the p-value, ``[runs_x, runs_y]``,
    the smallest p-value these run counts can give (:func:`smallest_p`) and the runs a side that ``alpha`` needs (:func:`seeds_needed`).
    """
    xs, ys = as_scores(x, "x"), as_scores(y, "y")
    if xs.ndim != 2 or ys.ndim != 2 or xs.shape[1] != ys.shape[1]:
        raise ValueError(f"x and y must be shaped [runs, tasks] over the same tasks, got {xs.shape} and {ys.shape}")
    n_x, tasks = xs.shape
    null, observed = np.ones(1), 0
    for task in range(tasks):
        doubled = doubled_midranks(np.concatenate([xs[:, task], ys[:, task]]))
        observed += int(doubled[:n_x].sum())
        null = np.convolve(null, rank_sum_distribution(doubled, n_x))
    greater, less = float(null[observed:].sum()), float(null[: observed + 1].sum())
    min_p = smallest_p(n_x, ys.shape[0], tasks)
    p = min(1.0, max(min_p, 2 * min(greater, less)))  # no lower than the test can reach: the two sums round apart
    return {"p": p, "runs": [n_x, int(ys.shape[0])], "min_p": min_p,
            "seeds_needed": seeds_needed(tasks, alpha), "alpha": alpha}


# -- the report ----------------------------------------------------------------------------------


def _statistics(threshold: float) -> dict[str, Statistic]:
    return {"iqm": iqm, "mean": mean, "median": median,
            "optimality_gap": lambda s: optimality_gap(s, threshold)}


def _verdict(x: str, y: str, difference: dict[str, Any], improvement: dict[str, Any],
             test: dict[str, Any]) -> tuple[str, str]:
    """(verdict, reason): ``"x better"``, ``"y better"``, ``"not distinguishable"``,
    ``"conflicting"`` or ``"not enough runs"``.

    A pair is ``better`` only when a bootstrap interval (the IQM difference's excludes 0, or
    P(improvement)'s excludes 0.5) and the exact rank test (``test``: :func:`rank_test`, p at most
    its ``alpha``) agree on the winner. When the run counts cannot bring the test's p-value down
    to ``alpha`` at all (``min_p > alpha``) the verdict is ``"not enough runs"`` whatever the data:
    with few runs the bootstrap resamples the same few values and its intervals say nothing."""
    alpha = test["alpha"]
    if test["min_p"] > alpha:
        n_x, n_y = test["runs"]
        sides = f"n={n_x} a side" if n_x == n_y else f"n={n_x} and {n_y} runs"
        return "not enough runs", (f"{sides} can reach p >= {test['min_p']:.3g} at best (exact rank test), "
                                   f"above {alpha:g}; {test['seeds_needed']} seeds a side are needed")
    votes = []
    if difference["low"] > 0 or difference["high"] < 0:
        votes.append(("IQM difference interval excludes 0", difference["low"] > 0))
    if improvement["low"] > 0.5 or improvement["high"] < 0.5:
        votes.append(("P(improvement) interval excludes 0.5", improvement["low"] > 0.5))
    tested = f"exact rank test p = {test['p']:.3g}"
    if not votes:
        return "not distinguishable", f"both intervals include no difference; {tested}"
    if len({favours_x for _, favours_x in votes}) > 1:
        return "conflicting", "the IQM difference and P(improvement) intervals point opposite ways"
    reasons = "; ".join(reason for reason, _ in votes)
    if test["p"] > alpha:
        return "not distinguishable", f"{reasons}, but the {tested} > {alpha:g}"
    if improvement["point"] != 0.5 and (improvement["point"] > 0.5) != votes[0][1]:  # the test's side
        return "conflicting", f"{reasons}, but the rank test favours the other ({tested})"
    return f"{x if votes[0][1] else y} better", f"{reasons}; {tested}"


def compare(
    scores_by_agent: Mapping[str, Any],
    task_names: Sequence[str] | None = None,
    reps: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
    taus: Sequence[float] = DEFAULT_TAUS,
    threshold: float = 1.0,
) -> dict[str, Any]:
    """Every statistic of the benchmark for agents' ``[runs, tasks]`` normalised scores.

    Returns a JSON-ready dict: ``agents``, ``tasks``, ``runs`` (per agent), the settings,
    ``seeds_needed`` (the runs a side any verdict needs on these tasks: :func:`seeds_needed`);
    ``aggregates[agent][stat]`` for stat in :data:`AGGREGATES` and ``per_task[agent][task]``, each
    ``{"point", "low", "high"}``; ``profiles[agent]`` (:func:`performance_profile`); ``pairs``: for
    each pair of agents (in the given order) the IQM difference x - y and P(x > y) with intervals,
    ``rank_test`` (:func:`rank_test` at ``alpha = 1 - confidence``: the p-value, the smallest one
    the run counts allow, the seeds a side a verdict needs) and ``verdict`` / ``reason``
    (:func:`_verdict`). An agent with a single run gets point estimates with ``low``/``high`` None
    and its pairs the verdict ``"no interval (one run)"``.
    """
    _check_confidence(confidence)
    if not scores_by_agent:
        raise ValueError("compare needs the scores of at least one agent")
    arrays = {name: as_scores(s, f"scores of {name!r}") for name, s in scores_by_agent.items()}
    for name, array in arrays.items():
        if array.ndim != 2:
            raise ValueError(f"scores of {name!r} must be shaped [runs, tasks], got shape {array.shape}")
    counts = {array.shape[1] for array in arrays.values()}
    if len(counts) > 1:
        shapes = ", ".join(f"{n}: {a.shape}" for n, a in arrays.items())
        raise ValueError(f"every agent must cover the same tasks (columns); got {shapes}")
    tasks = list(task_names) if task_names is not None else [f"task{i}" for i in range(counts.pop())]
    if len(tasks) != next(iter(arrays.values())).shape[1]:
        raise ValueError(f"task_names has {len(tasks)} names for {next(iter(arrays.values())).shape[1]} tasks")
    taus = [float(t) for t in taus]
    statistics = {**_statistics(threshold), "per_task": per_task_mean,
                  "profile": lambda s: run_score_profile(s, taus)}

    report: dict[str, Any] = {
        "agents": list(arrays), "tasks": tasks, "runs": {n: int(a.shape[0]) for n, a in arrays.items()},
        "reps": int(reps), "confidence": confidence, "seed": int(seed), "threshold": threshold,
        "seeds_needed": seeds_needed(len(tasks), 1.0 - confidence),
        "aggregates": {}, "per_task": {}, "profiles": {}, "pairs": [],
    }
    for name, array in arrays.items():
        found = {}
        for key, statistic in statistics.items():
            if array.shape[0] >= 2:
                found[key] = stratified_bootstrap_ci({name: array}, statistic, reps, confidence, seed)[name]
            else:
                point = np.asarray(statistic(array), dtype=float)
                found[key] = {"point": point.tolist(), "low": None, "high": None}
        report["aggregates"][name] = {key: found[key] for key in AGGREGATES}
        report["per_task"][name] = {
            task: {k: (None if found["per_task"][k] is None else found["per_task"][k][i]) for k in ("point", "low", "high")}
            for i, task in enumerate(tasks)
        }
        report["profiles"][name] = {"taus": taus, **found["profile"]}

    names = list(arrays)
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            xs, ys = arrays[x], arrays[y]
            pair: dict[str, Any] = {"x": x, "y": y, "rank_test": rank_test(xs, ys, alpha=1.0 - confidence)}
            if min(xs.shape[0], ys.shape[0]) < 2:
                pair["iqm_difference"] = {"point": float(iqm(xs) - iqm(ys)), "low": None, "high": None}
                pair["probability_of_improvement"] = {
                    "point": float(probability_of_improvement(xs, ys)), "low": None, "high": None}
                pair["verdict"], pair["reason"] = "no interval (one run)", "a single run gives no uncertainty estimate"
            else:
                pair["iqm_difference"] = difference_ci(xs, ys, iqm, reps, confidence, seed, (x, y))
                pair["probability_of_improvement"] = probability_of_improvement_ci(
                    xs, ys, reps, confidence, seed, (x, y))
                pair["verdict"], pair["reason"] = _verdict(
                    x, y, pair["iqm_difference"], pair["probability_of_improvement"], pair["rank_test"])
            report["pairs"].append(pair)
    return report


def _cell(entry: dict[str, Any], spec: str = ".3f") -> str:
    if entry["low"] is None:
        return f"{entry['point']:{spec}}"
    return f"{entry['point']:{spec}} [{entry['low']:{spec}}, {entry['high']:{spec}}]"


def few_runs(pair: dict[str, Any]) -> str:
    """What the bootstrap intervals of a pair with too few runs for a verdict are not (said beside them)."""
    return ("The bootstrap resamples the same few runs, so its intervals understate the uncertainty: "
            "an interval such as [1.000, 1.000] is not certainty.")


def _sentence(pair: dict[str, Any], level: str) -> str:
    x, y, verdict = f"`{pair['x']}`", f"`{pair['y']}`", pair["verdict"]
    figures = (f"IQM difference {_cell(pair['iqm_difference'], '+.3f')}, "
               f"P({pair['x']} > {pair['y']}) {_cell(pair['probability_of_improvement'])}")
    if verdict == "not distinguishable":
        return f"- {x} vs {y}: not distinguishable at this budget ({figures}; {pair['reason']}, {level} intervals)."
    if verdict == "not enough runs":
        return (f"- {x} vs {y}: not enough runs for a verdict ({figures}): {pair['reason']}. "
                f"{few_runs(pair)}")
    if verdict == "no interval (one run)":
        return (f"- {x} vs {y}: no claim possible with a single run ({figures}); run more seeds "
                f"({pair['rank_test']['seeds_needed']} a side are needed).")
    if verdict == "conflicting":
        return f"- {x} vs {y}: the two criteria disagree ({figures}); treat as not distinguishable."
    winner = verdict.removesuffix(" better")
    loser = pair["y"] if winner == pair["x"] else pair["x"]
    return f"- `{winner}` scores higher than `{loser}` ({figures}; {pair['reason']} at {level})."


def markdown_report(report: dict[str, Any], label: str = "agent") -> str:
    """The :func:`compare` report as Markdown: aggregates, per-task scores, pairwise verdicts; ``label``
    names what is compared in the tables' first column (``"arm"`` for agents crossed with settings)."""
    level = f"{round(100 * report['confidence'])}%"
    agents, tasks = report["agents"], report["tasks"]
    lines = [
        f"### Statistics ({level} stratified-bootstrap percentile intervals, {report['reps']} resamples, "
        f"seed {report['seed']})",
        "",
        "Scores are normalised per task (0: reference low, 1: reference high). IQM: mean of the middle "
        "50% of all runs x tasks; mean and median: over tasks of the per-task mean; optimality gap: "
        f"shortfall from {report['threshold']:g} (lower is better).",
        "",
        f"| {label} | runs | IQM | mean | median | optimality gap |",
        "|---|---|---|---|---|---|",
    ]
    for name in agents:
        stats = report["aggregates"][name]
        cells = " | ".join(_cell(stats[key]) for key in AGGREGATES)
        lines.append(f"| `{name}` | {report['runs'][name]} | {cells} |")
    lines += ["", "Per task (mean over runs):", "", f"| {label} | " + " | ".join(f"`{t}`" for t in tasks) + " |",
              "|---|" + "---|" * len(tasks)]
    for name in agents:
        lines.append(f"| `{name}` | " + " | ".join(_cell(report["per_task"][name][t]) for t in tasks) + " |")
    if report["pairs"]:
        alpha = 1.0 - report["confidence"]
        lines += ["", "Pairwise comparisons (a difference counts as significant when the interval of the "
                  "IQM difference excludes 0 or the interval of P(improvement) excludes 0.5, and the exact "
                  f"rank test of P(improvement), stratified by task, gives p <= {alpha:.2g}; that test needs "
                  f"{report['seeds_needed']} seeds a side on {len(tasks)} task(s) to reach it at all, and below "
                  "that no pair is called significant):", ""]
        lines += [_sentence(pair, level) for pair in report["pairs"]]
        lines += ["", f"Each interval is a {level} interval for one pair; with several pairs some may "
                  "exclude no-difference by chance (no correction for multiple comparisons)."]
    return "\n".join(lines) + "\n"
