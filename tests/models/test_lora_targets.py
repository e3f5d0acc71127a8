"""LoRA target modules: 'auto' is peft's per-architecture choice (GPT-2 ``c_attn``, Llama / Qwen2
``q_proj, v_proj``), 'all-linear' where peft has none; a list that matches nothing is refused
naming the model's linear modules; an old config's explicit Llama list still means that list."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.agents.conftest import collect
from textrl.agents import agent_class
from textrl.config import TrainConfig
from textrl.models import build_tiny_causal_lm, build_tiny_gpt2, build_tiny_tokenizer
from textrl.models.adapters import LEGACY_LLAMA_TARGETS, lora_config, target_modules_for

SMALL = dict(prompts_per_iteration=2, n_samples_per_prompt=2, max_new_tokens=4, ppo_epochs=1, num_minibatches=1,
             forward_batch_size=4, generation_batch_size=4, iterations=3, warmup_sft_steps=0, actor_lr=1e-2)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _tiny_qwen2(tok):
    config = Qwen2Config(vocab_size=len(tok) + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


BUILDERS = {"gpt2": build_tiny_gpt2, "qwen2": _tiny_qwen2, "llama": build_tiny_causal_lm}
EXPECTED = {"gpt2": {"c_attn"}, "qwen2": {"q_proj", "v_proj"}, "llama": {"q_proj", "v_proj"}}


def _folder(tmp_path, tok, arch: str) -> str:
    model = BUILDERS[arch](tok) if arch != "qwen2" else _tiny_qwen2(tok)
    path = tmp_path / arch
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _wrapped(agent) -> set[str]:
    """The last names of the modules the policy LoRA wraps."""
    return {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in agent.stack.model.named_parameters()
            if "lora_A" in name}


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_the_default_targets_peft_s_choice_and_trains(tmp_path, tok, arch):
    config = TrainConfig(agent="gae_ppo", model=_folder(tmp_path, tok, arch), lora_r=8, **SMALL)
    assert config.lora_target_modules == "auto"
    torch.manual_seed(0)
    agent = agent_class("gae_ppo").from_config(config, "cpu", log=lambda *a: None)
    assert _wrapped(agent) == EXPECTED[arch]
    before = {n: p.detach().clone() for n, p in agent.policy.named_parameters()}
    metrics = agent.update(collect(agent, tok))
    assert metrics["nonfinite/skipped_updates"] == 0.0
    assert any(not torch.equal(before[n], p) for n, p in agent.policy.named_parameters())


def test_without_a_peft_entry_auto_is_every_linear_layer_but_the_head(tok, monkeypatch):
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping

    monkeypatch.delitem(mapping, "llama")
    model = build_tiny_causal_lm(tok)
    assert target_modules_for("auto", model) == "all-linear"
    from peft import get_peft_model

    wrapped = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in
               get_peft_model(model, lora_config(4, target_modules="auto", model=model)).named_parameters() if "lora_A" in n}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # no lm_head


def test_a_list_that_matches_nothing_names_the_models_linear_modules(tmp_path, tok):
    config = TrainConfig(agent="grpo", model=_folder(tmp_path, tok, "gpt2"), lora_r=8,
                         lora_target_modules=LEGACY_LLAMA_TARGETS, **SMALL)
    with pytest.raises(ValueError) as err:
        agent_class("grpo").from_config(config, "cpu", log=lambda *a: None)
    message = str(err.value)
    assert message.startswith("lora_target_modules='q_proj,k_proj,v_proj,o_proj' matches no module of this gpt2 model")
    assert "its linear modules are c_attn, c_proj, c_fc, lm_head" in message and "'auto'" in message


def test_an_old_configs_explicit_llama_list_still_means_that_list(tok):
    model = build_tiny_causal_lm(tok)
    assert set(lora_config(4, target_modules=LEGACY_LLAMA_TARGETS, model=model).target_modules) == {
        "q_proj", "k_proj", "v_proj", "o_proj"}
    # an agent that reads no LoRA option takes an old config.yaml's list as the option left unset
    old = TrainConfig(agent="one_step_ppo", lora_target_modules=LEGACY_LLAMA_TARGETS)
    assert old.validate() is old and old.is_default("lora_target_modules")
    with pytest.raises(ValueError, match="one_step_ppo does not read lora_target_modules='q_proj'"):
        TrainConfig(agent="one_step_ppo", lora_target_modules="q_proj").validate()
