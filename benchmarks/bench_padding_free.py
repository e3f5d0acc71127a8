"""The learner's phases padded and padding-free (``padding_free``) on ragged rollouts, against a floor.

    OMP_NUM_THREADS=1 python benchmarks/bench_padding_free.py [--paddings 0.25,0.5,0.75] [--repeats 3] [--reward]
    python benchmarks/bench_padding_free.py --device cuda --hidden 1024 --intermediate 4096 --layers 8 \\
        --heads 16 --rows 64 --new-tokens 1024 --threads 0          # the GPU command (docs/benchmarks.md)

A ``gae_ppo`` agent (policy, reference, critic: a Llama of ``--hidden`` x ``--layers``, the tiny
512-token vocabulary) gets a rollout of ``--rows`` rows whose lengths are drawn as a run draws them:
prompts of ``--prompt-tokens / 2`` to ``--prompt-tokens`` tokens (left-padded), responses of
lognormal length (sigma 1: most rows stop early, a long tail, some cut at ``--new-tokens``; one row
at the cap, as a batch is as wide as its longest row), the scale found by bisection so that padding
is the asked share of the ``[rows, prompt + new tokens]`` batch. Two phases are timed (on the CPU
in this process's CPU seconds, which another process's load does not count; on a GPU in wall
seconds), each the least of ``--repeats``, the variants interleaved:

- ``prefill``: the rollout's forwards (``Actor.evaluate``: the behaviour and reference log-probs,
  the values; no grad);
- ``fwd+bwd``: the update's forwards and backward over the rollout (``run_epochs``: one epoch, one
  minibatch, the loss and its backward through the policy and the critic; the optimiser step, the
  same either way, left out);
- ``reward`` (with ``--reward``): a reward model of the policy's size (a Llama sequence classifier)
  scoring the rollout's rows (prompt and response tokens) in one batch, as ``NeuralReward`` scores
  a batch (its batch forward, the text rendering and tokenizing left out).

``padded`` runs them with ``padding_free`` off, ``packed`` on (the layout the models take: ``bins``
under sdpa / eager), and with ``--layouts`` each named layout forced on every model. The floor is
the same phase with ``padding_free`` off on a rollout with nothing to pad: every row of one length,
holding the same number of real tokens. Printed: one row per padding share and phase with the
seconds, ``speedup`` (padded / packed) and ``packed/floor``, and a ``learner`` row, the phases'
sum: the learner's part of an iteration (generation, which ``padding_free`` does not touch, and the
optimiser step, the same either way, are not in it), then one JSON line. The packed
log-probs and values (and the reward model's scores) are checked against the padded ones (``max |diff|``). Goal on the CPU, one
thread: ``speedup`` >= 1.5 for both phases at 50% padding. A script, never imported.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import unittest.mock
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

PHASES = ("prefill", "fwd+bwd")
"""The phases the goal is judged on (``--reward`` adds ``reward``)."""
GOAL = 1.5
"""The least padded / packed ratio of each phase at 50% padding on the CPU."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=384)
    parser.add_argument("--paddings", default="0.25,0.5,0.75", help="padding shares of the batch, comma-separated")
    parser.add_argument("--layouts", default="", help="also time these layouts forced: per_row,one_row,bins")
    parser.add_argument("--reward", action="store_true", help="also time a reward model's scoring of the rows")
    parser.add_argument("--attn", default="sdpa", help="attn_implementation of the models")
    parser.add_argument("--mixed-precision", default="no", help="TrainConfig.mixed_precision (bf16 on a GPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def response_lengths(prompt_lengths: Tensor, width: int, padding: float, gen: torch.Generator) -> Tensor:
    """int64 ``[B]``: lognormal lengths (sigma 1) in ``[1, width]``, row 0 at ``width``, scaled so that
    ``1 - (prompts + responses) / (B * (P + width))`` is ``padding`` (bisection on the log-scale)."""
    rows, total = prompt_lengths.shape[0], prompt_lengths.shape[0] * (int(prompt_lengths.max()) + width)
    z = torch.randn(rows, generator=gen, dtype=torch.float64)

    def lengths(mu: float) -> Tensor:
        out = torch.exp(mu + z).ceil().clamp(1, width).long()
        out[0] = width
        return out

    def share(mu: float) -> float:
        return 1.0 - float(prompt_lengths.sum() + lengths(mu).sum()) / total

    low, high = -5.0, math.log(width) + 10.0
    if not share(high) <= padding <= share(low):
        raise SystemExit(f"--paddings {padding}: reachable shares at these sizes lie in [{share(high):.2f}, "
                         f"{share(low):.2f}]")
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if share(mid) > padding else (low, mid)
    return lengths(high)


def rollout(agent: Any, tok: Any, prompt_lengths: Tensor, lengths: Tensor, prompt_width: int, gen: torch.Generator):
    """A processed rollout (log-probs, values, advantages) of left-padded prompts and right-padded
    responses of ``lengths`` (EOS last, unless cut at the cap)."""
    from textrl.envs import rollout_from_responses

    rows, width = lengths.shape[0], int(lengths.max())
    eos, pad = tok.eos_token_id, tok.pad_token_id
    ids = torch.randint(4, 508, (rows, prompt_width), generator=gen)
    mask = torch.arange(prompt_width)[None] >= (prompt_width - prompt_lengths)[:, None]
    responses = torch.randint(4, 508, (rows, width), generator=gen)
    columns = torch.arange(width)[None]
    responses = torch.where(columns < lengths[:, None], responses, pad)
    ends = (lengths < agent.config.max_new_tokens)
    responses[ends, (lengths[ends] - 1)] = eos
    td = rollout_from_responses(torch.where(mask, ids, pad), mask, responses, tokenizer=tok,
                                reward_fn=lambda prompts, completions, **_: torch.zeros(len(completions)),
                                eos_token_id=eos, pad_token_id=pad, max_new_tokens=agent.config.max_new_tokens)
    return agent.process_rollout(td.to(agent.device))


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of ``fn``: on the CPU this process's CPU seconds (``time.process_time``: on a shared
    machine another process's load does not count, and with one thread they are the wall seconds of
    an idle machine), on a GPU wall seconds after a synchronisation."""
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    sync(device)
    start = clock()
    fn()
    sync(device)
    return clock() - start


def sequences(td: Any) -> list[list[int]]:
    """Each row's attended prompt and response tokens, as a reward model reads them."""
    from textrl.agents.forwards import sequence_inputs

    input_ids, attention_mask, _ = sequence_inputs(td)
    return [row[mask].tolist() for row, mask in zip(input_ids.cpu(), attention_mask.bool().cpu())]


def phases(agent: Any, td: Any, reward: Any = None) -> dict[str, Callable[[], Any]]:
    """The timed phases of ``agent`` on ``td`` (module docstring); ``reward`` with a reward model."""
    from textrl.agents.base import UpdateTally
    from textrl.agents.update import Objective, run_epochs

    def update() -> None:
        run_epochs(agent.learner, td, None, UpdateTally(), Objective(agent.loss, agent.micro_weight))
        agent.backend.zero_grad(agent.learner)

    out = {"prefill": lambda: agent.actor.evaluate(td), "fwd+bwd": update}
    if reward is not None:
        rows = sequences(td)
        out["reward"] = lambda: torch.no_grad()(reward._forward)(rows)  # NeuralReward's batch forward
    return out


def forced(layout: str | None):
    """Every model's layout forced to ``layout`` (None: the one each model takes)."""
    import contextlib

    from textrl.agents import forwards
    from textrl.rewards import neural

    if layout is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(unittest.mock.patch.object(forwards, "packing_layout", lambda model, device: layout))
    stack.enter_context(unittest.mock.patch.object(forwards, "critic_layout", lambda model, device: layout))
    stack.enter_context(unittest.mock.patch.object(neural, "scorer_layout", lambda model, device: layout))
    return stack


def measure(agent: Any, td: Any, floor_td: Any, layouts: list[str], repeats: int,
            reward: Any = None) -> dict[str, dict[str, float]]:
    """The least seconds over ``repeats`` of each phase: ``padded``, ``packed``, ``packed:<layout>``
    and ``floor``, interleaved phase by phase, the order reversed every other round (on a shared
    machine other work only adds time: the least is the phase's own)."""
    variants: dict[str, tuple[Any, bool, str | None]] = {"padded": (td, False, None), "packed": (td, True, None),
                                                       **{f"packed:{lay}": (td, True, lay) for lay in layouts},
                                                       "floor": (floor_td, False, None)}
    names = list(phases(agent, td, reward))
    seconds: dict[str, dict[str, list[float]]] = {v: {p: [] for p in names} for v in variants}
    for repeat in range(repeats + 1):  # the first round warms up (the probe, the allocator)
        for phase in names:
            order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
            for name in order:
                rows, padding_free, layout = variants[name]
                agent.config.padding_free = padding_free
                if reward is not None:
                    reward.padding_free = padding_free
                with forced(layout):
                    took = timed(phases(agent, rows, reward)[phase], agent.device)
                if repeat:
                    seconds[name][phase].append(took)
    agent.config.padding_free = False
    return {name: {phase: min(values) for phase, values in by.items()} for name, by in seconds.items()}


def agreement(agent: Any, td: Any, reward: Any = None) -> float:
    """The largest |packed - padded| of the behaviour log-probs and the values over the agent's tokens
    (and of the reward model's scores)."""
    from textrl.keys import KEYS

    mask = td.get(KEYS.mask)
    outs = []
    for padding_free in (False, True):
        agent.config.padding_free = padding_free
        out = agent.actor.evaluate(td)
        outs.append((out.get(KEYS.action_log_prob), out.get(KEYS.state_value).squeeze(-1)))
    agent.config.padding_free = False
    diff = max(float((a - b)[mask].abs().max()) for a, b in zip(*outs))
    if reward is not None:
        scores = []
        for padding_free in (False, True):
            reward.padding_free = padding_free
            with torch.no_grad():
                scores.append(reward._forward(sequences(td)))
        reward.padding_free = False
        diff = max(diff, float((scores[0] - scores[1]).abs().max()))
    return diff


def build(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any]:
    from textrl.agents import GAEPPO
    from textrl.config import TrainConfig
    from textrl.core.precision import set_attn_implementation
    from textrl.models import ValueModel, build_tiny_causal_lm, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    policy = build_tiny_causal_lm(tok, seed=args.seed, hidden_size=args.hidden, intermediate_size=args.intermediate,
                                  num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                  max_position_embeddings=max(512, args.prompt_tokens + args.new_tokens + 8))
    set_attn_implementation(policy, args.attn)
    policy = policy.to(device)
    config = TrainConfig(device=str(device), prompts_per_iteration=args.rows, n_samples_per_prompt=1,
                         max_new_tokens=args.new_tokens, ppo_epochs=1, num_minibatches=1,
                         generation_batch_size=args.rows, forward_batch_size=args.rows, eval_every=0,
                         mixed_precision=args.mixed_precision, nonfinite_weights="stop")
    critic = ValueModel.from_causal_lm(policy)
    with torch.no_grad():  # values that say something, for the agreement check
        weight = critic.value_head.weight
        weight.copy_(0.1 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(args.seed)))
    agent = GAEPPO(policy, tok, config, critic=critic)
    agent.reuse_rollout_forward = False
    return agent, tok


def build_reward(args: argparse.Namespace, tok: Any, device: torch.device, precision: Any) -> Any:
    """A ``NeuralReward`` over a Llama sequence classifier of the policy's size, in the run's precision."""
    from textrl.core.precision import set_attn_implementation
    from textrl.models import build_tiny_reward_model
    from textrl.rewards import NeuralReward

    model = build_tiny_reward_model(tok, seed=args.seed + 1, hidden_size=args.hidden,
                                    intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                    num_attention_heads=args.heads,
                                    max_position_embeddings=max(512, args.prompt_tokens + args.new_tokens + 8))
    set_attn_implementation(model, args.attn)
    return NeuralReward(model.to(device), tok, batch_size=args.rows, clip=None, autocast=precision.autocast)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available on this machine")
    if args.threads:
        torch.set_num_threads(args.threads)
    agent, tok = build(args, device)
    reward = build_reward(args, tok, device, agent.precision) if args.reward else None
    layouts = [lay for lay in args.layouts.split(",") if lay]
    n_params = sum(p.numel() for p in agent.policy.parameters())
    figures: dict[str, Any] = {"device": str(device), "threads": torch.get_num_threads(), "policy_parameters": n_params,
                               "rows": args.rows, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                               "attn": args.attn, "repeats": args.repeats}
    print(f"gae_ppo learner phases, {n_params / 1e6:.2f}M-parameter Llama (hidden {args.hidden}, {args.layers} "
          f"layers, {args.attn}), {args.rows} rows x ({args.prompt_tokens} + {args.new_tokens}) tokens, {device}, "
          f"{torch.get_num_threads()} thread(s); least of {args.repeats}")
    print(f"{'padding':>8} {'phase':<8} {'variant':<16} {'seconds':>8} {'speedup':>8} {'/floor':>7}")
    for padding in (float(x) for x in args.paddings.split(",")):
        gen = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(args.prompt_tokens // 2, args.prompt_tokens + 1, (args.rows,), generator=gen)
        prompts[0] = args.prompt_tokens
        lengths = response_lengths(prompts, args.new_tokens, padding, gen)
        td = rollout(agent, tok, prompts, lengths, args.prompt_tokens, gen)
        real = int(prompts.sum() + lengths.sum())
        even = max(1, round(real / args.rows) - args.prompt_tokens)  # the floor: every row this long, nothing padded
        floor_td = rollout(agent, tok, torch.full_like(prompts, args.prompt_tokens), torch.full_like(lengths, even),
                           args.prompt_tokens, gen)
        share = 1 - real / (args.rows * (args.prompt_tokens + args.new_tokens))
        diff = agreement(agent, td, reward)
        seconds = measure(agent, td, floor_td, layouts, args.repeats, reward)
        key = f"padding_{round(padding * 100)}"
        figures[f"{key}/share"] = share
        figures[f"{key}/max_abs_diff"] = diff
        for phase in seconds["padded"]:
            padded, floor = seconds["padded"][phase], seconds["floor"][phase]
            for variant, by in seconds.items():
                took = by[phase]
                figures[f"{key}/{phase}/{variant}_s"] = took
                speedup = padded / took
                if variant.startswith("packed"):
                    figures[f"{key}/{phase}/{variant}_speedup"] = speedup
                print(f"{share:>8.0%} {phase:<8} {variant:<16} {took:>8.3f} {speedup:>8.2f} {took / floor:>7.2f}")
        totals = {variant: sum(by.values()) for variant, by in seconds.items()}  # the learner's share of an iteration
        for variant, took in totals.items():
            figures[f"{key}/learner/{variant}_s"] = took
            print(f"{share:>8.0%} {'learner':<8} {variant:<16} {took:>8.3f} {totals['padded'] / took:>8.2f} "
                  f"{took / totals['floor']:>7.2f}")
        what = "log-probs, values and scores" if reward is not None else "log-probs and values"
        print(f"{'':>8} packed {what} against padded: max |diff| {diff:.2e}")
    half = figures.get("padding_50/prefill/packed_speedup"), figures.get("padding_50/fwd+bwd/packed_speedup")
    if None not in half:
        figures["goal_met"] = device.type != "cpu" or min(half) >= GOAL
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
