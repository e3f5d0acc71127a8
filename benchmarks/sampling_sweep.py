"""Every sampling setting trains: a table of sampling settings x agents x engines x staleness.

Each cell is a tiny `textrl train` run (the built-in digits task); it prints the skipped updates over
the run's iterations, whether every KL and ratio was finite, and the largest `rollout/weight_gap`.
Before the learner's log-probs were taken at the temperature alone, every `--top-p 0.9` cell skipped
updates (docs/benchmarks.md, "Every sampling setting trains").

    python benchmarks/sampling_sweep.py [--agents gae_ppo,grpo,rloo,one_step_ppo,dapo] [--iterations 4]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from textrl import TrainConfig, train  # noqa: E402

SETTINGS = {"top_p=0.9": dict(top_p=0.9), "top_p=0.95": dict(top_p=0.95), "top_k=20": dict(top_k=20),
            "T=0.7": dict(temperature=0.7), "T=1.3": dict(temperature=1.3),
            "T=0.7,k=20,p=0.9": dict(temperature=0.7, top_k=20, top_p=0.9)}


def cell(agent: str, setting: dict, engine: str, staleness: int, iterations: int) -> tuple[int, bool, float]:
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        train(TrainConfig(agent=agent, iterations=iterations, warmup_sft_steps=20, prompts_per_iteration=4,
                          n_samples_per_prompt=4, max_new_tokens=16, eval_size=4, eval_every=0, checkpoint_every=0,
                          progress=False, output_dir=out, generation_engine=engine, max_staleness=staleness,
                          **setting))
        rows = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    skipped = int(sum(r["nonfinite/skipped_updates"] for r in rows))
    finite = all(r.get(k) is not None and math.isfinite(r[k]) for r in rows
                 for k in ("kl/collection", "ratio/mean") if k in r)
    gap = max(r.get("rollout/weight_gap", math.nan) for r in rows)
    return skipped, finite, gap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", default="gae_ppo,grpo,rloo,one_step_ppo,dapo")
    ap.add_argument("--engines", default="textrl,hf,static")
    ap.add_argument("--staleness", default="0,1")
    ap.add_argument("--iterations", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"| agent | engine | K | {' | '.join(SETTINGS)} |")
    print(f"|---|---|---|{'---|' * len(SETTINGS)}")
    total = bad = 0
    for agent in args.agents.split(","):
        for engine in args.engines.split(","):
            for k in (int(x) for x in args.staleness.split(",")):
                cells = []
                for setting in SETTINGS.values():
                    skipped, finite, gap = cell(agent, setting, engine, k, args.iterations)
                    total += 1
                    bad += bool(skipped or not finite)
                    cells.append(f"{skipped}/{args.iterations}{'' if finite else ' NaN'} gap {gap:.0e}")
                print(f"| {agent} | {engine} | {k} | {' | '.join(cells)} |", flush=True)
    print(f"\n{total} cells, {bad} with a skipped update or a non-finite KL / ratio "
          "(cell: skipped updates / iterations, largest rollout/weight_gap)")


if __name__ == "__main__":
    main()
