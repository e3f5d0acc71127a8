"""The weight check's noise floor and signal (docs/training.md, "Does the engine have the learner's weights?").

For each engine and precision: ``rollout/weight_gap`` of a tiny run whose engine has the learner's
weights (the noise floor), and of the same run with an engine that keeps the weights of its first
call (a broken sync: the signal, one update stale from iteration 2 on), under top-p 0.9 and plain
sampling. Prints each figure and the ratio of the bound (textrl.agents.weight_check.WEIGHT_GAP_BOUNDS)
to the floor and of the stale gap to the bound.

    python benchmarks/weight_gap.py [--iterations 4] [--engines textrl,hf,static]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from textrl import TrainConfig, train  # noqa: E402
from textrl.agents.weight_check import WEIGHT_GAP_BOUNDS  # noqa: E402
from textrl.testing.engines import register_stale_engine  # noqa: E402


def stale_engine(inner_name: str) -> str:
    """An engine that samples with a copy of the model taken at its first call (textrl.testing.engines)."""
    return register_stale_engine(f"stale-{inner_name}", inner_name)


def gaps(engine: str, precision: str, top_p: float, iterations: int) -> list[float]:
    with tempfile.TemporaryDirectory() as out:
        config = TrainConfig(agent="grpo", iterations=iterations, warmup_sft_steps=30, prompts_per_iteration=4,
                             n_samples_per_prompt=4, max_new_tokens=16, eval_size=4, eval_every=0, progress=False,
                             output_dir=out, generation_engine=engine, top_p=top_p, actor_lr=1e-5,
                             max_weight_gap=1e9, mixed_precision="bf16" if precision == "bfloat16" else "no",
                             checkpoint_every=0)
        train(config)
        rows = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
        return [r.get("rollout/weight_gap", math.nan) for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--engines", default="textrl,hf,static")
    ap.add_argument("--precisions", default="float32,bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'engine':<8}{'precision':<10}{'top_p':>6}{'floor (max)':>14}{'stale it.2':>12}{'bound':>9}"
          f"{'bound/floor':>13}{'stale/bound':>13}")
    for precision in args.precisions.split(","):
        bound = WEIGHT_GAP_BOUNDS[precision]
        for engine in args.engines.split(","):
            for top_p in (1.0, 0.9):
                floor = max(gaps(engine, precision, top_p, args.iterations))
                stale = gaps(stale_engine(engine), precision, top_p, args.iterations)[1]
                print(f"{engine:<8}{precision:<10}{top_p:>6}{floor:>14.3g}{stale:>12.3g}{bound:>9g}"
                      f"{bound / floor:>13.3g}{stale / bound:>13.3g}", flush=True)


if __name__ == "__main__":
    main()
