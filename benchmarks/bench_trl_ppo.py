"""One PPO iteration of TRL 1.12's ``trl.experimental.ppo.PPOTrainer`` against one of textrl's ``GAEPPO``.

    pip install trl==1.12.0                                   # the baseline (in textrl's dev extra)
    python benchmarks/bench_trl_ppo.py                        # CPU, small sizes, ~20 s
    python benchmarks/bench_trl_ppo.py --device cuda --hidden 768 --intermediate 3072 --layers 12 \\
        --heads 12 --batch 64 --new-tokens 256 --iterations 3 --warmup 1 --generation-engine textrl

Both sides get the same models, built once by ``benchmarks/bench_ppo_iteration.py``'s ``build``
(loaded from this folder by path, with ``--iteration-only``; the argument names are its own): a
random Llama policy with a -1e4 bias on its LM head for the special tokens (EOS, pad) and the lone
UTF-8 byte tokens, so every row runs to the full ``--new-tokens``; a reward model of the same
architecture (a Llama sequence classifier, ``base_model_prefix='model'``, head ``score``); the same
``--batch`` random prompts of ``--prompt-tokens`` tokens, none of them a pad token. TRL gets deep
copies made before either side trains: the policy (bias included), a reference copy of it, the
reward model, and a value model that starts where textrl's critic does (a sequence classifier with
the policy's body and a zero ``score`` head; textrl's ``ValueModel.from_causal_lm``), and the
prompts as a ``datasets.Dataset`` with an ``input_ids`` column.

One iteration is the same on both sides: ``--batch`` prompts, one sample each, ``--new-tokens``
sampled at temperature 1, one forward batch of ``--batch`` rows per model, then one PPO epoch of
one minibatch: one optimiser step. ``PPOConfig``: ``per_device_train_batch_size=--batch``,
``gradient_accumulation_steps=1``, ``num_ppo_epochs=1``, ``num_mini_batches=1``,
``local_rollout_forward_batch_size=--batch``, ``response_length=--new-tokens``, ``stop_token=None``,
``missing_eos_penalty=None``, ``temperature=1.0``, ``total_episodes=--batch x (warmup + iterations)``
(so ``train()`` runs warmup + iterations updates), ``activation_checkpointing=False`` where
transformers has that field (5.24: TRL's default is on, though its PPO loop never applies it; 5.17
has none), no sample generations, no eval, no saving,
``report_to=[]``, a temporary ``output_dir``, ``seed=--seed``.

Precision. textrl keeps float32 trained weights and runs every forward (generation included) under
bf16 autocast on CUDA, float32 on the CPU; its reference is a frozen copy in bf16 on a CUDA device
(``frozen_dtype='auto'``; ``textrl_reference_dtype``). TRL gets ``bf16=True`` on CUDA, float32 on
the CPU. ``bf16`` is a ``TrainingArguments`` flag: bf16 mixed precision (autocast over float32
weights) where the ``Trainer``'s accelerator applies it. In TRL 1.12 with transformers 5 that flag
alone does nothing here: ``PPOTrainer`` builds its own ``Accelerator`` without a
``mixed_precision``, so accelerate reads ``ACCELERATE_MIXED_PRECISION`` (what ``accelerate launch
--mixed_precision bf16`` sets), which transformers 5 no longer exports from the flag. This script sets that variable to match (``bf16`` on CUDA, ``no`` on the CPU) and
reports what TRL's accelerator ended up with (``trl_mixed_precision``). Even then accelerate's
autocast wraps only the forward of the model it prepared (TRL's policy-and-value wrapper, i.e. the
update's forward): TRL's generation and its reference, value and reward forwards of the rollout
call the float32 models directly and run in float32.

Timing. The sides run one after the other in this process, TRL first (its models are then freed,
with ``gc.collect`` and ``torch.cuda.empty_cache``), then textrl. TRL's updates are timed by wall
clock with a ``TrainerCallback``: TRL's PPO loop calls ``on_step_end`` once per update (after the
optimiser step, the metrics and ``lr_scheduler.step``), so an update's seconds are those from the
previous ``on_step_end`` (``on_train_begin`` for the first) to its own, with
``torch.cuda.synchronize`` at each stamp on CUDA; each such span holds one whole update, including
the previous update's clean-up (``del``, ``empty_cache``, ``gc.collect``). textrl's iteration is
``bench_ppo_iteration.ppo_iteration`` (``collect``, ``agent.update``, ``iteration_metrics``), timed
the same way. Each figure is the median over ``--iterations`` after ``--warmup``. The seconds
spent in Python's garbage collector during each timed span are reported too (``*_gc_seconds``, all
collections, timed with ``gc.callbacks``): TRL calls ``gc.collect()`` twice an update, and a full
collection walks every Python object of the process (~0.5M once TRL is imported: ~0.3 s on a CPU).

What the two do per iteration at these settings (to describe the comparison honestly):

- TRL generates with ``model.generate`` (``output_scores=True``: the sampled tokens' old
  log-probs come from the generation's logits, no policy forward in the rollout); textrl generates
  with ``--generation-engine`` (``auto`` | ``hf`` | ``static`` | ``textrl``);
- TRL's rollout runs the reference, the value model and the reward model on the token ids; textrl's
  runs the policy and the critic with grad, kept for the update (one epoch, one minibatch: its
  update back-propagates through that behaviour forward instead of running them again), the
  reference, and the reward model on ``prompt + completion`` re-tokenised from text
  (``NeuralReward``);
- TRL's update runs the policy and the value model again with grad (logits and all hidden states
  of every position, prompt included), the softmax entropy over the whole vocabulary, one AdamW
  (``adamw_torch_fused``) over both models, no gradient clipping, a linear LR schedule; textrl's
  update back-propagates, clips each model's gradient norm to 1.0 (``max_grad_norm``), steps two
  AdamWs (policy, critic), and keeps a copy of the trained weights and optimiser state for its
  rollback guard (``nonfinite_weights='rollback'``, its default; staged while the rollout is
  processed);
- TRL's loop logs its metrics (``.item()`` on each) and calls ``gc.collect()`` twice an update;
  both sides compute KL-shaped rewards and GAE.

Prints a small table, then one JSON line: ``trl_seconds_per_iteration``,
``textrl_seconds_per_iteration``, ``speedup`` (TRL seconds / textrl seconds),
``speedup_without_gc`` (the same with each iteration's gc seconds taken out first), each side's
``*_tokens_per_second`` (rows x generated tokens / seconds) and ``*_gc_seconds``,
``trl_new_tokens`` (the fewest non-pad tokens TRL generated in a row, read from its generations)
and ``trl_response_width``, ``trl_mixed_precision`` and ``textrl_mixed_precision``,
``textrl_reference_dtype``, ``float32_matmul_precision``, ``device``, ``trl_version``, the sizes
and ``generation_engine``. A script, never imported (torchrl ships a top-level ``benchmarks`` package).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

TRL_VERSION = "1.12.0"
"""The TRL release this benchmark is written against (its ``experimental.ppo`` API)."""


def parse_args(bench: ModuleType, argv: list[str] | None = None) -> argparse.Namespace:
    """``bench_ppo_iteration``'s device and size arguments, and this script's own."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_model_arguments(parser)
    parser.add_argument("--iterations", type=int, default=3, help="measured iterations of each side (>= 1)")
    parser.add_argument("--warmup", type=int, default=1, help="iterations of each side left out of the median")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--generation-engine", default="auto",
                        help="textrl's TrainConfig.generation_engine: auto | hf | static | textrl")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.warmup < 0:
        parser.error(f"--iterations {args.iterations} --warmup {args.warmup}: need >= 1 measured and >= 0 warm-up")
    return args


def require_trl() -> str:
    """TRL's version, or a one-line exit saying how to install it."""
    try:
        import trl
    except ImportError:
        raise SystemExit(f"bench_trl_ppo.py needs TRL: pip install trl=={TRL_VERSION}") from None
    return str(trl.__version__)


def load_bench_ppo_iteration() -> ModuleType:
    """``bench_ppo_iteration.py`` from this folder, loaded by path (benchmarks are scripts, not a package)."""
    path = Path(__file__).resolve().with_name("bench_ppo_iteration.py")
    spec = importlib.util.spec_from_file_location("bench_ppo_iteration", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def resolved(device: torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` is the current CUDA device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class GcClock:
    """Seconds spent in Python's garbage collector (every collection) since it was installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    @contextlib.contextmanager
    def installed(self) -> Iterator[GcClock]:
        gc.callbacks.append(self)
        try:
            yield self
        finally:
            gc.callbacks.remove(self)


def update_clock(device: torch.device, gc_clock: GcClock, sync: Callable[[torch.device], None]) -> Any:
    """A ``TrainerCallback`` that stamps the wall clock (and the gc clock) at the start of training
    and at every ``on_step_end``, the end of one PPO update in TRL's loop, after ``sync(device)``."""
    from transformers import TrainerCallback

    class UpdateClock(TrainerCallback):
        def __init__(self) -> None:
            self.stamps: list[tuple[float, float]] = []

        def stamp(self) -> None:
            sync(device)
            self.stamps.append((time.perf_counter(), gc_clock.seconds))

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.stamp()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.stamp()

        def spans(self) -> tuple[list[float], list[float]]:
            """Seconds and gc seconds of each update."""
            pairs = list(zip(self.stamps, self.stamps[1:]))
            return [b[0] - a[0] for a, b in pairs], [b[1] - a[1] for a, b in pairs]

    return UpdateClock()


@contextlib.contextmanager
def recording_generations(module: ModuleType) -> Iterator[list[tuple[torch.Tensor, int]]]:
    """``module.batch_generation`` (TRL's rollout generation, looked up at each call) wrapped to keep
    what it returned: ``(query_responses [B, P + T], P)`` per call. Only references are kept (no sync)."""
    original: Callable[..., Any] = module.batch_generation
    seen: list[tuple[torch.Tensor, int]] = []

    def batch_generation(model: Any, queries: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        query_responses, logits = original(model, queries, *args, **kwargs)
        seen.append((query_responses, queries.shape[1]))
        return query_responses, logits

    module.batch_generation = batch_generation
    try:
        yield seen
    finally:
        module.batch_generation = original


def trl_models(policy: torch.nn.Module, reward_model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """TRL's policy, reference, value and reward models: copies of textrl's starting weights. The
    value model is a sequence classifier with the policy's body and a zero ``score`` head, where
    textrl's critic (``ValueModel.from_causal_lm``: the policy's body, a zero head) starts."""
    value = copy.deepcopy(reward_model)
    value.get_submodule(value.base_model_prefix).load_state_dict(policy.get_submodule(policy.base_model_prefix).state_dict())
    torch.nn.init.zeros_(value.score.weight)
    return {"model": copy.deepcopy(policy), "ref_model": copy.deepcopy(policy).requires_grad_(False),
            "value_model": value, "reward_model": copy.deepcopy(reward_model)}


def trl_config(args: argparse.Namespace, device: torch.device, output_dir: str) -> Any:
    """The ``PPOConfig`` of one textrl iteration (module docstring)."""
    from trl.experimental.ppo import PPOConfig

    cuda = device.type == "cuda"
    # A TrainingArguments field in transformers 5.24, absent in 5.17 (the GPU machine's): off where it exists.
    off = {"activation_checkpointing": False} if "activation_checkpointing" in {
        f.name for f in dataclasses.fields(PPOConfig)} else {}
    return PPOConfig(
        output_dir=output_dir, seed=args.seed, use_cpu=not cuda, bf16=cuda, report_to=[],
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=1, num_ppo_epochs=1,
        num_mini_batches=1, local_rollout_forward_batch_size=args.batch,
        total_episodes=args.batch * (args.warmup + args.iterations), response_length=args.new_tokens,
        stop_token=None, missing_eos_penalty=None, temperature=1.0, num_sample_generations=0,
        save_strategy="no", eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0, **off,
    )


def run_trl(args: argparse.Namespace, bench: ModuleType, device: torch.device, parts: dict[str, Any],
            gc_clock: GcClock) -> dict[str, Any]:
    """TRL's ``train()`` for warmup + iterations updates: each update's seconds and gc seconds, what
    it generated, and the accelerator's mixed precision. Its models are freed before returning."""
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl.experimental.ppo import PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    tok = parts["tokenizer"]
    models = trl_models(parts["agent"].policy, parts["reward_fn"].model)
    dataset = Dataset.from_dict({"input_ids": parts["batch"].input_ids.tolist()})  # [B, P], no pad token in it
    # PPOTrainer's own Accelerator reads the precision from here (module docstring, "Precision").
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if device.type == "cuda" else "no"
    clock = update_clock(device, gc_clock, bench.sync)
    with tempfile.TemporaryDirectory(prefix="bench_trl_ppo_") as output_dir:
        trainer = PPOTrainer(args=trl_config(args, device, output_dir), processing_class=tok, train_dataset=dataset,
                             callbacks=[clock], **models)
        for printer in (PrinterCallback, ProgressCallback):  # the metrics are still computed and logged
            trainer.remove_callback(printer)
        if resolved(trainer.accelerator.device) != resolved(device):
            raise SystemExit(f"--device {device}: TRL's accelerator runs on {trainer.accelerator.device}; "
                             "pass --device cuda (or set CUDA_VISIBLE_DEVICES to pick the GPU)")
        with recording_generations(trl_ppo) as generations:
            trainer.train()
        seconds, gc_seconds = clock.spans()
        mixed_precision = str(trainer.accelerator.mixed_precision)
        pad = tok.pad_token_id
        new_tokens = min(int((qr[:, p:] != pad).sum(1).min()) for qr, p in generations)
        width = max(qr.shape[1] - p for qr, p in generations)
        del trainer, models, generations
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"seconds": seconds, "gc_seconds": gc_seconds, "new_tokens": new_tokens, "response_width": width,
            "mixed_precision": mixed_precision}


def run_textrl(args: argparse.Namespace, bench: ModuleType, parts: dict[str, Any], gc_clock: GcClock) -> dict[str, Any]:
    """warmup + iterations of ``bench_ppo_iteration.ppo_iteration``: seconds and gc seconds of each."""
    seconds, gc_seconds = [], []
    for i in range(args.warmup + args.iterations):
        before = gc_clock.seconds
        s, _, _ = bench.ppo_iteration(parts["agent"], parts["batch"], parts["reward_fn"], i + 1)
        seconds.append(s)
        gc_seconds.append(gc_clock.seconds - before)
    return {"seconds": seconds, "gc_seconds": gc_seconds}


def median_after_warmup(values: list[float], warmup: int) -> float:
    return statistics.median(values[warmup:])


def without_gc(side: dict[str, Any]) -> list[float]:
    """Each iteration's seconds less the garbage collector's in it."""
    return [s - g for s, g in zip(side["seconds"], side["gc_seconds"])]


def report(args: argparse.Namespace, device: torch.device, trl_version: str, agent: Any, trl: dict[str, Any],
           textrl: dict[str, Any]) -> dict[str, Any]:
    """Print the table and the JSON line; return the figures."""
    n_params = sum(p.numel() for p in agent.policy.parameters())
    engine = agent.actor.engine.name
    if len(trl["seconds"]) != args.warmup + args.iterations:
        raise SystemExit(f"TRL ran {len(trl['seconds'])} updates, expected {args.warmup + args.iterations}")
    trl_s = median_after_warmup(trl["seconds"], args.warmup)
    textrl_s = median_after_warmup(textrl["seconds"], args.warmup)
    figures: dict[str, Any] = {
        "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "threads": args.threads, "trl_version": trl_version, "generation_engine": engine,
        "policy_parameters": n_params, "hidden": args.hidden, "intermediate": args.intermediate,
        "layers": args.layers, "heads": args.heads, "batch": args.batch, "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens, "iterations": args.iterations, "warmup": args.warmup,
        "trl_seconds_per_iteration": trl_s, "textrl_seconds_per_iteration": textrl_s, "speedup": trl_s / textrl_s,
        "trl_tokens_per_second": args.batch * trl["new_tokens"] / trl_s,
        "textrl_tokens_per_second": args.batch * args.new_tokens / textrl_s,
        "trl_gc_seconds": median_after_warmup(trl["gc_seconds"], args.warmup),
        "textrl_gc_seconds": median_after_warmup(textrl["gc_seconds"], args.warmup),
        "speedup_without_gc": median_after_warmup(without_gc(trl), args.warmup)
        / median_after_warmup(without_gc(textrl), args.warmup),
        "trl_new_tokens": trl["new_tokens"], "trl_response_width": trl["response_width"],
        "trl_mixed_precision": trl["mixed_precision"],
        "textrl_mixed_precision": "bf16" if agent.precision.autocast_dtype == torch.bfloat16 else "no",
        "textrl_reference_dtype": None if agent.ref_policy is None
        else str(next(agent.ref_policy.parameters()).dtype).removeprefix("torch."),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    print(f"PPO iteration, {n_params / 1e6:.2f}M-parameter Llama per model, B={args.batch}, prompt "
          f"{args.prompt_tokens} + {args.new_tokens} new tokens, {device}; median of {args.iterations} after "
          f"{args.warmup} warm-up")
    print(f"{'side':<24}{'s/iter':>10}{'tokens/s':>11}{'gc s':>8}  precision")
    rows = (("trl", f"TRL {trl_version}"), ("textrl", f"textrl ({engine} engine)"))
    for key, name in rows:
        print(f"{name:<24}{figures[f'{key}_seconds_per_iteration']:>10.3f}{figures[f'{key}_tokens_per_second']:>11.0f}"
              f"{figures[f'{key}_gc_seconds']:>8.3f}  {figures[f'{key}_mixed_precision']}")
    print(f"speedup (TRL s / textrl s): {figures['speedup']:.2f}x ({figures['speedup_without_gc']:.2f}x with the "
          f"garbage collector's seconds left out of both); TRL generated {trl['new_tokens']} tokens a row")
    print(json.dumps(figures))
    return figures


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from textrl.run import resolve_device

    bench = load_bench_ppo_iteration()
    args = parse_args(bench, argv)
    trl_version = require_trl()
    if trl_version != TRL_VERSION:
        print(f"note: TRL {trl_version} installed; this benchmark is written against {TRL_VERSION}", file=sys.stderr)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    device = resolve_device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    built = bench.parse_args(["--iteration-only"])  # its defaults for anything not set here
    for name in ("hidden", "intermediate", "layers", "heads", "batch", "prompt_tokens", "new_tokens", "iterations",
                 "warmup", "seed", "generation_engine"):
        setattr(built, name, getattr(args, name))
    parts = bench.build(built, device)
    with GcClock().installed() as gc_clock:
        trl = run_trl(args, bench, device, parts, gc_clock)  # first: it copies the starting weights
        textrl = run_textrl(args, bench, parts, gc_clock)
    return report(args, device, trl_version, parts["agent"], trl, textrl)


if __name__ == "__main__":
    main()
