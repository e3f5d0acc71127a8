"""textrl.bench.stats: closed forms, agreement with scipy and plain loops, the stratified bootstrap."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from textrl.bench import stats

SCORES = arrays(np.float64, st.tuples(st.integers(1, 6), st.integers(1, 5)),
                elements=st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0, 1.5, -0.5]))


def trimmed_mean_loop(values):
    """Reference IQM: sort, cut int(n/4) from each end, average the rest."""
    ordered = sorted(float(v) for v in np.ravel(values))
    cut = int(0.25 * len(ordered))
    kept = ordered[cut : len(ordered) - cut]
    return sum(kept) / len(kept)


def improvement_loop(x, y):
    """Reference P(X > Y): per task, wins + ties/2 over all pairs, averaged over tasks."""
    per_task = []
    for t in range(x.shape[1]):
        total = 0.0
        for a in x[:, t]:
            for b in y[:, t]:
                total += 1.0 if a > b else 0.5 if a == b else 0.0
        per_task.append(total / (x.shape[0] * y.shape[0]))
    return sum(per_task) / len(per_task)


# -- point statistics ----------------------------------------------------------------------------


def test_iqm_closed_forms():
    assert stats.iqm(np.arange(8.0).reshape(4, 2)) == pytest.approx(3.5)  # mean of 2..5
    assert stats.iqm([[0.0], [0.0], [1.0], [100.0]]) == pytest.approx(0.5)  # outlier cut
    assert stats.iqm([[1.0, 2.0, 6.0]]) == pytest.approx(3.0)  # n = 3: nothing cut
    assert stats.iqm(np.arange(10.0).reshape(5, 2)) == pytest.approx(4.5)  # n = 10: cut 2 each end


@settings(max_examples=60, deadline=None)
@given(SCORES)
def test_iqm_matches_trimmed_mean_loop(scores):
    assert stats.iqm(scores) == pytest.approx(trimmed_mean_loop(scores))


@settings(max_examples=40, deadline=None)
@given(SCORES)
def test_iqm_matches_scipy_trim_mean(scores):
    scipy_stats = pytest.importorskip("scipy.stats")
    assert stats.iqm(scores) == pytest.approx(scipy_stats.trim_mean(scores, 0.25, axis=None))


def test_mean_median_optimality_gap_closed_forms():
    scores = np.array([[0.2, 0.4, 1.0], [0.4, 0.8, 1.4]])  # per-task means 0.3, 0.6, 1.2
    assert stats.per_task_mean(scores) == pytest.approx([0.3, 0.6, 1.2])
    assert stats.mean(scores) == pytest.approx(0.7)
    assert stats.median(scores) == pytest.approx(0.6)
    # min(scores, 1) = 0.2, 0.4, 1, 0.4, 0.8, 1 -> mean 0.6333
    assert stats.optimality_gap(scores) == pytest.approx(1 - 3.8 / 6)
    assert stats.optimality_gap(scores, threshold=0.5) == pytest.approx(0.5 - 2.5 / 6)  # 0.2, 0.4, 0.5, 0.4, 0.5, 0.5


def test_statistics_reduce_only_the_last_two_axes():
    batch = np.random.default_rng(0).uniform(size=(7, 4, 3))
    for fn in (stats.iqm, stats.mean, stats.median, stats.optimality_gap):
        assert fn(batch) == pytest.approx([float(fn(b)) for b in batch])
    assert stats.probability_of_improvement(batch, batch[::-1]).shape == (7,)


def test_normalise_per_task_and_errors():
    scores = np.array([[1.0, 10.0], [3.0, 30.0]])
    np.testing.assert_allclose(stats.normalise(scores, [1.0, 10.0], [3.0, 30.0]), [[0, 0], [1, 1]])
    np.testing.assert_allclose(stats.normalise(scores, 0.0, 10.0), scores / 10)  # not clipped
    with pytest.raises(ValueError, match=r"high must exceed low.*\[1\]"):
        stats.normalise(scores, [0.0, 5.0], [1.0, 5.0])
    with pytest.raises(ValueError, match="one value per task"):
        stats.normalise(scores, [0.0, 0.0, 0.0], 1.0)


def test_probability_of_improvement_closed_forms():
    low, high = np.zeros((3, 2)), np.ones((4, 2))
    assert stats.probability_of_improvement(high, low) == 1.0
    assert stats.probability_of_improvement(low, high) == 0.0
    same = np.array([[0.1, 0.5], [0.3, 0.9], [0.2, 0.4]])
    assert stats.probability_of_improvement(same, same) == 0.5
    assert stats.probability_of_improvement(np.full((2, 1), 0.7), np.full((5, 1), 0.7)) == 0.5  # all ties
    # task 0: x wins every pair (1); task 1: x = [0, 1] vs y = [0.5, 0.5] wins half (0.5)
    x, y = np.array([[2.0, 0.0], [3.0, 1.0]]), np.array([[1.0, 0.5], [0.0, 0.5]])
    assert stats.probability_of_improvement(x, y) == pytest.approx(0.75)


@settings(max_examples=60, deadline=None)
@given(SCORES, st.integers(1, 6), st.randoms(use_true_random=False))
def test_probability_of_improvement_matches_loop_and_is_antisymmetric(x, runs_y, random):
    y = np.array([[random.choice([0.0, 0.5, 1.0, 0.25]) for _ in range(x.shape[1])] for _ in range(runs_y)])
    p = stats.probability_of_improvement(x, y)
    assert p == pytest.approx(improvement_loop(x, y))
    assert p + stats.probability_of_improvement(y, x) == pytest.approx(1.0)


def test_probability_of_improvement_matches_scipy_mannwhitneyu():
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 4, size=(5, 3)) / 4, rng.integers(0, 4, size=(7, 3)) / 4  # many ties
    expected = np.mean([scipy_stats.mannwhitneyu(x[:, t], y[:, t]).statistic / 35 for t in range(3)])
    assert stats.probability_of_improvement(x, y) == pytest.approx(expected)


def test_run_score_profile_is_a_step_function():
    scores = np.array([[0.1, 0.6], [0.5, 0.9]])
    taus = [0.0, 0.1, 0.3, 0.5, 0.6, 0.8, 0.9, 1.0]
    # task 0 above tau: 1, .5, .5, 0, 0, 0, 0, 0; task 1: 1, 1, 1, 1, .5, .5, 0, 0
    expected = [1.0, 0.75, 0.75, 0.5, 0.25, 0.25, 0.0, 0.0]
    assert stats.run_score_profile(scores, taus) == pytest.approx(expected)


@settings(max_examples=40, deadline=None)
@given(SCORES)
def test_run_score_profile_is_non_increasing_in_tau(scores):
    profile = stats.run_score_profile(scores, np.linspace(-1, 2, 31))
    assert np.all(np.diff(profile) <= 0) and profile[0] == 1.0 and profile[-1] == 0.0


@pytest.mark.parametrize("bad, match", [
    (np.zeros(3), r"shaped \[runs, tasks\].*scores\[:, None\]"),
    (np.zeros((0, 2)), "at least one run"),
    (np.array([[0.1, np.nan]]), "NaN or infinite.*failed run"),
])
def test_bad_scores_are_rejected_with_a_clear_message(bad, match):
    with pytest.raises(ValueError, match=match):
        stats.iqm(bad)


def test_different_tasks_are_rejected():
    with pytest.raises(ValueError, match="same tasks"):
        stats.probability_of_improvement(np.zeros((2, 2)), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="same tasks"):
        stats.compare({"a": np.zeros((2, 2)), "b": np.zeros((2, 3))})


# -- the stratified bootstrap --------------------------------------------------------------------


def test_stratified_resample_never_mixes_tasks():
    runs, tasks = 5, 4
    scores = 100.0 * np.arange(tasks) + np.arange(runs)[:, None]  # task t holds 100t + run
    batch = stats.stratified_resample(scores, 300, np.random.default_rng(0))
    assert batch.shape == (300, runs, tasks)
    owner = np.floor(batch / 100)
    assert np.all(owner == np.arange(tasks))  # every draw comes from its own task's runs
    # within a task the draws are with replacement and reach every run
    assert set(np.unique(batch[:, :, 2] - 200).tolist()) == set(range(runs))
    assert any(len(set(rep[:, 0])) < runs for rep in batch)


def test_bootstrap_is_deterministic_given_the_seed_and_independent_of_other_agents():
    rng = np.random.default_rng(1)
    a, b = rng.uniform(size=(4, 3)), rng.uniform(size=(5, 3))
    first = stats.stratified_bootstrap_ci({"a": a, "b": b}, stats.iqm, reps=500, seed=7)
    again = stats.stratified_bootstrap_ci({"a": a, "b": b}, stats.iqm, reps=500, seed=7)
    alone = stats.stratified_bootstrap_ci({"a": a}, stats.iqm, reps=500, seed=7)
    other = stats.stratified_bootstrap_ci({"a": a}, stats.iqm, reps=500, seed=8)
    assert first == again and first["a"] == alone["a"]
    assert other["a"]["low"] != first["a"]["low"]
    assert first["a"]["point"] == pytest.approx(stats.iqm(a))
    assert first["a"]["low"] <= first["a"]["point"] <= first["a"]["high"]


def test_bootstrap_interval_equals_percentiles_of_a_plain_resampling_loop():
    scores = np.random.default_rng(2).normal(size=(6, 3))
    reps, seed = 400, 5
    rng = stats.generator(seed, "a")
    rows = rng.integers(0, 6, size=(reps, 6, 3))
    replicates = []
    for b in range(reps):
        sample = np.empty((6, 3))
        for t in range(3):
            for r in range(6):
                sample[r, t] = scores[rows[b, r, t], t]
        replicates.append(stats.mean(sample))
    found = stats.stratified_bootstrap_ci({"a": scores}, stats.mean, reps=reps, confidence=0.9, seed=seed)["a"]
    assert found["low"] == pytest.approx(np.quantile(replicates, 0.05))
    assert found["high"] == pytest.approx(np.quantile(replicates, 0.95))


def test_interval_of_the_mean_of_a_large_normal_sample_covers_the_true_mean():
    rng = np.random.default_rng(0)
    covered = 0
    for trial in range(20):
        scores = rng.normal(loc=0.3, scale=1.0, size=(400, 1))
        ci = stats.stratified_bootstrap_ci({"a": scores}, stats.mean, reps=1000, seed=trial)["a"]
        assert ci["high"] - ci["low"] == pytest.approx(2 * 1.96 / 20, rel=0.2)  # ~ 2 z sigma / sqrt(n)
        covered += ci["low"] <= 0.3 <= ci["high"]
    assert covered >= 16  # 95% nominal; P(fewer than 16 of 20) < 0.3% if the interval is right


def test_vector_statistics_give_per_task_intervals():
    scores = np.array([[0.0, 1.0], [0.25, 1.0], [0.5, 1.0]])
    ci = stats.stratified_bootstrap_ci({"a": scores}, stats.per_task_mean, reps=300)["a"]
    assert ci["point"] == pytest.approx([0.25, 1.0])
    assert 0.0 <= ci["low"][0] < 0.25 < ci["high"][0] <= 0.5
    assert ci["low"][1] == ci["high"][1] == 1.0  # a constant task has a zero-width interval


def test_degenerate_inputs():
    one_run = np.array([[0.3, 0.5]])
    with pytest.raises(ValueError, match="single run per task.*at least 2 runs"):
        stats.stratified_bootstrap_ci({"a": one_run}, stats.iqm)
    with pytest.raises(ValueError, match="single run"):
        stats.probability_of_improvement_ci(one_run, one_run)
    equal = np.full((3, 2), 0.4)
    ci = stats.stratified_bootstrap_ci({"a": equal}, stats.iqm, reps=100)["a"]
    assert ci["point"] == ci["low"] == ci["high"] == pytest.approx(0.4)
    one_task = np.array([[0.1], [0.2], [0.9]])
    assert stats.median(one_task) == stats.mean(one_task) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="reduce only the last two axes"):
        stats.stratified_bootstrap_ci({"a": equal}, lambda s: float(np.mean(s)), reps=10)
    with pytest.raises(ValueError, match="confidence"):
        stats.stratified_bootstrap_ci({"a": equal}, stats.iqm, confidence=95)
    with pytest.raises(ValueError, match="reps"):
        stats.stratified_bootstrap_ci({"a": equal}, stats.iqm, reps=0)


def test_probability_of_improvement_interval():
    rng = np.random.default_rng(4)
    good, bad = rng.uniform(0.6, 1.0, size=(5, 3)), rng.uniform(0.0, 0.4, size=(5, 3))
    separated = stats.probability_of_improvement_ci(good, bad, reps=300)
    assert separated == {"point": 1.0, "low": 1.0, "high": 1.0}
    noise = rng.uniform(size=(5, 3)), rng.uniform(size=(5, 3))
    ci = stats.probability_of_improvement_ci(*noise, reps=500, seed=1)
    assert ci["low"] < 0.5 < ci["high"]
    assert ci == stats.probability_of_improvement_ci(*noise, reps=500, seed=1)


def test_performance_profile_bands_contain_the_profile():
    scores = np.random.default_rng(5).uniform(size=(4, 3))
    profile = stats.performance_profile(scores, taus=[0.0, 0.5, 1.0], reps=300)
    assert profile["taus"] == [0.0, 0.5, 1.0]
    assert profile["point"] == pytest.approx(stats.run_score_profile(scores, [0.0, 0.5, 1.0]))
    for low, point, high in zip(profile["low"], profile["point"], profile["high"]):
        assert 0.0 <= low <= point <= high <= 1.0


# -- the report ----------------------------------------------------------------------------------


def test_compare_and_markdown_report_state_significance_honestly():
    rng = np.random.default_rng(6)
    scores = {
        "strong": rng.uniform(0.7, 0.9, size=(5, 3)),
        "weak": rng.uniform(0.1, 0.3, size=(5, 3)),
        "weak_twin": rng.uniform(0.1, 0.3, size=(5, 3)),
    }
    report = stats.compare(scores, task_names=["add", "copy", "sort"], reps=500, seed=0)
    json.dumps(report)  # JSON-ready for results.json
    assert report["agents"] == ["strong", "weak", "weak_twin"] and report["runs"]["weak"] == 5
    assert report["aggregates"]["strong"]["iqm"]["point"] == pytest.approx(stats.iqm(scores["strong"]))
    assert report["per_task"]["weak"]["copy"]["point"] == pytest.approx(scores["weak"][:, 1].mean())
    verdicts = {(p["x"], p["y"]): p["verdict"] for p in report["pairs"]}
    assert verdicts == {("strong", "weak"): "strong better", ("strong", "weak_twin"): "strong better",
                        ("weak", "weak_twin"): "not distinguishable"}
    assert report == stats.compare(scores, task_names=["add", "copy", "sort"], reps=500, seed=0)
    text = stats.markdown_report(report)
    assert "| `strong` | 5 |" in text and "`sort`" in text
    assert "`strong` scores higher than `weak`" in text
    assert "`weak` vs `weak_twin`: not distinguishable at this budget" in text
    assert "no correction for multiple comparisons" in text


def test_compare_with_a_single_run_gives_points_and_no_claims():
    report = stats.compare({"a": [[0.2, 0.4]], "b": [[0.1, 0.3], [0.2, 0.5]]}, reps=100)
    assert report["tasks"] == ["task0", "task1"]
    assert report["aggregates"]["a"]["iqm"] == {"point": pytest.approx(0.3), "low": None, "high": None}
    assert report["aggregates"]["b"]["iqm"]["low"] is not None
    assert report["pairs"][0]["verdict"] == "no interval (one run)"
    assert "no claim possible with a single run" in stats.markdown_report(report)


def test_verdict_rules():
    diff = lambda lo, hi: {"point": (lo + hi) / 2, "low": lo, "high": hi}  # noqa: E731
    passes = {"p": 0.01, "min_p": 0.001, "seeds_needed": 3, "alpha": 0.05}
    fails = {**passes, "p": 0.2}
    assert stats._verdict("a", "b", diff(0.1, 0.2), diff(0.4, 0.6), passes) == (
        "a better", "IQM difference interval excludes 0; exact rank test p = 0.01")
    assert stats._verdict("a", "b", diff(-0.1, 0.2), diff(0.2, 0.4), passes)[0] == "b better"
    assert stats._verdict("a", "b", diff(0.0, 0.0), diff(0.5, 0.5), passes)[0] == "not distinguishable"
    assert stats._verdict("a", "b", diff(0.1, 0.2), diff(0.1, 0.4), passes)[0] == "conflicting"
    # both intervals exclude no difference, the exact test does not: no claim
    assert stats._verdict("a", "b", diff(0.1, 0.2), diff(0.6, 0.9), fails) == (
        "not distinguishable", "IQM difference interval excludes 0; P(improvement) interval excludes 0.5, "
        "but the exact rank test p = 0.2 > 0.05")
    # the intervals favour a, P(improvement)'s point (and so the rank test) b
    assert stats._verdict("a", "b", diff(0.1, 0.2), diff(0.3, 0.5), passes)[0] == "conflicting"
    # runs too few for the test to reach the level: whatever the intervals say
    few = {"p": 0.333, "runs": [2, 2], "min_p": 0.333, "seeds_needed": 4, "alpha": 0.05}
    assert stats._verdict("a", "b", diff(0.5, 0.9), diff(1.0, 1.0), few) == (
        "not enough runs", "n=2 a side can reach p >= 0.333 at best (exact rank test), above 0.05; "
        "4 seeds a side are needed")


# -- the exact rank test that gates a verdict -------------------------------------------------------


def stratified_permutation_loop(x, y):
    """Reference p-value: every relabelling of each task's pooled runs (tasks independently), the
    statistic P(X > Y) (:func:`improvement_loop`), two-sided as scipy.stats.permutation_test."""
    from itertools import combinations, product

    n_x, tasks = x.shape
    pooled = [np.concatenate([x[:, t], y[:, t]]) for t in range(tasks)]
    splits = list(combinations(range(len(pooled[0])), n_x))
    observed = improvement_loop(x, y)
    null = []
    for choice in product(splits, repeat=tasks):
        xs = np.stack([pooled[t][list(c)] for t, c in enumerate(choice)], axis=1)
        ys = np.stack([np.delete(pooled[t], list(c)) for t, c in enumerate(choice)], axis=1)
        null.append(improvement_loop(xs, ys))
    null = np.array(null)
    greater, less = np.mean(null >= observed - 1e-12), np.mean(null <= observed + 1e-12)
    return min(1.0, 2 * min(greater, less))


TIES = st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0])
"""Few distinct values: tied runs are common."""


def runs_of(n_runs, tasks):
    return arrays(np.float64, (n_runs, tasks), elements=TIES)


@settings(max_examples=80, deadline=None)
@given(st.data(), st.integers(1, 4), st.integers(1, 4), st.integers(1, 2))
def test_rank_test_p_equals_the_stratified_permutation_loop(data, n_x, n_y, tasks):
    x, y = data.draw(runs_of(n_x, tasks)), data.draw(runs_of(n_y, tasks))
    test = stats.rank_test(x, y)
    assert test["p"] == pytest.approx(stratified_permutation_loop(x, y), abs=1e-12)
    assert test["min_p"] - 1e-12 <= test["p"] <= 1.0  # no data beats the bound the run counts set
    assert test["p"] == pytest.approx(stats.rank_test(y, x)["p"])  # two-sided: the order does not matter


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(2, 5), st.integers(2, 5))  # scipy takes two runs a side at least
def test_rank_test_p_equals_scipys_exact_permutation_test_on_one_task(data, n_x, n_y):
    scipy_stats = pytest.importorskip("scipy.stats")
    x, y = data.draw(runs_of(n_x, 1)), data.draw(runs_of(n_y, 1))

    def u(a, b, axis):  # Mann-Whitney U of a over b, ties 1/2
        left, right = a[..., :, None], b[..., None, :]
        return (left > right).sum((-2, -1)) + 0.5 * (left == right).sum((-2, -1))

    expected = scipy_stats.permutation_test((x[:, 0], y[:, 0]), u, permutation_type="independent",
                                            n_resamples=np.inf, vectorized=True).pvalue
    assert stats.rank_test(x, y)["p"] == pytest.approx(expected, abs=1e-12)


def test_rank_test_without_ties_is_scipys_exact_mann_whitney():
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(4)
    for n_x, n_y in ((2, 2), (3, 4), (6, 5), (9, 9)):
        x, y = rng.normal(size=(n_x, 1)), rng.normal(0.8, size=(n_y, 1))
        expected = scipy_stats.mannwhitneyu(x[:, 0], y[:, 0], method="exact").pvalue
        assert stats.rank_test(x, y)["p"] == pytest.approx(expected, rel=1e-9)


def test_smallest_p_and_the_seeds_a_verdict_needs():
    from math import comb

    assert stats.smallest_p(2, 2) == pytest.approx(2 / 6)  # the issue's `--seeds 0,1`: 1/3 at best
    assert stats.smallest_p(3, 3, tasks=2) == pytest.approx(2 / 400)
    assert [stats.seeds_needed(tasks) for tasks in (1, 2, 3, 6)] == [4, 3, 2, 1]
    assert stats.seeds_needed(1, alpha=0.01) == 5  # 2 / C(10, 5) = 0.0079; 2 / C(8, 4) = 0.029
    for tasks in (1, 2, 3):
        n = stats.seeds_needed(tasks)
        assert 2 / comb(2 * n, n) ** tasks <= 0.05 < 2 / comb(2 * n - 2, n - 1) ** tasks or n == 1
    # the bound is reached: every run of x above every run of y on every task, untied
    x, y = np.arange(4.0, 8.0)[:, None] + [0, 10], np.arange(4.0)[:, None] + [0, 10]
    assert stats.rank_test(x, y)["p"] == pytest.approx(stats.smallest_p(4, 4, tasks=2))


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 4), st.integers(1, 4), st.integers(1, 3))
def test_no_verdict_at_tiny_samples_is_significant_unless_the_test_can_reach_the_level(data, n_x, n_y, tasks):
    x = data.draw(arrays(np.float64, (n_x, tasks), elements=st.floats(-1, 2) | TIES))
    y = data.draw(arrays(np.float64, (n_y, tasks), elements=st.floats(-1, 2) | TIES))
    pair = stats.compare({"x": x, "y": y}, reps=200, seed=data.draw(st.integers(0, 3)))["pairs"][0]
    test = pair["rank_test"]
    if pair["verdict"].endswith(" better"):
        assert test["min_p"] <= test["p"] <= 0.05 and min(n_x, n_y) >= 2
    if test["min_p"] > 0.05:
        assert pair["verdict"] in ("not enough runs", "no interval (one run)")
    if n_x == n_y and stats.smallest_p(n_x, n_y, tasks) > 0.05:
        assert n_x < stats.seeds_needed(tasks)


def test_two_runs_a_side_that_never_overlap_are_not_enough_and_say_so():
    """The issue's case: `--seeds 0,1`, one environment, every run of one above every run of the
    other: P(improvement) 1.000 [1.000, 1.000], which 2 runs a side cannot make significant."""
    report = stats.compare({"grpo@K0": [[0.9], [0.8]], "grpo@K1": [[0.1], [0.2]]}, reps=300)
    pair = report["pairs"][0]
    assert pair["probability_of_improvement"] == {"point": 1.0, "low": 1.0, "high": 1.0}
    assert pair["verdict"] == "not enough runs" and report["seeds_needed"] == 4
    assert pair["rank_test"]["p"] == pytest.approx(1 / 3) and pair["rank_test"]["min_p"] == pytest.approx(1 / 3)
    text = stats.markdown_report(report)
    assert "not enough runs for a verdict" in text and "n=2 a side can reach p >= 0.333 at best" in text
    assert "4 seeds a side are needed" in text
    assert "[1.000, 1.000] is not certainty" in text and "scores higher" not in text
    four = stats.compare({"a": [[0.9], [0.8], [0.7], [0.95]], "b": [[0.1], [0.2], [0.3], [0.0]]}, reps=300)
    assert four["pairs"][0]["verdict"] == "a better" and four["pairs"][0]["rank_test"]["p"] == pytest.approx(2 / 70)
