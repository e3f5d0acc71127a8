"""The ``textrl`` engine's static decode (textrl/generation/graph.py, step.py, static_kv.py, casts.py, draw.py) on the CPU: the static KV cache,
the host-sync-free draw, the weight casts under autocast, the per-shape decoders and the compiled
step, each against ``hf`` or a closed form. The captured CUDA graph itself: tests/cuda/test_generation.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from textrl.generation import DecodeEngine, HFEngine, Sampling
from textrl.generation.casts import MATMUL_LAYERS, WeightCasts
from textrl.generation.draw import draw
from textrl.generation.graph import Graphs
from textrl.generation.static_kv import StaticKV, bucket
from textrl.models import build_tiny_causal_lm, build_tiny_gpt2
from textrl.stages.data import pad_left

PROMPTS = ["What is 1+2?", "hi", "Count to 3 please, slowly", "a b c d"]


def encode(tok, samples=2):
    enc = tok([p for p in PROMPTS for _ in range(samples)], return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def spec(tok, greedy=True, **kw):
    base = dict(greedy=greedy, temperature=0.8, top_k=30, top_p=0.9, max_new_tokens=20,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    base.update(kw)
    return Sampling(**base)


def run(engine, model, ids, mask, sampling, seed=0, autocast=False):
    torch.manual_seed(seed)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return engine.generate(model, ids, mask, sampling)


def test_draw_is_multinomial_without_its_host_check():
    probs = torch.rand(16, 300).softmax(-1)
    for seed in range(3):
        torch.manual_seed(seed)
        want = torch.multinomial(probs, 1).squeeze(1)
        torch.manual_seed(seed)
        assert torch.equal(draw(probs), want)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_under_bf16_autocast_the_static_decode_draws_what_generate_draws(tok, model, greedy):
    """The weights cast once per call (WeightCasts) are autocast's casts: the same tokens as ``generate``
    under the same autocast, greedy and seeded. (GPT-2's bf16 attention over the static cache's
    wider, masked rows rounds apart from ``generate``'s growing one enough to flip one draw in this
    batch; in float32 it draws the same: tests/generation/test_engines.py.)"""
    if not greedy and type(model).__name__.startswith("GPT2"):
        pytest.skip("bf16 rounding of GPT-2's attention over a wider cache flips a seeded draw (float32: equal)")
    ids, mask = encode(tok)
    engine = DecodeEngine()
    for seed in (0, 1):
        want = run(HFEngine(), model, ids, mask, spec(tok, greedy), seed, autocast=True)
        assert torch.equal(run(engine, model, ids, mask, spec(tok, greedy), seed, autocast=True), want)
    decoder = list(engine.graphs.graphs.values())[-1]
    assert decoder.state.kv.layers[0].keys.dtype == torch.bfloat16  # the cache in the autocast dtype
    (casts,) = engine.graphs.casts.values()
    linears = [m for m in model.modules() if isinstance(m, MATMUL_LAYERS)]  # GPT-2's Conv1Ds too
    assert len(casts.entries) == sum(1 + (m.bias is not None) for m in linears) > 0


def test_weight_casts_follow_in_place_updates_skip_other_parameter_types_and_always_swap_back():
    class Quantised(nn.Parameter):
        pass

    lin, frozen = nn.Linear(4, 3), nn.Linear(4, 3, bias=False)
    frozen.weight = Quantised(frozen.weight.data)
    model = nn.Sequential(lin, frozen)
    casts = WeightCasts(model, torch.bfloat16)
    assert [(m, n) for m, n, *_ in casts.entries] == [(lin, "weight"), (lin, "bias")]
    assert casts.nbytes == (12 + 3) * 2
    with torch.no_grad():
        lin.weight.add_(1.0)
    casts.refresh()
    assert torch.equal(casts.entries[0][3], lin.weight.detach().to(torch.bfloat16))
    original = lin.weight
    with pytest.raises(RuntimeError, match="boom"), casts.swapped():
        assert lin.weight.dtype == torch.bfloat16
        raise RuntimeError("boom")
    assert lin.weight is original


def test_the_static_cache_writes_at_its_device_column_and_snapshots_a_copy():
    like = [(torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 4, 5))]
    kv = StaticKV(like, width=8)
    kv.load([(torch.ones(2, 3, 4, 5), torch.ones(2, 3, 4, 5) * 2)])
    assert int(kv.column) == 4 and kv.get_seq_length() == 4 and len(kv) == 1
    keys, values = kv.update(torch.full((2, 3, 1, 5), 7.0), torch.full((2, 3, 1, 5), 9.0), 0)
    assert keys.shape == (2, 3, 8, 5) and bool((keys[:, :, 4] == 7).all()) and bool((values[:, :, 4] == 9).all())
    assert bool((keys[:, :, 5:] == 0).all())
    snap = kv.snapshot(5)
    kv.layers[0].keys.zero_()
    assert snap.layers[0].keys.shape == (2, 3, 5, 5) and bool((snap.layers[0].keys[:, :, 4] == 7).all())


def test_a_decoder_is_made_once_per_shape_kept_for_the_next_calls_and_remade_for_new_weights(tok):
    model = build_tiny_causal_lm(tok).eval()
    ids, mask = encode(tok)
    engine = DecodeEngine(width_bucket=64)
    sampling = spec(tok, eos_token_id=None)
    first = run(engine, model, ids, mask, sampling)
    (decoder,) = engine.graphs.graphs.values()
    assert decoder.state.out.shape == (ids.shape[0], bucket(ids.shape[1] + 20, 64))
    assert torch.equal(run(engine, model, ids, mask, sampling), first)
    assert list(engine.graphs.graphs.values()) == [decoder] and decoder.replays == 2 * 19
    with torch.no_grad():
        model.lm_head.weight = nn.Parameter(model.lm_head.weight * 1.5)  # a new tensor: another data_ptr
    out = run(engine, model, ids, mask, sampling)
    assert torch.equal(out, run(HFEngine(), model, ids, mask, sampling))
    assert len(engine.graphs.graphs) == 2 and decoder.replays == 2 * 19


def test_only_the_most_recent_shapes_keep_a_decoder(tok):
    model = build_tiny_causal_lm(tok).eval()
    engine = DecodeEngine()
    engine.graphs.keep = 2
    ids, mask = encode(tok, samples=1)
    for rows in (4, 3, 2, 1):  # the largest first: the others fit in its buffers
        run(engine, model, ids[:rows], mask[:rows], spec(tok, max_new_tokens=3))
    assert sorted(k[4] for k in engine.graphs.graphs) == [1, 2]


def test_the_decoders_static_caches_share_one_buffer_grown_for_a_larger_shape(tok):
    """One call decodes at a time, so every decoder's static cache is a view of one flat buffer
    (keys, and one for values) for all layers: shapes that fit share it (the memory of the largest,
    not their sum); a larger shape grows it and the decoders viewing the old one are made again
    (their graphs read its addresses); each call still decodes ``generate``'s tokens, whatever an
    earlier shape left in the buffer."""
    model = build_tiny_causal_lm(tok).eval()
    engine = DecodeEngine(width_bucket=16)
    ids, mask = encode(tok, samples=2)
    sampling = spec(tok, max_new_tokens=6)

    def base(decoder):
        return decoder.state.kv.layers[0].keys.untyped_storage().data_ptr()

    for rows in (8, 3, 5):
        assert torch.equal(run(engine, model, ids[:rows], mask[:rows], sampling),
                           run(HFEngine(), model, ids[:rows], mask[:rows], sampling)), rows
    decoders = list(engine.graphs.graphs.values())
    assert len(decoders) == 3 and len({base(d) for d in decoders}) == 1  # one buffer for the three shapes
    ((keys, values),) = next(iter(engine.graphs.buffers.values()))  # one pair for all layers
    ((stacked, _),) = decoders[0].state.kv.stacks
    assert stacked.shape[0] == model.config.num_hidden_layers == len(decoders[0].state.kv.layers)
    assert keys.numel() == values.numel() == stacked.numel()  # the largest's size
    longer = run(engine, model, ids, mask, spec(tok, max_new_tokens=40))  # wider: more than the buffer holds
    assert torch.equal(longer, run(HFEngine(), model, ids, mask, spec(tok, max_new_tokens=40)))
    (decoder,) = engine.graphs.graphs.values()  # the three views of the old buffer were dropped
    assert base(decoder) != base(decoders[0])


def test_a_width_or_row_bucket_below_one_is_refused():
    with pytest.raises(ValueError, match="width_bucket=0: must be >= 1"):
        DecodeEngine(width_bucket=0)
    for bad in (0, True, "8"):
        with pytest.raises(ValueError, match=f"row_bucket={bad!r}: must be 'auto' or an int >= 1"):
            DecodeEngine(row_bucket=bad)
    assert bucket(65, 64) == 128 and bucket(64, 64) == 64 and bucket(3, 1) == 3


def test_graphs_without_autocast_cast_nothing(tok):
    model = build_tiny_causal_lm(tok).eval()
    assert Graphs().weight_casts(model, torch.device("cpu")) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert Graphs().weight_casts(model, torch.device("cpu")) is not None


@pytest.mark.slow
def test_the_compiled_step_decodes_what_generate_does(tok):
    """``compile=True`` (on CUDA by default): the step through ``torch.compile`` (inductor's C++ on
    the CPU), greedy with EOS mid-batch: the tokens of ``generate``."""
    model = build_tiny_causal_lm(tok).eval()
    ids, mask = encode(tok)
    sampling = spec(tok, max_new_tokens=12)
    engine = DecodeEngine(compile=True)
    assert torch.equal(run(engine, model, ids, mask, sampling), run(HFEngine(), model, ids, mask, sampling))
    from textrl.generation.step import decode_step

    (decoder,) = engine.graphs.graphs.values()
    assert engine.graphs.compile and decoder.step is engine.graphs._compiled[decode_step, "cpu"]


@pytest.mark.slow
def test_the_compiled_step_is_compiled_at_most_three_times_across_shapes(tok):
    """Rows and cache widths change from call to call in multi-turn rollouts: the step is compiled
    for the first shape, then once with symbolic sizes for every later one (not once per shape),
    each shape decoding ``generate``'s tokens."""
    from torch._dynamo.utils import counters

    model = build_tiny_causal_lm(tok, num_hidden_layers=1).eval()
    engine = DecodeEngine(compile=True, width_bucket=32, attention_window=None)
    g = torch.Generator().manual_seed(0)
    before = counters["stats"]["unique_graphs"]
    for rows, context in ((6, 5), (4, 5), (6, 40), (3, 70), (5, 40)):  # five (rows, width) shapes
        ids = torch.randint(3, 256, (rows, context), generator=g)
        mask = torch.ones_like(ids)
        sampling = spec(tok, max_new_tokens=6, eos_token_id=None)
        assert torch.equal(run(engine, model, ids, mask, sampling), run(HFEngine(), model, ids, mask, sampling))
    assert len(engine.graphs.graphs) == 3  # the third shape grew the buffers: its decoder and the next two
    assert counters["stats"]["unique_graphs"] - before <= 3


def test_the_static_engine_fills_rows_and_columns_to_buckets_and_reuses_its_cache(tok):
    """10 rows and ragged prompts -> 16 rows x 64 columns; the filler rows' outputs dropped; the
    same tokens as ``generate`` (greedy, also under bf16 autocast, whose cache is a second one)."""
    from textrl.generation.static import StaticEngine

    model = build_tiny_causal_lm(tok).eval()
    enc = tok([p for p in PROMPTS for _ in range(2)] + ["hi", "ok"], return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    engine = StaticEngine()
    sampling = spec(tok)
    for autocast in (False, True, False):
        want = run(HFEngine(), model, ids, mask, sampling, autocast=autocast)
        assert torch.equal(run(engine, model, ids, mask, sampling, autocast=autocast), want)
    assert [k[1:] for k in engine.caches] == [(16, 128, torch.bfloat16), (16, 128, None)]
    with pytest.raises(ValueError, match="row_bucket=0"):
        StaticEngine(row_bucket=0)


def test_the_cache_argument_of_a_wrapper_is_that_of_the_model_it_wraps(tok):
    """A wrapper whose forward takes ``**kwargs`` (textrl's adapter views, peft) hands the cache on
    under the wrapped model's name (``cache`` on transformers 5.2x: ``past_key_values`` warns there)."""
    import inspect

    from textrl.models.kv_cache import cache_argument

    inner = build_tiny_causal_lm(tok)
    own = next(n for n in ("cache", "past_key_values") if n in inspect.signature(inner.forward).parameters)

    class View(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.stack = [model]

        def forward(self, **kwargs):
            return self.stack[0](**kwargs)

        def generation_modules(self):
            return self.stack

    class Opaque(nn.Module):
        def forward(self, **kwargs):
            return None

    assert cache_argument(inner) == own and cache_argument(View(inner)) == own
    assert cache_argument(View(View(inner))) == own
    assert cache_argument(Opaque()) == "past_key_values"


def test_a_step_that_fails_to_compile_and_capture_is_captured_as_written(tok, monkeypatch):
    """The capture path's fallbacks (CUDA alone captures; here ``_capture`` is stood in for): a compiled
    step that cannot be captured is captured uncompiled; one that cannot be captured at all runs eagerly."""
    from textrl.generation.graph import DecodeGraph
    from textrl.generation.step import decode_step

    tried = []
    for ok_uncompiled, want in ((True, "graph"), (False, None)):
        def capture(self, model, decoder, run, compiled, what="", ok=ok_uncompiled):
            tried.append((decoder.step is decode_step, compiled))
            return ("graph", None) if decoder.step is decode_step and ok else None

        monkeypatch.setattr(Graphs, "_capture", capture)
        tried.clear()
        decoder = DecodeGraph(state=None, step=lambda *a: None)  # a stand-in compiled step
        Graphs(compile=True).capture_step(None, decoder, spec(tok), "cache")
        assert tried == [(False, True), (True, False)] and decoder.graph == want and decoder.step is decode_step
    decoder = DecodeGraph(state=None, step=decode_step)  # not compiled: one try
    tried.clear()
    Graphs().capture_step(None, decoder, spec(tok), "cache")
    assert tried == [(True, False)] and decoder.graph is None


def test_multi_turn_turns_under_bf16_autocast_equal_generate(tok):
    """The carried cache holds keys cast to bf16 (the static cache's dtype under autocast), which a
    later turn's prefill joins to its own: the attention is the same, greedy turns are ``generate``'s."""
    model = build_tiny_causal_lm(tok).eval()
    engine = DecodeEngine()
    sampling = spec(tok, max_new_tokens=8)
    seqs = [tok(p)["input_ids"] for p in PROMPTS for _ in range(2)]
    with engine.rollout():
        for turn in range(3):
            ids, mask = pad_left(seqs, tok.pad_token_id)
            before = engine.prefilled
            got = run(engine, model, ids, mask, sampling, autocast=True)
            assert torch.equal(got, run(HFEngine(), model, ids, mask, sampling, autocast=True)), turn
            if turn:
                assert engine.prefilled - before < int(mask.sum()) // 2
            seqs = [seq + [t for t in got[i].tolist() if t != tok.pad_token_id] + [40 + i, 41, 42 + turn]
                    for i, seq in enumerate(seqs)]


def test_a_rollout_casts_the_weights_once_and_again_only_after_they_change(tok, monkeypatch):
    """Under autocast each call decodes with the weights cast once (not at every matmul); inside a
    rollout, whose turns share the weights, they are cast at its first call and again only when a
    weight changed in place (an optimiser step between turns: the next turn reads the new weights,
    greedy tokens ``generate``'s); a new rollout and every call outside one cast them again, so a
    write the version counter does not see (``.data``) is read by the next rollout."""
    model = build_tiny_causal_lm(tok).eval()
    engine = DecodeEngine()
    sampling = spec(tok, max_new_tokens=6)
    refreshes = []
    refresh = WeightCasts.refresh
    monkeypatch.setattr(WeightCasts, "refresh", lambda self: (refreshes.append(self), refresh(self))[1])
    ids, mask = encode(tok)
    weight = model.model.layers[0].mlp.up_proj.weight

    def cast_of(p):
        (casts,) = engine.graphs.casts.values()
        return next(copy for _, _, q, copy in casts.entries if q is p)

    with engine.rollout():
        for _ in range(3):
            run(engine, model, ids, mask, sampling, autocast=True)
        assert len(refreshes) == 1
        with torch.no_grad():
            weight.mul_(-3.0)  # in place: its version moves
        got = run(engine, model, ids, mask, sampling, autocast=True)
        assert len(refreshes) == 2 and torch.equal(cast_of(weight), weight.to(torch.bfloat16))
        assert torch.equal(got, run(HFEngine(), model, ids, mask, sampling, autocast=True))
    weight.data.mul_(0.5)  # not seen by the version counter
    with engine.rollout():
        run(engine, model, ids, mask, sampling, autocast=True)
        run(engine, model, ids, mask, sampling, autocast=True)
    assert len(refreshes) == 3 and torch.equal(cast_of(weight), weight.to(torch.bfloat16))
    run(engine, model, ids, mask, sampling, autocast=True)
    run(engine, model, ids, mask, sampling, autocast=True)
    assert len(refreshes) == 5 and engine.graphs.fresh is None  # outside a rollout: every call


def test_on_the_cpu_the_engine_stops_where_generate_stops_and_leaves_the_same_random_state(tok):
    """``check_every`` is 1 on the CPU (a read of the running rows costs nothing there): no step
    after the last row's EOS, so the global generator is where ``generate`` leaves it and what is
    drawn next (a minibatch order, the next rollout) is the same with either engine."""
    model = build_tiny_causal_lm(tok).eval()
    eos = tok.eos_token_id
    bias = torch.zeros(model.lm_head.out_features)
    bias[eos] = 5.0  # EOS about one draw in five: every row ends, at different steps
    model.lm_head.bias = nn.Parameter(bias)
    ids, mask = encode(tok)
    sampling = spec(tok, greedy=False, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=60)
    states = []
    for engine in (HFEngine(), DecodeEngine()):
        got = run(engine, model, ids, mask, sampling, seed=4)
        states.append((got, torch.get_rng_state()))
    (want, want_state), (got, got_state) = states
    assert want.shape[1] < 45 and bool((want == eos).any(1).all())  # all ended, 16+ steps before the cap
    assert torch.equal(got, want) and torch.equal(got_state, want_state)
    with pytest.raises(ValueError, match="check_every=0"):
        DecodeEngine(check_every=0)


@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
def test_non_finite_logits_raise_what_multinomial_raises_so_the_agent_names_the_overflow(tok, static):
    """``generate`` raises ``torch.multinomial``'s error on NaN probabilities, which the agents turn
    into the overflow error naming the learning rate; the textrl engine checks on the device and
    raises the same at the end of the call (greedy, as ``generate``, does not check)."""
    import re

    from textrl.generation.draw import INVALID

    model = build_tiny_causal_lm(tok).eval()
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight[0, 0] = float("inf")  # overflows from the first step
    ids, mask = encode(tok)
    with pytest.raises(RuntimeError, match=re.escape(INVALID)):
        run(HFEngine(), model, ids, mask, spec(tok, greedy=False))
    with pytest.raises(RuntimeError, match=re.escape(INVALID + ": the textrl engine drew from a model whose logits")):
        run(DecodeEngine(static=static), model, ids, mask, spec(tok, greedy=False))
    run(DecodeEngine(static=static), model, ids, mask, spec(tok, greedy=True))  # greedy: argmax, no check


def test_a_model_the_static_cache_cannot_hold_decodes_over_the_growing_cache_with_one_warning(tok):
    """Sliding-window layers (a 4-D mask would override their window), flash attention (no 4-D
    mask), encoder-decoders: ``static_unsupported`` says why, and the engine decodes them as
    ``generate`` does, over transformers' growing cache, warning once."""
    from transformers import MistralConfig, MistralForCausalLM

    from textrl.generation.static_kv import static_unsupported

    assert static_unsupported(build_tiny_causal_lm(tok)) is None
    assert static_unsupported(build_tiny_gpt2(tok)) is None
    config = MistralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    assert static_unsupported(model) == "it has sliding-window layers"
    ids, mask = encode(tok)
    engine = DecodeEngine()
    with pytest.warns(UserWarning, match="decodes MistralForCausalLM over transformers' growing KV cache, without "
                                         "a static cache or CUDA graph: it has sliding-window layers"):
        got = run(engine, model, ids, mask, spec(tok))
    assert torch.equal(got, run(HFEngine(), model, ids, mask, spec(tok)))  # the window beyond 4 tokens kept
    assert not engine.graphs.graphs
    forced = DecodeEngine()
    forced._unsupported[id(model)] = None  # the static cache anyway: the window is lost, other tokens
    assert not torch.equal(run(forced, model, ids, mask, spec(tok)), got)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(engine, model, ids, mask, spec(tok))  # said once
    model.config._attn_implementation = "flash_attention_2"
    assert static_unsupported(model) == "its attention (flash_attention_2) takes no 4-D mask"


def test_each_decoder_reads_its_own_models_current_weights_under_autocast(tok):
    """Two models through one engine under bf16 autocast, one updated in place between its calls:
    every call draws what ``generate`` draws from that model as it is then (each decoder refreshes
    the weight casts it was made with)."""
    a, b = build_tiny_causal_lm(tok, seed=0).eval(), build_tiny_causal_lm(tok, seed=1).eval()
    ids, mask = encode(tok)
    engine = DecodeEngine()
    sampling = spec(tok, eos_token_id=None, max_new_tokens=8)
    for step in range(3):
        for model in (a, b):
            want = run(HFEngine(), model, ids, mask, sampling, autocast=True)
            assert torch.equal(run(engine, model, ids, mask, sampling, autocast=True), want), (step, model is a)
        with torch.no_grad():
            for p in a.parameters():
                p.add_(torch.randn_like(p) * 0.05)  # an optimiser step on a alone


def test_nothing_of_an_earlier_call_reaches_a_later_one_through_the_static_cache(tok):
    """A masked column still meets its value (weight 0 x NaN is NaN): a call loads the prefill and
    clears the columns after it, so a NaN an earlier call left there (an overflowed step) is gone."""
    model = build_tiny_causal_lm(tok).eval()
    ids, mask = encode(tok)
    engine = DecodeEngine()
    sampling = spec(tok, eos_token_id=None, max_new_tokens=8)
    want = run(engine, model, ids, mask, sampling)
    (decoder,) = engine.graphs.graphs.values()
    for layer in decoder.state.kv.layers:
        layer.keys[:, :, -1] = float("nan")
        layer.values[:, :, -1] = float("nan")
    assert torch.equal(run(engine, model, ids, mask, sampling), want)


def test_attention_windows_decode_what_generate_and_the_whole_width_decode(tok, model):
    """A step attends to the columns up to its own, rounded up to ``attention_window`` (8 here: a new
    window every 8 tokens over a 128-column cache): the columns left out are masked ones, so greedy
    and seeded runs are ``generate``'s and the whole width's, token for token."""
    ids, mask = encode(tok)
    for greedy in (True, False):
        sampling = spec(tok, greedy, max_new_tokens=80)
        want = run(HFEngine(), model, ids, mask, sampling, seed=3)
        windowed = DecodeEngine(attention_window=8)
        assert torch.equal(run(windowed, model, ids, mask, sampling, seed=3), want)
        assert torch.equal(run(DecodeEngine(attention_window=None), model, ids, mask, sampling, seed=3), want)
        (decoder,) = windowed.graphs.graphs.values()
        assert decoder.state.kv.width == 128 and decoder.state.kv.window is None  # reset after each step


def test_the_window_a_step_attends_to_is_the_next_multiple_past_its_column(tok):
    model = build_tiny_causal_lm(tok).eval()
    ids, mask = encode(tok)
    seen = []
    engine = DecodeEngine(attention_window=16)
    original = engine.graphs.get

    def get(*args, **kwargs):
        decoder = original(*args, **kwargs)
        run_step = decoder.run

        def recorded(model, sampling, name, window=None):
            seen.append((int(decoder.state.kv.column), window))
            return run_step(model, sampling, name, window)

        decoder.run = recorded
        return decoder

    engine.graphs.get = get
    run(engine, model, ids, mask, spec(tok, max_new_tokens=40, eos_token_id=None))
    assert len(seen) == 39 and all(column < window <= column + 16 and window % 16 == 0 for column, window in seen)
    assert DecodeEngine()._windows(torch.device("cpu")) == 64  # auto: on where the step runs eagerly
    assert DecodeEngine()._windows(torch.device("cuda")) is None  # off where each window is a compile and capture
    assert DecodeEngine(capture_graphs=False)._windows(torch.device("cuda")) == 64
    assert DecodeEngine(attention_window=64)._windows(torch.device("cuda")) == 64
    with pytest.raises(ValueError, match="attention_window=0: must be 'auto', None or an int >= 1"):
        DecodeEngine(attention_window=0)


def test_each_attention_window_is_captured_once_and_replayed_for_its_steps(tok, monkeypatch):
    """The capture path (CUDA alone captures; ``_capture`` is stood in for): the whole width, then a
    graph per window below it; a window that fails is left out and its steps replay the whole
    width's graph."""
    from textrl.generation.graph import DecodeGraph, windows
    from textrl.generation.step import decode_step

    class Graph:
        def __init__(self, window):
            self.window, self.replayed = window, 0

        def pool(self):
            return "pool"

        def replay(self):
            self.replayed += 1

    captured = []

    def capture(self, model, decoder, run, compiled, what=""):
        captured.append(decoder.state.kv.window)
        return None if decoder.state.kv.window == 128 else (Graph(decoder.state.kv.window), None)

    monkeypatch.setattr(Graphs, "_capture", capture)
    kv = StaticKV([(torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2))], width=256)
    decoder = DecodeGraph(state=type("State", (), {"kv": kv})(), step=decode_step)
    graphs = Graphs()
    graphs.capture_step(None, decoder, spec(tok), "cache")
    graphs._capture_windows(None, decoder, spec(tok), "cache", windows(256, 64))
    assert windows(256, 64) == [64, 128, 192] and windows(256, None) == []
    assert captured == [None, 64, 128, 192] and kv.window is None
    assert sorted(decoder.windows) == [64, 192]
    for window in (64, 64, 128, 192, 256, None):
        decoder.run(None, spec(tok), "cache", window)
    assert decoder.windows[64].replayed == 2 and decoder.windows[192].replayed == 1
    assert decoder.graph.replayed == 3  # 128 (its capture failed), 256 and None: the whole width


def test_a_feed_attends_each_new_token_to_the_real_columns_up_to_its_own():
    """:meth:`Feed.fill`'s mask against a closed form: kept columns 0-2 (column 1 a hole), new tokens
    at columns 3-5, the first of row 1 padding: a token sees the real columns up to its own, a
    padding token its own column too, nothing past it."""
    from textrl.generation.step import DecodeState, Feed

    like = [(torch.zeros(2, 1, 3, 2), torch.zeros(2, 1, 3, 2))]
    state = DecodeState.new(like, 2, 8)
    feed = Feed.new(state, 3)
    real = torch.tensor([[1, 0, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    feed.fill(torch.tensor([[5, 6, 7], [0, 8, 9]]), torch.tensor([[2, 3, 4], [1, 3, 4]]), real, start=3)
    assert feed.index.tolist() == [3, 4, 5]
    want = torch.zeros(2, 3, 8, dtype=torch.bool)
    for b in range(2):
        for s in range(3):
            for j in range(8):
                want[b, s, j] = (j < 6 and bool(real[b, j]) and j <= 3 + s) or j == 3 + s
    assert torch.equal(feed.mask[:, 0] == 0, want)
    assert bool((feed.mask[:, 0][~want] == torch.finfo(feed.mask.dtype).min).all())


def test_a_carried_turn_feeds_its_new_tokens_in_one_forward_over_the_static_cache(tok):
    """After the first turn, a turn's model forwards are one feed of its new tokens (left-padded to
    a multiple of 8) into the decoder's static cache, then one a decode step: no prefill through
    transformers' growing cache, and the tokens are ``generate``'s."""
    from textrl.generation.decode import FEED_BUCKET

    model = build_tiny_causal_lm(tok).eval()
    engine = DecodeEngine(attention_window=None)
    sampling = spec(tok, eos_token_id=-1, max_new_tokens=5)
    calls = []
    model.register_forward_pre_hook(lambda m, a, k: calls.append(k["input_ids"].shape), with_kwargs=True)
    seqs = [tok(p)["input_ids"] for p in PROMPTS]
    with engine.rollout():
        for turn in range(3):
            ids, mask = pad_left(seqs, tok.pad_token_id)
            want = run(HFEngine(), model, ids, mask, sampling)
            calls.clear()
            got = run(engine, model, ids, mask, sampling)
            assert torch.equal(got, want), turn
            assert [s[0] for s in calls] == [len(seqs)] * 5 and all(s[1] == 1 for s in calls[1:])
            if turn:  # the sampled tail and the observation: one feed of 8 columns, in the decoder's cache
                assert calls[0][1] == FEED_BUCKET
                decoder = next(reversed(engine.graphs.graphs.values()))
                assert list(decoder.feeds) == [FEED_BUCKET] and decoder.feeds[FEED_BUCKET].graph is None
            seqs = [seq + got[i].tolist() + [40 + i, 41, 42 + turn] for i, seq in enumerate(seqs)]


def test_a_feed_is_captured_once_per_size_after_its_decoders_step(tok, monkeypatch):
    """The capture path of a feed (CUDA alone captures; ``_capture`` is stood in for): made and
    captured the first time a decoder feeds that many tokens, its columns held on the device while
    captured, replayed after; a decoder whose step was not captured runs its feeds eagerly."""
    from textrl.generation.graph import DecodeGraph
    from textrl.generation.step import DecodeState, Feed, decode_step

    class Graph:
        replayed = 0

        def replay(self):
            self.replayed += 1

    captured = []

    def capture(self, model, decoder, run, compiled, what=""):
        captured.append((decoder.state.kv.index.tolist(), what))
        return Graph(), torch.ones(2, 3)

    monkeypatch.setattr(Graphs, "_capture", capture)
    like = [(torch.zeros(2, 1, 3, 2), torch.zeros(2, 1, 3, 2))]
    graphs = Graphs()
    decoder = DecodeGraph(state=DecodeState.new(like, 2, 16), step=decode_step, graph=object())
    feed = graphs.feed(None, decoder, 8, "cache")
    assert graphs.feed(None, decoder, 8, "cache") is feed and isinstance(feed, Feed)
    assert captured == [(list(range(8)), "feed of new tokens")] and decoder.state.kv.index is None
    assert torch.equal(decoder.feed(None, feed, "cache"), torch.ones(2, 3)) and feed.graph.replayed == 1
    graphs.feed(None, decoder, 16, "cache")
    assert len(captured) == 2 and sorted(decoder.feeds) == [8, 16]
    eager = DecodeGraph(state=DecodeState.new(like, 2, 16), step=decode_step)  # its step runs eagerly
    assert graphs.feed(None, eager, 8, "cache").graph is None and len(captured) == 2


@pytest.mark.slow
def test_the_compiled_feed_and_step_decode_multi_turn_what_generate_does(tok):
    """``compile=True`` (on CUDA by default): a carried turn's feed through ``torch.compile`` too."""
    from textrl.generation.step import feed_step

    model = build_tiny_causal_lm(tok, num_hidden_layers=1).eval()
    engine = DecodeEngine(compile=True, attention_window=None)
    sampling = spec(tok, max_new_tokens=6)
    seqs = [tok(p)["input_ids"] for p in PROMPTS for _ in range(2)]
    with engine.rollout():
        for turn in range(3):
            ids, mask = pad_left(seqs, tok.pad_token_id)
            got = run(engine, model, ids, mask, sampling)
            assert torch.equal(got, run(HFEngine(), model, ids, mask, sampling)), turn
            seqs = [seq + [t for t in got[i].tolist() if t != tok.pad_token_id] + [40 + i, 41, 42 + turn]
                    for i, seq in enumerate(seqs)]
    decoders = list(engine.graphs.graphs.values())
    assert any(d.feeds for d in decoders) and all(d.feeder is engine.graphs._compiled[feed_step, "cpu"] for d in decoders)


def test_filler_rows_let_a_second_rollout_reuse_every_decoder_and_feed_of_the_first(tok):
    """A multi-turn rollout's running rows shrink from turn to turn (episodes end): with rows rounded
    up to a multiple of 8 (``row_bucket``, "auto" on CUDA) a rollout meets the shapes of the
    earlier ones, so once the buffers have grown to the largest (the first rollout), it makes no
    decoder and no feed (on CUDA: captures nothing); with every row count its own shape it makes
    some again. The tokens are ``generate``'s either way."""
    model = build_tiny_causal_lm(tok).eval()
    sampling = spec(tok, eos_token_id=None, max_new_tokens=4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in torch.randint(3, 9, (13,), generator=g)]

    def rollout(engine):
        seqs = prompts
        with engine.rollout():
            for rows in (13, 11, 9, 6, 3):  # the episodes still running at each turn
                seqs = seqs[:rows]
                ids, mask = pad_left(seqs, tok.pad_token_id)
                got = run(engine, model, ids, mask, sampling)
                assert torch.equal(got, run(HFEngine(), model, ids, mask, sampling)), rows
                seqs = [s + got[i].tolist() + [40, 41] for i, s in enumerate(seqs)]

    def made(engine):
        return {id(d) for d in engine.graphs.graphs.values()} | {id(f) for d in engine.graphs.graphs.values()
                                                                  for f in d.feeds.values()}

    filled, own = DecodeEngine(row_bucket=8, width_bucket=16), DecodeEngine(row_bucket=1, width_bucket=16)
    own.graphs.keep = 4
    for engine in (filled, own):
        rollout(engine)  # grows the shared buffers as it meets wider shapes: the decoders made before go
        rollout(engine)
        second = made(engine)
        rollout(engine)
        assert (made(engine) == second) == (engine is filled)
    assert sorted({k[4] for k in filled.graphs.graphs}) == [8, 16]
