"""The ``textrl`` engine's captured decode step and the ``static`` engine on a GPU, against ``hf``
(transformers' ``generate``): greedy token for token in float32, seeded sampling draw for draw,
weights updated in place seen by the captured step, multi-turn with the carried cache, and a bf16
run that captures. Needs a real GPU: ``pytest -m cuda tests/cuda/test_generation.py``."""

from __future__ import annotations

import pytest
import torch

from textrl.generation import DecodeEngine, HFEngine, Sampling, get_engine
from textrl.generation.step import decode_step
from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer
from textrl.stages.data import pad_left

pytestmark = pytest.mark.cuda

PROMPTS = ["What is 1+2?", "hi", "Count to 3 please, slowly", "<think>", "a b c d e f g"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture
def model(tok):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return build_tiny_causal_lm(tok).cuda().eval()


def encode(tok, prompts, samples=2):
    enc = tok([p for p in prompts for _ in range(samples)], return_tensors="pt", padding=True)
    return enc["input_ids"].cuda(), enc["attention_mask"].cuda()


def spec(tok, greedy=True, eos=None, **kw):
    base = dict(greedy=greedy, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=24,
                eos_token_id=tok.eos_token_id if eos is None else eos, pad_token_id=tok.pad_token_id)
    base.update(kw)
    return Sampling(**base)


def run(engine, model, ids, mask, sampling, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        return engine.generate(model, ids, mask, sampling)


def frequent_token(model, tok, ids, mask):
    out = run(HFEngine(), model, ids, mask, spec(tok, eos=-1, max_new_tokens=12))
    return int(torch.bincount(out[:, 2:10].flatten().cpu(), minlength=len(tok)).argmax())


def test_the_captured_step_decodes_greedily_what_generate_does_and_is_replayed_across_calls(tok, model):
    ids, mask = encode(tok, PROMPTS)
    engine = DecodeEngine(compile=False)
    for sampling in (spec(tok), spec(tok, eos=frequent_token(model, tok, ids, mask))):  # EOS mid-batch
        want = run(HFEngine(), model, ids, mask, sampling)
        got = run(engine, model, ids, mask, sampling)
        assert torch.equal(got, want), (got, want)
    assert engine.graphs.captured == 2  # one per sampling (EOS differs), each a graph
    replays = sum(g.replays for g in engine.graphs.graphs.values())
    run(engine, model, ids, mask, spec(tok))
    assert engine.graphs.captured == 2 and sum(g.replays for g in engine.graphs.graphs.values()) > replays


@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=20),
                                  dict(temperature=1.3, top_p=0.8)], ids=["plain", "top_k", "top_p"])
def test_seeded_sampling_in_the_graph_draws_what_generate_draws(tok, model, warp):
    ids, mask = encode(tok, PROMPTS, samples=3)
    sampling = spec(tok, greedy=False, max_new_tokens=16, **warp)
    engine = DecodeEngine(compile=False, row_bucket=1)  # filler rows would draw for 16 rows, not 15
    for seed in (0, 1):
        assert torch.equal(run(engine, model, ids, mask, sampling, seed), run(HFEngine(), model, ids, mask, sampling, seed))


def test_weights_updated_in_place_are_what_the_captured_step_reads(tok, model):
    ids, mask = encode(tok, PROMPTS)
    engine = DecodeEngine(compile=False)
    sampling = spec(tok, eos=-1)
    before = run(engine, model, ids, mask, sampling)
    with torch.no_grad():  # an optimiser step: the same tensors, new values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = run(engine, model, ids, mask, sampling)
    assert engine.graphs.captured == 1
    assert not torch.equal(after, before) and torch.equal(after, run(HFEngine(), model, ids, mask, sampling))


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["graph", "compiled"])
def test_multi_turn_turns_with_the_carried_cache_equal_generate(tok, model, compile):
    """A carried turn's new tokens are one captured feed (compiled first, with ``compile``), replayed
    when a later rollout meets the same shape (the third: the first grows the shared buffers, and
    the decoders made before a growth are made again in the second); greedy turns token for token
    ``generate``'s, 10 rows decoded as 16 (filler rows, the default on CUDA)."""
    sampling = spec(tok, max_new_tokens=10)
    engine = DecodeEngine(compile=compile)
    seqs0 = [tok(p)["input_ids"] for p in PROMPTS for _ in range(2)]
    for rollout in range(3):
        seqs, captured = seqs0, engine.graphs.captured
        with engine.rollout():
            for turn in range(3):
                ids, mask = (x.cuda() for x in pad_left(seqs, tok.pad_token_id))
                before = engine.prefilled
                got = run(engine, model, ids, mask, sampling)
                assert torch.equal(got, run(HFEngine(), model, ids, mask, sampling)), (rollout, turn)
                if turn:
                    assert engine.prefilled - before < int(mask.sum()) // 2
                seqs = [s + got[i].tolist() + [40 + i, 41, 42 + turn] for i, s in enumerate(seqs)]
        feeds = [f for d in engine.graphs.graphs.values() for f in d.feeds.values()]
        assert feeds and all(f.graph is not None for f in feeds)  # every carried turn's feed was captured
        assert {k[4] for k in engine.graphs.graphs} == {16}
        if rollout == 2:
            assert engine.graphs.captured == captured  # the same shapes: replayed, nothing captured


def test_a_bf16_run_is_captured_and_stays_in_the_vocabulary(tok):
    model = build_tiny_causal_lm(tok, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                 num_attention_heads=4).cuda().eval()
    ids, mask = encode(tok, PROMPTS, samples=4)
    engine = DecodeEngine(compile=False)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = run(engine, model, ids, mask, spec(tok, greedy=False, eos=-1, max_new_tokens=64))
    assert engine.graphs.captured == 1 and out.shape == (ids.shape[0], 64)
    assert int(out.min()) >= 0 and int(out.max()) < len(tok)


@pytest.mark.slow
def test_the_compiled_captured_step_decodes_what_generate_does(tok, model):
    """The default on CUDA: the step compiled, then captured; greedy float32 token for token, and a
    bf16 run (its weights cast once per call) captured too."""
    ids, mask = encode(tok, PROMPTS)
    sampling = spec(tok, eos=frequent_token(model, tok, ids, mask))
    engine = DecodeEngine()
    assert torch.equal(run(engine, model, ids, mask, sampling), run(HFEngine(), model, ids, mask, sampling))
    (decoder,) = engine.graphs.graphs.values()
    assert decoder.step is engine.graphs._compiled[decode_step, "cuda"] and engine.graphs.captured == 1  # compiled, captured
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = run(engine, model, ids, mask, spec(tok, greedy=False, eos=-1, max_new_tokens=32))
    assert engine.graphs.captured == 2 and out.shape == (ids.shape[0], 32) and engine.graphs.casts


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_the_static_engine_decodes_greedily_what_generate_does(tok, model, autocast):
    ids, mask = encode(tok, PROMPTS)
    sampling = spec(tok, eos=frequent_token(model, tok, ids, mask))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        try:
            got = run(get_engine("static"), model, ids, mask, sampling)
        except ValueError as err:  # transformers 5.17: float32 keys (rotary) and bf16 values in one dtype
            assert autocast and "StaticCache stores values in the keys' dtype" in str(err)
            pytest.skip(f"this transformers' StaticCache cannot hold this model under autocast: {err}")
        want = run(HFEngine(), model, ids, mask, sampling)
    if autocast:  # bf16: the compiled forward rounds apart from the eager one; the shape and most tokens agree
        assert got.shape[0] == want.shape[0] and float((got[:, :8] == want[:, :8]).float().mean()) > 0.5
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["graph", "compiled"])
def test_a_step_captured_per_attention_window_decodes_what_generate_does(tok, model, compile):
    """``attention_window=32``: the whole width's graph, then one per window below it (a 128-column
    cache: 32, 64, 96), each step replaying the smallest window past its column; greedy with EOS
    mid-batch equals ``generate``, and seeded sampling too as written. Compiled, the step draws
    from inductor's random numbers, not eager's: the first token (the prefill's, eager) is
    ``generate``'s and a seed gives the same draws again, another seed others."""
    ids, mask = encode(tok, PROMPTS)
    engine = DecodeEngine(attention_window=32, compile=compile, row_bucket=1)  # seeded: no filler rows
    for sampling in (spec(tok, eos=frequent_token(model, tok, ids, mask), max_new_tokens=80),
                     spec(tok, greedy=False, eos=-1, max_new_tokens=80)):
        want = run(HFEngine(), model, ids, mask, sampling, seed=5)
        got = run(engine, model, ids, mask, sampling, seed=5)
        if compile and not sampling.greedy:
            assert torch.equal(got[:, 0], want[:, 0]) and got.shape == want.shape
            assert torch.equal(run(engine, model, ids, mask, sampling, seed=5), got)
            assert not torch.equal(run(engine, model, ids, mask, sampling, seed=6), got)
            assert int(got.min()) >= 0 and int(got.max()) < len(tok)
        else:
            assert torch.equal(got, want), (got, want)
    for decoder in engine.graphs.graphs.values():
        assert decoder.state.kv.width == 128 and sorted(decoder.windows) == [32, 64, 96]
    assert engine.graphs.captured == 2 * 4


def test_shapes_that_share_the_static_buffer_and_a_growth_decode_what_generate_does(tok, model):
    """Captured decoders of several shapes view one buffer a layer and capture into one memory pool;
    a larger shape grows the buffer and the decoders of the old one are captured again: every call,
    before and after, decodes greedily what ``generate`` does, and a replayed shape captures nothing."""
    ids, mask = encode(tok, PROMPTS, samples=4)  # 20 rows
    sampling = spec(tok, eos=frequent_token(model, tok, ids, mask), max_new_tokens=12)
    engine = DecodeEngine(compile=False, width_bucket=16)
    for rows in (16, 5, 9, 20, 5, 16):  # 20 (24 with filler rows) grows the buffer
        got = run(engine, model, ids[:rows], mask[:rows], sampling)
        assert torch.equal(got, run(HFEngine(), model, ids[:rows], mask[:rows], sampling)), rows
    captured = engine.graphs.captured
    run(engine, model, ids[:9], mask[:9], sampling)
    assert engine.graphs.captured == captured and len(engine.graphs.buffers) == 1
