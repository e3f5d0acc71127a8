"""Generation engines: how a batch of contexts becomes sampled responses.

Every rollout's tokens come from one call, :meth:`GenerationEngine.generate`: contexts
``[B, P]`` (left-padded) in, response tokens ``[B, T]`` out, padded after EOS, sampled from the
behaviour distribution (temperature, then top-k, then top-p: :class:`Sampling`; the learner's log-probs
are the policy's at the temperature alone, docs/training.md);
:meth:`GenerationEngine.generate_with_logprobs` returns the same tokens and the log-prob of each
under that distribution (None from an engine that computes none).
Engines are registered by name (:func:`register_engine`) and chosen by ``--generation-engine``:

- ``hf``: transformers' ``generate`` (:func:`textrl.models.sampling.sample`), the reference every
  other engine is tested against;
- ``static``: ``generate`` over a transformers ``StaticCache`` kept per shape, with bucketed shapes
  (:mod:`textrl.generation.static`);
- ``textrl`` (``auto`` on the CPU and CUDA): textrl's own decode loop (:mod:`textrl.generation.decode`):
  each distinct context prefilled once and its KV cache shared by its samples, the cache carried
  across a multi-turn rollout's turns (:mod:`textrl.generation.carry`), then a static KV cache and
  one decode step, sampling included, compiled and captured as a CUDA graph on CUDA
  (:mod:`textrl.generation.graph`; the cache :mod:`~textrl.generation.static_kv`, the step
  :mod:`~textrl.generation.step`).
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
from textrl.generation.static import StaticEngine

__all__ = ["ENGINES", "DecodeEngine", "GenerationEngine", "HFEngine", "Sampling", "StaticEngine", "engine_for", "engine_named", "engine_names",
           "get_engine", "register_engine"]
