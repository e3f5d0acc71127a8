"""Time and peak memory of the functional core against the baselines it replaces.

    python benchmarks/bench_functional.py [--threads 2] [--repeats 20]

1. ``gae`` (B=64, T=1024) against TorchRL's vectorised GAE
   (``vec_generalized_advantage_estimate``) on the same data: median seconds, ratio.
   Goal: ratio <= 2.
2. ``logprobs_from_logits`` (B=8, T=512, V=32000, float32) against the naive
   ``log_softmax(logits).gather(...)``: peak extra memory above the inputs (each measured in a
   fresh subprocess as the rise of the resident-set high-water mark), and seconds.
   Goal: chunked peak extra <= 0.5x the naive one.

Prints one JSON line last with every figure. A script, never imported (torchrl ships a
top-level ``benchmarks`` package, so this folder is not one).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

GAE_B, GAE_T = 64, 1024
LP_B, LP_T, LP_V = 8, 512, 32000


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_gae(repeats: int) -> dict[str, float]:
    from torchrl.objectives.value.functional import vec_generalized_advantage_estimate

    from textrl.functional import gae

    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(GAE_B, GAE_T, generator=g)
    values = torch.randn(GAE_B, GAE_T, generator=g)
    lengths = torch.randint(1, GAE_T + 1, (GAE_B,), generator=g)
    mask = torch.arange(GAE_T) < lengths[:, None]
    gamma, lam = 0.99, 0.95

    # TorchRL's layout: [B, T, 1], done at the last valid token, V(s_{t+1}) = 0 after it.
    done = torch.zeros(GAE_B, GAE_T, 1, dtype=torch.bool)
    done[torch.arange(GAE_B), lengths - 1, 0] = True
    value3 = torch.where(mask, values, 0.0).unsqueeze(-1)
    next_value3 = torch.cat([value3[:, 1:], torch.zeros(GAE_B, 1, 1)], dim=1)
    next_value3 = torch.where(done, 0.0, next_value3)
    reward3 = torch.where(mask, rewards, 0.0).unsqueeze(-1)

    ours = median_seconds(lambda: gae(rewards, values, mask, gamma=gamma, lam=lam), repeats)
    theirs = median_seconds(
        lambda: vec_generalized_advantage_estimate(
            gamma, lam, value3, next_value3, reward3, done=done, terminated=done, time_dim=-2
        ),
        repeats,
    )
    adv, _ = gae(rewards, values, mask, gamma=gamma, lam=lam)
    ref, _ = vec_generalized_advantage_estimate(
        gamma, lam, value3, next_value3, reward3, done=done, terminated=done, time_dim=-2
    )
    max_abs_diff = (adv - ref.squeeze(-1))[mask].abs().max().item()
    return {
        "gae_seconds": ours,
        "torchrl_vec_gae_seconds": theirs,
        "gae_ratio_to_torchrl": ours / theirs,
        "gae_max_abs_diff_vs_torchrl": max_abs_diff,
    }


def _logprob_worker(mode: str) -> None:
    """Run in a subprocess: print the peak-RSS rise (bytes) of one log-prob call, and its seconds."""
    from textrl.functional import logprobs_from_logits

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(LP_B, LP_T, LP_V, generator=g)
    tokens = torch.randint(0, LP_V, (LP_B, LP_T), generator=g)
    if mode == "naive":
        def fn():
            return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    else:
        def fn():
            return logprobs_from_logits(logits, tokens)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    start = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert out.shape == (LP_B, LP_T)
    print(json.dumps({"peak_extra_bytes": after - before, "seconds": seconds}))


def bench_logprobs(threads: int) -> dict[str, float]:
    results = {}
    for mode in ("naive", "chunked"):
        out = subprocess.run(
            [sys.executable, __file__, "--worker", mode, "--threads", str(threads)],
            check=True, capture_output=True, text=True,
        ).stdout.strip().splitlines()[-1]
        results[mode] = json.loads(out)
    mib = 2**20
    return {
        "logits_mib": LP_B * LP_T * LP_V * 4 / mib,
        "naive_peak_extra_mib": results["naive"]["peak_extra_bytes"] / mib,
        "chunked_peak_extra_mib": results["chunked"]["peak_extra_bytes"] / mib,
        "logprob_memory_ratio": results["chunked"]["peak_extra_bytes"]
        / max(1, results["naive"]["peak_extra_bytes"]),
        "naive_seconds": results["naive"]["seconds"],
        "chunked_seconds": results["chunked"]["seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--worker", choices=("naive", "chunked"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        _logprob_worker(args.worker)
        return
    figures = {"threads": args.threads, **bench_gae(args.repeats), **bench_logprobs(args.threads)}
    print(f"gae B={GAE_B} T={GAE_T}: {figures['gae_seconds'] * 1e3:.2f} ms, TorchRL vec GAE "
          f"{figures['torchrl_vec_gae_seconds'] * 1e3:.2f} ms, ratio {figures['gae_ratio_to_torchrl']:.2f} "
          f"(goal <= 2), max |diff| {figures['gae_max_abs_diff_vs_torchrl']:.2e}")
    print(f"logprobs B={LP_B} T={LP_T} V={LP_V} (logits {figures['logits_mib']:.0f} MiB): peak extra "
          f"naive {figures['naive_peak_extra_mib']:.0f} MiB, chunked {figures['chunked_peak_extra_mib']:.0f} MiB, "
          f"ratio {figures['logprob_memory_ratio']:.3f} (goal <= 0.5); seconds naive "
          f"{figures['naive_seconds']:.3f}, chunked {figures['chunked_seconds']:.3f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
