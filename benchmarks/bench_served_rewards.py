"""Seconds a served reward model and an LLM judge add to an iteration's scoring, against the same reward
model scored in this process (``reward_model:PATH``), measured in the same run.

    python benchmarks/bench_served_rewards.py                        # tiny models, both servers started here
    python benchmarks/bench_served_rewards.py --rows 256 --repeats 7
    python benchmarks/bench_served_rewards.py --rm-server http://rm-node:8002 --judge-server http://judge-node:8003 \\
        --rm PATH                                                     # servers already running (their own GPUs)

One iteration's rows (``--rows`` prompt/completion pairs of ``--words`` words each, the same every
repeat) are scored ``--repeats`` times by each path, the median printed:

- ``rule``: ``think_format`` (the floor: no model);
- ``in_process``: ``reward_model:PATH``, the tiny reward model (heads of 32) in this process, on one CPU
  thread (the baseline; the servers idle meanwhile);
- ``served``: ``reward_model:URL``, the same model served by ``textrl vllm-serve --reward-model``;
- ``judge``: ``judge:URL``, the tiny causal LM served by ``textrl vllm-serve``, a verdict of
  ``--judge-tokens`` tokens a row (greedy), parsed by the default yes/no choices.

``ratio``: the path's seconds over ``in_process``'s; ``added``: the path's seconds minus
``in_process``'s, what swapping the in-process reward model for it adds per iteration. On one
machine the servers share its cores with this process: the figures are what a served reward costs
in transit and waiting, not what a GPU server gives. Every model runs on one thread (this process's
torch, each server's worker bound to core 0, the servers started here), so the comparison is of the
paths, not of how many cores each takes. One JSON line at the end. A script, never imported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any


def rows(n: int, words: int) -> tuple[list[str], list[str]]:
    vocab = "the answer is four because two and two make four so we add them up".split()
    prompts = [f"Question {i}: what is {i % 7} plus {i % 5}?" for i in range(n)]
    completions = [" ".join(vocab[(i + j) % len(vocab)] for j in range(words)) for i in range(n)]
    return prompts, completions


def timed(fn: Any, prompts: list[str], completions: list[str], repeats: int) -> float:
    fn(prompts, completions)  # warm: the first call's set-up (threads, connections, caches)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(prompts, completions)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def start(folder: Path, port: int, log: Path, *options: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    cmd = [sys.executable, "-m", "textrl.cli", "vllm-serve", *options, str(folder), "--port", str(port), "--dtype",
           "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", str(256 << 20), "--enforce-eager"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True), \
        f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="rows an iteration scores (prompts x samples)")
    parser.add_argument("--words", type=int, default=48, help="words per completion")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--judge-tokens", type=int, default=4)
    parser.add_argument("--rm", default=None, help="the reward model folder (default: the tiny one, built here)")
    parser.add_argument("--rm-server", default=None, help="a running textrl vllm-serve --reward-model URL of --rm")
    parser.add_argument("--judge-server", default=None, help="a running textrl vllm-serve URL of a judge model")
    args = parser.parse_args()

    import signal

    import torch

    from textrl.generation.vllm_server import free_port
    from textrl.models import build_tiny_causal_lm, build_tiny_reward_model, build_tiny_tokenizer
    from textrl.rewards import get_reward
    from textrl.testing.servers import wait_until_serving

    torch.set_num_threads(1)  # one core each: this process's forward, each server's worker (on core 0)
    root = Path(tempfile.mkdtemp(prefix="bench_served_"))
    tok = build_tiny_tokenizer()
    rm = args.rm or str(root / "rm")
    if args.rm is None:
        build_tiny_reward_model(tok, num_attention_heads=2).save_pretrained(rm)
        tok.save_pretrained(rm)
    started = []
    if args.rm_server is None:
        started.append(start(Path(rm), free_port(), root / "rm.log", "--reward-model"))
    if args.judge_server is None:
        build_tiny_causal_lm(tok, num_attention_heads=2).save_pretrained(root / "judge")
        tok.save_pretrained(root / "judge")
        started.append(start(root / "judge", free_port(), root / "judge.log"))
    try:
        for proc, url in started:
            wait_until_serving(proc, url, root / ("rm.log" if "--reward-model" in proc.args else "judge.log"))
        urls = iter(url for _, url in started)
        rm_url = args.rm_server or next(urls)
        judge_url = args.judge_server or next(urls)
        prompts, completions = rows(args.rows, args.words)
        paths = {
            "rule": get_reward("think_format"),
            "in_process": get_reward(f"reward_model:{rm}"),
            "served": get_reward(f"reward_model:{rm_url}"),
            "judge": get_reward(f"judge:{judge_url}?max_tokens={args.judge_tokens}"),
        }
        figures = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the untrained judge's verdicts are unparsable
            for name, fn in paths.items():
                figures[name] = timed(fn, prompts, completions, args.repeats)
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
    base = figures["in_process"]
    print(f"{args.rows} rows of {args.words} words, median of {args.repeats}; baseline in_process "
          f"(this process, {torch.get_num_threads()} threads)")
    print(f"{'path':<12} {'s/iteration':>12} {'ratio':>8} {'added s':>9}")
    for name, seconds in figures.items():
        print(f"{name:<12} {seconds:>12.4f} {seconds / base:>8.2f} {seconds - base:>+9.4f}")
    print(json.dumps({"rows": args.rows, "threads": torch.get_num_threads(), "words": args.words, "repeats": args.repeats,
                      "judge_tokens": args.judge_tokens, "seconds": figures}))


if __name__ == "__main__":
    main()
