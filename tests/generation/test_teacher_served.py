"""A teacher served by vLLM (``--teacher URL``): its prompt log-probs of the policy's tokens are the
in-process teacher's, its tokenizer passes the probe, and a run distils it. One ``textrl vllm-serve``
of a tiny teacher (heads of 32, as vLLM's CPU attention needs) for the module. Marked ``vllm``."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.generation.test_vllm_served import start_server, stop, wait_ready
from textrl.agents.forwards import Forwards
from textrl.agents.teacher import LoadedTeacher, ServedTeacher
from textrl.cli import main
from textrl.config import TrainConfig
from textrl.core.precision import Precision
from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """``(folder, model, url)``: a tiny teacher saved, loaded here, and served."""
    tok = build_tiny_tokenizer()
    folder = tmp_path_factory.mktemp("teacher") / "model"
    model = build_tiny_causal_lm(tok, seed=5, num_attention_heads=2).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    proc, url = start_server(folder, folder.parent / "server.log")
    try:
        wait_ready(proc, url, folder.parent / "server.log")
        yield folder, model, url
    finally:
        stop(proc)


def test_served_logprobs_are_the_in_process_teachers(teacher):
    folder, model, url = teacher
    tok = build_tiny_tokenizer()
    served = ServedTeacher(url)
    served.check(tok, "tiny")  # the same tokenizer: the probe's ids agree
    enc = tok(["What is 1+2?", "hi", "Count to three, slowly"], return_tensors="pt", padding=True)
    g = torch.Generator().manual_seed(0)
    action = torch.randint(5, 300, (3, 7), generator=g)
    response = torch.tensor([[1] * 7, [1] * 3 + [0] * 4, [1] * 5 + [0] * 2], dtype=torch.bool)
    input_ids = torch.cat([enc["input_ids"], action], 1)
    attention_mask = torch.cat([enc["attention_mask"].bool(), response], 1)
    p = enc["input_ids"].shape[1]
    config = TrainConfig(device="cpu", dtype="float32")
    loaded = LoadedTeacher(model, Forwards(config, Precision.of(config, torch.device("cpu"))), str(folder))
    want = torch.where(response, loaded.logprobs(input_ids, attention_mask, p, action), 0.0)
    got = served.logprobs(input_ids, attention_mask, p, action)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=2e-3), (got - want).abs().max()
    assert not got[~response].any()


def test_a_run_distils_the_served_teacher(teacher, tmp_path):
    _, _, url = teacher
    out = tmp_path / "run"
    main(["train", "--teacher", url, "--agent", "grpo", "--kl-coef", "0", "--iterations", "2", "--output-dir", str(out),
          "--prompts-per-iteration", "2", "--n-samples-per-prompt", "2", "--max-new-tokens", "6",
          "--warmup-sft-steps", "0", "--eval-size", "2", "--eval-every", "0", "--progress", "false", "--device", "cpu"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [(row["teacher/reverse_kl"], row["teacher/log_prob"]) for row in rows if "teacher/reverse_kl" in row]
    assert len(logged) == 2 and all(math.isfinite(kl) and logp < 0 for kl, logp in logged)
