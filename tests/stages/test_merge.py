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
