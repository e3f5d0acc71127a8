"""On-policy distillation on the CPU: the untrained tiny model learns the warmed-up one's distribution.

    python benchmarks/bench_distill.py [--seeds 0,1,2] [--iterations 60] [--agent gae_ppo] [--actor-lr 3e-3] [--gamma 0]

The teacher is textrl's embedded default as ``textrl train`` starts it: the tiny model after its
supervised format warm-up on the digits task (:func:`textrl.agents.build.load_policy`, 200 steps at
the default settings), saved to a temporary folder. The student is the same tiny model without the
warm-up (``--warmup-sft-steps 0``). Each seed runs ``textrl train --teacher FOLDER`` with no
``--reward`` (the teacher's per-token reward alone: minus the reverse KL to it), ``--kl-coef 0``, and for
``gae_ppo`` ``--gamma 0`` (each token credited with its own reward, as the papers do; the critic is the
baseline). 8 prompts x 4 samples of 16 tokens an iteration, ``--actor-lr 3e-3``.

The KL is the run's own ``teacher/reverse_kl``: the mean over the student's sampled tokens of
``log pi(y_t) - log pi_T(y_t)``, an unbiased estimate of the per-token KL(student || teacher) on the
student's own samples (every iteration's rollout, before its update). *Before* is the first
iteration's (the untrained student), *after* the mean of the last five. Over the seeds, the mean with
its stratified-bootstrap 95% interval and the after - before difference with its interval
(:mod:`textrl.bench.stats`, as ``textrl bench`` reports them); the task's accuracy (logged, not
optimised) is printed beside it. Prints a table, then one JSON line last. A script, never imported.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from textrl.bench.stats import difference_ci, mean, stratified_bootstrap_ci

LAST = 5
"""Iterations averaged for the KL after training."""


def warmed_teacher(folder: Path) -> Path:
    """The tiny model after ``textrl train``'s default format warm-up, saved (with its tokenizer) in ``folder``."""
    import torch

    from textrl.agents.build import load_policy, load_tokenizer
    from textrl.config import TrainConfig

    config = TrainConfig(model="tiny", device="cpu")  # warmup_sft_steps=200, the default
    tokenizer = load_tokenizer(config)
    with contextlib.redirect_stdout(io.StringIO()):
        policy, record, _ = load_policy(config, tokenizer, torch.device("cpu"))
    assert record["ran_steps"] == config.warmup_sft_steps, record
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run(teacher: Path, seed: int, iterations: int, agent: str, lr: float, out: Path,
        extra: tuple[str, ...] = ()) -> list[dict]:
    """One ``textrl train --teacher`` run; its metric rows."""
    from textrl.cli import main

    argv = ["train", "--model", "tiny", "--teacher", str(teacher), "--agent", agent, "--kl-coef", "0",
            "--warmup-sft-steps", "0", "--seed", str(seed), "--iterations", str(iterations), "--device", "cpu",
            "--prompts-per-iteration", "8", "--n-samples-per-prompt", "4", "--max-new-tokens", "16",
            "--actor-lr", str(lr), "--eval-every", "0", "--eval-size", "8", "--checkpoint-every", "0",
            "--progress", "false", "--output-dir", str(out), *extra]
    with contextlib.redirect_stdout(io.StringIO()):
        main(argv)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def interval(entry: dict) -> str:
    return f"{entry['point']:.3f} [{entry['low']:.3f}, {entry['high']:.3f}]"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--agent", default="gae_ppo")
    parser.add_argument("--actor-lr", type=float, default=3e-3)
    parser.add_argument("--gamma", type=float, default=0.0,
                        help="for an agent that reads it: 0 credits each token with its own reward, the papers' choice")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    from textrl.agents import agent_class

    extra = ("--gamma", str(args.gamma)) if "gamma" in agent_class(args.agent).options else ()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        teacher = warmed_teacher(Path(tmp) / "teacher")
        before, after, accuracy = [], [], []
        for seed in seeds:
            rows = [r for r in run(teacher, seed, args.iterations, args.agent, args.actor_lr, Path(tmp) / f"run{seed}", extra)
                    if "teacher/reverse_kl" in r]
            kl = [r["teacher/reverse_kl"] for r in rows]
            before.append(kl[0])
            after.append(float(np.mean(kl[-LAST:])))
            accuracy.append((rows[0].get("reward/mean", float("nan")), float(np.mean([r.get("reward/mean", np.nan)
                                                                                      for r in rows[-LAST:]]))))
            print(f"seed {seed}: KL {kl[0]:.3f} -> {after[-1]:.3f} (task reward {accuracy[-1][0]:.3f} -> "
                  f"{accuracy[-1][1]:.3f}), {len(rows)} iterations", file=sys.stderr)
        seconds = time.perf_counter() - start
    b, a = np.array(before)[:, None], np.array(after)[:, None]  # [runs, tasks=1]
    cis = stratified_bootstrap_ci({"before": b, "after": a}, mean)
    cis = {name: {k: float(np.asarray(v).reshape(-1)[0]) for k, v in entry.items()} for name, entry in cis.items()}
    diff = difference_ci(a, b, mean, names=("after", "before"))
    diff = {k: float(np.asarray(v).reshape(-1)[0]) for k, v in diff.items()}
    print(f"\non-policy distillation, {args.agent} {' '.join(extra)}, {len(seeds)} seeds x {args.iterations} iterations "
          f"({seconds:.0f} s): KL(student || teacher) per token, mean [95% interval]")
    print(f"  before  {interval(cis['before'])}")
    print(f"  after   {interval(cis['after'])}  (mean of the last {LAST} iterations)")
    print(f"  after - before  {interval(diff)}")
    print(json.dumps({"agent": args.agent, "settings": list(extra) + ["--actor-lr", str(args.actor_lr)], "seeds": seeds, "iterations": args.iterations, "before": before,
                      "after": after, "before_ci": cis["before"], "after_ci": cis["after"], "difference_ci": diff,
                      "task_reward": accuracy, "seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()
