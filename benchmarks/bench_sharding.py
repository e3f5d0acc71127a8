"""Peak memory per process of `textrl train` on N processes: replicated, FSDP and DeepSpeed ZeRO.

    python benchmarks/bench_sharding.py [--processes 2] [--hidden 768] [--layers 8] [--iterations 3]
                                        [--variants replicated,fsdp,zero2,zero3]

A Llama with the tiny 512-token vocabulary, hidden 768, 8 layers (57.4M parameters) is built
offline once; then `textrl train` (GAEPPO: policy and critic with AdamW, a reference copy, the
built-in rule reward) runs under torchrun on N CPU processes (gloo), with the same seed, prompts
and sizes, once per variant:

- ``replicated``: every process holds every weight, gradient and AdamW state;
- ``fsdp``: ``--fsdp``, each process holds 1/N of all three;
- ``zero1`` / ``zero2`` / ``zero3``: ``--zero-stage N`` (DeepSpeed: AdamW states, + gradients,
  + weights partitioned).

Gradient clipping is off in every run (``--max-grad-norm 0``): DeepSpeed clips the joint actor +
critic norm where the other variants clip each model, which would make the runs differ.
Reported:

- *training peak*: the largest process's peak memory over the training iterations (the last
  row's ``memory/peak_mib`` of `metrics.jsonl`, taken before that iteration's checkpoint:
  ``ru_maxrss`` on CPU, ``torch.cuda.max_memory_allocated`` with ``--device cuda``);
- *run peak per process* (`summary.json` ``peak_memory_mib``), which includes the final
  checkpoint: under FSDP the main process gathers the full state into CPU memory to write it;
- the median seconds per iteration (the first, with start-up, left out).

Every variant must end with the replicated run's weights: the rewards (no EOS, repetition) make
a random model learn, and a variant's mean |weight difference| must stay under 1% of the policy's
mean change (partitioned reductions add in another order, and Adam turns that float noise into
steps of up to the learning rate where a gradient is ~0). Prints a table, then one JSON line last. A script, never imported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

VARIANTS = {"replicated": [], "fsdp": ["--fsdp"], "zero1": ["--zero-stage", "1"],
            "zero2": ["--zero-stage", "2"], "zero3": ["--zero-stage", "3"]}
"""Each variant's extra `textrl train` options."""
REWARD = "missing_eos_penalty,repetition_penalty"
"""Rewards a random model earns (-1 without EOS, less for repeats), so every run learns something."""
AGREEMENT = 0.01
"""A variant's mean |weight - replicated weight| must stay under this share of the policy's mean movement."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(workdir: Path, hidden: int, layers: int) -> int:
    """The base causal LM and its tokenizer under ``workdir/base``; its parameter count."""
    from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer

    path = workdir / "base"
    if not (path / "config.json").is_file():
        tok = build_tiny_tokenizer()
        model = build_tiny_causal_lm(tok, seed=0, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                                     num_hidden_layers=layers, num_attention_heads=hidden // 64)
        model.save_pretrained(path)
        tok.save_pretrained(path)
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())


def run(variant: str, args: argparse.Namespace, workdir: Path) -> dict:
    out = workdir / variant
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time (textrl train refuses old checkpoints)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.processes}",
           f"--master_port={free_port()}", "-m", "textrl.cli", "train", "--agent", "gae_ppo",
           "--model", str(workdir / "base"),
           "--output-dir", str(out), "--iterations", str(args.iterations), "--warmup-sft-steps", "0",
           "--prompts-per-iteration", str(4 * args.processes), "--n-samples-per-prompt", "1",
           "--max-new-tokens", "16", "--ppo-epochs", "1", "--num-minibatches", "1", "--eval-every", "0",
           "--eval-size", "4", "--generation-batch-size", "4", "--forward-batch-size", "4",
           "--checkpoint-every", "0", "--keep-checkpoints", "1", "--device", args.device,
           "--max-grad-norm", "0", "--reward", REWARD, "--progress", "false", *VARIANTS[variant]]
    # glibc otherwise keeps freed large buffers (all-gathers, activations) in the heap after its
    # mmap threshold adapts, so the RSS high-water mark would count dead memory; with a fixed
    # threshold large blocks go back to the OS when freed, as CUDA's allocator statistics would
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["time/iteration_s"] for r in rows[1:]] or [rows[0]["time/iteration_s"]]
    return {"peak_mib": summary["peak_memory_mib"], "training_peak_mib": rows[-1]["memory/peak_mib"],
            "seconds_per_iteration": statistics.median(seconds),
            "weights_held_per_process": summary.get("weights_held_per_process", 1.0), "output_dir": out}


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    checkpoint = sorted((out / "checkpoints").glob("iter_*"))[-1]
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False, map_location="cpu")["agent"]
    return {k: v for k, v in state.items() if torch.is_tensor(v)}


def mean_abs(pairs) -> float:
    """Mean |a - b| over every element of ``(a, b)`` tensor pairs."""
    total = count = 0
    for a, b in pairs:
        total += (a - b).abs().sum().item()
        count += a.numel()
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU per process)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the model and runs here")
    parser.add_argument("--variants", default="replicated,fsdp,zero2,zero3",
                        help=f"comma-separated, from {', '.join(VARIANTS)} (replicated is always run first)")
    args = parser.parse_args()
    variants = ["replicated", *[v for v in args.variants.split(",") if v and v != "replicated"]]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")

    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        n_params = build_model(workdir, args.hidden, args.layers)
        results = {variant: run(variant, args, workdir) for variant in variants}
        reference = final_weights(results["replicated"]["output_dir"])
        # how far PPO moved the policy (the reference is its starting point): what the variants must agree on
        policy = [k for k in reference if k.startswith("policy.")]
        movement = mean_abs((reference[k], reference["ref_policy." + k[len("policy."):]]) for k in policy)
        max_diff, mean_diff = {}, {}
        for variant in variants[1:]:
            weights = final_weights(results[variant]["output_dir"])
            max_diff[variant] = max((reference[k] - weights[k]).abs().max().item() for k in reference)
            mean_diff[variant] = mean_abs((reference[k], weights[k]) for k in policy)

    base = results["replicated"]["training_peak_mib"]
    unit = "MiB (CUDA max allocated)" if args.device.startswith("cuda") else "MiB (peak RSS)"
    print(f"policy {n_params / 1e6:.1f}M parameters; {args.processes} processes on {args.device}; memory in {unit}")
    print(f"{'variant':<12}{'weights held':>14}{'training peak':>15}{'x replicated':>14}"
          f"{'run peak per process':>24}{'s / iteration':>15}")
    for variant, r in results.items():
        peaks = "/".join(f"{p:.0f}" for p in r["peak_mib"])
        print(f"{variant:<12}{r['weights_held_per_process']:>14.2f}{r['training_peak_mib']:>15.0f}"
              f"{r['training_peak_mib'] / base:>14.2f}{peaks:>24}{r['seconds_per_iteration']:>15.2f}")
    print(f"mean |policy weight change| over the run (replicated): {movement:.2e}")
    for variant in max_diff:
        print(f"final weights, {variant} vs replicated: mean |difference| {mean_diff[variant]:.2e} "
              f"(must be < {AGREEMENT:g} x the change), max {max_diff[variant]:.2e}")
    print(json.dumps({
        "parameters": n_params, "processes": args.processes, "device": args.device,
        "training_peak_mib": {k: round(r["training_peak_mib"], 1) for k, r in results.items()},
        "ratio_to_replicated": {k: round(r["training_peak_mib"] / base, 3) for k, r in results.items()},
        "run_peak_mib": {k: [round(p, 1) for p in r["peak_mib"]] for k, r in results.items()},
        "seconds_per_iteration": {k: round(r["seconds_per_iteration"], 3) for k, r in results.items()},
        "policy_mean_change": movement, "mean_weight_difference": mean_diff, "max_weight_difference": max_diff,
    }))
    if not movement > 0:
        raise SystemExit("the replicated run did not change the policy: nothing to compare")
    failed = [v for v, diff in mean_diff.items() if not diff < AGREEMENT * movement]
    if failed:
        raise SystemExit(f"{', '.join(failed)} did not reproduce the replicated run")


if __name__ == "__main__":
    main()
