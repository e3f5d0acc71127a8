"""``textrl merge``: the merged model gives the adapter model's logits, and says it was merged."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.arithmetic import model_rtol
from textrl.stages.common import StageConfig, add_lora, load_adapter_model, save_policy
from textrl.stages.merge import MergeConfig, merge
from textrl.testing import assert_close_normwise


@pytest.fixture
def adapter_dir(tmp_path):
    """A LoRA adapter on the tiny model with random (non-zero) weights, saved like `sft --lora`."""
    from textrl.models import load_causal_lm, load_tokenizer

    config = StageConfig(lora=True)
    model = add_lora(load_causal_lm("tiny"), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.1)
    return save_policy(model, load_tokenizer("tiny"), tmp_path / "adapter", config=config, stage="sft")


def test_merge_then_reload_gives_the_adapter_models_logits(adapter_dir, tmp_path):
    from textrl.models import load_causal_lm

    out = tmp_path / "merged"
    merge(MergeConfig(adapter=str(adapter_dir), output_dir=str(out)))
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    with_adapter = load_adapter_model(adapter_dir)
    ids = torch.randint(4, 500, (2, 12))
    with torch.no_grad():
        expected = with_adapter(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        base = load_causal_lm("tiny")(input_ids=ids).logits
    # x (W + s B A) against x W + s (x A) B: other sums, W + s B A rounded once (tests/arithmetic.py)
    assert_close_normwise(got, expected, rtol=model_rtol(merged.config, ids.numel()), name="merged logits")
    assert not torch.allclose(base, expected, atol=1e-3)  # the adapter did change the model
    assert json.loads((out / "textrl_merged.json").read_text()) == {"base_model": "tiny", "adapter": str(adapter_dir)}
    from textrl.models.adapters import merge_info

    assert merge_info(merged)["adapter"] == str(adapter_dir)


def test_merge_rejects_what_it_cannot_merge(tmp_path, adapter_dir):
    with pytest.raises(ValueError, match="pass --adapter"):
        MergeConfig(output_dir=str(tmp_path / "m")).validate()
    with pytest.raises(ValueError, match="holds no adapter_config.json"):
        MergeConfig(adapter=str(tmp_path), output_dir=str(tmp_path / "m")).validate()
    (adapter_dir / "textrl_reward.json").write_text("{}")
    with pytest.raises(ValueError, match="is a LoRA reward adapter"):
        MergeConfig(adapter=str(adapter_dir), output_dir=str(tmp_path / "m")).validate()


# -- the merge's arithmetic: float32, then one cast to the base's dtype ---------------------------------
def bf16_lora(seed: int = 0, base_dir=None):
    """The tiny model in bfloat16 (saved to ``base_dir`` when given) under a LoRA whose weights are
    bfloat16 too (peft would otherwise keep them in float32), random and non-zero, and
    ``{module name: (W, s B A in float32)}`` of its targets."""
    from peft import get_peft_model

    from textrl.models import load_causal_lm
    from textrl.models.adapters import lora_config

    base = load_causal_lm("tiny").to(torch.bfloat16)
    if base_dir is not None:
        base.save_pretrained(base_dir)
    model = get_peft_model(base, lora_config(r=4, alpha=8, dropout=0.0, target_modules="auto", model=base),
                           autocast_adapter_dtype=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    targets = {}
    for name, module in model.get_base_model().named_modules():
        if hasattr(module, "base_layer") and "default" in getattr(module, "lora_A", {}):
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            assert a.dtype == b.dtype == module.base_layer.weight.dtype == torch.bfloat16
            targets[name] = (module.base_layer.weight.detach().clone(),
                             (b.float() @ a.float()) * module.scaling["default"])
    assert targets
    return model, targets


def once(weight, delta):
    """``W + s B A`` in float32, rounded once to bfloat16."""
    return (weight.float() + delta).to(torch.bfloat16)


def twice(weight, delta):
    """The bfloat16 arithmetic: the delta rounded to bfloat16, then the sum rounded again."""
    return weight + delta.to(torch.bfloat16)


def test_merge_adapter_merges_in_float32_and_casts_once():
    from textrl.models.adapters import merge_adapter

    model, targets = bf16_lora()
    merged = dict(merge_adapter(model, "default").named_modules())
    differs = 0
    for name, (weight, delta) in targets.items():
        got = merged[name].weight
        assert got.dtype == torch.bfloat16 and torch.equal(got, once(weight, delta)), name
        differs += int((once(weight, delta) != twice(weight, delta)).sum())
    assert differs > 0  # bfloat16 arithmetic would give other weights: this test can fail


def test_the_weights_pushed_to_vllm_are_merged_in_float32_and_cast_once():
    from textrl.generation.vllm_engine import merged_state_dict

    model, targets = bf16_lora(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weights = merged_state_dict(model)
    for name, (weight, delta) in targets.items():
        assert torch.equal(weights[f"{name}.weight"], once(weight, delta)), name
        assert not torch.equal(weights[f"{name}.weight"], twice(weight, delta)), name
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the policy is untouched


def test_a_bfloat16_base_merges_into_a_bfloat16_model_rounded_once(tmp_path):
    from textrl.models import load_tokenizer
    from textrl.models.adapters import save_adapter

    base_dir, adapter = tmp_path / "base16", tmp_path / "adapter"
    model, targets = bf16_lora(seed=2, base_dir=base_dir)
    tok = load_tokenizer("tiny")
    tok.save_pretrained(base_dir)
    save_adapter(model, "default", adapter)
    merge(MergeConfig(adapter=str(adapter), output_dir=str(tmp_path / "merged"), base_model=str(base_dir)))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype="auto")
    modules = dict(merged.named_modules())
    assert merged.dtype == torch.bfloat16  # the base's dtype, not float32
    for name, (weight, delta) in targets.items():
        assert torch.equal(modules[name].weight, once(weight, delta)), name


def test_only_a_plain_linear_lora_is_merged_by_hand():
    from textrl.models.adapters import lora_delta

    model, targets = bf16_lora()
    layer = dict(model.get_base_model().named_modules())[next(iter(targets))]
    torch.testing.assert_close(lora_delta(layer, "default"), targets[next(iter(targets))][1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="not a plain linear LoRA"):
        lora_delta(layer, "other")
