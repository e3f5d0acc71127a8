"""Multi-turn collection throughput against single-turn collection of the same agent tokens.

    python benchmarks/bench_multiturn.py [--rows 32] [--turns 3] [--turn-tokens 16] [--repeats 3]

Both sides run :class:`textrl.envs.collector.EpisodeRunner` with the tiny Llama's batched
``generate`` (KV cache within a turn). Every agent turn is exactly ``--turn-tokens`` tokens (the
last one forced to EOS), so both collect the same number of agent tokens per row:

- multi-turn: ``--turns`` turns of ``--turn-tokens`` tokens, an environment observation (a short
  user message, about 14 tokens with the chat template) between them; each turn re-encodes the
  row's history before generating;
- single-turn: one turn of ``turns x turn-tokens`` tokens.

Prints agent tokens per second of each (median of ``--repeats``) and the ratio multi / single
(the aim: at least 0.7), then one JSON line. A script, never imported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from textrl.envs.collector import EpisodeRunner
    from textrl.envs.environment import Environment, Turn
    from textrl.envs.prompts import encode_prompts
    from textrl.envs.tasks import make_digits_task
    from textrl.keys import KEYS
    from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    device = torch.device(args.device)
    model = build_tiny_causal_lm(tok, seed=0).to(device).eval()
    eos = tok.eos_token_id

    class Chat(Environment):
        """Answers every turn with the same short message until ``--turns`` turns."""

        id = "bench_chat"
        max_turns = args.turns

        def step(self, episode, completion):
            return Turn(observation="go on, please")

    def generate_exactly(n: int):
        def generate(input_ids, attention_mask):
            with torch.no_grad():
                out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.long().to(device),
                                     do_sample=True, max_new_tokens=n, min_new_tokens=n, pad_token_id=tok.pad_token_id)
            turn = out[:, input_ids.shape[1]:].clone()
            turn[:, -1] = eos  # every turn ends with EOS after exactly n tokens
            return turn
        return generate

    batch = encode_prompts(make_digits_task(args.rows, seed=1), tok)[0]
    n = args.turn_tokens
    sides = {
        "multi_turn": (EpisodeRunner(Chat(), tokenizer=tok, max_new_tokens=n, max_episode_tokens=args.turns * (n + 32)),
                       generate_exactly(n)),
        "single_turn": (EpisodeRunner(Environment(), tokenizer=tok, max_new_tokens=args.turns * n),
                        generate_exactly(args.turns * n)),
    }
    results = {}
    for name, (runner, generate) in sides.items():
        runner.run(generate, batch)  # warm-up
        rates = []
        for repeat in range(args.repeats):
            torch.manual_seed(repeat)
            start = time.perf_counter()
            td = runner.run(generate, batch)
            seconds = time.perf_counter() - start
            tokens = int(td.get(KEYS.mask).sum())
            rates.append(tokens / seconds)
        results[name] = {"agent_tokens": tokens, "tokens_per_s": statistics.median(rates)}
        print(f"{name:<12} {tokens:6d} agent tokens  {results[name]['tokens_per_s']:9.1f} tokens/s (median of "
              f"{args.repeats})")
    ratio = results["multi_turn"]["tokens_per_s"] / results["single_turn"]["tokens_per_s"]
    print(f"multi-turn / single-turn throughput: {ratio:.2f}x (aim: >= 0.7x)")
    print(json.dumps({"rows": args.rows, "turns": args.turns, "turn_tokens": n, "device": str(device),
                      **{f"{k}_tokens_per_s": round(v["tokens_per_s"], 1) for k, v in results.items()},
                      "ratio": round(ratio, 3)}))


if __name__ == "__main__":
    main()
