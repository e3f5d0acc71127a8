"""The ``hf`` engine: transformers' ``generate`` under textrl's whole sampling configuration, and the
log-probs of the tokens it draws (:class:`DrawnLogprobs`), without keeping every step's scores."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from textrl.generation.base import GenerationEngine, Sampling, register_engine
from textrl.generation.draw import warped
from textrl.models.sampling import sample, sampling_config


def generation_config(sampling: Sampling) -> Any:
    """The whole ``GenerationConfig`` of ``sampling`` (:func:`textrl.models.sampling.sampling_config`)."""
    return sampling_config(greedy=sampling.greedy, temperature=sampling.temperature, top_k=sampling.top_k,
                           top_p=sampling.top_p, max_new_tokens=sampling.max_new_tokens,
                           eos_token_id=sampling.eos_token_id, pad_token_id=sampling.pad_token_id)


class DrawnLogprobs:
    """A logits processor (``generate(logits_processor=[...])``) that records the log-prob of each
    drawn token under the distribution it was drawn from, keeping one step's ``[B, V]``, not every
    step's scores.

    At each step it is given the tokens so far ``[B, P + t]`` and the step's raw scores ``[B, V]``
    (float32). transformers runs a call's own processors *before* its warpers (temperature, top-k,
    top-p: ``GenerationMixin._get_logits_processor`` appends those after the merged list), so the
    scores are the model's logits and the warping is applied here (:func:`~textrl.generation.draw.warped`,
    what ``generate`` draws from; greedy: the same formula at the sampling's temperature, 0.0 at a
    temperature <= 0). It gathers the previous step's drawn token (the last column of the tokens)
    from the previous step's log-probs, keeps this step's, and returns the scores unchanged (nothing
    drawn changes: the same tokens for the same seed); :meth:`logprobs` gathers the last step's."""

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling
        self.last: Tensor | None = None
        """The last step's log-probs ``[B, V]`` (float32)."""
        self.columns: list[Tensor] = []
        """Each earlier step's drawn token's log-prob ``[B]``."""

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.last is not None:
            self.columns.append(self.last.gather(-1, input_ids[:, -1:])[:, 0])
        self.last = self._logprobs(scores)
        return scores

    def _logprobs(self, scores: Tensor) -> Tensor:
        """``[B, V]`` scores -> ``[B, V]`` float32 log-probs of the distribution a row draws from."""
        if self.sampling.greedy and not self.sampling.temperature > 0:
            return torch.zeros_like(scores, dtype=torch.float32)
        return warped(scores, self.sampling).log_softmax(-1)

    def logprobs(self, tokens: Tensor) -> Tensor:
        """The log-probs ``[B, T]`` (float32) of ``tokens`` ``[B, T]``, the response ``generate`` returned
        (its first ``B`` rows: a call's filler rows past them are dropped), 0.0 after a row's EOS."""
        b, t = tokens.shape
        if self.last is None or len(self.columns) + 1 < t:
            raise ValueError(f"DrawnLogprobs.logprobs: {len(self.columns) + (self.last is not None)} steps recorded "
                             f"for {t} tokens; pass it to generate(logits_processor=...) first")
        columns = [column[:b] for column in self.columns[:t]]
        if len(columns) < t:
            columns.append(self.last[:b].gather(-1, tokens[:, t - 1:])[:, 0])
        logp = torch.stack(columns, dim=1)
        return logp.masked_fill(after_eos(tokens, self.sampling.eos_token_id), 0.0)


def after_eos(tokens: Tensor, eos_token_id: int | None) -> Tensor:
    """``[B, T]`` bool: the columns after a row's first EOS (its padding)."""
    if eos_token_id is None:
        return torch.zeros_like(tokens, dtype=torch.bool)
    eos = (tokens == eos_token_id).long()
    return (eos.cumsum(1) - eos) > 0


def sample_with_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling,
                         **kwargs: Any) -> tuple[Tensor, DrawnLogprobs]:
    """:func:`textrl.models.sampling.sample` under ``sampling`` with a :class:`DrawnLogprobs` added to the
    call's logits processors: ``(prompt + response [B, P + T], the processor)``."""
    from transformers import LogitsProcessorList

    drawn = DrawnLogprobs(sampling)
    processors = LogitsProcessorList([*(kwargs.pop("logits_processor", None) or []), drawn])
    out = sample(model, input_ids, attention_mask, generation_config(sampling), logits_processor=processors, **kwargs)
    return out, drawn


@register_engine("hf")
class HFEngine(GenerationEngine):
    """``model.generate`` (:func:`textrl.models.sampling.sample`: none of the model's own
    ``generation_config``), the reference engine. ``kwargs`` go to ``generate`` (``synced_gpus``
    under a backend that partitions the weights)."""

    def generate(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling,
                 **kwargs: Any) -> Tensor:
        out = sample(model, input_ids, attention_mask.long(), generation_config(sampling), **kwargs)
        return out[:, input_ids.shape[1]:]

    def generate_with_logprobs(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling,
                               **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """:meth:`generate`'s tokens and their log-probs, recorded by a :class:`DrawnLogprobs` in the call."""
        out, drawn = sample_with_logprobs(model, input_ids, attention_mask.long(), sampling, **kwargs)
        tokens = out[:, input_ids.shape[1]:]
        return tokens, drawn.logprobs(tokens)


__all__ = ["DrawnLogprobs", "HFEngine", "after_eos", "generation_config", "sample_with_logprobs"]
