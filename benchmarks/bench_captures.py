"""The decoders and feeds the ``textrl`` engine makes over a multi-turn training run: on CUDA each
is a CUDA graph captured (a few warm-up steps and a capture, tens of milliseconds), so a run whose
later iterations keep making them pays that every turn.

    python benchmarks/bench_captures.py                       # guess_number, rloo, 10 iterations
    python benchmarks/bench_captures.py --env guess_number --agent grpo --iterations 20

Runs ``textrl train --env ENV --agent AGENT --iterations N`` (the embedded default model, on the
CPU, in this process) once per set-up, the engine built as on CUDA (``attention_window=None``; the
CPU captures nothing, so what is counted is :class:`textrl.generation.graph.Graphs`' ``made`` and
``feeds_made``, what CUDA would capture):

- ``filled``: the engine's CUDA defaults: rows rounded up to a multiple of 8 with filler rows, 32
  decoders kept, their static caches views of one shared buffer;
- ``own_shapes``: every row count its own shape, 4 decoders kept (``row_bucket=1``, ``keep=4``).

Prints, per set-up, the decoders and feeds each rollout (``engine.rollout()`` block: a training
iteration's or an evaluation's episodes) made, their totals, and those of the rollouts in the
second half of the run (after warming up), then one JSON line. Counts, not time: the same on any
device. A script, never imported (torchrl ships a top-level ``benchmarks`` package).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

SETUPS = {"filled": dict(row_bucket=8, keep=32), "own_shapes": dict(row_bucket=1, keep=4)}


def count_run(setup: str, args: argparse.Namespace) -> list[tuple[int, int]]:
    """``(decoders made, feeds made)`` of each outermost rollout of one ``textrl train`` run in ``setup``."""
    from textrl.cli import main
    from textrl.generation import DecodeEngine, register_engine

    options = SETUPS[setup]
    name = f"bench_captures_{setup}"
    per_rollout: list[tuple[int, int]] = []

    class Counted(DecodeEngine):
        def __init__(self) -> None:
            super().__init__(row_bucket=options["row_bucket"], attention_window=None)
            self.graphs.keep = options["keep"]

        @contextlib.contextmanager
        def rollout(self) -> Iterator[None]:
            outer = self.carry is None
            made, feeds = self.graphs.made, self.graphs.feeds_made
            with super().rollout():
                yield
            if outer:
                per_rollout.append((self.graphs.made - made, self.graphs.feeds_made - feeds))

    register_engine(name)(Counted)
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(sys.stderr):  # the run's table: not ours
        code = main(["train", "--env", args.env, "--agent", args.agent, "--iterations", str(args.iterations),
                     "--generation-engine", name, "--output-dir", out, "--seed", str(args.seed), "--progress", "false",
                     *(["--warmup-sft-steps", str(args.warmup_sft_steps)] if args.warmup_sft_steps is not None else [])])
    if code:
        raise SystemExit(f"bench_captures.py: textrl train exited with {code} in set-up {setup}")
    return per_rollout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="guess_number", help="a multi-turn environment (textrl envs)")
    parser.add_argument("--agent", default="rloo")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-sft-steps", type=int, default=None,
                        help="textrl train's supervised warm-up steps (default: train's own)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {}
    for setup in SETUPS:
        per = count_run(setup, args)
        later = per[len(per) // 2:]
        result[setup] = {"per_rollout": per, "decoders": sum(d for d, _ in per), "feeds": sum(f for _, f in per),
                         "later_decoders": sum(d for d, _ in later), "later_feeds": sum(f for _, f in later)}
    print(f"{args.env}, {args.agent}, {args.iterations} iterations: decoders and feeds made (on CUDA: graphs captured)")
    print(f"{'set-up':<12} {'rollouts':>8} {'decoders':>8} {'feeds':>6} {'2nd half: decoders':>19} {'feeds':>6}")
    for setup, r in result.items():
        print(f"{setup:<12} {len(r['per_rollout']):>8} {r['decoders']:>8} {r['feeds']:>6} {r['later_decoders']:>19} "
              f"{r['later_feeds']:>6}")
    print(json.dumps({"env": args.env, "agent": args.agent, "iterations": args.iterations, "setups": result}), flush=True)


if __name__ == "__main__":
    main()
