"""The ``vllm`` engine on a GPU (marked ``cuda`` and ``vllm``: a GPU with vLLM installed): greedy
rollouts against ``hf`` in float32, the engine asleep between rollouts (its memory back for the
update), the new weights after waking, and a run through the front door under bf16 autocast."""

from __future__ import annotations

import json

import pytest
import torch

from textrl.generation import HFEngine, Sampling
from textrl.generation.vllm_engine import VLLMEngine
from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer

pytestmark = [pytest.mark.cuda, pytest.mark.vllm]


def test_vllm_on_cuda_sleeps_between_rollouts_and_wakes_with_the_new_weights():
    tok = build_tiny_tokenizer()
    model = build_tiny_causal_lm(tok, num_attention_heads=2).cuda().eval()
    enc = tok(["What is 1+2?", "hi", "Count to 3 please"], return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"].cuda(), enc["attention_mask"].cuda()
    sampling = Sampling(greedy=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=12,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    engine = VLLMEngine()
    try:
        with torch.no_grad(), engine.rollout():
            tokens, logp = engine.generate_with_logprobs(model, ids, mask, sampling)
            awake = torch.cuda.mem_get_info()[0]
        assert engine._asleep and torch.cuda.mem_get_info()[0] > awake  # released for the update
        reference, ref_logp = HFEngine().generate_with_logprobs(model, ids, mask, sampling)
        assert torch.equal(tokens, reference) and torch.allclose(logp, ref_logp, atol=1e-3)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
            with engine.rollout():
                after = engine.generate(model, ids, mask, sampling)
            assert torch.equal(after, HFEngine().generate(model, ids, mask, sampling))
    finally:
        engine.close()


def test_a_run_with_the_vllm_engine_under_bf16_logs_its_gap(tmp_path, monkeypatch):
    from textrl.cli import main

    tok = build_tiny_tokenizer()
    folder = tmp_path / "tiny32"
    build_tiny_causal_lm(tok, num_attention_heads=2).save_pretrained(folder)
    tok.save_pretrained(folder)
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(["train", "--model", str(folder), "--generation-engine", "vllm", "--device", "cuda",
                 "--iterations", "3", "--output-dir", str(out), "--eval-every", "0", "--progress", "false",
                 "--warmup-sft-steps", "5"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # bf16 autocast in the learner, bf16 weights in vLLM: a gap, but no lag
        assert row["rollout/staleness"] == 0.0 and row["rollout/logprob_gap"] < 0.1, row


@pytest.mark.slow
def test_two_processes_on_two_gpus_each_draw_their_share_with_their_own_sleeping_vllm(tmp_path):
    """torchrun over 2 GPUs (NCCL): each process's vLLM on its own GPU (the launcher's LOCAL_RANK),
    asleep during the update, draws its share with the update's weights (bf16 autocast: a gap under
    0.1, no lag); identical policies at the end (the trainer's checksum). The CPU's form, with the
    resume: tests/generation/test_vllm.py::test_two_processes_each_draw_their_share_with_their_own_vllm_and_resume_exactly."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (one per training process)")
    from tests.runs import metrics
    from tests.test_multiprocess import _train

    tok = build_tiny_tokenizer()
    folder = tmp_path / "tiny32"
    build_tiny_causal_lm(tok, num_attention_heads=2).save_pretrained(folder)
    tok.save_pretrained(folder)
    out = tmp_path / "run"
    _train(out, "--model", str(folder), "--generation-engine", "vllm", "--device", "cuda", "--iterations", "2",
           cache=tmp_path / "cache")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and len(summary["parameter_checksum"]) == 64
    rows = metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2] and all(r["samples"] == 8 for r in rows)
    for row in rows:
        assert row["rollout/staleness"] == 0.0 and row["rollout/logprob_gap"] < 0.1, row
