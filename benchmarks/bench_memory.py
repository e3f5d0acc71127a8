"""Peak memory of one PPO iteration: GAEPPO with four models vs MultiAdapterPPO on one base.

    python benchmarks/bench_memory.py [--threads 2] [--layers 8] [--hidden 768] [--workdir DIR] [--device cuda]

A Llama with the tiny 512-token vocabulary, hidden 768, 8 layers (about 57M parameters, so the
weights dominate; about a minute in all on 2 CPU cores) is built offline once, with a same-sized sequence-classification reward model
and a LoRA reward adapter on the base. Each variant then runs in a fresh subprocess:

- ``gae_ppo``: policy, reference (a copy), critic (a copy + value head), reward model: four
  full-precision models, the policy and critic with AdamW states;
- ``multi_adapter_ppo``: one full-precision base with policy / reward LoRA adapters and a value head;
- ``multi_adapter_ppo_4bit``: the same on a 4-bit NF4 base.

Each subprocess loads its models, then runs iteration 1 (``collect`` + ``update``: generation,
reward, log-prob / value forwards, one epoch of two minibatches) and iteration 2 (timed). Memory
is the rise of the peak over the RSS right after the imports (``ru_maxrss``; after loading, the
freed heap is handed back with ``malloc_trim`` and the kernel's peak is reset where
``/proc/self/clear_refs`` allows, so loading and quantisation transients do not count), or ``torch.cuda.max_memory_allocated`` on CUDA. Goal: MultiAdapterPPO at most 0.4x
the four-model peak. Prints a table, then one JSON line last. A script, never imported.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

VARIANTS = ("gae_ppo", "multi_adapter_ppo", "multi_adapter_ppo_4bit")
GOAL = 0.4


def rss_mb() -> float:
    """Current resident set size in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    """High-water RSS of this process in MiB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def trim_heap() -> None:
    """Hand the memory the loaders freed back to the OS (glibc keeps it otherwise), for every variant."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass



def write_reward_adapter(base: torch.nn.Module, hidden: int, folder: Path, base_folder: Path) -> None:
    """A LoRA reward adapter on ``base`` with random (non-zero) B matrices and a score head of
    ``hidden`` inputs, written to ``folder`` as ``textrl rm --lora`` writes one (its base: ``base_folder``)."""
    from peft import get_peft_model

    from textrl.models.adapters import lora_config, save_reward_adapter

    adapter = get_peft_model(base, lora_config(), adapter_name="default")
    with torch.no_grad():
        for name, param in adapter.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    save_reward_adapter(adapter, torch.nn.Linear(hidden, 1), folder, base_model=str(base_folder))

def build_models(workdir: Path, hidden: int, layers: int) -> None:
    """Base causal LM, same-sized reward model and a LoRA reward adapter, saved under ``workdir``."""

    from textrl.models import build_tiny_causal_lm, build_tiny_reward_model, build_tiny_tokenizer

    if (workdir / "DONE").is_file():
        return
    tok = build_tiny_tokenizer()
    sizes = dict(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64, num_hidden_layers=layers,
                 num_attention_heads=hidden // 64)
    base = build_tiny_causal_lm(tok, seed=0, **sizes)
    n_params = sum(p.numel() for p in base.parameters())
    base.save_pretrained(workdir / "base")
    tok.save_pretrained(workdir / "base")
    reward = build_tiny_reward_model(tok, seed=1, **sizes)
    reward.save_pretrained(workdir / "reward_model")
    tok.save_pretrained(workdir / "reward_model")
    write_reward_adapter(base, hidden, workdir / "reward_adapter", workdir / "base")
    (workdir / "DONE").write_text(json.dumps({"base_parameters": n_params}))


def run_variant(variant: str, workdir: Path, threads: int, device: torch.device) -> dict[str, float]:
    """Load the variant's models, run two PPO iterations; memory of the first, time of the second."""
    torch.set_num_threads(threads)
    import peft  # noqa: F401 - imported before the baseline, so imports do not count

    from textrl.agents import GAEPPO, MultiAdapterPPO
    from textrl.config import TrainConfig
    from textrl.envs.prompts import encode_prompts
    from textrl.envs.tasks import make_digits_task
    from textrl.models import ValueModel, load_causal_lm, load_tokenizer
    from textrl.models.adapters import load_base_model
    from textrl.rewards import CompositeReward, NeuralReward
    from textrl.run.rollout import collect

    if variant.endswith("4bit"):  # load bitsandbytes' native kernels before the baseline, like the imports
        import bitsandbytes as bnb

        packed, state = bnb.functional.quantize_4bit(torch.ones(64, 64), quant_type="nf4")
        bnb.functional.dequantize_4bit(packed, state)

    cuda = device.type == "cuda"
    baseline = rss_mb()
    tok = load_tokenizer(workdir / "base")
    config = TrainConfig(
        agent="gae_ppo" if variant == "gae_ppo" else "multi_adapter_ppo", prompts_per_iteration=8,
        n_samples_per_prompt=1, max_new_tokens=16, ppo_epochs=1, num_minibatches=2, forward_batch_size=8,
        generation_batch_size=8, load_in_4bit=variant.endswith("4bit"),
    )
    if variant == "gae_ppo":
        policy = load_causal_lm(workdir / "base", device=device).float()
        ref = load_causal_lm(workdir / "base", device=device).float()
        agent = GAEPPO(policy, tok, config, ref_policy=ref, critic=ValueModel.from_causal_lm(policy))
        neural = NeuralReward.from_pretrained(workdir / "reward_model", device=device, batch_size=8)
    else:
        base = load_base_model(workdir / "base", load_in_4bit=config.load_in_4bit, device=device)
        agent = MultiAdapterPPO(base, tok, config, reward_adapter=workdir / "reward_adapter", merged=False)
        neural = NeuralReward(agent.reward_model, tok, batch_size=8)
    reward = CompositeReward({"reward_model": neural})
    # Random models stop at random lengths: with EOS unreachable every variant generates the full
    # 8 x max_new_tokens tokens, so the seconds compare like for like.
    agent.eos_token_id = len(tok) + 1000
    batches = [encode_prompts(make_digits_task(8, seed=s), tok)[0] for s in (1, 2)]
    trim_heap()
    loaded = rss_mb()
    reset = reset_peak()
    if cuda:
        torch.cuda.synchronize()
        loaded_cuda = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    seconds, phases = [], {}
    for i, batch in enumerate(batches):
        torch.manual_seed(i)
        phases = {}
        t0 = time.perf_counter()
        td = collect(agent, batch, reward, timings=phases)
        t1 = time.perf_counter()
        agent.update(td)
        if cuda:
            torch.cuda.synchronize()
        phases["update"] = time.perf_counter() - t1
        phases["tokens"] = float(td.get(("collector", "mask")).sum())
        seconds.append(time.perf_counter() - t0)
        if i == 0:
            peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_mb() - baseline
    out = {
        "variant": variant, "peak_mb": peak, "seconds_per_iteration": seconds[1],
        "first_iteration_s": seconds[0], "peak_reset_before_iteration": reset,
        "memory": "cuda_max_allocated" if cuda else "rss_rise", "phases": phases,
    }
    out["loaded_mb"] = loaded_cuda if cuda else loaded - baseline
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the built models here (default: a temp dir)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the subprocess side
    args = parser.parse_args()
    from textrl.run import resolve_device

    device = resolve_device(args.device)  # an unavailable CUDA device is named before anything is built
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args.variant, args.workdir, args.threads, device)), flush=True)
        return

    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        build_models(workdir, args.hidden, args.layers)
        n_params = json.loads((workdir / "DONE").read_text())["base_parameters"]
        results = {}
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--variant", variant, "--workdir", str(workdir),
                   "--threads", str(args.threads), "--device", str(device)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
            results[variant] = json.loads(lines[-1][len("RESULT "):])

    four = results["gae_ppo"]["peak_mb"]
    unit = "MiB (CUDA max allocated)" if results["gae_ppo"]["memory"] == "cuda_max_allocated" else "MiB (RSS rise)"
    print(f"base model: {n_params / 1e6:.1f}M parameters, float32 {n_params * 4 / 2**20:.0f} MiB; peak in {unit}")
    print(f"{'variant':<26}{'models loaded':>14}{'peak':>10}{'x four-model':>14}{'s / iteration':>15}")
    for variant, r in results.items():
        print(f"{variant:<26}{r['loaded_mb']:>14.0f}{r['peak_mb']:>10.0f}{r['peak_mb'] / four:>14.2f}"
              f"{r['seconds_per_iteration']:>15.2f}")
    ratio = results["multi_adapter_ppo"]["peak_mb"] / four
    ratio_4bit = results["multi_adapter_ppo_4bit"]["peak_mb"] / four
    print(f"goal: multi_adapter_ppo <= {GOAL}x the four-model peak: "
          f"{'met' if max(ratio, ratio_4bit) <= GOAL else 'NOT met'} ({ratio:.2f}x, 4-bit {ratio_4bit:.2f}x)")
    print(json.dumps({
        "base_parameters": n_params,
        "peak_mb": {k: round(r["peak_mb"], 1) for k, r in results.items()},
        "ratio_multi_adapter": round(ratio, 3),
        "ratio_multi_adapter_4bit": round(ratio_4bit, 3),
        "seconds_per_iteration": {k: round(r["seconds_per_iteration"], 2) for k, r in results.items()},
        "peak_reset_before_iteration": all(r["peak_reset_before_iteration"] for r in results.values()),
        "memory": results["gae_ppo"]["memory"],
    }))


if __name__ == "__main__":
    main()
