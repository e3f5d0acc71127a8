"""Generation engines: how a batch of contexts becomes sampled responses (issue 27's seam).

Every rollout's tokens come from one call, :meth:`GenerationEngine.generate`: contexts
``[B, P]`` (left-padded) in, response tokens ``[B, T]`` out, padded after EOS, sampled from the
distribution the agents' log-probs compute (temperature, then top-k, then top-p: :class:`Sampling`).
Engines are registered by name (:func:`register_engine`) and chosen by ``--generation-engine``:

- ``hf``: transformers' ``generate`` (:func:`textrl.models.sampling.sample`), the reference every
  other engine is tested against;
- ``textrl``: textrl's own decode loop (:mod:`textrl.generation.decode`): each distinct context
  prefilled once and its KV cache shared by its samples (``n_samples_per_prompt`` copies of a
  prompt are one prefill), sampling on the device, the end of every row checked every
  ``check_every`` steps instead of after each token.
"""

from textrl.generation.base import (
    ENGINES,
    GenerationEngine,
    Sampling,
    engine_for,
    engine_named,
    engine_names,
    get_engine,
    register_engine,
)
from textrl.generation.decode import DecodeEngine
from textrl.generation.hf import HFEngine

__all__ = ["ENGINES", "DecodeEngine", "GenerationEngine", "HFEngine", "Sampling", "engine_for", "engine_named", "engine_names",
           "get_engine", "register_engine"]
