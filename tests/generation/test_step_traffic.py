"""What one decode step of the ``textrl`` engine moves (benchmarks/traffic.py), counted on the
CPU: under bf16 autocast with float32 weights (textrl's CUDA precision) the step reads its matmuls
and attention in bf16 and casts only a row's activations, whatever the cache's width, so it moves
what a step with bf16 weights moves; the count itself is checked against closed forms."""

from __future__ import annotations

import pytest
import torch

from benchmarks.traffic import OpLog, read_dtypes, step_bytes
from textrl.generation import DecodeEngine, Sampling
from textrl.generation.step import DecodeState
from textrl.models.kv_cache import cache_argument


def sampling(tok, new_tokens=4):
    return Sampling(greedy=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                    eos_token_id=None, pad_token_id=tok.pad_token_id)


def one_step(model, tok, context, rows=4, autocast=True, engine=None):
    """The ops of one more decode step after a call of ``rows`` contexts of ``context`` tokens, with
    autocast's cache of cast weights off, as in the step the engine captures on CUDA."""
    engine = engine or DecodeEngine(capture_graphs=False)
    ids = torch.randint(3, 200, (rows, context), generator=torch.Generator().manual_seed(context))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        engine.generate(model, ids, torch.ones_like(ids), sampling(tok))
        decoder = list(engine.graphs.graphs.values())[-1]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast, cache_enabled=False), OpLog() as log:
            decoder.run(model, sampling(tok), cache_argument(model))
    return log.ops, decoder


def matmul_weights(model):
    """The weights the matmuls read: the linear layers' (GPT-2's attention and MLP are ``Conv1D``s)."""
    from transformers.pytorch_utils import Conv1D

    return [m.weight for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D))]


def mid_size(tok):
    """A Llama wide enough that its weights, not the rows' activations, are most of a step's bytes."""
    from textrl.models import build_tiny_causal_lm

    return build_tiny_causal_lm(tok, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                num_attention_heads=4).eval()


def test_op_log_counts_matmul_operands_casts_and_slices_by_closed_form():
    a, b = torch.randn(8, 16), torch.randn(16, 32)
    cache, column, source = torch.zeros(4, 100), torch.tensor([3]), torch.ones(4, 1)
    with OpLog() as log:
        a @ b  # mm: reads 8x16 + 16x32, writes 8x32 floats
        a.to(torch.bfloat16)  # a cast: reads 8x16 x 4 bytes, writes 8x16 x 2
        cache.index_copy_(1, column, source)  # writes one column, not the cache
        a.t()  # a view: moves nothing
    got = step_bytes(log.ops)
    assert got["matmul"] == (8 * 16 + 16 * 32 + 8 * 32) * 4
    assert got["casts"] == 8 * 16 * (4 + 2)
    assert got["other"] == 8 + 4 * 4 + 4 * 4  # the index, the source, the column written
    assert [op.name for op in log.ops] == ["mm", "_to_copy", "index_copy_"]


def test_under_autocast_the_step_reads_bf16_and_its_casts_do_not_grow_with_the_cache(tok, model):
    """Casts per step: a row's activations into each matmul, the logits out; not the weights
    (:class:`WeightCasts` cast them once a call), not the cache or the mask (kept in bf16)."""
    short, _ = one_step(model, tok, context=8)
    long, decoder = one_step(model, tok, context=200)
    assert decoder.state.kv.width >= 200
    for ops in (short, long):
        assert read_dtypes(ops, "matmul") == {torch.bfloat16}
        assert read_dtypes(ops, "attention") <= {torch.bfloat16}
    assert step_bytes(short)["casts"] == step_bytes(long)["casts"]
    smallest = min(w.numel() for w in matmul_weights(model)) * 4
    assert all(op.reads[0][1] < smallest for op in long if op.name == "_to_copy")  # no weight cast


def test_under_autocast_without_the_weight_casts_every_weight_is_cast_every_step(tok, model, monkeypatch):
    """What the count catches: autocast alone (its cache off, as in a captured step) casts every
    matmul weight every step, more bytes than the bf16 weights themselves."""
    from textrl.generation.graph import Graphs

    monkeypatch.setattr(Graphs, "weight_casts", lambda self, *a, **k: None)
    ops, _ = one_step(model, tok, context=8)
    assert step_bytes(ops)["casts"] > sum(w.numel() for w in matmul_weights(model)) * (4 + 2)


def test_under_autocast_a_float32_model_moves_what_a_bf16_one_moves(tok):
    model = mid_size(tok)
    float32, _ = one_step(model, tok, context=32)
    bf16, _ = one_step(model.to(torch.bfloat16), tok, context=32, autocast=False)
    f, b = step_bytes(float32), step_bytes(bf16)
    assert f["matmul"] == b["matmul"]
    assert f["attention"] == b["attention"]
    assert f["total"] <= 1.1 * b["total"]


def test_a_float32_cache_under_autocast_would_be_cast_whole_every_step(tok, monkeypatch):
    """What the count catches: the cache kept in the prefill's float32 (the Llama's keys leave the
    rotary embedding in float32 under autocast) is cast to bf16 by attention in every layer of every
    step, so the casts grow with the cache's width."""
    from textrl.models import build_tiny_causal_lm

    model = build_tiny_causal_lm(tok).eval()
    new = DecodeState.new.__func__
    monkeypatch.setattr(DecodeState, "new", classmethod(lambda cls, like, rows, width, kv_dtype=None, storage=None:
                                                         new(cls, like, rows, width, None)))
    short, _ = one_step(model, tok, context=8)
    long, decoder = one_step(model, tok, context=200)
    assert decoder.state.kv.layers[0].keys.dtype == torch.float32
    kv = sum(x.keys.numel() + x.values.numel() for x in decoder.state.kv.layers)
    assert step_bytes(long)["casts"] - step_bytes(short)["casts"] > kv  # at least the extra columns, cast
    assert step_bytes(long)["casts"] > 3 * step_bytes(short)["casts"]


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "float32"])
def test_the_step_moves_its_weights_once(tok, model, autocast):
    """Every weight a matmul reads is read once a step: the matmuls' bytes are the weights'
    (in the dtype they are read in) plus the rows' activations, which are small beside them."""
    ops, _ = one_step(model, tok, context=16, autocast=autocast)
    weights = sum(w.numel() for w in matmul_weights(model)) * (2 if autocast else 4)
    assert weights <= step_bytes(ops)["matmul"] <= 1.2 * weights
