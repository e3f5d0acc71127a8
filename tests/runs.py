"""What the tests that run `textrl train` share: tiny run options and readers of its outputs."""

from __future__ import annotations

import json
from pathlib import Path

import torch

SMALL = [
    "--agent", "gae_ppo",  # written against the critic agent (the default is rloo); a later --agent wins
    "--prompts-per-iteration", "4", "--n-samples-per-prompt", "2", "--max-new-tokens", "8",
    "--warmup-sft-steps", "5", "--eval-size", "8", "--eval-every", "0", "--progress", "false",
    "--ppo-epochs", "1", "--num-minibatches", "2",
]
"""A few-second `textrl train` run: 8 rows per iteration, short responses, no evaluation."""


def metrics(out: Path) -> list[dict]:
    """The rows of ``out/metrics.jsonl``."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def checkpoint_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's agent state (policy, reference, critic, snapshots)."""
    agent = torch.load(checkpoint / "trainer_state.pt", weights_only=False)["agent"]
    return {k: v for k, v in agent.items() if torch.is_tensor(v)}
