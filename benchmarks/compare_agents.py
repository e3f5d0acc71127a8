"""Compare agents on several environments over seeds at an equal budget of generated tokens.

    python benchmarks/compare_agents.py [--agents gae_ppo,grpo] [--envs digits,guess_number]
                                        [--seeds 0,1,2] [--token-budget 81920] [--jobs 2]
                                        [--fresh] [--output-dir runs/bench] [any `textrl train` option]

The same as ``textrl bench`` (:mod:`textrl.bench`): each run in its own process, finished runs
reused; writes ``report.md`` (which differences are significant, IQM / probability of improvement
/ per-environment scores with stratified-bootstrap intervals, raw tables), ``learning_curves.png``,
``intervals.png``, ``profiles.png`` and ``results.json`` to ``--output-dir``. A script, never
imported (torchrl ships a top-level ``benchmarks`` package).
"""

from __future__ import annotations

from textrl.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
