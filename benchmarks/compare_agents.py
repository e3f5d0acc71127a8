"""Compare agents on the same task, reward, prompt split and token budget (several seeds each).

    python benchmarks/compare_agents.py [--agents gae_ppo,grpo] [--seeds 0,1,2] [--iterations 40]
                                        [--output-dir runs/bench] [any `textrl train` option]

Writes ``results.md`` (the table), ``reward_vs_iteration.png``, ``reward_vs_time.png`` and
``results.json`` to ``--output-dir``; see :mod:`textrl.bench` (also ``textrl bench``). A script,
never imported (torchrl ships a top-level ``benchmarks`` package).
"""

from __future__ import annotations

from textrl.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
