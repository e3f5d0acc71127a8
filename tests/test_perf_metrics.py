"""``perf/total_tokens``, ``perf/padding_fraction`` (textrl.training.records.sequence_tokens) and
``perf/tokens_per_s`` (textrl.run.loop: per process and second of the step, its evaluation left
out), as verl counts its ``perf/throughput``."""

from __future__ import annotations

import json
import time

import pytest
import torch
from tensordict import TensorDict

from textrl.keys import KEYS
from textrl.parallel.distributed import Distributed
from textrl.run import MetricsLog, RunLoop
from textrl.training.records import PADDING_FRACTION, TOTAL_TOKENS, sequence_tokens


def rollout(response_mask: bool = True) -> TensorDict:
    """Three rows: prompts of 2, 3 and 1 tokens (left-padded to 3), episodes of 4, 1 and 2 tokens
    (right-padded to 4), the first with an observation gap in its agent mask."""
    prompt = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]], dtype=torch.bool)
    attended = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    agent = attended.clone()
    agent[0, 1:3] = False  # an observation: attended, not the agent's
    td = TensorDict({KEYS.prompt_mask: prompt, KEYS.mask: agent}, batch_size=[3])
    if response_mask:
        td.set(KEYS.response_mask, attended)
    return td


def test_the_rollouts_tokens_and_padding_share():
    got = sequence_tokens(rollout(), Distributed())
    assert got == {TOTAL_TOKENS: 6.0 + 7.0, PADDING_FRACTION: pytest.approx(1 - 13 / 21)}
    # without a response mask (a single-turn rollout) the agent's tokens are the attended ones
    assert sequence_tokens(rollout(response_mask=False), Distributed())[TOTAL_TOKENS] == 6.0 + 5.0


class Body:
    """A LoopBody whose rows carry the rollout's tokens; its evaluation takes longer than its step."""

    def step(self, iteration, timings):
        time.sleep(0.02)
        return {"iteration": iteration, TOTAL_TOKENS: 1000.0}

    def evaluate(self, iteration, timings):
        start = time.perf_counter()
        time.sleep(0.05)
        timings["eval"] = time.perf_counter() - start
        return {"eval/score": 1.0}

    def checkpoint(self, iteration, stopping):
        return None

    def faulted(self):
        return False

    def stop_message(self, iteration, signum, saved):
        return ""

    def postfix(self, row):
        return {}


def test_tokens_per_second_per_device_leave_the_evaluation_out(tmp_path):
    RunLoop("test", 3, MetricsLog(tmp_path, True, resume_after=None), eval_every=2, fit_threads=False).run(Body(), start=0)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert ["time/eval_s" in r for r in rows] == [False, True, True]
    for row in rows:
        step_s = row["time/iteration_s"] - row.get("time/eval_s", 0.0)
        assert step_s >= 0.02 and row["perf/tokens_per_s"] == pytest.approx(1000.0 / step_s)
