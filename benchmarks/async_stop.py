"""How long an asynchronous run takes to stop on SIGTERM (a scheduler's preemption), with and without
cancelling the rollout in flight (docs/async.md, "Checkpoints, evaluations and stops").

A ``textrl train --max-staleness K`` run whose engine is slow (each generation call ``--call-s``
seconds longer, ``--calls`` calls a rollout: a rollout takes about their product) is sent SIGTERM
once ``--after`` iterations are in metrics.jsonl; printed: the seconds from the signal to the
process's exit (the current iteration's end, the checkpoint, the exit) with the actor's rollout in
flight cancelled at its next call (textrl's behaviour) and with the actor left to draw until it
waits for weights (up to K rollouts: the behaviour before), and their ratio; and the same stop
with an engine that is not slowed (what stopping costs by itself: the iteration's end, the
checkpoint, summary.json, curves.png, the exit). The floor over that is one rollout's seconds: the
current iteration may still be waiting for its own.

    python benchmarks/async_stop.py [--max-staleness 4] [--call-s 0.5] [--calls 4] [--after 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def child(args: argparse.Namespace) -> None:
    """The run itself (in its own process, for its signal handler)."""
    from textrl import TrainConfig, train
    from textrl.generation.base import get_engine
    from textrl.training.async_training import AsyncTraining

    engine = type(get_engine("textrl"))
    generate = engine.generate_with_logprobs

    def slow(self, *a, **kw):
        time.sleep(args.call_s)
        return generate(self, *a, **kw)

    engine.generate_with_logprobs = slow
    if args.cancel == "off":  # the behaviour before: no rewind, so quiesce waits for the producer to run dry
        from textrl.agents.async_actor import AsyncRollouts

        def pipeline(self):
            return AsyncRollouts(self._produce, max_staleness=self.max_staleness, load=self.actor.load,
                                 start_state=self._start_state)

        AsyncTraining._pipeline = pipeline
    rows = 8
    config = TrainConfig(agent="grpo", iterations=100, warmup_sft_steps=5, prompts_per_iteration=rows // 2,
                         n_samples_per_prompt=2, max_new_tokens=8, eval_size=4, eval_every=0, progress=False,
                         output_dir=args.output_dir, max_staleness=args.max_staleness,
                         generation_batch_size=max(1, rows // args.calls), checkpoint_every=0)
    train(config)


def stop_seconds(cancel: str, args: argparse.Namespace, call_s: float) -> float:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, __file__, "--child", "--cancel", cancel, "--output-dir", out,
                   "--max-staleness", str(args.max_staleness), "--call-s", str(call_s), "--calls", str(args.calls)]
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        metrics = Path(out) / "metrics.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= args.after):
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended before iteration {args.after}: {proc.stderr.read()[-2000:]}")
            time.sleep(0.05)
        sent = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=600)
        seconds = time.perf_counter() - sent
        if "stopped by SIGTERM" not in err or not any((Path(out) / "checkpoints").iterdir()):
            raise RuntimeError(f"no SIGTERM stop with a checkpoint: {err[-2000:]}")
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--call-s", type=float, default=0.5)
    parser.add_argument("--calls", type=int, default=4, help="generation calls a rollout (of 8 rows)")
    parser.add_argument("--after", type=int, default=2, help="iterations done before the SIGTERM")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cancel", default="on", help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rollout = args.call_s * args.calls
    figures = {cancel: stop_seconds(cancel, args, args.call_s) for cancel in ("off", "on")}
    figures["not_slowed"] = stop_seconds("on", args, 0.0)
    base = figures["not_slowed"]
    print(json.dumps({"max_staleness": args.max_staleness, "rollout_s": rollout, "sigterm_to_exit_s": figures}))
    print(f"K={args.max_staleness}, a rollout ~{rollout:.1f} s ({args.calls} calls of +{args.call_s} s): SIGTERM to "
          f"exit {figures['off']:.1f} s waiting for the actor, {figures['on']:.1f} s cancelling its rollout; "
          f"{base:.1f} s with the engine not slowed. Over that: {figures['off'] - base:.1f} s against "
          f"{figures['on'] - base:.1f} s ({(figures['off'] - base) / max(figures['on'] - base, 1e-9):.1f}x); "
          f"floor {rollout:.1f} s (the current iteration's own rollout), K rollouts {args.max_staleness * rollout:.1f} s")


if __name__ == "__main__":
    main()
