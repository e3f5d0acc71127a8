"""``generate_with_logprobs``: each engine's tokens are its ``generate``'s for the same seed, and its
log-probs are those of each drawn token under the distribution it was drawn from (temperature, then
top-k, then top-p), 0.0 after a row's EOS: within 1e-3 of what a prefill forward over the same
tokens computes, on the CPU in float32, single-turn and over a multi-turn rollout's carried turns."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.generation.test_engines import PROMPTS, encode, frequent_token, spec
from textrl.functional import logprobs_from_logits, sampling_filter
from textrl.generation import DecodeEngine, GenerationEngine, HFEngine, StaticEngine
from textrl.generation.draw import next_tokens, next_tokens_and_logprobs
from textrl.generation.hf import after_eos
from textrl.models.forward import response_logits
from textrl.stages.data import pad_left

GAP = 1e-3
"""The largest |engine log-prob - prefill log-prob| allowed on the CPU in float32 (rounding of
another batch shape and cache layout)."""

ENGINES = {"hf": HFEngine, "static_rows1": lambda: StaticEngine(row_bucket=1), "static": StaticEngine,
           "textrl": DecodeEngine, "textrl_dynamic": lambda: DecodeEngine(static=False),
           "textrl_rows8": lambda: DecodeEngine(row_bucket=8)}
"""Engines with filler rows (``static``, ``textrl_rows8``) draw other tokens than ``hf`` for a seed,
but their own ``generate``'s."""

WARPS = {"plain": dict(temperature=1.0), "hot": dict(temperature=1.4), "top_k": dict(temperature=0.7, top_k=20),
         "top_p": dict(temperature=1.3, top_p=0.8), "both": dict(temperature=0.9, top_k=50, top_p=0.9)}


def generate(engine, model, ids, mask, sampling, seed=0, logprobs=True):
    torch.manual_seed(seed)
    with torch.no_grad():
        if logprobs:
            return engine.generate_with_logprobs(model, ids, mask, sampling)
        return engine.generate(model, ids, mask, sampling)


def prefill_logprobs(model, ids, mask, tokens, sampling):
    """The log-probs ``[B, T]`` of ``tokens`` after the left-padded contexts ``ids``/``mask`` ``[B, P]``,
    from one forward over context + tokens, warped as the draw is (at the sampling's temperature,
    greedy too)."""
    full = torch.cat([ids, tokens], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(tokens)], dim=1)  # the pads come after a row's last token
    with torch.no_grad():
        logits = response_logits(model, full, full_mask, ids.shape[1]).float()
    z = sampling_filter(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    return logprobs_from_logits(z, tokens)


def gap(logp, ids, mask, model, tokens, sampling):
    """The largest |engine - prefill| over the real tokens (the pads checked to be 0.0 and left out)."""
    pads = after_eos(tokens, sampling.eos_token_id)
    assert logp.dtype == torch.float32 and logp.shape == tokens.shape
    assert bool((logp[pads] == 0).all())
    real = logp[~pads]
    assert bool(torch.isfinite(real).all()) and bool((real <= 0).all())
    want = prefill_logprobs(model, ids, mask, tokens, sampling)
    return float((logp - want)[~pads].abs().max())


@pytest.mark.parametrize("name", list(ENGINES))
@pytest.mark.parametrize("warp", list(WARPS))
def test_sampled_tokens_are_generates_and_their_logprobs_the_prefills(tok, model, name, warp):
    ids, mask = encode(tok, PROMPTS, samples=2)
    sampling = spec(tok, greedy=False, eos=frequent_token(model, tok, ids, mask), max_new_tokens=16, **WARPS[warp])
    engine = ENGINES[name]()
    for seed in (0, 1):
        tokens, logp = generate(engine, model, ids, mask, sampling, seed)
        assert torch.equal(tokens, generate(engine, model, ids, mask, sampling, seed, logprobs=False))
        assert gap(logp, ids, mask, model, tokens, sampling) < GAP


@pytest.mark.parametrize("name", list(ENGINES))
@pytest.mark.parametrize("warp", ["hot", "both"])
def test_greedy_logprobs_are_the_argmaxs_under_the_warped_distribution(tok, model, name, warp):
    ids, mask = encode(tok, PROMPTS)
    eos = frequent_token(model, tok, ids, mask)
    sampling = spec(tok, eos=eos, max_new_tokens=12, **WARPS[warp])
    tokens, logp = generate(ENGINES[name](), model, ids, mask, sampling)
    assert torch.equal(tokens, generate(HFEngine(), model, ids, mask, sampling, logprobs=False))
    assert bool(after_eos(tokens, eos).any())  # some rows padded
    assert gap(logp, ids, mask, model, tokens, sampling) < GAP


def test_every_engine_gives_the_same_logprobs_to_the_same_tokens(tok, model):
    """Seeded, without filler rows, the engines draw the same tokens: their log-probs agree."""
    ids, mask = encode(tok, PROMPTS, samples=2)
    sampling = spec(tok, greedy=False, eos=frequent_token(model, tok, ids, mask), max_new_tokens=16,
                    **WARPS["both"])
    want_tokens, want = generate(HFEngine(), model, ids, mask, sampling, seed=3)
    for name in ("static_rows1", "textrl", "textrl_dynamic"):
        tokens, logp = generate(ENGINES[name](), model, ids, mask, sampling, seed=3)
        assert torch.equal(tokens, want_tokens), name
        torch.testing.assert_close(logp, want, rtol=0, atol=GAP, msg=name)


def test_without_eos_no_column_is_padded(tok, model):
    ids, mask = encode(tok, PROMPTS[:3])
    sampling = spec(tok, greedy=False, eos=-1, max_new_tokens=8, **WARPS["top_k"])
    for name in ("hf", "textrl"):
        tokens, logp = generate(ENGINES[name](), model, ids, mask, sampling)
        assert tokens.shape == (3, 8) and bool((logp < 0).all()), name


@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_carried_turns_give_generates_tokens_and_the_prefills_logprobs(tok, model, static, greedy):
    """Three turns of a multi-turn rollout (the runner's contexts: the last one, the sampled turn up
    to EOS, every third row cut after 3 tokens as a stop string cuts it, an observation): a later
    turn's first token comes from the carried cache and its new tokens' feed, its log-probs too."""
    ids, mask = encode(tok, PROMPTS[:4])
    sampling = spec(tok, greedy=greedy, eos=frequent_token(model, tok, ids, mask), max_new_tokens=10,
                    temperature=0.8, top_k=40, top_p=0.95)
    seqs = [tok(p)["input_ids"] for p in PROMPTS[:4] for _ in range(2)]
    ours, plain = DecodeEngine(check_every=4, static=static), DecodeEngine(check_every=4, static=static)
    with ours.rollout(), plain.rollout():
        for turn in range(3):
            ids, mask = pad_left(seqs, tok.pad_token_id)
            before = ours.prefilled
            tokens, logp = generate(ours, model, ids, mask, sampling, seed=turn)
            assert torch.equal(tokens, generate(plain, model, ids, mask, sampling, seed=turn, logprobs=False))
            if turn:
                assert ours.prefilled - before < int(mask.sum()) // 2, turn  # carried
            assert gap(logp, ids, mask, model, tokens, sampling) < GAP, turn
            seqs = [seq + (row[:3] if i % 3 == 0 else row) + [40 + i, 41, 42 + turn]
                    for i, (seq, row) in enumerate(zip(seqs, _sampled(tokens, sampling.eos_token_id)))]


@pytest.mark.slow
def test_the_compiled_step_writes_the_logprobs_of_its_draws(tok):
    """``compile=True`` (on CUDA by default): the step through ``torch.compile`` (inductor's C++ on
    the CPU) writes ``out_logp`` as the eager step does; greedy, ``generate``'s tokens (sampled, it
    draws from inductor's random numbers)."""
    from textrl.generation.step import decode_step
    from textrl.models import build_tiny_causal_lm

    model = build_tiny_causal_lm(tok).eval()
    ids, mask = encode(tok, PROMPTS)
    eos = frequent_token(model, tok, ids, mask)
    engine = DecodeEngine(compile=True)
    for greedy in (False, True):
        sampling = spec(tok, greedy=greedy, eos=eos, max_new_tokens=12, **WARPS["both"])
        tokens, logp = generate(engine, model, ids, mask, sampling)
        if greedy:
            assert torch.equal(tokens, generate(HFEngine(), model, ids, mask, sampling, logprobs=False))
        assert gap(logp, ids, mask, model, tokens, sampling) < GAP
    assert all(d.step is engine.graphs._compiled[decode_step, "cpu"] for d in engine.graphs.graphs.values())


def _sampled(tokens, eos):
    """Each row's tokens up to and with its first EOS."""
    rows = []
    for row in tokens.tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), greedy=st.booleans(), temperature=st.sampled_from([0.5, 1.0, 1.7]),
       top_k=st.sampled_from([0, 1, 5, 40]), top_p=st.sampled_from([1.0, 0.9, 0.3]))
def test_the_drawn_tokens_logprob_is_the_warped_log_softmax_and_the_draw_is_unchanged(seed, greedy, temperature,
                                                                                      top_k, top_p):
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(seed)) * 3
    sampling = spec(_Tok(), greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p)
    torch.manual_seed(seed)
    want = next_tokens(logits, sampling)
    torch.manual_seed(seed)
    tokens, logp = next_tokens_and_logprobs(logits, sampling)
    assert torch.equal(tokens, want)
    z = sampling_filter(logits / temperature, top_k, top_p).log_softmax(-1)
    torch.testing.assert_close(logp, z.gather(-1, tokens[:, None])[:, 0], rtol=0, atol=1e-5)


class _Tok:
    eos_token_id, pad_token_id = 1, 0


def test_greedy_at_temperature_zero_is_certain():
    logits = torch.randn(3, 10)
    tokens, logp = next_tokens_and_logprobs(logits, spec(_Tok(), temperature=0.0))
    assert torch.equal(tokens, logits.argmax(-1)) and torch.equal(logp, torch.zeros(3))


def test_an_engine_that_implements_only_generate_returns_no_logprobs(tok):
    class Mine(GenerationEngine):
        def generate(self, model, input_ids, attention_mask, sampling, **kwargs):
            return torch.full((input_ids.shape[0], 2), 7)

    ids, mask = encode(tok, PROMPTS[:2])
    tokens, logp = Mine().generate_with_logprobs(None, ids, mask, spec(tok))
    assert logp is None and torch.equal(tokens, torch.full((2, 2), 7))
