"""The ``hf`` engine: transformers' ``generate`` under textrl's whole sampling configuration."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from textrl.generation.base import GenerationEngine, Sampling, register_engine
from textrl.models.sampling import sample, sampling_config


@register_engine("hf")
class HFEngine(GenerationEngine):
    """``model.generate`` (:func:`textrl.models.sampling.sample`: none of the model's own
    ``generation_config``), the reference engine. ``kwargs`` go to ``generate`` (``synced_gpus``
    under a backend that partitions the weights)."""

    def generate(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling,
                 **kwargs: Any) -> Tensor:
        config = sampling_config(greedy=sampling.greedy, temperature=sampling.temperature, top_k=sampling.top_k,
                                 top_p=sampling.top_p, max_new_tokens=sampling.max_new_tokens,
                                 eos_token_id=sampling.eos_token_id, pad_token_id=sampling.pad_token_id)
        out = sample(model, input_ids, attention_mask.long(), config, **kwargs)
        return out[:, input_ids.shape[1]:]


__all__ = ["HFEngine"]
