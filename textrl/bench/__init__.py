"""``textrl bench``: agents x environments x seeds at an equal token budget, with honest statistics.

:func:`compare_agents` trains every (agent, environment, seed) with :func:`textrl.training.trainer.train`,
each run in its own process, ``--jobs`` at a time, and writes to ``output_dir``:

- ``report.md``: the set-up line, which differences between agents are significant (in words),
  the statistics of Agarwal et al. 2021 ("Deep RL at the Edge of the Statistical Precipice", via
  :mod:`textrl.bench.stats`): per environment the mean normalised score with stratified-bootstrap 95%
  intervals; across environments the interquartile mean (IQM), mean, median and optimality gap
  with intervals, the probability of improvement of each pair with its interval; then the raw
  table per environment (mean ± std over seeds);
- ``learning_curves.png`` (a panel per environment: rollout reward against generated tokens, mean
  ± std over seeds), ``intervals.png`` (each agent's aggregates with their intervals) and
  ``profiles.png`` (performance profiles with bootstrap bands);
- ``results.json``: every run's figures, the statistics' report, the config fingerprints;
- ``warmup/<env>/seed<k>/`` and ``runs/<env>/<agent>/seed<k>/``: the jobs' own folders.

Arms (asynchronous-RL variants): ``--max-staleness 0,1,4`` and ``--rollout-correction none,tis``
(comma lists; either or both) cross every agent with those values of the TrainConfig fields
``max_staleness`` and ``rollout_correction``. Each combination is an *arm*, labelled
``<agent>@K<k>`` for the staleness axis and ``+<kind>`` for the correction axis (``grpo@K1``,
``grpo+tis``, ``grpo@K1+tis``; an axis not given adds nothing), its runs in
``runs/<env>/<label>/seed<k>/``. Arms are compared exactly as agents are (scores, IQM and
intervals, pairs); the report adds the wall clock per arm (training seconds: the sum of each run's
``time/iteration_s``, with the speed-up against the same agent and correction at K=0) and a
``training s`` column to the raw tables. All arms of an (env, seed) share its warm-up and its
iterations. An arm whose config does not validate (an agent without that correction) is refused
naming it, or skipped with the reason with ``--agents all``. Without either option nothing changes:
labels, folders, fingerprints and tables are those of the agents.

Scores (:mod:`textrl.bench.report`): a run's normalised score is the share of the gap it closed,
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
    textrl bench --agents grpo,rloo --max-staleness 0,1,4 --rollout-correction none,tis
"""

# The package is: plan.py (the defaults and every job), jobs.py (a job's folder, record, lock and
# worker process), compare.py (compare_agents and the command line), report.py (normalised scores,
# the report, plots) and stats.py (the statistics, numpy only). The names below are imported on
# first use, so ``from textrl.bench import stats`` loads neither torch nor the config.

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "compare": ("add_arguments", "compare_agents", "default_jobs", "execute_job", "failure_summary", "main",
                "run", "setup_line", "warm_start"),
    "plan": ("ALL_AGENTS", "BENCH_OUTPUT_DIR", "DEFAULT_BENCH", "WARMUP_FIELDS", "describe_envs", "env_label",
             "episode_token_cap", "iterations_for", "job_key", "job_state", "pending", "resolve_agents",
             "run_job", "run_label", "run_settings", "warmup_job"),
    "report": ("aggregate", "markdown_table"),  # kept for callers of the earlier single-task comparison
    "jobs": ("peak_rss_mib",),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME_OF)


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'textrl.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(f"textrl.bench.{module}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
