"""The ``textrl`` engine: textrl's own decode loop over a transformers model's KV cache.

1. **Prefill, once per distinct context.** Rows with the same tokens and mask (the
   ``n_samples_per_prompt`` copies of a prompt) are one row of the prefill; its cache is then
   repeated for its samples (``Cache.reorder_cache``), so a prompt's attention and MLP run once,
   not ``n`` times. Position ids come from the mask (left padding), as ``generate`` makes them.
   Inside a rollout, a row that continues an earlier call's row gets its keys and values from
   there (:mod:`textrl.generation.carry`), and only its new tokens are run: fed in one step into
   the static cache, after the carried columns (:class:`~textrl.generation.step.Feed`).
2. **Decode.** The prefilled cache is copied into a static one and each step, one forward of one
   token a row, writes its next column (:mod:`textrl.generation.graph`: on CUDA the step is
   compiled and captured as a CUDA graph, replayed once a token; ``static=False``: over the
   growing cache of the prefill instead). The next token is drawn on the device from the warped
   distribution (:func:`~textrl.generation.draw.next_tokens`: the warping of
   :func:`textrl.functional.sampling_filter`, then the draw ``torch.multinomial`` makes, so a seeded
   run draws the same tokens as ``hf`` in the same order); a row is ``pad_token_id`` after its EOS.
   The step also writes the drawn token's log-prob, gathered from the probabilities of the draw
   (:meth:`DecodeEngine.generate_with_logprobs` returns them; ``generate`` drops them).
3. **No host sync per token.** Whether every row has ended is read on the host only every
   ``check_every`` steps on a GPU; the output is then cut to the step where the last row ended, so
   the result is the shape ``generate`` returns.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from textrl.generation.base import GenerationEngine, Sampling, cut_at_last_eos, register_engine
from textrl.generation.carry import Plan, TurnCarry, cache_layers, layers_like
from textrl.generation.draw import INVALID, next_tokens, next_tokens_and_logprobs
from textrl.generation.graph import DecodeGraph, Graphs
from textrl.generation.static_kv import bucket, static_unsupported
from textrl.models.kv_cache import cache_argument, new_cache

FEED_BUCKET = 8
"""A carried turn's new tokens are left-padded to a multiple of this (fewer feed shapes, fewer captures)."""


def shared_prefixes(input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The distinct rows of ``(input_ids, attention_mask)`` ``[B, P]``: ``(ids [U, P], mask [U, P],
    inverse [B])`` with row ``b`` equal to distinct row ``inverse[b]`` (padding positions compared by
    the mask alone)."""
    key = torch.cat([input_ids * attention_mask, attention_mask], dim=1)
    unique, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    first = torch.full((unique.shape[0],), input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    first = first.scatter_reduce(0, inverse, rows, "amin")  # each distinct row's first occurrence
    return input_ids[first], attention_mask[first], inverse


def real_tokens(input_ids: Tensor, attention_mask: Tensor) -> tuple[list[list[int]], list[tuple[int, ...]]]:
    """Each row's real-token columns and those tokens, read to the host (``[B, P]`` each): a
    left-padded row (every real column after every padding one, as ``pad_left`` and the collectors
    make them) by its first real column alone, any other column by column."""
    columns, real = [], []
    for keep, row in zip(attention_mask.tolist(), input_ids.tolist()):
        first = keep.index(1) if 1 in keep else len(keep)
        if sum(keep) == len(keep) - first:  # no padding after the first real token
            columns.append(list(range(first, len(keep))))
            real.append(tuple(row[first:]))
        else:
            columns.append([j for j, m in enumerate(keep) if m])
            real.append(tuple(row[j] for j in columns[-1]))
    return columns, real


def _positions(mask: Tensor) -> Tensor:
    """``generate``'s position ids of a left-padded mask: the count of real tokens before, 1 on padding."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


@register_engine("textrl")
class DecodeEngine(GenerationEngine):
    """textrl's decode loop (module docstring). ``share_prefixes``: prefill each distinct context
    once; ``check_every``: steps between the host's reads of "has every row ended" (None: 16 on a
    GPU, where each read waits for the device; 1 on the CPU, where it costs nothing and the steps
    past the last EOS are saved); ``static``: decode over a static cache (:mod:`textrl.generation.graph`),
    its step captured as a CUDA graph on CUDA (``capture_graphs``) and compiled first (``compile``;
    None: where it is captured); ``width_bucket``: the static cache's width rounded up to a multiple of it;
    ``row_bucket``: its rows rounded up to a multiple of it with filler rows ("auto": 8 where the step
    is captured, on CUDA, so the shrinking rows of a multi-turn rollout meet few shapes and replay
    their graphs; 1 elsewhere: no filler rows, and seeded draws are ``generate``'s in order);
    ``attention_window``: a step attends to the cache's columns up to its own, rounded up to a multiple
    of this (the rest are masked: the same attention, fewer keys and values read), not to the whole
    width (None); on CUDA one graph is captured per window ("auto": 64 where the step runs eagerly,
    the CPU; None where it is captured, CUDA: faster there once captured, docs/benchmarks.md,
    "Generation engines", but each window is one more compile and capture per cache width;
    docs/generation.md)."""

    def __init__(self, share_prefixes: bool = True, check_every: int | None = None, carry_turns: bool = True,
                 static: bool = True, capture_graphs: bool = True, compile: bool | None = None,
                 width_bucket: int = 64, attention_window: int | str | None = "auto",
                 row_bucket: int | str = "auto") -> None:
        if check_every is not None and check_every < 1:
            raise ValueError(f"check_every={check_every}: must be >= 1")
        if width_bucket < 1:
            raise ValueError(f"width_bucket={width_bucket}: must be >= 1")
        if row_bucket != "auto" and (not isinstance(row_bucket, int) or isinstance(row_bucket, bool) or row_bucket < 1):
            raise ValueError(f"row_bucket={row_bucket!r}: must be 'auto' or an int >= 1")
        if attention_window != "auto" and attention_window is not None and (
                not isinstance(attention_window, int) or isinstance(attention_window, bool) or attention_window < 1):
            raise ValueError(f"attention_window={attention_window!r}: must be 'auto', None or an int >= 1")
        self.share_prefixes = share_prefixes
        self.check_every = check_every
        self.carry_turns = carry_turns
        self.static = static
        self.width_bucket = width_bucket
        self.row_bucket = row_bucket
        self.attention_window = attention_window
        self.graphs = Graphs(capture=capture_graphs, compile=compile)
        """The static caches and captured steps of the shapes decoded lately (``static``)."""
        self._unsupported: dict[int, str | None] = {}
        """``id(model)`` -> why it cannot use the static cache (None: it can)."""
        self.carry: TurnCarry | None = None
        """The KV caches of this rollout's calls, while :meth:`rollout` is open and ``carry_turns``."""
        self.prefilled = 0
        """Context tokens this engine has prefilled (run through the model before decoding), all calls."""

    def check_backend(self, partitions_weights: bool) -> None:
        if partitions_weights:
            raise ValueError("generation_engine='textrl' runs each forward on this process alone, and the backend "
                             "partitions the weights (FSDP / ZeRO-3: every forward is a collective); use "
                             "--generation-engine hf there")

    @contextmanager
    def rollout(self) -> Iterator[None]:
        """Until the block ends: carry each turn's KV cache to the next turn of the same rows
        (``carry_turns``), and cast the weights for autocast once, at the first call, again only
        when a weight changes in place (:class:`~textrl.generation.graph.Graphs`' ``fresh``)."""
        if self.graphs.fresh is not None:  # a rollout is open: it holds
            yield
            return
        self.graphs.fresh = set()
        if self.carry_turns:
            self.carry = TurnCarry()
        try:
            yield
        finally:
            self.graphs.fresh = None
            if self.carry is not None:
                self.carry.release()
                self.carry = None

    def _prefill(self, model: nn.Module, input_ids: Tensor, mask: Tensor, plan: Plan | None,
                 real: list[tuple[int, ...]] | None, columns: list[list[int]] | None,
                 name: str) -> tuple[Any, Tensor, Tensor, list[list[int]] | None]:
        """``(cache, next logits [B, V], attention mask [B, L], each row's real-token columns)`` of
        the contexts, in transformers' growing cache: from the carried keys of ``plan`` and the new
        tokens alone, else prefilled whole (each distinct context once; its columns are ``columns``,
        those of ``mask``)."""
        b, device = input_ids.shape[0], input_ids.device
        if plan is not None and real is not None and self.carry is not None:
            cache, cache_mask = self.carry.cache_for(model, plan, device)
            ids, suffix_mask, positions, cols = self._new_tokens(real, plan, 1, device)
            mask = torch.cat([cache_mask, suffix_mask], dim=1)
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                        **{name: cache})
            return cache, out.logits[:, -1], mask, cols
        cache = new_cache(model)
        ids_u, mask_u, inverse = input_ids, mask, None
        if self.share_prefixes and b > 1:
            shared = shared_prefixes(input_ids, mask)
            if shared[0].shape[0] < b:  # some contexts repeat (else: every row its own, in its order)
                ids_u, mask_u, inverse = shared
        out = model(input_ids=ids_u, attention_mask=mask_u, position_ids=_positions(mask_u), use_cache=True,
                    logits_to_keep=1, **{name: cache})  # fills the cache in place
        self.prefilled += int(mask_u.sum())
        logits = out.logits[:, -1]
        if inverse is not None:
            cache.reorder_cache(inverse)
            logits = logits[inverse]
        return cache, logits, mask, columns

    def _new_tokens(self, real: list[tuple[int, ...]], plan: Plan, multiple: int,
                    device: torch.device) -> tuple[Tensor, Tensor, Tensor, list[list[int]]]:
        """Each row's tokens past its reused ones, left-padded to a multiple of ``multiple``: ``(ids,
        mask, position ids)`` ``[B, S]``, the real ones counted in ``prefilled``, and each row's real-token
        columns in a context of its reused keys right-aligned in ``W = max(reuse)`` columns, then these
        ``S``. Built on the host, then one copy each: a row-by-row fill on the device is a few hundred
        small launches a turn."""
        suffixes = [row[u:] for row, u in zip(real, plan.reuse)]
        sl = bucket(max(len(x) for x in suffixes), multiple)
        pads = [sl - len(x) for x in suffixes]
        ids = torch.tensor([[0] * p + list(x) for x, p in zip(suffixes, pads)], dtype=torch.long, device=device)
        mask = torch.tensor([[0] * p + [1] * (sl - p) for p in pads], dtype=torch.long, device=device)
        positions = torch.tensor([[1] * p + list(range(u, u + sl - p)) for u, p in zip(plan.reuse, pads)],
                                 dtype=torch.long, device=device)
        self.prefilled += sum(sl - p for p in pads)
        w = max(plan.reuse)
        cols = [[*range(w - u, w), *range(w + p, w + sl)] for u, p in zip(plan.reuse, pads)]
        return ids, mask, positions, cols

    def _feed(self, model: nn.Module, plan: Plan, real: list[tuple[int, ...]], sampling: Sampling, name: str,
              device: torch.device) -> tuple[DecodeGraph, Tensor, int, list[list[int]]]:
        """A carried call over the static cache: each row's reused keys and values gathered into the
        decoder's cache (right-aligned, :meth:`TurnCarry.gather`), its new tokens fed in one step after
        them (:class:`~textrl.generation.step.Feed`, a captured graph on CUDA). ``(decoder, each row's
        next logits [B, V], the context's columns, each row's real-token columns)``."""
        assert self.carry is not None
        reused = max(plan.reuse)
        ids, suffix_mask, positions, cols = self._new_tokens(real, plan, FEED_BUCKET, device)
        tokens = ids.shape[1]
        context = reused + tokens
        like = layers_like(self.carry.kept[0].cache)  # heads, head size, dtype: the rows are ours
        b = len(real)
        decoder = self._decoder(model, b, context, like, sampling, name)
        feed = self.graphs.feed(model, decoder, tokens, name)  # captured (CUDA) before the cache is loaded
        state = decoder.state
        state.kv.clear(context)
        kept = self.carry.gather(plan, state.kv.stacks)
        real_cols = torch.cat([torch.tensor(kept, dtype=torch.bool, device=device), suffix_mask.bool()], dim=1)
        feed.fill(ids, positions, real_cols, reused)
        logits = decoder.feed(model, feed, name)[:b]
        state.attend(real_cols)
        return decoder, logits, context, cols

    def generate(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling,
                 **kwargs: Any) -> Tensor:
        return self._generate(model, input_ids, attention_mask, sampling, False, **kwargs)[0]

    def generate_with_logprobs(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling,
                               **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """:meth:`generate`'s tokens ``[B, T]`` and their log-probs ``[B, T]`` (float32, 0.0 after a
        row's EOS), each gathered from the probabilities its token was drawn from
        (:func:`~textrl.generation.draw.next_tokens_and_logprobs`): the first token's from the prefill's
        (or a carried turn's feed's) logits, the others' written by the decode step (``out_logp``)."""
        return self._generate(model, input_ids, attention_mask, sampling, True, **kwargs)

    @torch.no_grad()
    def _generate(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling,
                  logprobs: bool, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """``(tokens [B, T], their log-probs [B, T] when ``logprobs``, else None)``: the prefill (or a
        carried turn's feed), the first token, the decode."""
        if kwargs:
            raise TypeError(f"the textrl engine takes no generate arguments; got {', '.join(sorted(kwargs))}")
        name = cache_argument(model)
        real = columns = plan = None  # each row's real tokens and their columns: read to the host only for a carry
        if self.carry is not None:
            columns, real = real_tokens(input_ids, attention_mask)
            plan = self.carry.plan(model, real)
        static = self.static and self._fits_static(model)
        decoder: DecodeGraph | None = None
        if static and plan is not None and real is not None:
            decoder, logits, context, cols = self._feed(model, plan, real, sampling, name, input_ids.device)
        else:
            cache, logits, mask, cols = self._prefill(model, input_ids, attention_mask.long(), plan, real, columns, name)
            context = mask.shape[1]
            if static:
                layers = cache_layers(cache)
                decoder = self._decoder(model, input_ids.shape[0], context, layers, sampling, name)
                decoder.state.load_context(layers, mask)
                del cache, layers  # the prefill's cache is in the static one now
        invalid = torch.zeros(1, dtype=torch.bool, device=logits.device)  # non-finite logits met, when sampling
        if logprobs:
            first, first_logp = next_tokens_and_logprobs(logits, sampling, invalid)
        else:
            first, first_logp = next_tokens(logits, sampling, invalid), None
        if sampling.eos_token_id is not None:
            running = first != sampling.eos_token_id
        else:
            running = torch.ones_like(first, dtype=torch.bool)
        if decoder is not None:
            tokens, logp, fed, kept = self._decode_static(decoder, model, context, first, first_logp, running,
                                                          sampling, name, invalid)
        else:
            tokens, logp, fed, kept = self._decode_dynamic(model, cache, mask, first, first_logp, running, sampling,
                                                           name, invalid)
        if not sampling.greedy and bool(invalid.any()):  # one host read a call
            raise RuntimeError(f"{INVALID}: the textrl engine drew from a model whose logits are not finite")
        tokens = cut_at_last_eos(tokens, sampling.eos_token_id)
        if self.carry is not None and real is not None and cols is not None:
            self._remember(model, kept, real, cols, tokens, fed, context, sampling.eos_token_id)
        return tokens, (logp[:, :tokens.shape[1]] if logp is not None else None)

    def _windows(self, device: torch.device) -> int | None:
        """The attention window's granularity on ``device`` (``attention_window``; "auto": 64 where the step
        runs eagerly, None where it is captured, on CUDA: each window is one more compile and capture)."""
        if self.attention_window != "auto":
            return self.attention_window
        return None if self._captured(device) else 64

    def _fits_static(self, model: nn.Module) -> bool:
        """Whether ``model`` decodes over the static cache (:func:`static_unsupported`); a model that
        does not decodes over transformers' growing cache instead, said once in a warning."""
        if id(model) not in self._unsupported:
            reason = self._unsupported[id(model)] = static_unsupported(model)
            if reason is not None:
                warnings.warn(f"the textrl engine decodes {type(model).__name__} over transformers' growing KV cache, "
                              f"without a static cache or CUDA graph: {reason}", stacklevel=4)
        return self._unsupported[id(model)] is None

    def _ended(self, t: int, running: Tensor, sampling: Sampling) -> bool:
        """Whether to stop after drawing token ``t``: every ``check_every`` tokens, one host read of ``running``."""
        every = self.check_every or (1 if running.device.type == "cpu" else 16)
        return sampling.eos_token_id is not None and (t + 1) % every == 0 and not bool(running.any())

    def _decode_dynamic(self, model: nn.Module, cache: Any, mask: Tensor, first: Tensor, first_logp: Tensor | None,
                        running: Tensor, sampling: Sampling, name: str,
                        invalid: Tensor) -> tuple[Tensor, Tensor | None, int, Any]:
        """Decode over the growing cache of the prefill: ``(tokens [B, T], their log-probs [B, T] (0.0
        after EOS; None unless ``first_logp``, the first token's, is given), tokens fed back, cache)``,
        ``invalid`` or-ed with "a draw met non-finite logits"."""
        eos, pad = sampling.eos_token_id, sampling.pad_token_id
        tokens = torch.full((first.shape[0], sampling.max_new_tokens), pad, dtype=torch.long, device=first.device)
        tokens[:, 0] = first
        logps = None
        if first_logp is not None:
            logps = torch.zeros(tokens.shape, dtype=torch.float32, device=first.device)
            logps[:, 0] = first_logp
        token = first
        position = mask.sum(-1, keepdim=True)  # [B, 1]: the next token's position id (real tokens before it)
        steps = sampling.max_new_tokens
        for t in range(1, sampling.max_new_tokens):
            if self._ended(t - 1, running, sampling):
                steps = t
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(input_ids=token.unsqueeze(1), attention_mask=mask, position_ids=position, use_cache=True,
                        **{name: cache})
            position = position + 1
            if logps is not None:
                drawn, logp = next_tokens_and_logprobs(out.logits[:, -1], sampling, invalid)
                logps[:, t] = torch.where(running, logp, 0.0)
            else:
                drawn = next_tokens(out.logits[:, -1], sampling, invalid)
            token = torch.where(running, drawn, pad)
            tokens[:, t] = token
            if eos is not None:
                running = running & (token != eos)
        return tokens[:, :steps], (logps[:, :steps] if logps is not None else None), steps - 1, cache

    def _decoder(self, model: nn.Module, rows: int, context: int, like: list[tuple[Tensor, Tensor]],
                 sampling: Sampling, name: str) -> DecodeGraph:
        """The decoder of ``rows`` (rounded up to ``row_bucket``) x ``context`` columns and the tokens
        to come (rounded up to ``width_bucket``), the same one for every call of that shape
        (:mod:`textrl.generation.graph`)."""
        device = like[0][0].device
        width = bucket(context + sampling.max_new_tokens, self.width_bucket)
        every = self.row_bucket if self.row_bucket != "auto" else (8 if self._captured(device) else 1)
        return self.graphs.get(model, bucket(rows, every), width, like, sampling, name, self._windows(device))

    def _captured(self, device: torch.device) -> bool:
        """Whether the decode step is captured as a CUDA graph on ``device``."""
        return self.graphs.capture and device.type == "cuda"

    def _decode_static(self, decoder: DecodeGraph, model: nn.Module, context: int, first: Tensor,
                       first_logp: Tensor | None, running: Tensor, sampling: Sampling, name: str,
                       invalid: Tensor) -> tuple[Tensor, Tensor | None, int, Any]:
        """Decode over the decoder's static cache, its context loaded, one captured step a token on
        CUDA: ``(tokens [B, T], their log-probs [B, T] (the step writes them, ``out_logp``; None unless
        ``first_logp``, the first token's, is given), tokens fed back, a copy of the cache when carried)``."""
        state = decoder.state
        state.start(first, running, sampling.pad_token_id, first_logp)
        width = state.kv.width
        every = self._windows(first.device)
        steps = sampling.max_new_tokens
        for t in range(1, sampling.max_new_tokens):
            if self._ended(t - 1, state.running, sampling):
                steps = t
                break
            # step t writes column context + t - 1: it attends to the columns up to it, in windows
            decoder.run(model, sampling, name, min(width, bucket(context + t, every)) if every else None)
        b = first.shape[0]  # the rows past it are filler rows
        tokens = state.out[:b, :steps].clone()
        logp = state.out_logp[:b, :steps].clone() if first_logp is not None else None
        invalid.logical_or_(state.invalid)
        kept = state.kv.snapshot(context + steps - 1, b) if self.carry is not None else None
        return tokens, logp, steps - 1, kept

    def _remember(self, model: nn.Module, cache: Any, real: list[tuple[int, ...]], cols: list[list[int]],
                  tokens: Tensor, fed: int, context_width: int, eos: int | None) -> None:
        """Keep the cache for the next turn: each row's context and the sampled tokens fed back, up to its EOS."""
        rows, row_cols = [], []
        for b, sampled in enumerate(tokens[:, :fed].cpu().tolist()):
            n = sampled.index(eos) + 1 if eos is not None and eos in sampled else len(sampled)
            rows.append(real[b] + tuple(sampled[:n]))
            row_cols.append([*cols[b], *range(context_width, context_width + n)])
        assert self.carry is not None
        self.carry.remember(model, cache, row_cols, rows)


__all__ = ["DecodeEngine", "next_tokens", "real_tokens", "shared_prefixes"]
