"""``response_hidden`` / ``response_logprobs`` (textrl.models.forward): the response tokens' log-probs
and entropies from the final hidden states and the LM head's weight, equal (values and every
parameter's gradient) to ``response_logits`` followed by the agents' warping and
``logprobs_from_logits`` / ``entropy_from_logits``, through ragged left-padded prompts of a tiny
Llama, a tied-embedding Llama, a tiny GPT-2 (tied) and a PEFT LoRA model; and the models where the
head cannot be applied outside the forward refused with ``UnfusableHead``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaForCausalLM

from tests.arithmetic import assert_gradients_close, model_rtol
from tests.models.test_forward import AttentionSpy
from textrl.agents.forwards import warp_logits
from textrl.functional import entropy_from_logits, logprobs_from_logits
from textrl.models import build_tiny_causal_lm, build_tiny_gpt2, build_tiny_tokenizer
from textrl.models import forward as fwd
from textrl.models.adapters import lora_config
from textrl.models.forward import (
    UnfusableHead,
    leading_padding,
    response_hidden,
    response_logits,
    response_logprobs,
    unfusable_reason,
)
from textrl.testing import assert_close_normwise


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def tied_llama(tok):
    config = build_tiny_causal_lm(tok).config
    config.tie_word_embeddings = True
    model = LlamaForCausalLM(config)
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def lora_llama(tok):
    model = get_peft_model(build_tiny_causal_lm(tok), lora_config())  # peft's default targets
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():  # B starts at zero: give the adapter an effect
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


BUILDERS = {"llama": build_tiny_causal_lm, "tied_llama": tied_llama, "gpt2": build_tiny_gpt2, "lora": lora_llama}


@pytest.fixture(scope="module", params=list(BUILDERS))
def model(request, tok):
    return BUILDERS[request.param](tok).train()


def unfused(model, ids, mask, p, tokens, temperature, top_k, top_p):
    """What the agents compute today (``logprobs_and_entropy``), entropy with grad."""
    logits = response_logits(model, ids, mask, p)  # [B, T, V]
    warped = warp_logits(logits, temperature, top_k, top_p)
    logp = logprobs_from_logits(warped, tokens, temperature=temperature if warped is logits else 1.0)
    return logp, entropy_from_logits(logits, temperature=temperature)


@st.composite
def batches(draw):
    """Ragged prompts padded on the left (some rows without padding, maybe none in the batch),
    responses padded on the right, random token ids, sampling settings."""
    rows = draw(st.integers(1, 4))
    prompt_lengths = draw(st.lists(st.integers(1, 7), min_size=rows, max_size=rows))
    response_len = draw(st.integers(0, 5))
    response_lengths = draw(st.lists(st.integers(0, response_len), min_size=rows, max_size=rows))
    p = max(prompt_lengths)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ids = torch.randint(4, 500, (rows, p + response_len), generator=g)
    mask = torch.zeros(rows, p + response_len, dtype=torch.bool)
    for b, (n_prompt, n_response) in enumerate(zip(prompt_lengths, response_lengths)):
        mask[b, p - n_prompt : p + n_response] = True
        ids[b, : p - n_prompt] = 0  # the pad id
    sampling = dict(temperature=draw(st.sampled_from([0.6, 1.0, 1.4])), top_k=draw(st.sampled_from([0, 5, 40])),
                    top_p=draw(st.sampled_from([1.0, 0.9, 0.5])))
    return ids, mask, p, sampling, draw(st.one_of(st.none(), st.integers(1, 6)))


def param_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@settings(max_examples=12, deadline=None)
@given(batch=batches())
def test_logprobs_entropies_and_gradients_equal_the_unfused_path(model, batch):
    ids, mask, p, sampling, chunk = batch
    tokens = ids[:, p:]
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(tokens.shape, generator=g), torch.randn(tokens.shape, generator=g)

    model.zero_grad(set_to_none=True)
    logp, ent = response_logprobs(model, ids, mask, p, tokens, chunk_size=chunk, entropy="grad", **sampling)
    ((logp * w_lp).sum() + (ent * w_ent).sum()).backward()  # -inf for a filtered token, finite grads
    fused = param_grads(model)
    model.zero_grad(set_to_none=True)
    ref_logp, ref_ent = unfused(model, ids, mask, p, tokens, **sampling)
    ((ref_logp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    reference = param_grads(model)

    assert logp.shape == ent.shape == tokens.shape and logp.dtype == torch.float32
    assert torch.equal(torch.isfinite(logp), torch.isfinite(ref_logp))
    finite = torch.isfinite(ref_logp)
    # the fused head sums the vocabulary and the positions in chunks: the log-probs, the entropies
    # and each gradient equal by norm (tests/arithmetic.py; a gradient element that cancels to ~0
    # differs by float noise far above itself)
    rtol = model_rtol(model.config, ids.numel())
    assert_close_normwise(logp[finite], ref_logp[finite], rtol=rtol, name="logp")
    assert_close_normwise(ent, ref_ent, rtol=rtol, name="entropy")
    assert_gradients_close(fused, reference, rtol)


def test_hidden_through_the_head_are_the_response_logits_in_the_callers_layout(tok):
    model = build_tiny_causal_lm(tok).eval()
    enc = tok(["What is 1+2?", "hi", "Count to 3"], return_tensors="pt", padding=True)
    response = torch.randint(10, 200, (3, 4))
    ids = torch.cat([enc["input_ids"], response], 1)
    mask = torch.cat([enc["attention_mask"].bool(), torch.ones_like(response, dtype=torch.bool)], 1)
    p = enc["input_ids"].shape[1]
    assert leading_padding(mask).any()
    with torch.no_grad():
        hidden, head = response_hidden(model, ids, mask, p)
        assert head is model.lm_head and hidden.shape == (3, 4, 64)
        torch.testing.assert_close(head(hidden), response_logits(model, ids, mask, p), rtol=1e-6, atol=1e-6)
        hidden, _ = response_hidden(model, ids, mask, ids.shape[1])  # no response: [B, 0, H]
        assert hidden.shape == (3, 0, 64)
    with pytest.raises(ValueError, match="prompt_len=0"):
        response_hidden(model, ids, mask, 0)


def test_no_attention_row_is_fully_masked_under_the_graph(tok, monkeypatch):
    spy = AttentionSpy()
    monkeypatch.setattr(nn.functional, "scaled_dot_product_attention",
                        spy.wrap(nn.functional.scaled_dot_product_attention))
    model = build_tiny_causal_lm(tok)
    enc = tok(["What is 1+2?", "hi"], return_tensors="pt", padding=True)
    response = torch.randint(10, 200, (2, 3))
    ids = torch.cat([enc["input_ids"], response], 1)
    mask = torch.cat([enc["attention_mask"].bool(), torch.ones_like(response, dtype=torch.bool)], 1)
    logp, ent = response_logprobs(model, ids, mask, enc["input_ids"].shape[1], response, entropy="grad")
    (logp.sum() + ent.sum()).backward()
    assert spy.padded > 0 and spy.fully_masked == 0


def test_bf16_autocast_matches_the_unfused_path_under_the_same_autocast(tok):
    model = build_tiny_causal_lm(tok)
    enc = tok(["What is 1+2?", "hi", "Count to 3", "<think>"], return_tensors="pt", padding=True)
    g = torch.Generator().manual_seed(2)
    response = torch.randint(10, 500, (4, 6), generator=g)
    ids = torch.cat([enc["input_ids"], response], 1)
    mask = torch.cat([enc["attention_mask"].bool(), torch.ones_like(response, dtype=torch.bool)], 1)
    p = enc["input_ids"].shape[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent = response_logprobs(model, ids, mask, p, response, temperature=0.8, entropy="grad")
    (logp.sum() + ent.sum()).backward()
    fused = param_grads(model)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_logp, ref_ent = unfused(model, ids, mask, p, response, 0.8, 0, 1.0)
    (ref_logp.sum() + ref_ent.sum()).backward()
    reference = param_grads(model)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp, rtol=2e-2, atol=3e-2)
    torch.testing.assert_close(ent, ref_ent, rtol=2e-2, atol=3e-2)
    for name, want in reference.items():
        scale = want.abs().max().clamp(min=1e-6)
        torch.testing.assert_close(fused[name] / scale, want / scale, rtol=0, atol=3e-2, msg=name)


# -- refusals -------------------------------------------------------------------------------------


def short_batch(tok):
    enc = tok(["hi", "Count to 3"], return_tensors="pt", padding=True)
    response = torch.randint(10, 200, (2, 3))
    ids = torch.cat([enc["input_ids"], response], 1)
    mask = torch.cat([enc["attention_mask"].bool(), torch.ones_like(response, dtype=torch.bool)], 1)
    return ids, mask, enc["input_ids"].shape[1], response


class ScaledHead(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2.0


class DoublingLlama(LlamaForCausalLM):
    """Post-processes its logits under no name the config check knows: only the probe sees it."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out


def gemma2(softcap):
    config = Gemma2Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                          final_logit_softcapping=softcap)
    return Gemma2ForCausalLM(config)


def refused(model, tok, match):
    """``model`` is refused with a reason matching ``match``, by both entry points."""
    ids, mask, p, response = short_batch(tok)
    with pytest.raises(UnfusableHead, match=match):
        response_hidden(model, ids, mask, p)
    with pytest.raises(ValueError, match=match):  # UnfusableHead is a ValueError
        response_logprobs(model, ids, mask, p, response)


def test_a_lora_wrapped_head_is_refused(tok):
    model = get_peft_model(build_tiny_causal_lm(tok), LoraConfig(target_modules=["q_proj", "lm_head"]))
    assert "peft" in unfusable_reason(model)
    refused(model, tok, "not a plain torch.nn.Linear")


def test_a_head_of_a_linear_subclass_is_refused(tok):
    model = build_tiny_causal_lm(tok)
    model.set_output_embeddings(ScaledHead(64, 512, bias=False))
    refused(model, tok, "ScaledHead, not a plain")


def test_a_4bit_head_is_refused(tok):
    bnb = pytest.importorskip("bitsandbytes")
    model = build_tiny_causal_lm(tok)
    model.set_output_embeddings(bnb.nn.Linear4bit(64, 512, bias=False))
    refused(model, tok, "Linear4bit, not a plain")


def test_a_head_with_hooks_or_a_partitioned_weight_is_refused(tok):
    model = build_tiny_causal_lm(tok)
    handle = model.lm_head.register_forward_hook(lambda *_: None)
    refused(model, tok, "forward hooks")
    handle.remove()
    assert unfusable_reason(model) is None
    model.lm_head.weight.ds_id = 3  # what DeepSpeed ZeRO-3 marks its partitioned parameters with
    refused(model, tok, "partitioned")


def test_a_model_without_a_head_is_refused(tok):
    body = build_tiny_causal_lm(tok).model  # a LlamaModel: hidden states, no logits
    ids, mask, p, _ = short_batch(tok)
    with pytest.raises(UnfusableHead, match="has no LM head"):
        response_hidden(body, ids, mask, p)


@pytest.mark.parametrize("field,value", [("final_logit_softcapping", 30.0), ("logits_scaling", 4.0),
                                         ("logit_scale", 0.0625)])
def test_a_config_that_post_processes_the_logits_is_refused(tok, field, value):
    model = build_tiny_causal_lm(tok)
    setattr(model.config, field, value)
    refused(model, tok, f"config.{field}={value}")


def test_gemma2_soft_capping_is_refused_by_its_config_and_by_the_probe(tok, monkeypatch):
    refused(gemma2(30.0), tok, "final_logit_softcapping=30.0")
    monkeypatch.setattr(fwd, "LOGIT_POSTPROCESSING", {})  # only the probe left to see it
    model = gemma2(30.0)
    assert unfusable_reason(model) is None
    refused(model, tok, "changes its LM head's output")
    assert "probe" in unfusable_reason(model)  # remembered: the next call refuses before any forward
    uncapped = gemma2(None)  # the same architecture without soft-capping goes through, equal
    ids, mask, p, response = short_batch(tok)
    logp, _ = response_logprobs(uncapped, ids, mask, p, response)
    ref, _ = unfused(uncapped, ids, mask, p, response, 1.0, 0, 1.0)
    assert_close_normwise(logp, ref, rtol=model_rtol(uncapped.config, ids.numel()), name="logp")  # tests/arithmetic.py


def test_a_forward_that_changes_the_logits_is_caught_by_the_probe(tok):
    model = DoublingLlama(build_tiny_causal_lm(tok).config)
    assert unfusable_reason(model) is None
    refused(model, tok, "changes its LM head's output")
    assert unfusable_reason(model) is not None
