"""The wall-clock of ``textrl train --max-staleness K`` against the synchronous loop (K=0), and how
much of generation the actor's thread actually hides behind the learner's update.

    python benchmarks/bench_async.py [--staleness 0,1,4] [--iterations 12] [--repeats 2]
    python benchmarks/bench_async.py --hidden 256 --intermediate 1024 --layers 4   # a larger policy
    python benchmarks/bench_async.py --device cuda --hidden 768 --intermediate 3072 --layers 12 --heads 12

Each K trains the embedded default's task (``digits``, or ``--env``; the default agent and batch; no
warm-up, no evaluation) for ``--iterations`` in this process, the runs of the K's interleaved ``--repeats`` times
(so a loaded machine slows each alike); a run's first ``--skip`` iterations are left out. Per K it
prints the median seconds per iteration, ``speedup`` (K=0's median over this K's), the actor's
seconds per rollout (``generation`` + ``reward``, in its thread), the learner's (``forward`` +
``advantages`` + ``update``), the learner's wait for rollouts, and ``hidden``: the share of the
shorter side that overlapped the other, ``(actor + learner + wait - iteration) / min(actor,
learner)`` clipped to [0, 1] (1: the shorter side is hidden entirely). One JSON line at the end. A
larger ``--hidden`` spends more time in kernels that release the GIL; the tiny default is bound by
Python in both threads. A script, never imported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any


def build_model(folder: Path, hidden: int, intermediate: int, layers: int, heads: int) -> str:
    """A seeded tiny-tokenizer Llama of the given sizes saved to ``folder``; its path."""
    from textrl.models.tiny import build_tiny_causal_lm, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = build_tiny_causal_lm(tok, hidden_size=hidden, intermediate_size=intermediate,
                                 num_hidden_layers=layers, num_attention_heads=heads)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def run(k: int, root: Path, args: argparse.Namespace, model: str | None) -> list[dict[str, Any]]:
    """One run at staleness ``k``; its metrics rows."""
    from textrl.config import TrainConfig
    from textrl.trainer import train

    out = root / f"k{k}-{len(list(root.iterdir()))}"
    extra = {"model": model, "tokenizer": model} if model else {}
    config = TrainConfig(output_dir=str(out), iterations=args.iterations, max_staleness=k, warmup_sft_steps=0, env=args.env,
                         eval_every=0, eval_size=8, progress=False, device=args.device, seed=0, **extra)
    train(config)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summarise(rows: list[dict[str, Any]]) -> dict[str, float]:
    med = lambda key: statistics.median(r.get(key, 0.0) for r in rows)  # noqa: E731
    actor = med("time/generation_s") + med("time/reward_s")
    learner = med("time/forward_s") + med("time/advantages_s") + med("time/update_s")
    iteration, wait = med("time/iteration_s"), med("time/wait_s")
    overlap = actor + learner + wait - iteration
    hidden = min(1.0, max(0.0, overlap / min(actor, learner))) if min(actor, learner) > 0 else 0.0
    return {"seconds_per_iteration": iteration, "actor_s": actor, "learner_s": learner, "wait_s": wait,
            "hidden": hidden}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--staleness", default="0,1,4")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--skip", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--env", default="digits", help="the environment (guess_number: multi-turn)")
    parser.add_argument("--hidden", type=int, default=None, help="a Llama of these sizes instead of the tiny default")
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.staleness.split(",")]
    with tempfile.TemporaryDirectory(prefix="textrl-bench-async-") as tmp:
        root = Path(tmp) / "runs"
        root.mkdir()
        model = None
        if args.hidden:
            model = build_model(Path(tmp) / "model", args.hidden, args.intermediate or 4 * args.hidden, args.layers,
                                args.heads)
        rows: dict[int, list[dict[str, Any]]] = {k: [] for k in ks}
        for _ in range(args.repeats):
            for k in ks:
                rows[k] += run(k, root, args, model)[args.skip:]
    result = {k: summarise(r) for k, r in rows.items()}
    base = result[ks[0]]["seconds_per_iteration"]
    print(f"{'K':>3} {'s/iter':>8} {'speedup':>8} {'actor_s':>8} {'learner_s':>9} {'wait_s':>7} {'hidden':>7}")
    for k, r in result.items():
        r["speedup"] = base / r["seconds_per_iteration"]
        print(f"{k:>3} {r['seconds_per_iteration']:8.3f} {r['speedup']:8.2f} {r['actor_s']:8.3f} "
              f"{r['learner_s']:9.3f} {r['wait_s']:7.3f} {r['hidden']:7.2f}")
    print(json.dumps({"threads": torch.get_num_threads(), "hidden": args.hidden or "tiny", "env": args.env,
                      **{f"k{k}/{name}": round(v, 4) for k, r in result.items() for name, v in r.items()}}))


if __name__ == "__main__":
    main()
