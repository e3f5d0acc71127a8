"""The carried KV cache's gather (:meth:`TurnCarry.gather`) against a loop over rows, layers and
columns (the columns left of a row's reused ones are masked: any value), whichever way the kept caches and the destination hold their layers: one stack for all
layers (the static cache and its snapshots), one a layer (transformers' caches), or a mix; and the
static cache of a model whose layers differ in shape, one stack a layer."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from textrl.generation.carry import Kept, Plan, TurnCarry, unstacked
from textrl.generation.static_kv import Stacks, StaticKV, layer_runs


def per_layer(stacks):
    """A cache as transformers keeps it: one ``(keys, values)`` ``[B, H, L, D]`` a layer."""
    return SimpleNamespace(layers=[SimpleNamespace(keys=k[0], values=v[0]) for k, v in unstacked(stacks)])


@st.composite
def cases(draw):
    layers, heads, dim = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    kept, raw = [], []
    for _ in range(draw(st.integers(1, 3))):
        rows, width = draw(st.integers(1, 4)), draw(st.integers(2, 7))
        stacks = [(torch.randn(layers, rows, heads, width, dim, generator=gen),
                   torch.randn(layers, rows, heads, width, dim, generator=gen))]
        cols = [sorted(draw(st.sets(st.integers(0, width - 1), min_size=1))) for _ in range(rows)]
        cache = Stacks(stacks) if draw(st.booleans()) else per_layer(stacks)
        kept.append(Kept(cache, cols, [tuple(range(len(c))) for c in cols]))
        raw.append(stacks[0])
    source, reuse = [], []
    for _ in range(draw(st.integers(1, 5))):
        if draw(st.booleans()):
            source.append(None)
            reuse.append(0)
            continue
        k = draw(st.integers(0, len(kept) - 1))
        r = draw(st.integers(0, len(kept[k].cols) - 1))
        source.append((k, r))
        reuse.append(draw(st.integers(1, len(kept[k].cols[r]))))
    if not any(reuse):
        source[0], reuse[0] = (0, 0), 1
    return kept, raw, Plan(source, reuse), (layers, heads, dim), draw(st.sampled_from(["stacked", "per_layer"]))


@settings(max_examples=150, deadline=None)
@given(cases())
def test_the_gather_writes_each_rows_reused_columns_right_aligned_whatever_the_stacking(case):
    kept, raw, plan, (layers, heads, dim), into_kind = case
    rows, width, room = len(plan.reuse), max(plan.reuse), max(plan.reuse) + 2
    start = torch.randn(layers, rows, heads, room, dim), torch.randn(layers, rows, heads, room, dim)
    into = [(start[0].clone(), start[1].clone())]
    if into_kind == "per_layer":
        into = unstacked(into)
    carry = TurnCarry(kept=kept)
    mask = carry.gather(plan, into)
    want_k, want_v = start[0].clone(), start[1].clone()
    for i, (source, u) in enumerate(zip(plan.source, plan.reuse)):
        if source is None:
            continue
        k, r = source
        keys, values = raw[k]
        for j, col in enumerate(kept[k].cols[r][:u]):
            for layer in range(layers):
                want_k[layer, i, :, width - u + j] = keys[layer, r, :, col]
                want_v[layer, i, :, width - u + j] = values[layer, r, :, col]
    got_k = torch.cat([k for k, _ in into]) if into_kind == "per_layer" else into[0][0]
    got_v = torch.cat([v for _, v in into]) if into_kind == "per_layer" else into[0][1]
    padding = torch.zeros(rows, room, dtype=torch.bool)  # left of a row's reused columns: masked, any value
    for i, (source, u) in enumerate(zip(plan.source, plan.reuse)):
        padding[i, :width - u] = source is not None
    keep = ~padding[None, :, None, :, None]
    assert torch.equal(got_k * keep, want_k * keep) and torch.equal(got_v * keep, want_v * keep)
    assert mask == [[0] * (width - u) + [1] * u for u in plan.reuse]


def test_a_static_cache_of_layers_that_differ_in_shape_keeps_one_stack_a_layer():
    like = [(torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 4, 5)), (torch.zeros(2, 1, 4, 5), torch.zeros(2, 1, 4, 7))]
    assert layer_runs(like) == [range(0, 1), range(1, 2)]
    assert layer_runs([like[0]] * 3) == [range(0, 3)]
    kv = StaticKV(like, width=6)
    assert [k.shape for k, _ in kv.stacks] == [(1, 2, 3, 6, 5), (1, 2, 1, 6, 5)]
    assert kv.layers[1].values.shape == (2, 1, 6, 7)
    kv.load([(torch.ones(2, 3, 4, 5), torch.ones(2, 3, 4, 5)), (torch.ones(2, 1, 4, 5), torch.full((2, 1, 4, 7), 2.0))])
    assert int(kv.column) == 4 and bool((kv.layers[1].values[:, :, :4] == 2).all())
    assert bool((kv.layers[1].values[:, :, 4:] == 0).all())
    snap = kv.snapshot(5, rows=1)
    kv.clear(0)
    assert [k.shape for k, _ in snap.stacks] == [(1, 1, 3, 5, 5), (1, 1, 1, 5, 5)]
    assert bool((snap.layers[1].values[:, :, :4] == 2).all()) and not bool(kv.layers[1].values.any())
