"""The ``static`` engine: transformers' ``generate`` with its static KV cache (compiled on CUDA).

``generate`` over a ``StaticCache`` (allocated at its full length, written in place) compiles the
decoding forward on CUDA (``torch.compile``, CUDA graphs) the first time a shape is seen. This
engine passes its own cache, one per shape, reset and reused by the next call of that shape (its
layers take the dtype of the first keys written, so a float32 model under bf16 autocast gets a bf16
cache, which ``cache_implementation="static"`` would allocate in float32). A shape is the batch and
the cache's length, so this engine rounds both to a few sizes before calling it: the contexts are left-padded to a multiple of ``width_bucket`` columns (padding is
masked and the position ids count real tokens, so the tokens are those of the unpadded batch), and
the batch is filled up to a multiple of ``row_bucket`` rows with copies of its first row, whose
outputs are dropped (the extra rows draw random numbers too: a seeded run then draws other tokens
than ``hf``, from the same distribution); the cache is ``width + max_new_tokens`` columns rounded
up to ``width_bucket``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from textrl.generation.base import GenerationEngine, Sampling, cut_at_last_eos, register_engine
from textrl.generation.casts import ambient_autocast
from textrl.generation.graph import recent
from textrl.generation.hf import generation_config, sample_with_logprobs
from textrl.generation.static_kv import bucket
from textrl.models.kv_cache import cache_argument
from textrl.models.sampling import sample


@register_engine("static")
class StaticEngine(GenerationEngine):
    """``generate`` over a ``StaticCache`` of its own per shape, over bucketed shapes (module
    docstring); ``row_bucket=1`` and ``width_bucket=1``: the batch as given. ``kwargs`` go to ``generate``."""

    def __init__(self, width_bucket: int = 64, row_bucket: int = 8) -> None:
        if width_bucket < 1 or row_bucket < 1:
            raise ValueError(f"width_bucket={width_bucket}, row_bucket={row_bucket}: each must be >= 1")
        self.width_bucket = width_bucket
        self.row_bucket = row_bucket
        self.caches: dict[tuple[Any, ...], Any] = {}
        """``(id(model), rows, length, autocast)`` -> its ``StaticCache`` (the last ``keep``; its
        dtype is that of the first keys written, so the ambient autocast is part of the key)."""
        self.keep = 4

    def cache_for(self, model: nn.Module, rows: int, length: int) -> Any:
        from transformers import StaticCache

        key = (id(model), rows, length, ambient_autocast(next(model.parameters()).device))
        cache, made = recent(self.caches, key, self.keep, lambda: StaticCache(config=model.config, max_cache_len=length))
        if not made:
            cache.reset()
        return cache

    def check_backend(self, partitions_weights: bool) -> None:
        if partitions_weights:
            raise ValueError("generation_engine='static' compiles a forward of this process's whole model, and the "
                             "backend partitions the weights (FSDP / ZeRO-3); use --generation-engine hf there")

    def generate(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling,
                 **kwargs: Any) -> Tensor:
        return self._generate(model, input_ids, attention_mask, sampling, False, **kwargs)[0]

    def generate_with_logprobs(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling,
                               **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """:meth:`generate`'s tokens and their log-probs, recorded by a
        :class:`~textrl.generation.hf.DrawnLogprobs` in the call (the filler rows' dropped)."""
        return self._generate(model, input_ids, attention_mask, sampling, True, **kwargs)

    def _generate(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling,
                  logprobs: bool, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """``(tokens [B, T], their log-probs [B, T] when ``logprobs``, else None)`` over the bucketed shape."""
        b, p = input_ids.shape
        rows, width = bucket(b, self.row_bucket), bucket(p, self.width_bucket)
        ids = input_ids.new_full((rows, width), sampling.pad_token_id)
        mask = attention_mask.new_zeros((rows, width)).long()
        ids[:b, width - p:], mask[:b, width - p:] = input_ids, attention_mask.long()
        ids[b:, width - p:], mask[b:, width - p:] = input_ids[:1], attention_mask[:1].long()
        cache = self.cache_for(model, rows, bucket(width + sampling.max_new_tokens, self.width_bucket))
        kwargs = {**kwargs, cache_argument(model): cache}
        try:
            if logprobs:
                out, drawn = sample_with_logprobs(model, ids, mask, sampling, **kwargs)
            else:
                out, drawn = sample(model, ids, mask, generation_config(sampling), **kwargs), None
        except RuntimeError as err:
            if "index_copy_" not in str(err) or "same dtype" not in str(err):
                raise
            self.caches.clear()
            raise ValueError(
                "generation_engine='static': this transformers' StaticCache stores values in the keys' dtype, and "
                f"under autocast this model's keys and values differ ({err}); run with the weights in the autocast "
                "dtype (--dtype bfloat16), a newer transformers, or --generation-engine textrl") from err
        tokens = cut_at_last_eos(out[:b, width:], sampling.eos_token_id)  # the filler rows may have run longer
        return tokens, (drawn.logprobs(tokens) if drawn is not None else None)


__all__ = ["StaticEngine"]
