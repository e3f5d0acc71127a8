"""Peak memory and seconds of the response tokens' log-probs and entropies, forward + backward:
the fused linear log-softmax against the path that materialises the logits.

    python benchmarks/bench_logprobs.py [--device cpu|cuda] [--threads 2] [--vocab 512,32000,151936]
        [--positions 64,256] [--hidden 896] [--autocast none|bf16] [--variants unfused,fused]
        [--chunk-elements 16777216]

For each vocabulary V and number of positions N (flattened B x T), hidden states ``[N, H]`` and an
LM head weight ``[V, H]`` (both with grad) go through three variants, each followed by
``(logp * a).sum() + (entropy * b).sum()`` and its backward (entropy with grad):

- ``unfused``: ``F.linear`` to ``[N, V]`` logits, then ``logprobs_from_logits`` /
  ``entropy_from_logits`` (chunked themselves, but the logits and their gradient are whole): what
  ``response_logits`` + the agents compute today;
- ``checkpoint``: the same per chunk of positions inside ``torch.utils.checkpoint`` (the other way
  to fuse: autograd recomputes each chunk's forward in the backward);
- ``fused``: ``textrl.functional.logprobs_from_hidden`` (a custom autograd function that
  recomputes each chunk's logits and accumulates the weight's gradient itself).

Chunks hold ``DEFAULT_CHUNK_ELEMENTS`` (2**24) logits (``--chunk-elements``). Memory is the peak above the inputs,
including the gradients of hidden and weight (``grads`` column, the same for every variant;
``work`` is the peak less them): on CUDA ``torch.cuda.max_memory_allocated``; on the CPU the
resident-set high-water mark (reset through ``/proc/self/clear_refs``), with glibc told to
``mmap`` every block over 64 KiB so that a freed tensor leaves the resident set at once. Seconds:
one run on the CPU (the measured one), the median of three after a warm-up on CUDA. CPU defaults:
float32, ``N`` 64 and 256, unfused and fused (under a minute on 2 cores; at these ``N`` a chunk
is most of the positions, so the CPU shows the cost more than the saving: add ``--positions
2048 --vocab 151936`` for that); CUDA defaults: bf16 autocast, ``N`` 2048 and 8192, all three. Prints a table, then one JSON line last. A script, never imported.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from textrl.functional import entropy_from_logits, logprobs_from_hidden, logprobs_from_logits
from textrl.functional import logprobs as lp_mod

VARIANTS = ("unfused", "checkpoint", "fused")
MIB = 2**20


def unfused(hidden, weight, tokens):
    logits = F.linear(hidden, weight)[None]  # [1, N, V]
    return logprobs_from_logits(logits, tokens[None])[0], entropy_from_logits(logits)[0]


def checkpointed(hidden, weight, tokens):
    chunk = max(1, lp_mod.DEFAULT_CHUNK_ELEMENTS // weight.shape[0])
    pieces = [checkpoint(unfused, hidden[s : s + chunk], weight, tokens[s : s + chunk], use_reentrant=False)
              for s in range(0, hidden.shape[0], chunk)]
    return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])


def fused(hidden, weight, tokens):
    return logprobs_from_hidden(hidden, weight, tokens, entropy="grad")


FUNCTIONS = {"unfused": unfused, "checkpoint": checkpointed, "fused": fused}


# -- CPU memory: the resident set, every large block its own mapping ---------------------------------
def mmap_large_blocks() -> bool:
    """glibc: serve (and return) every allocation over 64 KiB with its own ``mmap``."""
    try:
        return ctypes.CDLL("libc.so.6").mallopt(-3, 65536) == 1  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- one measurement --------------------------------------------------------------------------------
def inputs(v: int, n: int, h: int, device: str):
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, generator=g).requires_grad_()
    weight = (torch.randn(v, h, device=device, generator=g) * 0.02).requires_grad_()
    tokens = torch.randint(0, v, (n,), device=device, generator=g)
    a, b = torch.randn(n, device=device, generator=g), torch.randn(n, device=device, generator=g)
    return hidden, weight, tokens, a, b


def step(fn, hidden, weight, tokens, a, b, autocast: bool) -> None:
    hidden.grad = weight.grad = None
    ctx = torch.autocast(hidden.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        logp, ent = fn(hidden, weight, tokens)
    ((logp * a).sum() + (ent * b).sum()).backward()


def measure(variant: str, v: int, n: int, h: int, device: str, autocast: bool) -> dict:
    hidden, weight, tokens, a, b = inputs(v, n, h, device)
    fn = FUNCTIONS[variant]
    if device == "cuda":
        step(fn, hidden, weight, tokens, a, b, autocast)  # warm-up
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            step(fn, hidden, weight, tokens, a, b, autocast)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        peak, seconds = torch.cuda.max_memory_allocated() - base, statistics.median(times)
    else:
        reset_peak()
        base = rss_bytes()
        start = time.perf_counter()
        step(fn, hidden, weight, tokens, a, b, autocast)
        seconds = time.perf_counter() - start
        peak = peak_rss_bytes() - base
    grads = hidden.grad.numel() * hidden.grad.element_size() + weight.grad.numel() * weight.grad.element_size()
    return {"variant": variant, "vocab": v, "positions": n, "peak_mib": peak / MIB, "grads_mib": grads / MIB,
            "work_mib": (peak - grads) / MIB, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", default="512,32000,151936")
    parser.add_argument("--positions", default=None, help="N values (default: 64,256 on cpu, 2048,8192 on cuda)")
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--chunk-elements", type=int, default=lp_mod.DEFAULT_CHUNK_ELEMENTS,
                        help="logits per chunk (default: DEFAULT_CHUNK_ELEMENTS)")
    parser.add_argument("--variants", default=None,
                        help=f"a comma list of {', '.join(VARIANTS)} (default: all on cuda, unfused,fused on cpu)")
    parser.add_argument("--autocast", choices=("none", "bf16"), default=None,
                        help="default: none on cpu (its bf16 matmuls are slow), bf16 on cuda")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lp_mod.DEFAULT_CHUNK_ELEMENTS = args.chunk_elements
    cuda = args.device == "cuda"
    positions = [int(x) for x in (args.positions or ("2048,8192" if cuda else "64,256")).split(",")]
    vocabs = [int(x) for x in args.vocab.split(",")]
    variants = [v for v in (args.variants or (",".join(VARIANTS) if cuda else "unfused,fused")).split(",") if v]
    if "unfused" not in variants or not set(variants) <= set(VARIANTS):
        raise SystemExit(f"--variants {args.variants}: a comma list of {', '.join(VARIANTS)}, with unfused (the baseline)")
    autocast = (args.autocast or ("bf16" if cuda else "none")) == "bf16"
    if not cuda and not mmap_large_blocks():
        raise SystemExit("bench_logprobs: could not set glibc's mmap threshold; CPU peaks would be unreliable")

    for variant in variants:  # first calls (thread pools, lazy initialisation) out of the figures
        measure(variant, 512, 16, 8, args.device, autocast)
    rows = [measure(variant, v, n, args.hidden, args.device, autocast)
            for v in vocabs for n in positions for variant in variants]
    base = {(r["vocab"], r["positions"]): r for r in rows if r["variant"] == "unfused"}
    for r in rows:
        ref = base[(r["vocab"], r["positions"])]
        r["peak_ratio"] = r["peak_mib"] / ref["peak_mib"]
        r["work_ratio"] = r["work_mib"] / max(ref["work_mib"], 1e-9)
        r["time_ratio"] = r["seconds"] / ref["seconds"]

    device = f"cuda ({torch.cuda.get_device_name()})" if cuda else f"cpu ({args.threads} threads)"
    print(f"{device}, H={args.hidden}, {'bf16 autocast' if autocast else 'float32'}, entropy with grad; "
          "memory above the inputs in MiB (grads: of hidden and weight, in every peak)")
    print(f"{'V':>7} {'N':>6} {'variant':>10} {'peak':>9} {'grads':>8} {'work':>9} {'seconds':>8} "
          f"{'peak/unf':>8} {'work/unf':>8} {'time/unf':>8}")
    for r in rows:
        print(f"{r['vocab']:>7} {r['positions']:>6} {r['variant']:>10} {r['peak_mib']:>9.1f} {r['grads_mib']:>8.1f} "
              f"{r['work_mib']:>9.1f} {r['seconds']:>8.3f} {r['peak_ratio']:>8.3f} {r['work_ratio']:>8.3f} "
              f"{r['time_ratio']:>8.2f}")
    print(json.dumps({"device": device, "hidden": args.hidden, "autocast": "bf16" if autocast else "none",
                      "chunk_elements": args.chunk_elements, "rows": rows}))


if __name__ == "__main__":
    main()
