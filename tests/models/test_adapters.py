"""textrl.models.adapters: base loading (4-bit too), LoRA recipe, last-token hidden state, the
reward-adapter folder (round trip, atomic write, error messages), merging and its record."""

from __future__ import annotations

import json
import os

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from tests.arithmetic import model_rtol
from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer
from textrl.models.adapters import (
    last_token_hidden,
    load_base_model,
    load_reward_adapter,
    lora_config,
    merge_adapter,
    merge_info,
    read_reward_meta,
    save_adapter,
    save_merged_model,
    save_reward_adapter,
    warn_if_merged,
)
from textrl.testing import assert_close_normwise

TEXTS = ["What is 12+7?", "<think>\nadd\n</think>\n<answer>19</answer>", "hi"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def random_lora(model, adapter_name: str = "default", seed: int = 1, **kwargs):
    """A PeftModel whose LoRA B is random (a fresh LoRA is the identity: B = 0)."""
    peft_model = get_peft_model(model, lora_config(**kwargs), adapter_name=adapter_name)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return peft_model


def score_head(seed: int = 2, hidden: int = 64) -> torch.nn.Linear:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Linear(hidden, 1)


def encode(tok, texts=TEXTS, side: str = "left"):
    tok.padding_side = side
    try:
        enc = tok(list(texts), return_tensors="pt", padding=True)
    finally:
        tok.padding_side = "left"
    return enc["input_ids"], enc["attention_mask"]


@pytest.fixture
def reward_folder(tok, tmp_path):
    """A saved reward adapter (named 'rm', so peft would put it in a subfolder) and its scores."""
    model = random_lora(build_tiny_causal_lm(tok, seed=0), adapter_name="rm")
    head = score_head()
    path = tmp_path / "reward"
    save_reward_adapter(model, head, path, adapter_name="rm", base_model="tiny")
    with torch.no_grad():
        scores = head(last_token_hidden(model, *encode(tok))).squeeze(-1)
    return path, scores


def test_lora_config_parses_module_lists():
    assert sorted(lora_config(target_modules="q_proj, v_proj").target_modules) == ["q_proj", "v_proj"]
    assert lora_config(target_modules="all-linear").target_modules == "all-linear"
    assert sorted(lora_config(target_modules=["k_proj"]).target_modules) == ["k_proj"]
    cfg = lora_config(r=4, alpha=8, dropout=0.1)
    assert (cfg.r, cfg.lora_alpha, cfg.lora_dropout, cfg.bias) == (4, 8, 0.1, "none")
    with pytest.raises(ValueError, match="target_modules"):
        lora_config(target_modules=" , ")


def test_last_token_hidden_reads_each_rows_last_token_with_either_padding(tok):
    model = build_tiny_causal_lm(tok, seed=0)
    with torch.no_grad():
        left = last_token_hidden(model, *encode(tok, side="left"))
        right = last_token_hidden(model, *encode(tok, side="right"))
        alone = torch.cat([last_token_hidden(model, *encode(tok, [t])) for t in TEXTS])
    assert left.shape == (len(TEXTS), 64) and left.dtype == torch.float32
    # padded batches sum the attention and the layers in other shapes: equal by norm (tests/arithmetic.py)
    rtol = model_rtol(model.config, encode(tok)[0].numel())
    assert_close_normwise(left, alone, rtol=rtol, name="left-padded")
    assert_close_normwise(right, alone, rtol=rtol, name="right-padded")


def test_reward_folder_round_trip(tok, reward_folder):
    path, scores = reward_folder
    assert sorted(os.listdir(path)) == [
        "adapter_config.json", "adapter_model.safetensors", "score_head.safetensors", "textrl_reward.json",
    ]
    meta = json.loads((path / "textrl_reward.json").read_text())
    assert meta == {"format": "textrl-lora-reward", "version": 1, "base_model": "tiny", "hidden_size": 64}
    model, head = load_reward_adapter(build_tiny_causal_lm(tok, seed=0), path)
    assert isinstance(model, PeftModel) and model.active_adapter == "reward"
    assert not any(p.requires_grad for p in [*model.parameters(), *head.parameters()])
    with torch.no_grad():
        again = head(last_token_hidden(model, *encode(tok))).squeeze(-1)
    assert torch.equal(again, scores)
    # loading it as a second adapter leaves the active one active
    policy = get_peft_model(build_tiny_causal_lm(tok, seed=0), lora_config(), adapter_name="policy")
    model, _ = load_reward_adapter(policy, path)
    assert model is policy and model.active_adapter == "policy" and "reward" in model.peft_config


def test_saving_again_replaces_the_folder_atomically(tok, reward_folder):
    path, _ = reward_folder
    model = random_lora(build_tiny_causal_lm(tok, seed=0), seed=5)
    save_reward_adapter(model, score_head(seed=9), path, base_model="other")
    assert read_reward_meta(path)["base_model"] == "other"
    assert sorted(p.name for p in path.parent.iterdir()) == ["reward"]  # no temp or old folders left


@pytest.mark.parametrize(
    "missing", ["adapter_config.json", "adapter_model.safetensors", "score_head.safetensors", "textrl_reward.json"]
)
def test_a_missing_file_is_named(tok, reward_folder, missing):
    path, _ = reward_folder
    (path / missing).unlink()
    with pytest.raises(ValueError, match=rf"has no {missing}.*textrl rm --lora"):
        load_reward_adapter(build_tiny_causal_lm(tok, seed=0), path)


def test_a_wrong_hidden_size_is_named(tok, reward_folder):
    path, _ = reward_folder
    with pytest.raises(ValueError, match=r"hidden_size=64 but the model has hidden_size=32"):
        load_reward_adapter(build_tiny_causal_lm(tok, seed=0, hidden_size=32), path)
    meta = json.loads((path / "textrl_reward.json").read_text())
    (path / "textrl_reward.json").write_text(json.dumps({**meta, "hidden_size": 128}))
    with pytest.raises(ValueError, match=r"textrl_reward.json: hidden_size=128"):
        load_reward_adapter(build_tiny_causal_lm(tok, seed=0), path)
    (path / "textrl_reward.json").write_text(json.dumps({**meta, "format": "other"}))
    with pytest.raises(ValueError, match="format 'other'"):
        read_reward_meta(path)
    with pytest.raises(ValueError, match="not a folder"):
        read_reward_meta(path / "nope")


def test_merge_then_reload_gives_the_adapter_models_logits(tok, tmp_path):
    model = random_lora(build_tiny_causal_lm(tok, seed=0), adapter_name="sft")
    ids, mask = encode(tok)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    merged = merge_adapter(model, "sft")
    assert not isinstance(merged, PeftModel)
    save_merged_model(merged, tmp_path / "merged", base_model="tiny", adapter="sft-folder", tokenizer=tok)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        logits = reloaded(input_ids=ids, attention_mask=mask).logits
    # x (W + s B A) against x W + s (x A) B: other sums, and W + s B A rounded once (tests/arithmetic.py)
    assert_close_normwise(logits, expected, rtol=model_rtol(reloaded.config, ids.numel()), name="merged logits")
    assert merge_info(reloaded) == {"base_model": "tiny", "adapter": "sft-folder"}
    assert merge_info(tmp_path / "merged") == {"base_model": "tiny", "adapter": "sft-folder"}
    with pytest.warns(UserWarning, match="already merged with a LoRA"):
        warn_if_merged(reloaded)


def test_merge_info_is_none_for_a_plain_model_and_sees_leftover_adapter_files(tok, tmp_path):
    plain = build_tiny_causal_lm(tok, seed=0)
    assert merge_info(plain) is None
    plain.save_pretrained(tmp_path / "m")
    save_adapter(random_lora(build_tiny_causal_lm(tok, seed=0), adapter_name="x"), "x", tmp_path / "m")
    assert "adapter" in merge_info(AutoModelForCausalLM.from_pretrained(tmp_path / "m"))


def test_merging_a_4bit_base_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))
    model = get_peft_model(load_base_model("tiny", load_in_4bit=True), lora_config())
    with pytest.raises(ValueError, match="full precision"):
        merge_adapter(model, "default")


def test_4bit_base_loads_and_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))
    full = load_base_model("tiny")
    quant = load_base_model("tiny", load_in_4bit=True)
    assert getattr(quant, "is_loaded_in_4bit", False) and not getattr(full, "is_loaded_in_4bit", False)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        a = full(input_ids=ids).logits
        b = quant(input_ids=ids).logits
    assert b.dtype == torch.float32 and torch.isfinite(b).all()
    assert (a - b).abs().max() < 0.5  # NF4 is close to, not equal to, the float weights
    del full
    import gc

    gc.collect()
    with open("/proc/self/maps") as maps:  # the float checkpoint is not kept mapped (and resident)
        assert str(tmp_path / "cache") not in maps.read()


def test_4bit_without_bitsandbytes_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a))
    with pytest.raises(ValueError, match="pip install bitsandbytes"):
        load_base_model("tiny", load_in_4bit=True)


def lora_grads(base, ids):
    """LoRA gradients of sum(logits) on ``base`` after a no-grad forward (as generation does)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = random_lora(base)
    with torch.no_grad():
        model(input_ids=ids)
    model(input_ids=ids).logits.sum().backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_match_dequantised(quant, ids) -> None:
    """LoRA gradients on an NF4 base equal those on a float copy holding its dequantised weights."""
    import bitsandbytes as bnb

    dense = load_base_model("tiny")
    for name, module in quant.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
            dense.get_submodule(name).weight.data.copy_(weight.float())
    expected = lora_grads(dense, ids)
    got = lora_grads(quant, ids)
    assert expected.keys() == got.keys() and len(got) == 8  # 2 layers x q_proj, v_proj (peft's Llama targets) x (A, B)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-4, rtol=1e-4)


def test_gradients_through_4bit_layers_match_the_dequantised_model(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))
    assert_grads_match_dequantised(load_base_model("tiny", load_in_4bit=True), torch.tensor([[5, 6, 7, 8, 9, 10]]))


def test_keep_4bit_differentiable_undoes_cpu_repacking(tmp_path, monkeypatch):
    from transformers import BitsAndBytesConfig

    from textrl.models import tiny_model_path
    from textrl.models.adapters import keep_4bit_differentiable

    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path / "cache"))
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    raw = AutoModelForCausalLM.from_pretrained(tiny_model_path(), quantization_config=quant, device_map="cpu").eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        raw(input_ids=ids)  # on AVX512-BF16 CPUs this repacks the weights for a bf16 inference kernel
    repacked = any(getattr(getattr(m.weight, "quant_state", None), "packing_format_for_cpu", False)
                   for m in raw.modules() if hasattr(m, "weight"))
    if repacked:
        with pytest.warns(UserWarning, match="repacked"):
            keep_4bit_differentiable(raw)
    else:
        keep_4bit_differentiable(raw)
    assert keep_4bit_differentiable(raw) == 0
    assert_grads_match_dequantised(raw, ids)
