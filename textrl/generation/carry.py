"""The KV cache carried across the turns of multi-turn episodes (the ``textrl`` engine).

A multi-turn episode's next context is the last one, the tokens the agent sampled (up to its EOS,
or fewer when a stop string cut the turn) and the environment's observation. :class:`TurnCarry`
keeps the KV cache of every generate call of a rollout (:meth:`TurnCarry.remember`: which cache
columns hold each row's real tokens, and those tokens) until the rollout ends
(:meth:`TurnCarry.release`). A later call's row whose real tokens start with a kept row's
(:meth:`TurnCarry.plan`: the longest common prefix over the kept rows with the same first tokens)
gets that row's keys and values (:meth:`TurnCarry.cache_for`: gathered, right-aligned into a new
cache) and only its new tokens are prefilled. The cached keys and values are the ones a fresh
prefill computes (the positions count real tokens only, so padding does not move them), up to
float rounding of another batch shape.

The carry holds only while the weights are those that filled it: a row is matched only for the
same model object and the same ``(data_ptr, _version)`` of every parameter (an optimiser step,
an in-place edit or a load changes them; a write through ``.data`` is marked by its writer:
:func:`textrl.core.versions.mark_written`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from textrl.core.versions import tensor_versions
from textrl.models.kv_cache import new_cache

KEY = 8
"""Kept rows are indexed by their first ``KEY`` tokens (a row shorter than that by all of them)."""


def weights_version(model: nn.Module) -> tuple[Any, ...]:
    """``(id, (data_ptr, _version) of every parameter)``: changes when a weight changes in place, is
    marked written (:func:`textrl.core.versions.mark_written`) or is replaced."""
    return (id(model), tensor_versions(model.parameters()))


def cache_layers(cache: Any) -> list[tuple[Tensor, Tensor]]:
    """``[(keys, values)]`` of every layer of a ``DynamicCache`` (``[B, H, L, D]`` each), across releases."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache))


def layer_stacks(cache: Any) -> list[tuple[Tensor, Tensor]]:
    """The cache's keys and values as stacks of layers ``[N, B, H, L, D]``: its own where it keeps them
    so (:class:`textrl.generation.static_kv.Stacks`: the static cache and its snapshots, all layers in one),
    else one a layer (``N = 1``)."""
    stacks = getattr(cache, "stacks", None)
    if stacks is not None:
        return stacks
    return [(k[None], v[None]) for k, v in cache_layers(cache)]


def layers_like(cache: Any) -> list[tuple[Tensor, Tensor]]:
    """One ``(keys, values)`` a layer of ``cache`` that stands for that layer's heads, head size, dtype
    and device, not its values: a stack's first layer for each of its layers (two views a stack, not
    two a layer)."""
    return [first for k, v in layer_stacks(cache) for first in [(k[0], v[0])] * k.shape[0]]


def unstacked(stacks: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
    """``stacks`` split into one stack a layer (views)."""
    return [(k[i:i + 1], v[i:i + 1]) for k, v in stacks for i in range(k.shape[0])]


@dataclass
class Kept:
    """One call's cache: ``cols[b]`` the cache columns of row ``b``'s real tokens (in order),
    ``tokens[b]`` those tokens."""

    cache: Any
    cols: list[list[int]]
    tokens: list[tuple[int, ...]]


@dataclass
class Plan:
    """Where each new row's reused keys come from: ``source[i] = (kept index, row)`` or None,
    ``reuse[i]`` the number of its first real tokens taken from there (0: none)."""

    source: list[tuple[int, int] | None]
    reuse: list[int]


@dataclass
class TurnCarry:
    """The caches of a rollout's calls (module docstring)."""

    kept: list[Kept] = field(default_factory=list)
    index: dict[tuple[int, ...], list[tuple[int, int]]] = field(default_factory=dict)
    short: set[int] = field(default_factory=set)
    """The lengths of the kept rows shorter than ``KEY`` tokens (indexed by all their tokens)."""
    version: tuple[Any, ...] | None = None

    def release(self) -> None:
        """Drop every kept cache (the rollout ended)."""
        self.kept.clear()
        self.index.clear()
        self.short.clear()
        self.version = None

    def remember(self, model: nn.Module, cache: Any, cols: list[list[int]], tokens: list[tuple[int, ...]]) -> None:
        """Keep ``cache``, whose row ``b`` holds ``tokens[b]`` in the columns ``cols[b]``."""
        version = weights_version(model)
        if version != self.version:
            self.release()
            self.version = version
        k = len(self.kept)
        self.kept.append(Kept(cache, cols, tokens))
        for b, row in enumerate(tokens):
            self.index.setdefault(row[:KEY], []).append((k, b))
            if len(row) < KEY:
                self.short.add(len(row))

    def plan(self, model: nn.Module, rows: list[tuple[int, ...]]) -> Plan | None:
        """For each new row (its real tokens), the kept row sharing its longest prefix (at most all
        but its last token, which the prefill must see); None when no row reuses anything."""
        if not self.kept or weights_version(model) != self.version:
            return None
        source: list[tuple[int, int] | None] = []
        reuse: list[int] = []
        for row in rows:
            best, best_n = None, 0
            candidates = self.index.get(row[:KEY], [])
            for n in self.short:  # kept rows shorter than the key, found by all their tokens
                if n < len(row) and n < KEY:
                    candidates = candidates + self.index.get(row[:n], [])
            for k, b in candidates:
                kept = self.kept[k].tokens[b]
                if len(kept) < len(row) and row[:len(kept)] == kept:  # the usual case, compared at C speed
                    n = len(kept)
                else:
                    n = 0
                    for a, c in zip(kept, row[:-1]):
                        if a != c:
                            break
                        n += 1
                if n > best_n:
                    best, best_n = (k, b), n
            source.append(best)
            reuse.append(best_n)
        return Plan(source, reuse) if any(reuse) else None

    def gather(self, plan: Plan, into: list[tuple[Tensor, Tensor]]) -> list[list[int]]:
        """Write row ``i``'s ``plan.reuse[i]`` reused keys and values right-aligned into columns
        ``[0, W)`` of ``into`` (stacks of layers, :func:`layer_stacks`: ``(keys, values)`` ``[N, B, H, >= W,
        D]`` each; ``W = max(reuse)``; the rest left as it is): the rows of its mask ``[B][W]`` (1 on
        the reused columns). One gather a kept call and stack (one for all layers of the static
        cache), not one a layer."""
        width = max(plan.reuse)
        device = into[0][0].device
        # The index tensors are built on the host and copied once (row by row on the device, a
        # turn cost a few hundred small launches).
        for k, kept in enumerate(self.kept):
            rows = [i for i, s in enumerate(plan.source) if s is not None and s[0] == k]
            if not rows:
                continue
            src = [plan.source[i][1] for i in rows]  # type: ignore[index]
            cols = torch.tensor([[0] * (width - plan.reuse[i]) + kept.cols[r][:plan.reuse[i]] for i, r in zip(rows, src)],
                                dtype=torch.long, device=device)
            src_rows, dest = torch.tensor(src, device=device)[:, None], torch.tensor(rows, device=device)[:, None]
            within = torch.arange(width, device=device)
            stacks, to = layer_stacks(kept.cache), into
            if [s[0].shape[0] for s in stacks] != [t[0].shape[0] for t in to]:  # stacked otherwise: layer by layer
                stacks, to = unstacked(stacks), unstacked(to)
            for pair, to_pair in zip(stacks, to):
                for x, y in zip(pair, to_pair):
                    # [N, B, H, L, D] seen as [B, L, N, H, D]: rows x columns [R, W] read and written, each a
                    # block of N x H x D (on the CPU as fast as one layer at a time, twice as fast as
                    # writing through [:, rows, :, :W])
                    y.permute(1, 3, 0, 2, 4)[dest, within] = x.permute(1, 3, 0, 2, 4)[src_rows, cols].to(y.dtype)
        return [[0] * (width - u) + [1] * u for u in plan.reuse]

    def cache_for(self, model: nn.Module, plan: Plan, device: torch.device) -> tuple[Any, Tensor]:
        """A new cache whose row ``i`` holds its ``plan.reuse[i]`` reused keys and values right-aligned
        in ``W = max(reuse)`` columns (:meth:`gather`), and its mask ``[B, W]`` (0 left of them)."""
        n, width = len(plan.reuse), max(plan.reuse)
        like = cache_layers(self.kept[0].cache)
        layers = [(k.new_zeros(n, k.shape[1], width, k.shape[3]), v.new_zeros(n, v.shape[1], width, v.shape[3]))
                  for k, v in like]
        mask = self.gather(plan, [(k[None], v[None]) for k, v in layers])
        cache = new_cache(model)
        for layer, (keys, values) in enumerate(layers):
            cache.update(keys, values, layer)
        return cache, torch.tensor(mask, dtype=torch.long, device=device)


__all__ = ["Kept", "Plan", "TurnCarry", "cache_layers", "layer_stacks", "layers_like", "unstacked", "weights_version"]
