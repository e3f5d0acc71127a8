"""Tokens per second of each generation engine, against the hardware floor measured in the same run.

    python benchmarks/bench_generation.py                              # CPU: small sizes, ~1 minute
    python benchmarks/bench_generation.py --device cuda --shape 114m   # the 114M set-up of docs/benchmarks.md
    python benchmarks/bench_generation.py --device cuda --shape 0.5b --vocab 151936

A random Llama of ``--shape`` (``small``: hidden 128, 2 layers, the CPU default; ``114m``: hidden
768, 12 layers, 12 heads, intermediate 3072, as ``bench_ppo_iteration.py``'s GPU set-up; ``0.5b``:
Qwen2-0.5B's widths, hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864) with the tiny
tokenizer padded to ``--vocab`` tokens generates ``--prompts`` x ``--samples`` rows of
``--new-tokens`` tokens after ``--prompt-tokens`` prompt tokens, every row to full length (EOS is
out of reach), in float32 under bf16 autocast on CUDA (as textrl trains there), or in bfloat16 with
``--weights bfloat16``. Each engine (``--engines``: the registered ones, ``vllm`` where vLLM imports (vLLM's ``LLM`` in this
process, :mod:`textrl.generation.vllm_engine`; not ``vllm-server``), and
the ``textrl`` engine with a part off: ``textrl_unshared`` without prefix sharing,
``textrl_dynamic`` over transformers' growing cache, ``textrl_eager`` without the CUDA graph,
``textrl_graph`` with the graph of the step as written, not compiled first) runs ``--repeats`` times after a
warm-up, interleaved; its figure is the median; ``first_call_seconds`` is its warm-up (the single
turn and, with ``--turns``, the episodes: the compiles and graph captures on CUDA). Rows of a prompt
are its samples, so prefix sharing has ``--samples`` rows to share.

The floor of the same work: each decode step reads every weight once (bytes = parameters x the
bytes of the dtype the matmuls read) and does 2 x parameters FLOPs a row, so a step takes at least
``max(bytes / bandwidth, FLOPs / matmul rate)``; bandwidth (a large on-device copy) and matmul
rate (a large square matmul in the run's dtype) are measured here, before the engines. The
prefill and the KV cache's reads are left out: the floor is a bound from below.

With ``--turns N`` (N > 1) each engine also runs episodes of N turns of ``--new-tokens / N``
tokens, an observation of ``--observation-tokens`` tokens appended after each turn (as the
multi-turn runner appends an environment's answer), inside the engine's ``rollout()`` (the
``textrl`` engine carries each turn's KV cache to the next: only the new tokens are prefilled);
``multi_tokens_per_second`` counts the agent's tokens, and ``multi_over_single`` compares it with
the same engine's single turn of ``--new-tokens`` tokens.

With ``--turn-ops`` (and ``--turns``) nothing is timed: each ``textrl`` engine runs one batch of
episodes (after one to warm up) and prints the aten ops each turn dispatches outside its decode steps (the carry, the
prefill, loading and keeping the cache: the host's work a turn, each op a launch or a copy on a GPU),
and outside its decode steps and its feed of a carried turn's new tokens too (``uncaptured``: what
the host dispatches on CUDA, where both are replays of captured graphs), under the autocast a CUDA
run has (float32 weights under bf16 autocast, unless ``--weights bfloat16``) on any device.

With ``--traffic`` nothing is timed: one eager decode step of the ``textrl`` engine's static
cache, halfway through the response, is counted op by op (benchmarks/traffic.py: the
bytes its casts, matmuls, attention and other ops read and write) in six set-ups on
``--device``: ``float32`` (no autocast), ``autocast`` (float32 weights under bf16 autocast, as
textrl trains on CUDA: the cache and mask in bf16 and the weights cast once a call, the step as the
engine captures it, autocast's cache off, attending to the whole static cache), ``bfloat16``
weights, ``autocast_window`` (``autocast`` attending to the columns up to its own in 64-column
windows: ``DecodeEngine(attention_window=64)``), and two baselines under autocast:
``autocast_f32_cache`` (the cache kept in the prefill's float32) and ``autocast_no_weight_casts``
(autocast casting every weight every step). Each against the step's floor: the bytes of the
weights its matmuls read (in the dtype they read) and of the keys and values of the real context.
A property of the step's ops, the same on every device; it predicts what a GPU run is short of.

Prints a table, then one JSON line: per engine ``seconds``, ``tokens_per_second``, ``x_hf`` (its
speed over ``hf``'s) and ``x_floor`` (its seconds over the floor's), the multi-turn figures, and
the floor's figures. A script, never imported (torchrl ships a top-level ``benchmarks`` package).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from typing import Any

import torch

SHAPES = {
    "small": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4),
    "114m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
}


VARIANTS = {
    "textrl_unshared": lambda: _decode(share_prefixes=False),  # every row prefilled
    "textrl_dynamic": lambda: _decode(static=False),  # transformers' growing cache, one eager forward a token
    "textrl_eager": lambda: _decode(capture_graphs=False),  # the static cache, no CUDA graph
    "textrl_graph": lambda: _decode(compile=False),  # the CUDA graph of the step as written, not compiled
    "textrl_full_width": lambda: _decode(attention_window=None),  # every step attends to the whole static cache
    "textrl_windows": lambda: _decode(attention_window=64),  # attention over 64-column windows (a graph each on CUDA)
}
"""The ``textrl`` engine with one of its parts off, to show what each part is worth."""


def _decode(**kwargs: Any) -> Any:
    from textrl.generation import DecodeEngine

    return DecodeEngine(**kwargs)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Any, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def hardware(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Bandwidth (bytes/s: a copy of 256 MiB on CUDA, 64 MiB on the CPU, read + written) and
    matmul rate (FLOP/s: a square matmul of 4096 on CUDA, 1024 on the CPU, in ``dtype``); the best
    of 5 runs each."""
    n = (256 if device.type == "cuda" else 64) * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    copy = min(timed(lambda: dst.copy_(src), device) for _ in range(5))
    m = 4096 if device.type == "cuda" else 1024
    a = torch.randn(m, m, device=device, dtype=dtype)
    b = torch.randn(m, m, device=device, dtype=dtype)
    mm = min(timed(lambda: a @ b, device) for _ in range(5))
    return {"bandwidth_gb_s": 2 * n * 4 / copy / 1e9, "matmul_tflop_s": 2 * m**3 / mm / 1e12}


def runnable_here(names: list[str]) -> list[str]:
    """The registered engines this benchmark can run by default: not ``vllm-server`` (it needs
    servers), ``vllm`` only where vLLM imports (``--engines vllm`` asks for it regardless)."""
    import importlib.util

    from textrl.generation.base import SERVED_ENGINE

    def importable() -> bool:
        try:
            return importlib.util.find_spec("vllm") is not None and bool(__import__("vllm"))
        except Exception:  # noqa: BLE001 - a broken install (a mismatched torchvision) counts as absent
            return False

    return [n for n in names if n != SERVED_ENGINE and (n != "vllm" or importable())]


def main() -> None:
    from textrl.generation import Sampling, engine_names, get_engine
    from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer
    from textrl.run import resolve_device
    from textrl.stages.data import pad_left

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size (the tiny tokenizer padded)")
    parser.add_argument("--prompts", type=int, default=None, help="distinct prompts (default 16 on CUDA, 4 on the CPU)")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=None, help="default 256 on CUDA, 32 on the CPU")
    parser.add_argument("--engines", default="", help="comma list (default: every registered one and textrl_unshared)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=1, help="also time episodes of this many turns (1: off)")
    parser.add_argument("--observation-tokens", type=int, default=14, help="tokens appended after each turn")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    parser.add_argument("--traffic", action="store_true", help="count the bytes of one decode step instead (no timing)")
    parser.add_argument("--turn-ops", action="store_true",
                        help="count the ops each turn of --turns dispatches outside its decode steps instead (no timing)")
    parser.add_argument("--weights", default="float32", choices=("float32", "bfloat16"),
                        help="the model's dtype: float32 (under bf16 autocast on CUDA, as textrl trains) or bfloat16 "
                             "(no autocast)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    prompts = args.prompts or (16 if cuda else 4)
    new_tokens = args.new_tokens or (256 if cuda else 32)
    names = [n for n in args.engines.split(",") if n] or [*runnable_here(engine_names()), *VARIANTS]
    engines = {n: VARIANTS[n]() if n in VARIANTS else get_engine(n) for n in names}

    tok = build_tiny_tokenizer() if args.vocab == 512 else build_tiny_tokenizer(args.vocab)
    model = build_tiny_causal_lm(tok, max_position_embeddings=4096, **SHAPES[args.shape]).to(device).eval()
    if args.traffic:
        return traffic(model, device, prompts * args.samples, args.prompt_tokens, new_tokens, args.shape)
    bf16_weights = args.weights == "bfloat16"
    if bf16_weights:
        model = model.to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (prompts, args.prompt_tokens), generator=gen).repeat_interleave(args.samples, 0)
    ids, mask = ids.to(device), torch.ones_like(ids, device=device)
    sampling = Sampling(greedy=False, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                        eos_token_id=None, pad_token_id=tok.pad_token_id)
    # --turn-ops counts the host's ops as on CUDA, under the same autocast (the weight casts' refresh included)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=(cuda or args.turn_ops) and not bf16_weights)
    dtype = torch.bfloat16 if cuda or bf16_weights else torch.float32
    hw = hardware(device, dtype)
    bytes_per_step = params * (2 if dtype == torch.bfloat16 else 4)
    flops_per_step = 2 * params * ids.shape[0]
    step_floor = max(bytes_per_step / (hw["bandwidth_gb_s"] * 1e9), flops_per_step / (hw["matmul_tflop_s"] * 1e12))
    floor = step_floor * new_tokens
    rows = ids.shape[0]

    def run(engine: Any) -> None:
        with torch.no_grad(), autocast:
            out = engine.generate(model, ids, mask, sampling)
        assert out.shape == (rows, new_tokens), out.shape

    turns = max(1, args.turns)
    per_turn = max(1, new_tokens // turns)
    observation = [int(t) for t in torch.randint(3, 256, (args.observation_tokens,), generator=gen)]
    turn_sampling = dataclasses.replace(sampling, max_new_tokens=per_turn)

    def episodes(engine: Any) -> None:
        """``turns`` turns of every row, an observation after each (module docstring)."""
        seqs = [row.tolist() for row in ids.cpu()]
        with torch.no_grad(), autocast, engine.rollout():
            for _ in range(turns):
                turn_ids, turn_mask = pad_left(seqs, tok.pad_token_id)
                out = engine.generate(model, turn_ids.to(device), turn_mask.to(device), turn_sampling).cpu()
                seqs = [seq + out[i].tolist() + observation for i, seq in enumerate(seqs)]

    if args.turn_ops:
        return turn_ops(engines, episodes, turns)

    seconds: dict[str, list[float]] = {n: [] for n in engines}
    multi: dict[str, list[float]] = {n: [] for n in engines}
    first: dict[str, float] = {}  # the warm-up call: compiles and captures (CUDA), allocates
    for name, engine in engines.items():
        first[name] = timed(lambda e=engine: run(e), device)
        if turns > 1:
            first[name] += timed(lambda e=engine: episodes(e), device)
    for _ in range(args.repeats):
        for name, engine in engines.items():
            seconds[name].append(timed(lambda e=engine: run(e), device))
            if turns > 1:
                multi[name].append(timed(lambda e=engine: episodes(e), device))
    tokens = rows * new_tokens
    result: dict[str, Any] = {}
    for name in engines:
        s = statistics.median(seconds[name])
        result[name] = {"seconds": s, "tokens_per_second": tokens / s, "x_floor": s / floor, "first_call_seconds": first[name]}
        if turns > 1:
            m = statistics.median(multi[name])
            result[name].update(multi_seconds=m, multi_tokens_per_second=rows * turns * per_turn / m)
            result[name]["multi_over_single"] = result[name]["multi_tokens_per_second"] / result[name]["tokens_per_second"]
    if "hf" in result:
        for name in result:
            result[name]["x_hf"] = result["hf"]["seconds"] / result[name]["seconds"]
            if turns > 1:
                result[name]["multi_x_hf"] = result["hf"]["multi_seconds"] / result[name]["multi_seconds"]
    print(f"{args.shape} ({params / 1e6:.1f}M parameters, vocab {len(tok)}) on {device}: {prompts} prompts x "
          f"{args.samples} samples, {args.prompt_tokens} + {new_tokens} tokens; floor {floor:.3f} s "
          f"({hw['bandwidth_gb_s']:.0f} GB/s, {hw['matmul_tflop_s']:.2f} TFLOP/s)")
    extra = f" {'turns x':>7} {'multi tok/s':>11} {'multi/single':>12} {'multi x hf':>10}" if turns > 1 else ""
    print(f"{'engine':<18} {'first call':>10} {'seconds':>9} {'tokens/s':>10} {'x hf':>7} {'x floor':>8}{extra}")
    for name, r in result.items():
        line = (f"{name:<18} {r['first_call_seconds']:>10.1f} {r['seconds']:>9.3f} {r['tokens_per_second']:>10.0f} "
                f"{r.get('x_hf', float('nan')):>7.2f} {r['x_floor']:>8.1f}")
        if turns > 1:
            line += (f" {turns:>3} x {per_turn:<3} {r['multi_tokens_per_second']:>11.0f} {r['multi_over_single']:>12.2f} "
                     f"{r.get('multi_x_hf', float('nan')):>10.2f}")
        print(line)
    print(json.dumps({"device": str(device), "shape": args.shape, "parameters": params, "vocab": len(tok),
                      "rows": rows, "prompts": prompts, "samples": args.samples, "prompt_tokens": args.prompt_tokens,
                      "new_tokens": new_tokens, "weights": args.weights, "turns": turns, "tokens_per_turn": per_turn,
                      "observation_tokens": args.observation_tokens, "floor_seconds": floor, **hw, "engines": result,
                      "gpu": torch.cuda.get_device_name(device) if cuda else None}), flush=True)


def turn_ops(engines: dict[str, Any], episodes: Any, turns: int) -> None:
    """``--turn-ops``: for each ``textrl`` engine of ``engines``, the aten ops each turn of one episode
    batch dispatches outside its decode steps (the host's work a turn: the carry, the prefill,
    loading and keeping the cache; on a GPU each is a launch or a copy the device waits for), and
    outside its feeds too (captured on CUDA, as the steps are)."""
    from textrl.generation import DecodeEngine

    counts, uncaptured = {}, {}
    for name, engine in engines.items():
        if isinstance(engine, DecodeEngine):
            episodes(engine)  # a warm-up: its decoders made, as in every iteration after the first
            counts[name] = _ops_per_turn(engine, episodes, ("run",))
            uncaptured[name] = _ops_per_turn(engine, episodes, ("run", "feed"))
    for name in counts:
        print(f"{name:<18} ops a turn outside the decode steps: {counts[name]}; outside the steps and feeds "
              f"(captured on CUDA): {uncaptured[name]}")
    print(json.dumps({"turns": turns, "turn_ops": counts, "turn_ops_uncaptured": uncaptured}), flush=True)


def _ops_per_turn(engine: Any, episodes: Any, paused_in: tuple[str, ...]) -> list[int]:
    """The ops each ``engine.generate`` call of ``episodes(engine)`` dispatches, those inside the
    ``paused_in`` methods of its decoders (``run``: a decode step; ``feed``: a carried turn's new tokens) left out."""
    from traffic import OpCount, uncounted

    from textrl.generation.graph import DecodeGraph

    count, per_turn = OpCount(), []
    generate = engine.generate

    def counted(*a: Any, **k: Any) -> Any:
        count.n = 0
        with count:
            out = generate(*a, **k)
        per_turn.append(count.n)
        return out

    engine.generate = counted
    try:
        with uncounted(count, DecodeGraph, *paused_in):
            episodes(engine)
    finally:
        del engine.generate
    return per_turn


def traffic(model: Any, device: torch.device, rows: int, prompt_tokens: int, new_tokens: int, shape: str) -> None:
    """``--traffic`` (module docstring): one step's bytes by kind in each set-up, against its floor."""
    from traffic import OpLog, step_bytes

    from textrl.generation import Sampling
    from textrl.generation.carry import cache_layers
    from textrl.generation.casts import MATMUL_LAYERS, WeightCasts
    from textrl.generation.static_kv import bucket
    from textrl.generation.step import DecodeState, decode_step
    from textrl.models.kv_cache import cache_argument, new_cache

    context = prompt_tokens + new_tokens // 2  # halfway through the response
    width = bucket(prompt_tokens + new_tokens, 64)  # the engine's static cache for the whole call
    ids = torch.randint(3, 256, (rows, context), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    name = cache_argument(model)
    greedy = Sampling(greedy=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                      eos_token_id=None, pad_token_id=0)
    window = bucket(context + 1, 64)  # the columns up to the one this step writes, in 64-column windows
    f32, bf16 = torch.float32, torch.bfloat16
    setups = {  # weights dtype, autocast, the cache's keys' and values' dtypes, weights cast once a call, window
        "float32": (f32, False, (f32, f32), False, None),
        "autocast": (f32, True, (bf16, bf16), True, None),
        "bfloat16": (bf16, False, (bf16, bf16), False, None),
        "autocast_window": (f32, True, (bf16, bf16), True, window),
        "autocast_f32_cache": (f32, True, (f32, bf16), True, None),  # a Llama's prefill under autocast
        "autocast_no_weight_casts": (f32, True, (bf16, bf16), False, None),
    }
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, MATMUL_LAYERS))
    with torch.no_grad():  # one prefill for all: a step's bytes do not depend on the cache's values
        cache = new_cache(model)
        first = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1,
                      **{name: cache}).logits[:, -1].argmax(-1)
        layers = cache_layers(cache)
    result: dict[str, Any] = {}
    for setup, (dtype, autocast, (key_dtype, value_dtype), cast_once, attend) in setups.items():
        model.to(dtype)
        amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast, cache_enabled=False)
        with torch.no_grad(), amp:
            like = [(k.to(key_dtype), v.to(value_dtype)) for k, v in layers]
            state = DecodeState.new(like, rows, width)  # the cache in like's dtypes, the mask in the keys'
            state.load(like, mask, first, torch.ones_like(first, dtype=torch.bool), 0)
            state.kv.window = attend
            casts = WeightCasts(model, torch.bfloat16) if cast_once else None
            if casts is not None:
                casts.refresh()
            with casts.swapped() if casts is not None else contextlib.nullcontext(), OpLog() as log:
                decode_step(model, state, greedy, name)
        read = 2 if autocast or dtype == torch.bfloat16 else 4
        kv = sum(k.numel() + v.numel() for k, v in layers) * read
        floor = weights * read + kv
        counted = step_bytes(log.ops)
        result[setup] = {**{k: v / 1e6 for k, v in counted.items()}, "floor": floor / 1e6,
                         "x_floor": counted["total"] / floor}
    model.float()
    base = result["autocast"]["total"]
    print(f"{shape} on {device}: one decode step of {rows} rows at context {context} (static cache {width} "
          f"columns); MB a step by kind")
    print(f"{'set-up':<26} {'casts':>8} {'matmul':>8} {'attention':>9} {'other':>7} {'total':>8} {'floor':>8} "
          f"{'x floor':>7} {'x autocast':>10}")
    for setup, r in result.items():
        r["x_autocast"] = r["total"] / base
        print(f"{setup:<26} {r['casts']:>8.1f} {r['matmul']:>8.1f} {r['attention']:>9.1f} {r['other']:>7.1f} "
              f"{r['total']:>8.1f} {r['floor']:>8.1f} {r['x_floor']:>7.2f} {r['x_autocast']:>10.2f}")
    print(json.dumps({"device": str(device), "shape": shape, "rows": rows, "context": context, "width": width,
                      "window": window,
                      "matmul_weights": weights, "traffic_mb": result}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
