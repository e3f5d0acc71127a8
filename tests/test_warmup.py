"""The SFT warm-up: completion-only labels, a falling loss, and the think/answer format it teaches."""

from __future__ import annotations

import re
import time

import pytest
import torch

from textrl.envs.prompts import encode_prompts
from textrl.envs.tasks import make_digits_task, warmup_examples
from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer
from textrl.run.warmup import IGNORE_INDEX, build_sft_batch, sft_warmup

FORMAT = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def pairs():
    return warmup_examples(make_digits_task(64, seed=1), seed=0)


def test_prompt_tokens_are_masked_and_completion_plus_eos_is_labelled(tokenizer, pairs):
    batch = build_sft_batch(tokenizer, pairs[:4])
    ids, attn, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.shape == attn.shape == labels.shape and ids.dtype == labels.dtype == torch.long
    # the prompt part is exactly what the policy sees at generation time (chat-templated)
    prompts = encode_prompts([p for p, _ in pairs[:4]], tokenizer)[0]
    for b, (_, completion) in enumerate(pairs[:4]):
        n = int(attn[b].sum())
        assert attn[b, :n].all() and not attn[b, n:].any()  # right padding
        p_ids = prompts.input_ids[b][prompts.attention_mask[b]]
        assert torch.equal(ids[b, : len(p_ids)], p_ids)
        assert (labels[b, : len(p_ids)] == IGNORE_INDEX).all()
        assert (labels[b, n:] == IGNORE_INDEX).all()
        assert torch.equal(labels[b, len(p_ids) : n], ids[b, len(p_ids) : n])
        assert (
            labels[b, n - 1]
            == tokenizer.eos_token_id
            == tokenizer.convert_tokens_to_ids("<|im_end|>")
        )
        assert tokenizer.decode(ids[b, len(p_ids) : n - 1]) == completion


def test_max_length_cuts_the_tail_and_refuses_prompt_only_rows(tokenizer, pairs):
    full = build_sft_batch(tokenizer, pairs[:1])
    n = int(full["attention_mask"].sum())
    cut = build_sft_batch(tokenizer, pairs[:1], max_length=n - 2)
    assert torch.equal(cut["labels"], full["labels"][:, : n - 2])
    n_prompt = int((full["labels"] == IGNORE_INDEX).sum())
    with pytest.raises(ValueError, match="max_length"):
        build_sft_batch(tokenizer, pairs[:1], max_length=n_prompt)


def test_loss_decreases_deterministically_and_leaves_eval_mode(tokenizer, pairs):
    results, weights = [], []
    state = torch.random.get_rng_state()
    for _ in range(2):
        model = build_tiny_causal_lm(tokenizer, seed=0)
        out = sft_warmup(model, tokenizer, pairs, steps=15, lr=3e-3, batch_size=8, seed=5)
        assert not model.training
        results.append(out)
        weights.append(model.lm_head.weight.detach().clone())
    assert torch.equal(torch.random.get_rng_state(), state)  # private generator only
    out = results[0]
    assert out["steps"] == 15 and out["seconds"] > 0
    assert out["loss_last"] < 0.5 * out["loss_first"]
    assert results[0]["loss_last"] == results[1]["loss_last"]
    assert torch.equal(weights[0], weights[1])


def test_bad_arguments_raise(tokenizer, pairs):
    model = build_tiny_causal_lm(tokenizer, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        sft_warmup(model, tokenizer, pairs, steps=1, lr=1e-3, batch_size=0, seed=0)
    with pytest.raises(ValueError, match="no \\(prompt, completion\\) pairs"):
        sft_warmup(model, tokenizer, [], steps=1, lr=1e-3, batch_size=2, seed=0)
    out = sft_warmup(model, tokenizer, pairs, steps=0, lr=1e-3, batch_size=2, seed=0)
    assert out["steps"] == 0 and not model.training


@pytest.mark.slow
def test_warmup_teaches_the_think_answer_format(tokenizer):
    rows = make_digits_task(512, seed=0)
    train, held_out = rows[:480], rows[480:]
    model = build_tiny_causal_lm(tokenizer, seed=0)
    start = time.perf_counter()
    out = sft_warmup(
        model, tokenizer, warmup_examples(train, seed=0), steps=150, lr=3e-3, batch_size=16, seed=0
    )
    batch = encode_prompts(held_out, tokenizer)[0]
    with torch.no_grad():
        gen = model.generate(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask.long(),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    texts = tokenizer.batch_decode(gen[:, batch.input_ids.shape[1] :], skip_special_tokens=True)
    rate = sum(bool(FORMAT.match(t)) for t in texts) / len(texts)
    elapsed = time.perf_counter() - start
    print(f"warm-up {out['seconds']:.1f} s, total {elapsed:.1f} s, format rate {rate:.2f}")
    assert out["loss_last"] < 0.5
    assert rate >= 0.8, texts[:4]
