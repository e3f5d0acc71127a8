"""A minibatch's logged stats do not depend on how it is split into micro-batches
(``gradient_accumulation_steps``): textrl.agents.update.combined_micro_stats."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from textrl.agents.update import combined_micro_stats


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=2, max_size=8), parts=st.integers(1, 4), seed=st.integers(0, 999))
def test_token_weighted_micro_stats_equal_the_whole_minibatchs(lengths, parts, seed):
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]  # one row's token values
    tokens = torch.cat(values)
    whole = {"loss/policy": float(tokens.mean()), "ratio/min": float(tokens.min()), "ratio/max": float(tokens.max())}
    stats, weights = {"loss/policy": [], "ratio/min": [], "ratio/max": []}, []
    for rows in torch.arange(len(values)).tensor_split(min(parts, len(values))):
        part = torch.cat([values[i] for i in rows])
        stats["loss/policy"].append(part.mean())
        stats["ratio/min"].append(part.min())
        stats["ratio/max"].append(part.max())
        weights.append(part.numel() / tokens.numel())  # the token mean's micro_weight
    combined = combined_micro_stats(stats, weights)
    assert combined["ratio/min"] == whole["ratio/min"] and combined["ratio/max"] == whole["ratio/max"]
    assert abs(combined["loss/policy"] - whole["loss/policy"]) < 1e-9
