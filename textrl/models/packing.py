"""Padding-free layouts: the real tokens of a padded batch laid end to end (``padding_free``).

A forward batch ``[B, L]`` (a left-padded prompt of ``P`` columns, then a right-padded response)
holds each row's attended tokens in one run of columns. :func:`pack_rows` lays those runs end to
end into packed rows and says where each wanted output lands back in ``[B, T]`` (``T = L - P``);
:func:`pack_last_tokens` does the same for a reward model's batch, whose one wanted output per row
is at its last attended token (``[B, 1]``); both are :func:`pack_picks` of their own picks.
Positions restart at 0 at each row's first token, so a model whose attention masks come from the
position ids (transformers' ``masking_utils``: a block-diagonal causal mask for sdpa / eager /
flex; the varlen kernels for flash attention, which need one row) attends only within a row.
Three layouts (docs/design.md, "Padding-free forwards"):

- ``one_row``: every row in one ``[1, N]`` sequence (flash attention's varlen kernels: attention
  costs the sum of the rows' squared lengths);
- ``bins``: rows packed first-fit-decreasing into ``[K, C]`` bins as wide as the longest row (sdpa
  and eager, whose attention is dense: one ``[1, N]`` row would cost ``N^2``; a bin costs ``C^2``);
  the room a bin has left is a run of its own (positions from 0 again) whose outputs are dropped;
- ``per_row``: one forward per row, unpadded (a model that does not honour packed position ids).

Pure tensor functions: :mod:`textrl.models.packed_forward` runs models on a :class:`Packing`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LAYOUTS = ("one_row", "bins", "per_row")
"""How :func:`pack_rows` lays rows out (module docstring)."""


@dataclass(frozen=True)
class Call:
    """One forward of a :class:`Packing`: ``input_ids`` and ``position_ids`` int64 ``[k, w]``,
    ``attention_mask`` None for packed rows (the mask comes from the positions) or all ones
    ``[1, w]`` for one row alone, and ``picks`` int64 ``[n]``: the flat index into ``[k * w]`` of
    each output the caller wants, in the order of :attr:`Packing.dest`."""

    input_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor | None
    picks: Tensor


@dataclass(frozen=True)
class Packing:
    """A batch's real tokens in packed forwards (:func:`pack_rows`): its ``calls``, and ``dest``
    int64 ``[n]``, the flat index into ``[B, T]`` (``shape``) of each pick, calls in order."""

    calls: tuple[Call, ...]
    dest: Tensor
    shape: tuple[int, int]
    layout: str

    @property
    def picks(self) -> int:
        """Outputs wanted: the response positions whose token is attended."""
        return int(self.dest.numel())

    @property
    def slots(self) -> int:
        """Positions the forwards run: the real tokens plus the bins' leftover room."""
        return sum(call.input_ids.numel() for call in self.calls)

    def gather(self, x: Tensor) -> Tensor:
        """``x`` ``[B, T, ...]`` at the picks: ``[n, ...]``."""
        return x.reshape(-1, *x.shape[2:])[self.dest]

    def scatter(self, values: Tensor, fill: float = 0.0) -> Tensor:
        """``values`` ``[n, ...]`` (the picks' outputs, calls in order) back at their ``[B, T, ...]``
        places, ``fill`` where nothing was picked (padding). Gradients flow to ``values``."""
        batch, length = self.shape
        out = values.new_full((batch * length, *values.shape[1:]), fill)
        return out.index_copy(0, self.dest, values).view(batch, length, *values.shape[1:])


def attended_runs(attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(first [B], length [B])`` int64: each row's first attended column and its attended count.

    Raises ``ValueError`` when a row's attended columns are not one run (a gap inside a row): its
    tokens could not be packed without changing what they attend to."""
    mask = attention_mask.bool()
    batch, width = mask.shape
    columns = torch.arange(width, device=mask.device)
    length = mask.sum(1)
    first = torch.where(mask.any(1), mask.int().argmax(1), 0).long()
    run = (columns >= first[:, None]) & (columns < (first + length)[:, None])
    if not bool((run == mask).all()):
        row = int((run != mask).any(1).nonzero()[0])
        raise ValueError(f"padding_free: row {row} attends to columns that are not one run (a gap inside the row); "
                         "a forward batch is a left-padded prompt and a right-padded response: leave padding_free off "
                         "for masks with gaps")
    return first, length


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows (indices into ``lengths``) in bins of at most ``capacity`` tokens: longest first, each
    into the first bin with room (a row longer than ``capacity`` gets a bin of its own). Rows of
    length 0 go nowhere. Deterministic: ties keep the rows' order.

    >>> first_fit_decreasing([3, 5, 2, 4, 0], 6)
    [[1], [3, 2], [0]]
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        size = lengths[row]
        if size == 0:
            continue
        target = next((k for k, left in enumerate(room) if left >= size), None)
        if target is None:
            bins.append([row])
            room.append(capacity - size)
        else:
            bins[target].append(row)
            room[target] -= size
    return bins


def response_targets(attention_mask: Tensor, prompt_len: int) -> tuple[Tensor, Tensor]:
    """``(rows [n], steps [n])`` int64: the response positions ``t`` (column ``P + t``) whose token
    is attended, row-major. The output that predicts (or values the state before) the token of
    column ``P + t`` is the model's at column ``P + t - 1``, attended too (the row's run starts in
    the prompt); a row whose prompt has no attended token is refused."""
    mask = attention_mask.bool()
    if prompt_len < 1 or prompt_len > mask.shape[1]:
        raise ValueError(f"padding_free: prompt_len={prompt_len} must lie in [1, {mask.shape[1]}]")
    wanted = mask[:, prompt_len:]  # [B, T]
    source = mask[:, prompt_len - 1 : -1]  # [B, T]: column P + t - 1
    if bool((wanted & ~source).any()):
        row = int((wanted & ~source).any(1).nonzero()[0])
        raise ValueError(f"padding_free: row {row} has a response but no attended prompt token; every row "
                         "needs at least one prompt token")
    rows, steps = wanted.nonzero(as_tuple=True)
    return rows, steps


def _calls(lengths: list[int], layout: str) -> list[tuple[list[list[int]], int]]:
    """Each forward's bins (the rows in each, in order) and its width, for rows of ``lengths`` tokens."""
    if layout == "per_row":
        return [([[row]], n) for row, n in enumerate(lengths) if n > 0]
    if layout == "one_row":
        rows = [row for row, n in enumerate(lengths) if n > 0]
        return [([rows], sum(lengths))] if rows else []
    bins = first_fit_decreasing(lengths, max(lengths, default=0))
    return [(bins, max(lengths))] if bins else []


def _packed_call(input_ids: Tensor, attention_mask: Tensor, first: Tensor, lengths: list[int], bins: list[list[int]],
                 width: int, single: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """``(input_ids [k, w], position_ids [k, w], attention_mask, member [B], zero [B])`` of one
    forward over ``bins`` (rows in each, in order) of ``width`` slots: ``member`` whether a row is
    in it, ``zero`` the flat slot its column 0 would take (its token at column ``j`` is in slot
    ``zero + j``)."""
    batch, length = input_ids.shape
    device = input_ids.device
    fill, base, inside = [0] * len(bins), [0] * batch, [False] * batch  # base: each row's first slot
    for k, rows in enumerate(bins):
        for row in rows:
            base[row], inside[row] = k * width + fill[k], True
            fill[k] += lengths[row]
    zero = torch.tensor(base, dtype=torch.long, device=device) - first
    member = torch.tensor(inside, dtype=torch.bool, device=device)
    room = torch.tensor(fill, dtype=torch.long, device=device)
    positions = (torch.arange(width, device=device)[None] - room[:, None]).clamp(min=0).reshape(-1)  # the room left
    ids = torch.zeros(len(bins) * width, dtype=input_ids.dtype, device=device)
    mask = attention_mask.bool() & member[:, None]  # [B, L]
    columns = torch.arange(length, device=device)
    slot = (zero[:, None] + columns[None])[mask]  # [n]
    ids[slot] = input_ids[mask]
    positions[slot] = (columns[None] - first[:, None])[mask]
    ones = torch.ones(1, width, dtype=torch.long, device=device) if single else None
    return ids.view(len(bins), width), positions.view(len(bins), width), ones, member, zero


def _checked_runs(attention_mask: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    """:func:`attended_runs` once ``layout`` is known to be one of :data:`LAYOUTS` (else ``ValueError``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"padding_free: layout={layout!r} must be one of {', '.join(LAYOUTS)}")
    return attended_runs(attention_mask)


def pack_picks(input_ids: Tensor, attention_mask: Tensor, rows: Tensor, columns: Tensor, dest: Tensor,
               shape: tuple[int, int], layout: str) -> Packing:
    """The forwards that run ``input_ids`` ``[B, L]`` on their attended tokens only, in ``layout``
    (:data:`LAYOUTS`), and the picks of the outputs at ``(rows [n], columns [n])`` (row-major,
    attended), which :meth:`Packing.scatter` puts at ``dest [n]`` of a ``shape`` batch.

    Row ``b``'s token at column ``j`` gets position ``j - first[b]`` (what
    :func:`textrl.models.forward.positions_from_mask` gives it in the padded batch); a bin's
    leftover room holds token 0 at positions from 0 (a run of its own, never picked). A row with
    no pick is left out; with none at all there is no call.
    """
    first, length = _checked_runs(attention_mask, layout)
    wanted = torch.zeros_like(length, dtype=torch.bool).index_fill_(0, rows, True)
    lengths = torch.where(wanted, length, 0).tolist()  # a row without a pick is not run
    calls, dests = [], []
    for bins, call_width in _calls(lengths, layout):
        ids, positions, ones, member, zero = _packed_call(input_ids, attention_mask, first, lengths, bins, call_width,
                                                          single=layout == "per_row")
        mine = member[rows]  # this forward's picks, in the callers' order
        calls.append(Call(ids, positions, ones, zero[rows[mine]] + columns[mine]))
        dests.append(dest[mine])
    picked = torch.cat(dests) if dests else torch.zeros(0, dtype=torch.long, device=input_ids.device)
    return Packing(tuple(calls), picked, shape, layout)


def pack_rows(input_ids: Tensor, attention_mask: Tensor, prompt_len: int, layout: str) -> Packing:
    """:func:`pack_picks` of the outputs at columns ``P - 1 .. L - 2`` whose next token is attended
    (:func:`response_targets`: the logits or values of each response token), scattered back to
    ``[B, T]`` (``T = L - P``). A row with no attended response token is left out."""
    batch, width = input_ids.shape
    _checked_runs(attention_mask, layout)  # a gap inside a row is said before a missing prompt
    rows, steps = response_targets(attention_mask, prompt_len)
    return pack_picks(input_ids, attention_mask, rows, prompt_len - 1 + steps, rows * (width - prompt_len) + steps,
                      (batch, width - prompt_len), layout)


def pack_last_tokens(input_ids: Tensor, attention_mask: Tensor, layout: str) -> Packing:
    """:func:`pack_picks` of each row's output at its last attended token (a sequence score: a
    reward model's), scattered back to ``[B, 1]``; rows padded on either side (one run of attended
    columns each, :func:`attended_runs`). A row with no attended token is left out."""
    first, length = _checked_runs(attention_mask, layout)
    rows = (length > 0).nonzero()[:, 0]
    return pack_picks(input_ids, attention_mask, rows, (first + length - 1)[rows], rows, (input_ids.shape[0], 1),
                      layout)


def padding_fraction(attention_mask: Tensor) -> float:
    """The share of a padded batch ``[B, L]`` that is padding: ``1 - attended / (B * L)`` (0 for an
    empty batch)."""
    total = attention_mask.numel()
    return 0.0 if total == 0 else 1.0 - float(attention_mask.bool().sum()) / total


__all__ = ["LAYOUTS", "Call", "Packing", "attended_runs", "first_fit_decreasing", "pack_last_tokens", "pack_picks",
           "pack_rows", "padding_fraction", "response_targets"]
