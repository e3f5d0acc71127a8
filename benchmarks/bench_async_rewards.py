"""The seconds a slow reward costs a training iteration: scored in the loop, or in the background.

    python benchmarks/bench_async_rewards.py [--sleep 0.02] [--iterations 6] [--skip 2] [--repeats 2]
    python benchmarks/bench_async_rewards.py --max-staleness 1     # the asynchronous loop too

The reward waits ``--sleep`` S seconds for each completion it scores, one after another (a judge or a
sandbox called once per completion), then scores as ``tag_count`` does. Three arms train the same run
(the tiny default policy on ``digits``, no warm-up, no evaluation; ``--prompts`` x ``--samples`` rows
a rollout, generated in micro-batches of ``--generation-batch-size``):

- ``sync``: the reward a plain function, scored in the loop once generation ends (today's path);
- ``does_io``: the same function declared ``@textrl.rewards.does_io``: scored in the background,
  each micro-batch's episodes while the next generates, in up to ``--reward-concurrency`` calls
  (docs/rewards.md, "Asynchronous rewards");
- ``async``: the same as ``async def`` (awaiting ``asyncio.sleep``), in the background too.

The arms' runs are interleaved ``--repeats`` times (a loaded machine slows each alike), a run's first
``--skip`` iterations left out. Per arm it prints the median seconds per iteration, of generation, of
``time/reward_s`` (the seconds the loop waited for rewards), of ``time/reward_calls_s`` (the seconds
the background calls ran, summed over the calls), ``ratio``: the arm's iteration seconds over
``sync``'s, and ``wait ratio``: its reward wait over ``sync``'s, both measured in the same run (on a
shared machine the iteration's seconds swing with the other jobs; the wait is the reward's part).
One JSON line at the end. A script, never imported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ARMS = ("sync", "does_io", "async")
SLEEP = {"s": 0.02}
"""Seconds the reward waits per completion (``--sleep``)."""


def slow_tag_count(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    from textrl.rewards import tag_count_reward

    time.sleep(SLEEP["s"] * len(completions))
    return tag_count_reward(prompts, completions, **kwargs).tolist()


async def async_tag_count(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    from textrl.rewards import tag_count_reward

    await asyncio.sleep(SLEEP["s"] * len(completions))
    return tag_count_reward(prompts, completions, **kwargs).tolist()


def reward_of(arm: str) -> Any:
    from textrl.rewards import does_io

    if arm == "sync":
        return slow_tag_count
    if arm == "does_io":
        return does_io(lambda prompts, completions, **kw: slow_tag_count(prompts, completions, **kw))
    return async_tag_count


def run(arm: str, root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One run of ``arm``; its metrics rows."""
    from textrl.config import TrainConfig
    from textrl.training.trainer import train

    out = root / f"{arm}-{len(list(root.iterdir()))}"
    config = TrainConfig(output_dir=str(out), iterations=args.iterations, warmup_sft_steps=0, env="digits",
                         reward=reward_of(arm), eval_every=0, eval_size=4, progress=False, device=args.device, seed=0,
                         prompts_per_iteration=args.prompts, n_samples_per_prompt=args.samples,
                         generation_batch_size=args.generation_batch_size, reward_concurrency=args.reward_concurrency,
                         max_staleness=args.max_staleness)
    train(config)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summarise(rows: list[dict[str, Any]]) -> dict[str, float]:
    med = lambda key: statistics.median(r.get(key, 0.0) for r in rows)  # noqa: E731
    return {"seconds_per_iteration": med("time/iteration_s"), "generation_s": med("time/generation_s"),
            "reward_wait_s": med("time/reward_s"), "reward_calls_s": med("time/reward_calls_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sleep", type=float, default=0.02, help="seconds the reward waits per completion")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--generation-batch-size", type=int, default=8)
    parser.add_argument("--reward-concurrency", type=int, default=8)
    parser.add_argument("--max-staleness", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.iterations <= args.skip:
        raise SystemExit(f"--iterations {args.iterations} must exceed --skip {args.skip}")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    SLEEP["s"] = args.sleep
    rows: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for arm in ARMS:
                rows[arm] += run(arm, Path(tmp), args)[args.skip:]
    figures = {arm: summarise(r) for arm, r in rows.items()}
    base, base_wait = figures["sync"]["seconds_per_iteration"], figures["sync"]["reward_wait_s"]
    rollout = args.prompts * args.samples
    print(f"a reward sleeping {args.sleep:g} s a completion, {rollout} completions a rollout (the loop's wait in "
          f"series: {rollout * args.sleep:.2f} s), micro-batches of {args.generation_batch_size}, "
          f"--reward-concurrency {args.reward_concurrency}, --max-staleness {args.max_staleness}; medians of "
          f"{args.repeats} x {args.iterations - args.skip} iterations")
    print(f"{'arm':<10}{'s / it':>9}{'generation':>12}{'reward wait':>13}{'reward calls':>14}{'ratio':>8}"
          f"{'wait ratio':>12}")
    for arm, f in figures.items():
        f["ratio"] = f["seconds_per_iteration"] / base
        f["wait_ratio"] = f["reward_wait_s"] / base_wait
        print(f"{arm:<10}{f['seconds_per_iteration']:>9.3f}{f['generation_s']:>12.3f}{f['reward_wait_s']:>13.3f}"
              f"{f['reward_calls_s']:>14.3f}{f['ratio']:>8.2f}{f['wait_ratio']:>12.2f}")
    print(json.dumps({"sleep_s": args.sleep, "rows": rollout, "generation_batch_size": args.generation_batch_size,
                      "reward_concurrency": args.reward_concurrency, "max_staleness": args.max_staleness,
                      "arms": figures}))


if __name__ == "__main__":
    main()
