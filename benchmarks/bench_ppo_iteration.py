"""One PPO iteration of ``GAEPPO``, by phase, against the floor of the same work done plainly.

    python benchmarks/bench_ppo_iteration.py [--iterations 10] [--threads 2]
    python benchmarks/bench_ppo_iteration.py --device cuda --hidden 768 --intermediate 3072 \\
        --layers 12 --heads 12 --batch 64 --new-tokens 256       # ~110M parameters per model

The iteration is the trainer's (``textrl.training.trainer.train``): ``collect(..., timings=)`` (phases
``generation``, ``reward``, ``forward``, ``advantages``), ``agent.update`` (``update``) and
``iteration_metrics`` (``bookkeeping``), with a neural reward model (``NeuralReward``, the same
architecture as the policy) as the task reward. Every row is generated to full length: a bias of
-1e4 on the policy's LM head keeps the special tokens (EOS) and the lone UTF-8 byte tokens (whose
text would re-encode to more reward tokens) from being sampled, in the iteration and in the floor
alike. It is part of the model, so the agent's log-probs include it (a ``generation_config``
setting would not be: the agent samples without the folder's processors, to stay on-policy); the
reward model reads ``prompt + completion`` without a chat template, as the policy did.

The floor, timed in the same process and interleaved with the iterations (so a loaded machine
slows both alike), is the least any PPO step has to do for the same sizes: one batched
``model.generate`` with a KV cache, one forward each of the reference, value and reward model on
the finished sequences, one forward/backward of the policy and the value model, and one step of
each optimiser (AdamW). It works on its own copies of the models.

The rollback guard (``nonfinite_weights='rollback'``, the default: a copy of the trained weights
and optimiser state before every update) is measured as an A/B: a second agent, built the same
way from the same weights but with ``nonfinite_weights='stop'`` (no copy, no check in the update),
runs its own iterations interleaved with the first's (the order alternating), and
``guard/update_overhead`` is the first's median update seconds over the second's, minus 1
(``guard/iteration_overhead`` the same for whole iterations: on the CPU the copy is staged when the
rollout is processed, in the ``forward`` phase). ``guard/bytes_per_update`` and
``guard/seconds_per_update`` are the medians of the update's ``guard/bytes`` and of
``Backend.rollback_seconds()`` (the host seconds of the guard's own calls in an iteration),
``guard/placement`` where ``rollback_copy`` (``--rollback-copy``) put the copy.

Prints a phase table, then one JSON line with ``seconds_per_iteration`` (median over
``--iterations`` after ``--warmup``), ``floor_seconds_per_iteration``, ``ratio_to_floor``,
``tokens_per_second``, ``phase/<name>_s`` (medians), ``stop/phase/update_s`` and
``stop/seconds_per_iteration`` (the ``'stop'`` agent's) and the ``guard/*`` figures above. Goal on
CPU at the default sizes: ratio <= 1.1; on a GPU at ~110M parameters: ``guard/update_overhead``
<= 0.05. A script, never imported (torchrl ships a top-level ``benchmarks`` package).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any

import torch
from torch import Tensor

PHASES = ("generation", "reward", "forward", "advantages", "update", "bookkeeping")
"""The trainer's phase names (``time/<phase>_s`` in metrics.jsonl), eval aside."""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The device and the sizes of the models and the batch (``bench_trl_ppo.py`` takes the same)."""
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="prompts (one sample each)")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--iterations", type=int, default=10, help="measured iterations (>= 10)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rollback-copy", default="auto", choices=("auto", "device", "host"),
                        help="where the rollback guard keeps its copy (TrainConfig.rollback_copy)")
    parser.add_argument("--iteration-only", action="store_true",
                        help="time the agent's iterations alone (no floor, no 'stop' twin; --iterations >= 3)")
    parser.add_argument("--generation-engine", default="auto", help="TrainConfig.generation_engine: auto | hf | static | textrl")
    return parser.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Tokenizer, the agent (policy, reference, critic), its twin with ``nonfinite_weights='stop'``,
    the reward, a prompt batch, floor models."""
    from textrl.agents import GAEPPO
    from textrl.config import TrainConfig
    from textrl.envs.prompts import PromptBatch
    from textrl.models import (
        ValueModel,
        build_tiny_causal_lm,
        build_tiny_reward_model,
        build_tiny_tokenizer,
    )
    from textrl.rewards.neural import NeuralReward

    tok = build_tiny_tokenizer()
    sizes = dict(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                 num_attention_heads=args.heads, max_position_embeddings=max(512, args.prompt_tokens + args.new_tokens + 64))
    policy = build_tiny_causal_lm(tok, seed=args.seed, **sizes).to(device)
    # Never sampled, in the iteration and the floor alike: special tokens (so no row ends early) and
    # the lone UTF-8 bytes, which decode to U+FFFD and would re-encode to ~1.5x as many reward tokens.
    suppressed = [t for t in range(len(tok)) if t in tok.all_special_ids or "\ufffd" in tok.decode([t])]
    head = policy.get_output_embeddings()
    bias = torch.zeros(head.out_features, device=device, dtype=head.weight.dtype)
    bias[suppressed] = -1e4
    head.bias = torch.nn.Parameter(bias)
    reward_model = build_tiny_reward_model(tok, seed=args.seed + 1, **sizes).to(device)
    config = TrainConfig(
        device=str(device), prompts_per_iteration=args.batch, n_samples_per_prompt=1,
        max_new_tokens=args.new_tokens, ppo_epochs=1, num_minibatches=1,
        generation_batch_size=args.batch, forward_batch_size=args.batch,
        iterations=args.warmup + args.iterations, eval_every=0, rollback_copy=args.rollback_copy,
        generation_engine=args.generation_engine,
    )
    floor, unguarded = None, None  # --iteration-only: the agent alone
    if not args.iteration_only:
        floor = {  # the floor's own copies, so its updates do not touch the agent
            "policy": copy.deepcopy(policy), "ref": copy.deepcopy(policy).requires_grad_(False),
            "critic": ValueModel.from_causal_lm(policy), "reward": copy.deepcopy(reward_model),
        }
        floor["actor_opt"] = torch.optim.AdamW(floor["policy"].parameters(), lr=config.actor_lr, weight_decay=0.0)
        floor["critic_opt"] = torch.optim.AdamW(floor["critic"].parameters(), lr=config.critic_lr, weight_decay=0.0)
        twin = copy.deepcopy(policy)  # before the agent trains: the same starting weights
        stop_config = copy.deepcopy(config)
        stop_config.nonfinite_weights = "stop"
        unguarded = GAEPPO(twin, tok, stop_config, critic=ValueModel.from_causal_lm(twin))
    agent = GAEPPO(policy, tok, config, critic=ValueModel.from_causal_lm(policy))
    # The prompts carry no chat template, so the reward model reads prompt + completion as the policy did.
    reward_fn = NeuralReward(reward_model, tok, batch_size=args.batch, use_chat_template=False)

    g = torch.Generator().manual_seed(args.seed)
    allowed = torch.tensor(sorted(set(range(len(tok))) - set(suppressed)))
    ids = allowed[torch.randint(len(allowed), (args.batch, args.prompt_tokens), generator=g)]  # [B, P]
    texts = tok.batch_decode(ids.tolist())
    batch = PromptBatch(ids, torch.ones_like(ids, dtype=torch.bool), texts, [{"prompt": t} for t in texts],
                        list(range(args.batch)))
    return {"agent": agent, "unguarded": unguarded, "reward_fn": reward_fn, "batch": batch, "floor": floor,
            "tokenizer": tok}


def ppo_iteration(agent: Any, batch: Any, reward_fn: Any, iteration: int) -> tuple[float, dict[str, float], dict[str, float]]:
    """One trainer iteration (phases 1-5, no eval / logging to disk): seconds, per-phase seconds
    and the update's metrics, with ``guard/seconds`` (``Backend.rollback_seconds``)."""
    from textrl.core.timing import timed
    from textrl.run.rollout import collect
    from textrl.training.records import iteration_metrics

    sync(agent.device)
    start = time.perf_counter()
    timings: dict[str, float] = {}
    td = collect(agent, batch, reward_fn, timings=timings)
    with timed(timings, "update", agent.device):
        metrics = agent.update(td)
    with timed(timings, "bookkeeping", agent.device):
        iteration_metrics(iteration, td, metrics)
    sync(agent.device)
    seconds = time.perf_counter() - start
    return seconds, timings, {**metrics, "guard/seconds": agent.backend.rollback_seconds()}


def floor_iteration(floor: dict[str, Any], input_ids: Tensor, new_tokens: int, tok: Any) -> tuple[float, dict[str, float]]:
    """generate + ref / value / reward forwards + policy and value forward/backward + optimiser steps."""
    device = input_ids.device
    policy, ref, critic, reward = floor["policy"], floor["ref"], floor["critic"], floor["reward"]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    parts: dict[str, float] = {}
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad(), autocast:
        seq = policy.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, use_cache=True,
        )  # [B, P+T]
    sync(device)
    t1 = time.perf_counter()
    p = input_ids.shape[1]
    mask = torch.ones_like(seq)
    with torch.no_grad(), autocast:
        ref_logits = ref(input_ids=seq, attention_mask=mask).logits[:, p - 1 : -1]  # [B, T, V]
        old_values = critic(input_ids=seq, attention_mask=mask)[:, p - 1 : -1]  # [B, T]
        score = reward(input_ids=seq, attention_mask=mask).logits[:, 0]  # [B]
    sync(device)
    t2 = time.perf_counter()
    action = seq[:, p:]  # [B, T]
    with autocast:
        logits = policy(input_ids=seq, attention_mask=mask).logits[:, p - 1 : -1].float()  # [B, T, V]
        logp = torch.log_softmax(logits, -1).gather(-1, action.unsqueeze(-1)).squeeze(-1)  # [B, T]
        ref_logp = torch.log_softmax(ref_logits.float(), -1).gather(-1, action.unsqueeze(-1)).squeeze(-1)
        adv = score.float().unsqueeze(1) - (logp - ref_logp).detach() - old_values.float()  # [B, T]
        values = critic(input_ids=seq, attention_mask=mask)[:, p - 1 : -1].float()  # [B, T]
        loss = -(logp * adv).mean() + (values - score.float().unsqueeze(1)).pow(2).mean()
    for opt in (floor["actor_opt"], floor["critic_opt"]):
        opt.zero_grad(set_to_none=True)
    loss.backward()
    for opt in (floor["actor_opt"], floor["critic_opt"]):
        opt.step()
    sync(device)
    t3 = time.perf_counter()
    parts.update(generate=t1 - t0, forwards=t2 - t1, update=t3 - t2)
    return t3 - t0, parts


def record_phases(phases: dict[str, list[float]], seconds: float, timings: dict[str, float]) -> None:
    """Append one iteration's phase seconds, and the time between phases (checks, glue) as ``unaccounted``."""
    for name in PHASES:
        phases[name].append(timings.get(name, 0.0))
    phases["unaccounted"].append(seconds - sum(timings.values()))


def iteration_only(args: argparse.Namespace, agent: Any, n_params: int, seconds: float, phases: dict[str, float],
                   device: torch.device) -> dict[str, Any]:
    """``--iteration-only``: the phase table and JSON of the agent's iterations, no floor or guard figures."""
    figures: dict[str, Any] = {
        "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "generation_engine": agent.actor.engine.name, "policy_parameters": n_params, "batch": args.batch,
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "iterations": args.iterations,
        "seconds_per_iteration": seconds, "tokens_per_second": args.batch * args.new_tokens / seconds,
        **{f"phase/{name}_s": value for name, value in phases.items()}}
    print(f"GAEPPO iteration ({agent.actor.engine.name} engine), {n_params / 1e6:.2f}M-parameter Llama, "
          f"B={args.batch}, prompt {args.prompt_tokens} + {args.new_tokens} new tokens, {device}; median of "
          f"{args.iterations}")
    for name, value in phases.items():
        print(f"{name:<14}{value * 1e3:>9.1f}{value / seconds:>8.1%}")
    print(f"{'iteration':<14}{seconds * 1e3:>9.1f}")
    print(json.dumps(figures))
    return figures


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    least = 3 if args.iteration_only else 10
    if args.iterations < least:
        raise SystemExit(f"--iterations {args.iterations}: the median needs at least {least} iterations")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available on this machine")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    parts = build(args, device)
    agent, batch, floor, tok = parts["agent"], parts["batch"], parts["floor"], parts["tokenizer"]
    input_ids = batch.input_ids.to(device)
    n_params = sum(p.numel() for p in agent.policy.parameters())

    ppo_s, floor_s, stop_s, stop_update_s = [], [], [], []
    phases: dict[str, list[float]] = {p: [] for p in (*PHASES, "unaccounted")}
    floor_parts: dict[str, list[float]] = {}
    guard: dict[str, list[float]] = {"guard/bytes": [], "guard/seconds": []}
    for i in range(args.warmup + args.iterations):
        # Interleaved, so that load from other processes on a shared machine hits every run alike;
        # the guarded agent and its 'stop' twin take turns going first.
        if args.iteration_only:
            seconds, timings, metrics = ppo_iteration(agent, batch, parts["reward_fn"], i + 1)
            if i >= args.warmup:
                ppo_s.append(seconds)
                record_phases(phases, seconds, timings)
            continue
        f_seconds, f_parts = floor_iteration(floor, input_ids, args.new_tokens, tok)
        if i % 2:
            unguarded = ppo_iteration(parts["unguarded"], batch, parts["reward_fn"], i + 1)
        seconds, timings, metrics = ppo_iteration(agent, batch, parts["reward_fn"], i + 1)
        if not i % 2:
            unguarded = ppo_iteration(parts["unguarded"], batch, parts["reward_fn"], i + 1)
        if i < args.warmup:
            continue
        floor_s.append(f_seconds)
        ppo_s.append(seconds)
        stop_s.append(unguarded[0])
        stop_update_s.append(unguarded[1]["update"])
        for name in guard:
            guard[name].append(metrics[name])
        record_phases(phases, seconds, timings)
        for name, value in f_parts.items():
            floor_parts.setdefault(name, []).append(value)

    med = statistics.median
    if args.iteration_only:
        return iteration_only(args, agent, n_params, med(ppo_s), {name: med(v) for name, v in phases.items()}, device)
    seconds, floor_seconds = med(ppo_s), med(floor_s)
    tokens = args.batch * args.new_tokens
    figures: dict[str, float] = {
        "device": str(device), "threads": args.threads, "policy_parameters": n_params,
        "generation_engine": agent.actor.engine.name,
        "batch": args.batch, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "iterations": args.iterations,
        "seconds_per_iteration": seconds,
        "floor_seconds_per_iteration": floor_seconds,
        "ratio_to_floor": seconds / floor_seconds,
        "tokens_per_second": tokens / seconds,
        "floor_tokens_per_second": tokens / floor_seconds,
    }
    figures.update({f"phase/{name}_s": med(values) for name, values in phases.items()})
    figures.update({f"floor/{name}_s": med(values) for name, values in floor_parts.items()})
    figures.update({
        "stop/seconds_per_iteration": med(stop_s),
        "stop/phase/update_s": med(stop_update_s),
        "guard/placement": agent.backend.rollback_copy.placement,
        "guard/bytes_per_update": med(guard["guard/bytes"]),
        "guard/seconds_per_update": med(guard["guard/seconds"]),
        "guard/update_overhead": figures["phase/update_s"] / med(stop_update_s) - 1,
        "guard/iteration_overhead": seconds / med(stop_s) - 1,
    })

    print(f"GAEPPO iteration, {n_params / 1e6:.2f}M-parameter Llama, B={args.batch}, prompt {args.prompt_tokens} "
          f"+ {args.new_tokens} new tokens, {device}, {args.threads} threads; median of {args.iterations}")
    print(f"{'phase':<14}{'ms':>9}{'share':>8}")
    for name in (*PHASES, "unaccounted"):
        value = figures[f"phase/{name}_s"]
        print(f"{name:<14}{value * 1e3:>9.1f}{value / seconds:>8.1%}")
    print(f"{'iteration':<14}{seconds * 1e3:>9.1f}")
    print(f"floor: {floor_seconds * 1e3:.1f} ms (generate {figures['floor/generate_s'] * 1e3:.1f}, forwards "
          f"{figures['floor/forwards_s'] * 1e3:.1f}, update {figures['floor/update_s'] * 1e3:.1f}); ratio to floor "
          f"{figures['ratio_to_floor']:.3f} (goal <= 1.1); {figures['tokens_per_second']:.0f} generated tokens/s")
    print(f"rollback guard: {figures['guard/bytes_per_update'] / 2**20:.1f} MiB copied to the "
          f"{figures['guard/placement']}, {figures['guard/seconds_per_update'] * 1e3:.1f} ms in its calls; update "
          f"{figures['phase/update_s'] * 1e3:.1f} ms against {figures['stop/phase/update_s'] * 1e3:.1f} ms with "
          f"nonfinite_weights='stop' ({figures['guard/update_overhead']:+.1%}; whole iteration "
          f"{figures['guard/iteration_overhead']:+.1%})")
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
