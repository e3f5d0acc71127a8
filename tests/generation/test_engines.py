"""The generation engines against ``hf`` (transformers' ``generate``), the reference: greedy token for
token, seeded sampling draw for draw, the sampled distribution, and a rollout that trains the same."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.traffic import OpCount, uncounted
from textrl.generation import DecodeEngine, HFEngine, Sampling, engine_names, get_engine
from textrl.generation.decode import next_tokens, real_tokens, shared_prefixes
from textrl.generation.static import StaticEngine
from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer
from textrl.stages.data import pad_left

PROMPTS = ["What is 1+2?", "hi", "Count to 3 please, slowly", "<think>", "a b c d e f g"]


def encode(tok, prompts, samples=1):
    enc = tok([p for p in prompts for _ in range(samples)], return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def spec(tok, greedy=True, eos=None, pad=None, **kw):
    base = dict(greedy=greedy, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=20,
                eos_token_id=tok.eos_token_id if eos is None else eos,
                pad_token_id=tok.pad_token_id if pad is None else pad)
    base.update(kw)
    return Sampling(**base)


ENGINES = {"textrl": DecodeEngine(), "textrl_unshared": DecodeEngine(share_prefixes=False),
           "textrl_dynamic": DecodeEngine(static=False), "textrl_bucket1": DecodeEngine(width_bucket=1),
           "textrl_check1": DecodeEngine(check_every=1), "static_rows1": StaticEngine(row_bucket=1)}
"""``static_rows1``: the static engine without filler rows, so its draws are ``generate``'s in order;
with them (the default) it is in the greedy tests alone."""

FILLED = {"static": StaticEngine(), "textrl_rows8": DecodeEngine(row_bucket=8)}
"""Engines with filler rows (the ``textrl`` engine's default on CUDA): each step draws for more rows
than ``generate``, so seeded draws part from its order (each row's still from its own distribution:
a row's draw reads its own noise alone); greedy, token for token."""


def pad_after_eos(tokens, eos_token_id, pad_token_id):
    """``tokens [B, T]`` with every column after a row's first EOS set to ``pad_token_id``."""
    eos = (tokens == eos_token_id).long()
    after = (eos.cumsum(1) - eos) > 0
    return torch.where(after, torch.full_like(tokens, pad_token_id), tokens)


def run(engine, model, ids, mask, sampling, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        return engine.generate(model, ids, mask, sampling)


def frequent_token(model, tok, ids, mask):
    """A token greedy decoding emits mid-way in some rows and not in others: as EOS, rows end at
    different steps."""
    out = run(HFEngine(), model, ids, mask, spec(tok, eos=-1, max_new_tokens=12))
    counts = torch.bincount(out[:, 2:10].flatten(), minlength=len(tok))
    return int(counts.argmax())


@pytest.mark.parametrize("name", [*ENGINES, *FILLED])
def test_greedy_is_token_for_token_generate(tok, model, name):
    ids, mask = encode(tok, PROMPTS, samples=2)  # ragged, left-padded, each prompt twice
    for sampling in (spec(tok), spec(tok, eos=frequent_token(model, tok, ids, mask)),  # EOS mid-batch
                     spec(tok, eos=frequent_token(model, tok, ids, mask), pad=frequent_token(model, tok, ids, mask))):
        want = run(HFEngine(), model, ids, mask, sampling)
        got = run({**ENGINES, **FILLED}[name], model, ids, mask, sampling)
        assert got.shape == want.shape and torch.equal(got, want), (sampling, got, want)


def test_rows_end_at_eos_and_the_output_stops_with_the_last(tok, model):
    ids, mask = encode(tok, PROMPTS)
    eos = frequent_token(model, tok, ids, mask)
    sampling = spec(tok, eos=eos, max_new_tokens=40)
    got = run(DecodeEngine(check_every=7), model, ids, mask, sampling)
    ended = got == eos
    assert torch.equal(got, pad_after_eos(got, eos, tok.pad_token_id))
    if bool(ended.any(1).all()):  # every row ended: the last column is some row's EOS
        assert bool(ended[:, -1].any())


@pytest.mark.parametrize("name", list(ENGINES))
@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=20),
                                  dict(temperature=1.3, top_p=0.8), dict(temperature=0.9, top_k=50, top_p=0.9)],
                         ids=["plain", "top_k", "top_p", "both"])
def test_seeded_sampling_draws_what_generate_draws(tok, model, name, warp):
    """Both draw ``torch.multinomial`` over the same warped distribution, one row per step, in the
    same order: the same seed gives the same tokens."""
    ids, mask = encode(tok, PROMPTS, samples=3)
    sampling = spec(tok, greedy=False, max_new_tokens=16, **warp)
    for seed in (0, 1):
        want = run(HFEngine(), model, ids, mask, sampling, seed)
        assert torch.equal(run(ENGINES[name], model, ids, mask, sampling, seed), want)


def test_the_first_token_is_drawn_from_the_warped_softmax(tok, model):
    """4,000 draws of the first token of one prompt against ``softmax(filter(logits / T))``: every
    token's frequency within 5 standard errors, and no filtered token ever drawn."""
    ids, mask = encode(tok, ["Count to 3"], samples=4000)
    sampling = spec(tok, greedy=False, max_new_tokens=1, temperature=1.5, top_k=30, top_p=0.9)
    with torch.no_grad():
        logits = model(input_ids=ids[:1], attention_mask=mask[:1]).logits[0, -1]
    from textrl.functional import sampling_filter

    p = sampling_filter(logits.float()[None] / 1.5, 30, 0.9).softmax(-1)[0]
    first = run(DecodeEngine(), model, ids, mask, sampling, seed=3)[:, 0]
    freq = torch.bincount(first, minlength=len(tok)).double() / first.numel()
    se = (p.double() * (1 - p.double()) / first.numel()).sqrt()
    assert bool((freq[p == 0] == 0).all())
    assert bool(((freq - p.double()).abs() <= 5 * se + 1e-3).all())


def test_next_tokens_is_argmax_when_greedy(tok):
    logits = torch.randn(6, 40)
    assert torch.equal(next_tokens(logits, spec(tok)), logits.argmax(-1))


@settings(max_examples=15, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(1, 3)), min_size=1, max_size=5),
       new=st.integers(1, 12))
def test_greedy_equals_generate_on_drawn_batches(rows, new):
    tok = build_tiny_tokenizer()
    model = _llama(tok)
    prompts = [PROMPTS[i] for i, n in rows for _ in range(n)]
    ids, mask = encode(tok, prompts)
    sampling = spec(tok, max_new_tokens=new)
    assert torch.equal(run(DecodeEngine(check_every=3), model, ids, mask, sampling),
                       run(HFEngine(), model, ids, mask, sampling))


_MODELS: dict[int, torch.nn.Module] = {}


def _llama(tok):
    return _MODELS.setdefault(0, build_tiny_causal_lm(tok).eval())


def test_shared_prefixes_prefill_each_distinct_context_once(tok):
    ids, mask = encode(tok, ["hi", "What is 1+2?", "hi", "hi"])
    ids_u, mask_u, inverse = shared_prefixes(ids, mask)
    assert ids_u.shape[0] == 2
    assert torch.equal(ids_u[inverse], ids) and torch.equal(mask_u[inverse], mask)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.lists(st.booleans(), max_size=6), st.integers(0, 4)), min_size=1, max_size=4),
       st.sampled_from([torch.long, torch.bool, torch.float32]), st.integers(0, 2**16))
def test_real_tokens_are_each_rows_masked_in_columns_left_padded_or_not(rows, dtype, seed):
    """The carry's host read of each row's real columns and tokens: left-padded rows by their first
    real column, rows with padding inside column by column; both the columns the mask holds."""
    width = max(pad + len(inside) + tail for pad, inside, tail in rows)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, (pad, inside, tail) in enumerate(rows):  # right-aligned: padding, maybe holes, real tokens
        row = [0] * pad + [int(x) for x in inside] + [1] * tail
        mask[b, width - len(row):] = torch.tensor(row, dtype=torch.long)
    ids = torch.randint(3, 100, mask.shape, generator=torch.Generator().manual_seed(seed))
    columns, real = real_tokens(ids, mask.to(dtype))
    assert columns == [[j for j in range(width) if mask[b, j]] for b in range(len(rows))]
    assert real == [tuple(int(ids[b, j]) for j in cols) for b, cols in enumerate(columns)]


def test_the_engines_are_registered_and_a_wrong_name_is_refused():
    assert {"hf", "textrl"} <= set(engine_names())
    assert isinstance(get_engine("textrl"), DecodeEngine)
    with pytest.raises(ValueError, match=r"generation_engine='textrll': not a registered engine \(did you mean "
                                         r"'textrl'\?\); choose auto or one of hf, static, textrl"):
        get_engine("textrll")


def test_the_textrl_engine_refuses_partitioned_weights():
    with pytest.raises(ValueError, match="partitions the weights.*--generation-engine hf"):
        DecodeEngine().check_backend(partitions_weights=True)
    DecodeEngine().check_backend(partitions_weights=False)


def test_sampling_refuses_what_cannot_be_drawn(tok):
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        spec(tok, max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature=0"):
        spec(tok, greedy=False, temperature=0)


@pytest.mark.parametrize("name", ["gae_ppo", "grpo"])
def test_a_rollout_from_the_textrl_engine_trains_as_one_from_hf(tok, name):
    """The same seed, the same tokens, the same log-probs, values, advantages and update stats."""
    from tests.agents.conftest import PROMPTS as AGENT_PROMPTS
    from tests.agents.conftest import collect, make_agent

    results = []
    for engine in ("hf", "textrl"):
        agent = make_agent(tok, name, generation_engine=engine, max_new_tokens=10)
        assert agent.actor.engine.name == engine
        td = collect(agent, tok, prompts=AGENT_PROMPTS * 2, seed=5)
        results.append((td, agent.update(td)))
    (td_hf, stats_hf), (td_ours, stats_ours) = results
    for key in td_hf.keys(include_nested=True, leaves_only=True):
        torch.testing.assert_close(td_ours.get(key), td_hf.get(key), rtol=0, atol=0, msg=str(key))
    assert {k: v for k, v in stats_ours.items() if "time" not in k} == {k: v for k, v in stats_hf.items() if "time" not in k}


# -- multi-turn: the KV cache carried across turns ------------------------------------------------


def _episodes(tok, model, engine, sampling, turns=3, seed=0):
    """Turns as the multi-turn runner makes them: each row's next context is its last one, its sampled
    tokens up to EOS (every third row cut after 3 tokens, as a stop string cuts a turn) and an
    observation. Yields ``(turn, hf's tokens, the engine's, prefilled tokens, context tokens)``."""
    seqs = [tok(p)["input_ids"] for p in PROMPTS[:4] for _ in range(2)]
    with engine.rollout():
        for turn in range(turns):
            ids, mask = pad_left(seqs, tok.pad_token_id)
            want = run(HFEngine(), model, ids, mask, sampling, seed + turn)
            before = engine.prefilled
            got = run(engine, model, ids, mask, sampling, seed + turn)
            yield turn, want, got, engine.prefilled - before, int(mask.sum())
            grown = []
            for i, seq in enumerate(seqs):
                sampled = got[i].tolist()
                sampled = sampled[: sampled.index(sampling.eos_token_id) + 1] if sampling.eos_token_id in sampled else sampled
                grown.append(seq + (sampled[:3] if i % 3 == 0 else sampled) + [40 + i, 41, 42 + turn])
            seqs = grown


@pytest.mark.parametrize("greedy, rows", [(True, 1), (False, 1), (True, 8)], ids=["greedy", "sampled", "greedy-filled"])
def test_a_turn_prefills_only_its_new_tokens_and_generates_what_generate_does(tok, model, greedy, rows):
    ids, mask = encode(tok, PROMPTS[:4])
    sampling = spec(tok, greedy=greedy, eos=frequent_token(model, tok, ids, mask), max_new_tokens=10,
                    temperature=0.8, top_k=40)
    engine = DecodeEngine(check_every=4, row_bucket=rows)
    for turn, want, got, prefilled, context in _episodes(tok, model, engine, sampling):
        assert torch.equal(got, want), f"turn {turn}"
        if turn:  # the history comes from the carried cache: only the sampled tokens' tail and the observation
            assert prefilled < context // 2, (turn, prefilled, context)


def test_a_carried_turn_dispatches_no_op_per_row(tok, model):
    """The host work of a carried turn (which kept row each new row continues, the columns it keeps,
    the new tokens' ids, mask and positions) is built on the host and copied once: the ops a second
    turn dispatches are the same for 4 rows as for 16 (a row-by-row fill on the device was a few
    hundred small launches a turn on a GPU)."""
    sampling = spec(tok, greedy=False, eos=-1, max_new_tokens=6)

    def second_turn_ops(rows):
        engine = DecodeEngine(attention_window=None)
        seqs = [tok(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(rows)]
        with engine.rollout():
            ids, mask = pad_left(seqs, tok.pad_token_id)
            out = run(engine, model, ids, mask, sampling)
            seqs = [seq + out[i].tolist() + [40, 41] for i, seq in enumerate(seqs)]
            ids, mask = pad_left(seqs, tok.pad_token_id)
            before = engine.prefilled
            with OpCount() as ops:
                run(engine, model, ids, mask, sampling)
        assert engine.prefilled - before < int(mask.sum()) // 2  # the turn was carried
        return ops.n

    assert second_turn_ops(4) == second_turn_ops(16)


def test_a_carried_turn_dispatches_no_op_per_layer_outside_its_steps_and_feed(tok):
    """The static cache keeps all layers' keys in one tensor and their values in another, so
    clearing it, gathering a carried turn's kept columns into it and keeping a copy of it for the
    next turn are one op each for the whole model: outside its decode steps and its feed (captured
    graphs on CUDA) a carried turn dispatches the same ops for 2 layers as for 6 (it was 16 more a
    layer)."""
    from textrl.generation.graph import DecodeGraph

    sampling = spec(tok, greedy=False, eos=-1, max_new_tokens=6)
    counting = OpCount()

    def second_turn_ops(layers):
        model = build_tiny_causal_lm(tok, num_hidden_layers=layers).eval()
        engine = DecodeEngine(attention_window=None)
        for _ in range(2):  # the second finds its decoders made, as every iteration after the first
            seqs = [tok(p)["input_ids"] for p in PROMPTS]
            with engine.rollout():
                ids, mask = pad_left(seqs, tok.pad_token_id)
                out = run(engine, model, ids, mask, sampling)
                seqs = [seq + out[i].tolist() + [40, 41] for i, seq in enumerate(seqs)]
                ids, mask = pad_left(seqs, tok.pad_token_id)
                before, counting.n, made = engine.prefilled, 0, engine.graphs.made
                with counting, uncounted(counting, DecodeGraph, "run", "feed"):
                    run(engine, model, ids, mask, sampling)
            assert engine.prefilled - before < int(mask.sum()) // 2  # the turn was carried
        assert engine.graphs.made == made
        return counting.n

    run_step, feed = DecodeGraph.run, DecodeGraph.feed
    assert second_turn_ops(2) == second_turn_ops(6)
    assert (DecodeGraph.run, DecodeGraph.feed) == (run_step, feed)  # uncounted put them back


def test_no_carry_outside_a_rollout_or_after_the_weights_change(tok):
    model = build_tiny_causal_lm(tok).eval()
    ids, mask = encode(tok, PROMPTS[:4])
    sampling = spec(tok, eos=frequent_token(model, tok, ids, mask), max_new_tokens=10)
    engine = DecodeEngine()
    episodes = _episodes(tok, model, engine, sampling)
    next(episodes)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)  # an optimiser step between turns
    turn, want, got, prefilled, context = next(episodes)
    assert prefilled == context and torch.equal(got, want)  # nothing carried from other weights
    episodes.close()
    assert engine.carry is None  # the rollout ended: its caches are dropped
    before = engine.prefilled
    run(engine, model, ids, mask, sampling)
    run(engine, model, ids, mask, sampling)
    assert engine.prefilled - before == 2 * int(mask.sum())  # no rollout open: each call prefills all


def test_a_multi_turn_run_logs_the_same_with_either_engine(tmp_path):
    """The same metrics, but the gap between the engine's log-probs and the learner's (gap, KL, share
    past 2x, the weight check's gap): each engine's own rounding, below 1e-3 with both."""
    from tests.runs import SMALL, metrics
    from textrl.cli import main

    rows, gaps = {}, {}
    for engine in ("hf", "textrl"):
        out = tmp_path / engine
        main(["train", *SMALL, "--agent", "rloo", "--env", "guess_number", "--iterations", "2",
              "--generation-engine", engine, "--output-dir", str(out)])
        rows[engine] = [{k: v for k, v in r.items()
                         if not any(w in k for w in ("time", "_s", "seconds", "memory", "per_s", "rollout/logprob", "rollout/weight_gap"))}
                        for r in metrics(out)]
        gaps[engine] = [r[k] for r in metrics(out) for k in ("rollout/logprob_gap_max", "rollout/weight_gap")]
    assert rows["textrl"] == rows["hf"]
    assert all(0 <= g < 1e-3 for engine in gaps for g in gaps[engine]) and len(gaps["hf"]) == 4, gaps


def test_textrl_train_refuses_an_unknown_engine_before_any_work(tmp_path):
    from textrl.cli import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as err:
        main(["train", "--generation-engine", "sglang", "--iterations", "1", "--output-dir", str(out)])
    assert str(err.value.code) == ("textrl train: generation_engine='sglang': not a registered engine; choose auto or "
                                   "one of hf, static, textrl, vllm, vllm-server")
    assert not out.exists()  # refused before the warm-up wrote anything


def test_a_registered_engine_is_what_the_agent_generates_with(tok):
    from tests.agents.conftest import make_agent
    from textrl.generation import GenerationEngine, register_engine
    from textrl.generation.base import ENGINES

    calls = []

    @register_engine("greedy_hf_for_test")
    class Recording(GenerationEngine):
        def generate(self, model, input_ids, attention_mask, sampling, **kwargs):
            calls.append(input_ids.shape)
            return HFEngine().generate(model, input_ids, attention_mask, sampling, **kwargs)

    try:
        agent = make_agent(tok, "gae_ppo", generation_engine="greedy_hf_for_test")
        ids, mask = encode(tok, PROMPTS[:4])
        out = agent.act(ids, mask.bool())
        assert calls == [ids.shape] and out.shape[0] == 4
        with pytest.raises(ValueError, match="generation engine name 'greedy_hf_for_test' is taken"):
            register_engine("greedy_hf_for_test")(DecodeEngine)
    finally:
        ENGINES.pop("greedy_hf_for_test", None)


def test_auto_is_the_measured_engine_of_the_device(tok, monkeypatch):
    from tests.agents.conftest import make_agent
    from textrl.generation import base, engine_for

    assert make_agent(tok, "gae_ppo").actor.engine.name == "textrl"  # the CPU's measured default
    assert engine_for("auto", "cuda").name == "textrl" and engine_for("hf", "cpu").name == "hf"
    assert engine_for("auto", "mps").name == "hf"  # a device nothing was measured on
    monkeypatch.setitem(base.AUTO, "cpu", "hf")
    assert engine_for("auto", "cpu").name == "hf"
    assert make_agent(tok, "gae_ppo").actor.engine.name == "hf"


def test_auto_falls_back_to_hf_under_a_backend_that_partitions_the_weights():
    from textrl.generation import engine_for

    assert engine_for("auto", "cpu", partitions_weights=True).name == "hf"
    assert engine_for("textrl", "cpu", partitions_weights=True).name == "textrl"  # asked for: refused at prepare
