"""Tiny offline tokenizer and models: determinism, tokenization, caching and the loaders."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from tests.arithmetic import assert_within, head_tolerance, model_rtol
from textrl.models import (
    TAG_TOKENS,
    build_tiny_causal_lm,
    build_tiny_gpt2,
    build_tiny_reward_model,
    build_tiny_tokenizer,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    tiny_model_path,
)
from textrl.models.tiny import COMPLETE_MARKER

BUILDERS = [build_tiny_causal_lm, build_tiny_reward_model, build_tiny_gpt2]
TEXTS = ["What is 12+7?", "<think>\nadd\n</think>\n<answer>19</answer>", "hi"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_tokenizer_ids_and_defaults(tok):
    assert len(tok) == 512
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|pad|>", "<|bos|>", "<|im_end|>")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 3)
    assert tok.convert_tokens_to_ids("<|im_start|>") == 2
    assert tok.padding_side == "left"
    assert tok.model_max_length == 512


def test_tokenizer_is_deterministic(tok):
    other = build_tiny_tokenizer()
    assert other.get_vocab() == tok.get_vocab()
    assert other.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()


def test_tags_are_single_tokens_and_survive_skip_special(tok):
    for tag in TAG_TOKENS:
        assert len(tok(tag)["input_ids"]) == 1, tag
    text = "<think>\nabc\n</think>\n<answer>12+7=19</answer>"
    ids = tok(text)["input_ids"]
    assert [i for i in ids if i >= 508] == [508, 509, 510, 511]
    assert tok.decode(ids, skip_special_tokens=True) == text
    with_eos = tok(text + "<|im_end|>")["input_ids"]
    assert with_eos[-1] == tok.eos_token_id
    assert tok.decode(with_eos, skip_special_tokens=True) == text


def test_chat_template(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_system = tok.apply_chat_template(messages[1:], tokenize=False)
    assert no_system.startswith("<|im_start|>system\n") and no_system.endswith("<|im_end|>\n")


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8") | st.just("\n")))
def test_text_round_trip(text):
    tok = build_tiny_tokenizer()
    ids = tok(text, add_special_tokens=True)["input_ids"]
    assert tok.decode(ids) == text
    assert all(0 <= i < len(tok) for i in ids)


QWEN2_VOCAB = 151936
"""The embedding rows of Qwen2-0.5B / 1.5B / 7B: the large tiny vocabulary of the memory benchmark."""


@functools.lru_cache(maxsize=1)
def _tokenizers():
    return build_tiny_tokenizer(), build_tiny_tokenizer(QWEN2_VOCAB)


@pytest.fixture(scope="module")
def big_tok():
    return _tokenizers()[1]


def test_default_vocab_size_is_the_512_token_tokenizer(tok):
    assert build_tiny_tokenizer(512).backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    with pytest.raises(ValueError, match="at least 512"):
        build_tiny_tokenizer(100)


def test_large_vocab_encodes_every_text_as_the_tiny_tokenizer(tok, big_tok):
    assert len(big_tok) == QWEN2_VOCAB
    assert sorted(big_tok.get_vocab().values()) == list(range(QWEN2_VOCAB))
    assert (big_tok.pad_token_id, big_tok.bos_token_id, big_tok.eos_token_id) == (0, 1, 3)
    assert [big_tok.convert_tokens_to_ids(t) for t in TAG_TOKENS] == [508, 509, 510, 511]
    assert big_tok.chat_template == tok.chat_template and big_tok.padding_side == "left"
    fillers = big_tok.convert_ids_to_tokens([512, 513, 5000, QWEN2_VOCAB - 1])  # as text, too
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 3+4?"}], tokenize=False,
                                   add_generation_prompt=True)
    for text in [*TEXTS, chat, " ".join(fillers), "".join(fillers), "abc ABC 09 zz9 Qx", "日本語 ünï \n\t"]:
        assert big_tok(text)["input_ids"] == tok(text)["input_ids"], text


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8") | st.just("\n")))
def test_large_vocab_encodes_any_text_as_the_tiny_tokenizer(text):
    tok, big_tok = _tokenizers()
    assert big_tok(text)["input_ids"] == tok(text)["input_ids"]


def test_every_filler_id_decodes_to_short_text(tok, big_tok):
    ids = list(range(512, QWEN2_VOCAB, 997)) + [QWEN2_VOCAB - 1]
    for i in ids:
        text = big_tok.decode([i])
        assert 2 <= len(text) <= 3 and text.isalnum(), (i, text)
        assert len(tok(text)["input_ids"]) <= 3  # the reward model's re-encoding of a sampled filler
    assert big_tok.decode([512, 3], skip_special_tokens=True) == big_tok.decode([512])


@pytest.mark.parametrize("build", BUILDERS, ids=lambda b: b.__name__)
def test_seed_determinism(tok, build):
    assert_same_weights(build(tok, seed=3), build(tok, seed=3))
    a, b = build(tok, seed=0).state_dict(), build(tok, seed=1).state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_build_leaves_global_rng_alone(tok):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    for build in BUILDERS:
        build(tok, seed=7)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("build", BUILDERS, ids=lambda b: b.__name__)
def test_special_ids_on_config(tok, build):
    model = build(tok)
    assert model.config.vocab_size == len(tok)
    expected = (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (
        expected
    )
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == expected
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("kind", ["causal_lm", "reward_model", "gpt2"])
def test_cache_round_trip(tok, tmp_path, kind):
    path = tiny_model_path(kind, seed=5, cache_dir=tmp_path)
    assert path.parent == tmp_path and path.name.startswith(f"tiny-{kind}-")
    assert (path / COMPLETE_MARKER).is_file()
    assert tiny_model_path(kind, seed=5, cache_dir=tmp_path) == path

    loaded_tok = AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        assert loaded_tok(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded_tok.chat_template == tok.chat_template
    assert loaded_tok.padding_side == "left"
    assert (
        loaded_tok.decode(loaded_tok(TEXTS[1])["input_ids"], skip_special_tokens=True) == TEXTS[1]
    )

    auto = AutoModelForSequenceClassification if kind == "reward_model" else AutoModelForCausalLM
    loaded = auto.from_pretrained(path)
    built = {
        "causal_lm": build_tiny_causal_lm,
        "reward_model": build_tiny_reward_model,
        "gpt2": build_tiny_gpt2,
    }[kind](tok, seed=5)
    assert_same_weights(loaded, built)
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, built(**batch).logits)


def test_cache_key_covers_seed_and_sizes(tmp_path):
    base = tiny_model_path(cache_dir=tmp_path)
    assert tiny_model_path(seed=1, cache_dir=tmp_path) != base
    small = tiny_model_path(hidden_size=32, num_attention_heads=2, cache_dir=tmp_path)
    assert small != base
    assert AutoModelForCausalLM.from_pretrained(small).config.hidden_size == 32


def test_half_written_cache_dir_is_rebuilt(tmp_path):
    path = tiny_model_path(cache_dir=tmp_path)
    (path / COMPLETE_MARKER).unlink()
    (path / "model.safetensors").write_bytes(b"truncated")
    assert tiny_model_path(cache_dir=tmp_path) == path
    assert (path / COMPLETE_MARKER).is_file()
    AutoModelForCausalLM.from_pretrained(path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp or stale dirs left


def test_cache_dir_with_a_marker_but_no_model_is_rebuilt(tmp_path):
    """What a non-main process left before the cache knew that save_pretrained skips ranks > 0."""
    path = tiny_model_path(cache_dir=tmp_path)
    (path / "config.json").unlink()
    (path / "model.safetensors").unlink()
    assert tiny_model_path(cache_dir=tmp_path) == path
    AutoModelForCausalLM.from_pretrained(path)


def test_reward_model_left_padding_matches_single_rows(tok):
    model = build_tiny_reward_model(tok, seed=2)
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    assert (batch["attention_mask"][:, 0] == 0).any()  # some row really is left-padded
    with torch.no_grad():
        batched = model(**batch).logits  # [B, 1]
        alone = torch.cat([model(**tok(t, return_tensors="pt")).logits for t in TEXTS])
    assert batched.shape == (len(TEXTS), 1)
    # each score is a head's dot product that cancels: within the body's normwise error and the head's
    # own sum, times its terms' magnitudes (tests/arithmetic.py)
    with torch.no_grad():
        last = torch.cat([model.model(**tok(t, return_tensors="pt")).last_hidden_state[:, -1] for t in TEXTS])
    tol = head_tolerance(last, model.score.weight, model_rtol(model.config, batch["input_ids"].numel()))
    assert_within(batched, alone, tol, "scores")


def test_generate_greedy(tok):
    model = build_tiny_causal_lm(tok)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
        )
        for t in TEXTS[:2]
    ]
    batch = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 2 and 1 <= out.shape[1] - batch["input_ids"].shape[1] <= 4
    again = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, again)


def test_loaders_resolve_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path))
    model = load_causal_lm("tiny")
    assert_same_weights(model, build_tiny_causal_lm(build_tiny_tokenizer()))
    tok = load_tokenizer("tiny")
    assert tok.padding_side == "left" and tok.pad_token_id == 0
    rm = load_reward_model("tiny", dtype=torch.float32)
    assert rm.config.num_labels == 1 and rm.config.pad_token_id == tok.pad_token_id
    assert load_causal_lm("tiny-gpt2").config.model_type == "gpt2"
    assert all(p.parent == tmp_path for p in tmp_path.iterdir())


def test_load_tokenizer_falls_back_to_eos_pad(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    no_pad = AutoTokenizer.from_pretrained(tmp_path)
    no_pad.pad_token = None
    no_pad.padding_side = "right"
    no_pad.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="no pad token"):
        loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token_id == loaded.eos_token_id and loaded.padding_side == "left"


@pytest.mark.parametrize("bad", ["./no/such/model", "/no/such/dir", "a/b/c", "../up"])
def test_missing_path_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="neither an existing local path"):
        load_causal_lm(bad)
