"""Per-step cost of the Gymnasium ``TokenMDPEnv`` at response position 8 and 512.

    python benchmarks/bench_env.py [--threads 2] [--episodes 5]

The env is driven by the tiny Llama policy, which carries its KV cache across steps: one
prefill of the prompt at ``reset``, then one single-token forward per ``step``. A step costs
``policy forward for one token + env.step``; both are timed, separately, in windows of steps
around response positions 8 and 512 (EOS is masked out so episodes reach them). Goal: the cost
at 512 is at most 1.5x the cost at 8 (the env never re-encodes the prefix).

For contrast, a TextRL-style step (decode the prefix to text, re-tokenise it, run the policy on
the whole sequence without a cache) is timed at the same positions.

Prints one JSON line last. A script, never imported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

POSITIONS = (8, 512)
WINDOW = 4  # steps timed on each side of a position
MAX_NEW_TOKENS = 512 + 2 * WINDOW


def timed_episode(env, model, eos_ids: list[int], seed: int) -> dict[str, dict[int, list[float]]]:
    """One episode with a KV-cached policy; per-step seconds of the policy and of env.step."""
    obs, _ = env.reset(seed=seed)
    prompt = torch.as_tensor(obs["prompt_ids"][obs["prompt_mask"].astype(bool)]).unsqueeze(0)
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]
    times: dict[str, dict[int, list[float]]] = {"policy": {}, "env": {}}
    for position in range(MAX_NEW_TOKENS):
        logits[:, eos_ids] = float("-inf")
        token = int(torch.argmax(logits, dim=-1))
        start = time.perf_counter()
        env.step(token)
        env_seconds = time.perf_counter() - start
        start = time.perf_counter()
        if position < MAX_NEW_TOKENS - 1:
            with torch.no_grad():
                out = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1]
        policy_seconds = time.perf_counter() - start
        for target in POSITIONS:
            if abs(position - target) <= WINDOW:
                times["env"].setdefault(target, []).append(env_seconds)
                times["policy"].setdefault(target, []).append(policy_seconds)
    return times


def textrl_style_step_seconds(env, model, tokenizer, position: int, repeats: int) -> float:
    """Seconds of one re-encoding step at ``position``: decode, re-tokenise, uncached forward."""
    obs, _ = env.reset(seed=0)
    prompt_ids = obs["prompt_ids"][obs["prompt_mask"].astype(bool)].tolist()
    rng = np.random.default_rng(0)
    response = rng.integers(4, 500, size=position).tolist()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        text = tokenizer.decode(prompt_ids + response)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from textrl.envs import TokenMDPEnv
    from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_causal_lm(tokenizer, max_position_embeddings=1024)
    env = TokenMDPEnv(tokenizer=tokenizer, max_new_tokens=MAX_NEW_TOKENS)
    eos_ids = sorted(env.eos_token_ids)

    merged: dict[str, dict[int, list[float]]] = {"policy": {}, "env": {}}
    timed_episode(env, model, eos_ids, seed=-1 % 2**31)  # warm-up
    for episode in range(args.episodes):
        for part, by_pos in timed_episode(env, model, eos_ids, seed=episode).items():
            for pos, values in by_pos.items():
                merged[part].setdefault(pos, []).extend(values)

    figures: dict[str, float] = {"threads": args.threads, "episodes": args.episodes}
    for pos in POSITIONS:
        env_s = statistics.median(merged["env"][pos])
        pol_s = statistics.median(merged["policy"][pos])
        figures[f"env_step_seconds_at_{pos}"] = env_s
        figures[f"policy_step_seconds_at_{pos}"] = pol_s
        figures[f"step_seconds_at_{pos}"] = env_s + pol_s
        figures[f"textrl_style_step_seconds_at_{pos}"] = textrl_style_step_seconds(env, model, tokenizer, pos, 5)
    figures["ratio_512_to_8"] = figures["step_seconds_at_512"] / figures["step_seconds_at_8"]
    figures["env_only_ratio_512_to_8"] = figures["env_step_seconds_at_512"] / figures["env_step_seconds_at_8"]
    figures["textrl_style_ratio_512_to_8"] = (
        figures["textrl_style_step_seconds_at_512"] / figures["textrl_style_step_seconds_at_8"]
    )
    for pos in POSITIONS:
        print(f"position {pos:>3}: step {figures[f'step_seconds_at_{pos}'] * 1e3:.3f} ms "
              f"(policy {figures[f'policy_step_seconds_at_{pos}'] * 1e3:.3f} ms + env.step "
              f"{figures[f'env_step_seconds_at_{pos}'] * 1e6:.1f} us); TextRL-style re-encoding step "
              f"{figures[f'textrl_style_step_seconds_at_{pos}'] * 1e3:.3f} ms")
    print(f"ratio 512/8: {figures['ratio_512_to_8']:.2f} (goal <= 1.5; env.step alone "
          f"{figures['env_only_ratio_512_to_8']:.2f}; TextRL-style {figures['textrl_style_ratio_512_to_8']:.2f})")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
