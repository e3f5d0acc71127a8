"""The colocated ``vllm`` engine's options as vLLM's users set them (docs/vllm.md, "Engine options"):
what reaches ``vllm.LLM(...)`` (intercepted by a stand-in ``vllm`` module, so no vLLM is needed),
``max_model_len`` from the run's lengths, when the engine sleeps, and the refusals said in one line
before any model loads. The test marked ``vllm`` trains with non-default options where vLLM imports
(the CI's vllm tier)."""

from __future__ import annotations

import json
import re
import sys
import types

import pytest
import torch

from textrl.agents.build import run_lengths
from textrl.cli import main
from textrl.config import TrainConfig
from textrl.core.env_facts import EnvFacts
from textrl.generation import Sampling
from textrl.generation.vllm_engine import (
    EngineOptions,
    VLLMEngine,
    kv_cache_bytes,
    llm_options,
    model_length,
    sleeps,
)
from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer

SMALL = ["--iterations", "1", "--prompts-per-iteration", "2", "--n-samples-per-prompt", "2", "--max-new-tokens", "8",
         "--warmup-sft-steps", "0", "--eval-size", "2", "--progress", "false"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


# -- the options, read once and passed on as given ---------------------------------------------------
def test_the_options_are_read_from_the_config_in_one_place():
    config = TrainConfig(generation_engine="vllm", vllm_tensor_parallel_size=2, vllm_max_model_length=96,
                         vllm_max_num_seqs=8, vllm_quantization="fp8_per_tensor", vllm_gpu_memory_utilization=0.5,
                         max_staleness=1, seed=7)
    assert EngineOptions.of(config) == EngineOptions(gpu_memory_utilization=0.5, tensor_parallel_size=2,
                                                     max_model_length=96, max_num_seqs=8, quantization="fp8_per_tensor",
                                                     learner_beside=True, seed=7)
    assert EngineOptions.of(TrainConfig()) == EngineOptions()  # the defaults: vLLM's own for what is unset


def test_vllms_options_reach_its_keywords_and_unset_ones_stay_vllms():
    given = EngineOptions(tensor_parallel_size=2, max_num_seqs=8, quantization="fp8_per_tensor", gpu_memory_utilization=0.4)
    on_cuda = llm_options(given, device_type="cuda", max_model_len=96, kv_bytes=None)
    assert on_cuda == {"max_model_len": 96, "tensor_parallel_size": 2, "max_num_seqs": 8, "quantization": "fp8_per_tensor",
                       "gpu_memory_utilization": 0.4, "enable_sleep_mode": True}
    on_cpu = llm_options(EngineOptions(), device_type="cpu", max_model_len=40, kv_bytes=1 << 25)
    assert on_cpu == {"max_model_len": 40, "tensor_parallel_size": 1, "enforce_eager": True,
                      "enable_chunked_prefill": False, "max_num_batched_tokens": 4096, "kv_cache_memory_bytes": 1 << 25}
    long = llm_options(EngineOptions(), device_type="cpu", max_model_len=9000, kv_bytes=None)
    assert long["max_num_batched_tokens"] == 9000  # without chunked prefill a step holds the longest sequence


@pytest.mark.parametrize("extra, added", [
    (["--max-model-len", "512"], ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"]),
    (["--max-model-len=8192"], ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"]),
    (["--max-model-len", "4k"], ["--no-enable-chunked-prefill"]),  # vLLM's own reading of it
    (["--max-num-batched-tokens", "16384"], ["--no-enable-chunked-prefill"]),
    (["--enable-chunked-prefill"], []),
    ([], ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096"]),  # the model's context, read
])
def test_a_cpu_server_runs_without_chunked_prefill_and_a_step_holds_the_longest_sequence(tmp_path, extra, added):
    from textrl.generation.vllm_server import cpu_prefill_options, serve_command
    from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer

    build_tiny_causal_lm(build_tiny_tokenizer(), max_position_embeddings=4096).config.save_pretrained(tmp_path)
    assert cpu_prefill_options(str(tmp_path), extra) == added
    argv, _ = serve_command(str(tmp_path), extra, cuda=False)
    assert argv[-len(extra) - len(added):] == added + extra if extra else argv[-len(added):] == added
    assert "--no-enable-chunked-prefill" not in serve_command(str(tmp_path), extra, cuda=True)[0]
    assert "kv_cache_memory_bytes" not in llm_options(EngineOptions(), device_type="cpu", max_model_len=40, kv_bytes=None)


def test_max_model_len_is_what_the_run_needs_unless_given():
    assert model_length(None, 48, 131072) == 48  # not the model's whole context
    assert model_length(64, 48, 131072) == 64
    assert model_length(None, None, 512) == 512 and model_length(None, None, None) == 2048  # nothing known: as before
    with pytest.raises(ValueError, match=r"^vllm_max_model_length=40: .* reach 48 tokens; raise it to 48") as err:
        model_length(40, 48, 512)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^vllm_max_model_length=600: the policy has 512 positions; lower it"):
        model_length(600, 48, 512)


def test_the_engine_is_told_the_lengths_the_trainer_resolved():
    facts = EnvFacts(env_id="digits", episode_budget=24, max_prompt_length=37)
    assert run_lengths(TrainConfig(), facts) == (37, 24)
    assert run_lengths(TrainConfig(max_prompt_length=50), EnvFacts(env_id="digits", episode_budget=24)) == (50, 24)
    assert run_lengths(TrainConfig(max_prompt_length=50, max_episode_tokens=30), None) == (50, 30)
    assert run_lengths(TrainConfig(), EnvFacts(env_id="digits", episode_budget=24)) is None  # prompts not measured yet


def test_a_given_length_under_the_runs_is_refused_when_the_engine_is_told():
    engine = VLLMEngine()
    engine.configure(TrainConfig(generation_engine="vllm", vllm_max_model_length=40))
    with pytest.raises(ValueError, match="vllm_max_model_length=40: .* reach 48 tokens"):
        engine.fit_lengths(40, 8)
    engine.fit_lengths(32, 8)
    assert engine.needed_length == 40


def test_a_run_tells_its_engine_the_lengths_it_resolved(tmp_path, monkeypatch):
    """Without --max-prompt-length the prompts' cap is measured once the models load; the engine is
    told it and the episode's budget (what summary.json records as the lengths in use)."""
    from textrl.generation.base import GenerationEngine

    told = []
    monkeypatch.setattr(GenerationEngine, "fit_lengths", lambda self, prompts, budget: told.append((prompts, budget)))
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--output-dir", str(out), "--eval-every", "0"]) == 0
    lengths = json.loads((out / "summary.json").read_text())["lengths"]
    assert told and set(told) == {(lengths["max_prompt_length"], lengths["max_episode_tokens"])}


# -- sleep -------------------------------------------------------------------------------------------
def test_the_engine_sleeps_only_where_the_learner_takes_the_memory():
    assert sleeps("cuda", learner_beside=False)  # the synchronous loop: the update follows the rollout
    assert not sleeps("cuda", learner_beside=True)  # --max-staleness >= 1: the learner runs beside vLLM
    assert not sleeps("cpu", learner_beside=False)  # no sleep mode on the CPU
    for staleness, expected in ((0, True), (1, False), (3, False)):
        engine = VLLMEngine()
        engine.configure(TrainConfig(generation_engine="vllm", max_staleness=staleness))
        assert sleeps("cuda", engine.options.learner_beside) is expected
        assert llm_options(engine.options, device_type="cuda", max_model_len=64, kv_bytes=None)["enable_sleep_mode"] is expected


# -- the keywords vLLM gets, intercepted -------------------------------------------------------------
class RecordingLLM:
    """Stands in for ``vllm.LLM``: keeps its keywords, answers every prompt with EOS."""

    made: list[dict] = []

    def __init__(self, **kwargs):
        RecordingLLM.made.append(kwargs)
        self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=lambda: None))

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=p.stop_token_ids[:1], logprobs=None)])
                for p in params]


@pytest.fixture
def recording_vllm(monkeypatch):
    fake = types.ModuleType("vllm")
    fake.LLM = RecordingLLM
    fake.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    RecordingLLM.made.clear()
    return RecordingLLM.made


def test_the_run_settings_reach_vllms_llm(tok, recording_vllm):
    model = build_tiny_causal_lm(tok, num_attention_heads=2)  # heads of 32: vLLM's CPU attention runs them
    engine = VLLMEngine()
    engine.configure(TrainConfig(generation_engine="vllm", vllm_max_num_seqs=3, vllm_quantization="fp8_per_tensor",
                                 max_weight_gap=0.5, seed=5))
    engine.fit_lengths(40, 24)  # the prompts' cap and the episode's budget: 64 tokens, not the model's 512
    enc = tok(["hi", "a b c"], return_tensors="pt", padding=True)
    sampling = Sampling(greedy=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    try:
        tokens = engine.generate(model, enc["input_ids"], enc["attention_mask"], sampling)
    finally:
        engine.close()
    assert tokens.tolist() == [[tok.eos_token_id]] * 2
    (kwargs,) = recording_vllm
    expected_kv = kv_cache_bytes(model.config, 64, torch.float32, sequences=3)
    assert {k: kwargs[k] for k in ("max_model_len", "max_num_seqs", "quantization", "tensor_parallel_size", "seed",
                                   "kv_cache_memory_bytes")} == {
        "max_model_len": 64, "max_num_seqs": 3, "quantization": "fp8_per_tensor", "tensor_parallel_size": 1, "seed": 5,
        "kv_cache_memory_bytes": expected_kv}
    assert "gpu_memory_utilization" not in kwargs and "enable_sleep_mode" not in kwargs  # CUDA's, not the CPU's


# -- refused in one line, before any model loads -------------------------------------------------------
@pytest.mark.parametrize(("args", "message"), [
    (["--vllm-max-num-seqs", "8"], "vllm_max_num_seqs=8 is an option of the colocated vLLM engine, and this run "
                                   "generates with --generation-engine auto: add --generation-engine vllm"),
    (["--generation-engine", "textrl", "--vllm-gpu-memory-utilization", "0.5"], "vllm_gpu_memory_utilization=0.5 is an option"),
    (["--generation-engine", "vllm", "--device", "cpu", "--vllm-tensor-parallel-size", "2"],
     "vllm_tensor_parallel_size=2: vLLM splits the policy over that many GPUs, and this run has the CPU; lower it to 1"),
    (["--generation-engine", "vllm", "--max-prompt-length", "30", "--vllm-max-model-length", "32"],
     "vllm_max_model_length=32: max_prompt_length=30 plus an episode of 8 tokens reach 38; raise it to 38"),
    (["--generation-engine", "vllm", "--vllm-quantization", "fp8_per_tensor"], "set --max-weight-gap"),
    (["--generation-engine", "vllm", "--vllm-max-num-seqs", "0"], "vllm_max_num_seqs=0: must be a number >= 1"),
], ids=["not-the-vllm-engine", "memory-share-under-textrl", "tensor-parallel-on-cpu", "length-under-the-need",
        "quantization-without-a-gap-bound", "no-sequences"])
def test_bad_engine_options_stop_in_one_line_before_any_model_loads(tmp_path, args, message):
    with pytest.raises(SystemExit, match=re.escape(message)) as stop:
        main(["train", *SMALL, "--output-dir", str(tmp_path / "x"), *args])
    assert "\n" not in str(stop.value.code)
    assert not (tmp_path / "x").exists()


# -- where vLLM imports --------------------------------------------------------------------------------
@pytest.mark.vllm
def test_a_run_with_vllms_own_options_trains(tmp_path, monkeypatch, tok):
    """--vllm-max-num-seqs 3 (fewer than a call's 4 rows: they queue) and --vllm-max-model-length 200,
    beside a run whose default is its prompts' cap plus the episode (68 with --max-prompt-length 60):
    vLLM runs with what was asked, and the rollouts are the learner's policy's."""
    import vllm

    folder = tmp_path / "tiny32"
    build_tiny_causal_lm(tok, num_attention_heads=2).save_pretrained(folder)
    tok.save_pretrained(folder)
    started = []

    class Recorded(vllm.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self.llm_engine.vllm_config)

    monkeypatch.setattr(vllm, "LLM", Recorded)
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))
    for name, options in (("given", ["--vllm-max-num-seqs", "3", "--vllm-max-model-length", "200"]),
                          ("default", ["--max-prompt-length", "60"])):
        out = tmp_path / name
        assert main(["train", "--model", str(folder), "--generation-engine", "vllm", "--env", "digits",
                     "--iterations", "2", "--output-dir", str(out), "--prompts-per-iteration", "2",
                     "--n-samples-per-prompt", "2", "--max-new-tokens", "8", "--warmup-sft-steps", "3",
                     "--eval-size", "2", "--eval-every", "0", "--progress", "false", *options]) == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in rows] == [1, 2]
        assert all(r["rollout/logprob_gap_max"] < 1e-4 for r in rows), rows
    given, default = started
    assert (given.model_config.max_model_len, given.scheduler_config.max_num_seqs) == (200, 3)
    assert default.model_config.max_model_len == 68 and default.scheduler_config.max_num_seqs != 3
