"""One decode step and one feed of a carried turn's new tokens over the static cache: the work a
captured graph replays, reading no host value (:class:`DecodeState`, :func:`decode_step`,
:class:`Feed`, :func:`feed_step`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from textrl.generation.base import Sampling
from textrl.generation.draw import next_tokens_and_logprobs
from textrl.generation.static_kv import StaticKV


@dataclass
class DecodeState:
    """The buffers a step reads and writes, one set per shape: ``token`` ``[B]`` (fed next),
    ``position`` ``[B, 1]`` (its position id), ``running`` ``[B]``, ``mask`` ``[B, 1, 1, L]``
    (additive: 0 on the columns a row attends to), ``out`` ``[B, L]`` (the tokens drawn, column
    ``step``), ``out_logp`` ``[B, L]`` (float32: their log-probs under the distribution drawn from,
    0.0 after a row's EOS), ``step`` ``[1]``, ``invalid`` ``[1]`` (a step drew from non-finite
    logits), ``kv``."""

    kv: StaticKV
    token: Tensor
    position: Tensor
    running: Tensor
    mask: Tensor
    out: Tensor
    out_logp: Tensor
    step: Tensor
    invalid: Tensor

    @classmethod
    def new(cls, like: list[tuple[Tensor, Tensor]], rows: int, width: int, kv_dtype: torch.dtype | None = None,
            storage: list[tuple[Tensor, Tensor]] | None = None) -> DecodeState:
        """Buffers for ``rows`` x ``width``, the cache and the mask in ``kv_dtype`` (None: the prefill
        keys' dtype; attention casts its mask to its keys' dtype, so a mask kept in it is not cast each
        layer), the cache a view of ``storage`` (flat, per run of layers: :class:`StaticKV`; None: its own)."""
        device, dtype = like[0][0].device, kv_dtype or like[0][0].dtype
        kv = StaticKV(like, width, kv_dtype, rows, storage)
        return cls(kv=kv, token=torch.zeros(rows, dtype=torch.long, device=device),
                   position=torch.zeros(rows, 1, dtype=torch.long, device=device),
                   running=torch.ones(rows, dtype=torch.bool, device=device),
                   mask=torch.full((rows, 1, 1, width), torch.finfo(dtype).min, dtype=dtype, device=device),
                   out=torch.zeros(rows, width, dtype=torch.long, device=device),
                   out_logp=torch.zeros(rows, width, dtype=torch.float32, device=device),
                   step=torch.zeros(1, dtype=torch.long, device=device),
                   invalid=torch.zeros(1, dtype=torch.bool, device=device))

    def load(self, layers: list[tuple[Tensor, Tensor]], mask: Tensor, first: Tensor, running: Tensor,
             pad: int, first_logp: Tensor | None = None) -> None:
        """Start a call: the prefilled cache and its 2-D mask ``[B, W]``, the first token drawn ``[B]``
        (and its log-prob ``[B]``, :meth:`start`)."""
        self.load_context(layers, mask)
        self.start(first, running, pad, first_logp)

    def load_context(self, layers: list[tuple[Tensor, Tensor]], mask: Tensor) -> None:
        """The prefilled cache ``[B', H, W, D]`` a layer and its 2-D mask ``[B', W]`` into the first
        ``B'`` rows (the first token comes by :meth:`start`)."""
        self.kv.load(layers)
        self.attend(mask.bool())

    def attend(self, real: Tensor) -> None:
        """The context of the first ``B'`` rows: the columns holding their real tokens, ``real``
        ``[B', W]`` (bool, columns ``[0, W)``), which a step attends to (none past them), and the next
        position id, their count; a filler row past them attends to no column but the one each step
        writes."""
        self.mask.fill_(torch.finfo(self.mask.dtype).min)
        self.mask[:real.shape[0], 0, 0, :real.shape[1]].masked_fill_(real, 0.0)
        self.position.zero_()
        self.position[:real.shape[0]] = real.sum(-1, keepdim=True)

    def start(self, first: Tensor, running: Tensor, pad: int, first_logp: Tensor | None = None) -> None:
        """The first token drawn ``[B']`` (fed by the first step), its log-prob ``[B']`` (None: 0.0) and
        the rows still running after it; filler rows past ``B'`` feed ``pad`` and are not running."""
        b = first.shape[0]
        if b == self.token.shape[0]:
            self.token.copy_(first)
            self.running.copy_(running)
        else:
            self.token.fill_(pad)
            self.token[:b] = first
            self.running.fill_(False)
            self.running[:b] = running
        self.out.fill_(pad)
        self.out[:b, 0] = first
        self.out_logp.zero_()
        if first_logp is not None:
            self.out_logp[:b, 0] = first_logp
        self.step.fill_(1)
        self.invalid.fill_(False)


def decode_step(model: nn.Module, state: DecodeState, sampling: Sampling, name: str) -> None:
    """One step, in place: feed ``state.token`` at ``state.position`` into cache column
    ``kv.column``, draw the next token (``pad`` for a row past its EOS) into ``token`` and ``out[:, step]``,
    and its log-prob (0.0 past EOS) into ``out_logp[:, step]``."""
    state.mask.index_fill_(3, state.kv.column, 0.0)
    mask = state.mask if state.kv.window is None else state.mask[..., :state.kv.window]
    logits = model(input_ids=state.token[:, None], attention_mask=mask, position_ids=state.position,
                   use_cache=True, **{name: state.kv}).logits[:, -1]
    drawn, logp = next_tokens_and_logprobs(logits, sampling, state.invalid)
    token = torch.where(state.running, drawn, sampling.pad_token_id)
    state.out.index_copy_(1, state.step, token[:, None])
    state.out_logp.index_copy_(1, state.step, torch.where(state.running, logp, 0.0)[:, None])
    if sampling.eos_token_id is not None:
        state.running.logical_and_(token != sampling.eos_token_id)
    state.token.copy_(token)
    state.position.add_(1)
    state.kv.column.add_(1)
    state.step.add_(1)


@dataclass
class Feed:
    """A step that feeds ``S`` tokens a row at once into a decoder's static cache (a carried turn's
    new tokens, the ``textrl`` engine), its buffers: ``ids`` and ``positions`` ``[B, S]``, ``mask``
    ``[B, 1, S, L]`` (additive), ``index`` ``[S]`` (the cache columns written); ``logits`` ``[B, V]``
    (the last token's, once run) and, on CUDA, its captured ``graph``. Like the decode step it reads
    no host value, so it is captured once per ``(rows, S, width)`` and replayed every later turn."""

    ids: Tensor
    positions: Tensor
    mask: Tensor
    index: Tensor
    logits: Tensor | None = None
    graph: Any = None

    @classmethod
    def new(cls, state: DecodeState, tokens: int) -> Feed:
        rows, width, device = state.mask.shape[0], state.mask.shape[-1], state.mask.device
        return cls(ids=torch.zeros(rows, tokens, dtype=torch.long, device=device),
                   positions=torch.zeros(rows, tokens, dtype=torch.long, device=device),
                   mask=torch.zeros(rows, 1, tokens, width, dtype=state.mask.dtype, device=device),
                   index=torch.arange(tokens, device=device))

    def fill(self, ids: Tensor, positions: Tensor, real: Tensor, start: int) -> None:
        """Feed ``ids`` ``[B', S]`` at ``positions`` into columns ``[start, start + S)`` of the first
        ``B'`` rows (filler rows past them feed padding); ``real`` ``[B', start + S]`` (bool): the
        columns holding a row's real tokens, those before ``start`` and the new ones. A token attends
        to the real columns up to its own, and a padding token to its own column too (a query with no
        column would be NaN, and its keys and values written with it; no real token attends to them)."""
        (b, s), width = ids.shape, self.mask.shape[-1]
        if b < self.ids.shape[0]:
            self.ids.zero_()
            self.positions.zero_()
        self.ids[:b] = ids
        self.positions[:b] = positions
        self.index.copy_(torch.arange(start, start + s, device=ids.device))
        cols = torch.arange(width, device=ids.device)
        keys = torch.zeros(self.ids.shape[0], width, dtype=torch.bool, device=ids.device)
        keys[:b, :real.shape[1]] = real
        before = cols <= self.index[:, None]  # [S, L]: a token's own column and those left of it
        allowed = (keys[:, None, :] & before) | (cols == self.index[:, None])
        self.mask.fill_(torch.finfo(self.mask.dtype).min)
        self.mask.masked_fill_(allowed[:, None], 0.0)


def feed_step(model: nn.Module, state: DecodeState, feed: Feed, name: str) -> Tensor:
    """Feed ``feed.ids`` ``[B, S]`` into the cache columns ``feed.index`` (``state.kv.index`` is set
    to it around the call): the logits of each row's last token ``[B, V]``."""
    return model(input_ids=feed.ids, attention_mask=feed.mask, position_ids=feed.positions, use_cache=True,
                 logits_to_keep=1, **{name: state.kv}).logits[:, -1]


__all__ = ["DecodeState", "Feed", "decode_step", "feed_step"]
