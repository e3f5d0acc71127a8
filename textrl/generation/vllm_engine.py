"""The ``vllm`` engine's names where users import them: vLLM in the training process
(:class:`~textrl.generation.vllm.colocated.VLLMEngine`). Each lives in the module of its concern
under :mod:`textrl.generation.vllm`: ``colocated`` (the engine), ``checks`` (vLLM installed, a policy
it can run), ``handover`` (the weights vLLM takes), ``options`` (vLLM's options, lengths, sleep),
``launch`` (the training processes), ``sampling`` (requests and rows); the weights' fingerprints in
:mod:`textrl.generation.weight_sync`."""

from __future__ import annotations

from textrl.generation.vllm.checks import (
    CPU_MIN_HEAD_SIZE,
    VLLM_INSTALL,
    VLLMMissing,
    check_lora_trainable,
    check_model,
    head_size,
    import_vllm,
)
from textrl.generation.vllm.colocated import VLLMEngine
from textrl.generation.vllm.handover import (
    base_state_dict,
    is_lora_name,
    lora_base,
    lora_of,
    merged_state_dict,
    reload_weights,
    write_model_folder,
)
from textrl.generation.vllm.launch import Launch, check_processes, launch_of, launcher_group_kept
from textrl.generation.vllm.options import (
    CPU_NO_CHUNKED_PREFILL,
    CPU_STEP_TOKENS,
    EngineOptions,
    kv_cache_bytes,
    llm_options,
    model_length,
    run_bucket_bytes,
    sleeps,
)
from textrl.generation.vllm.sampling import (
    drawn_logprobs,
    prompt_token_ids,
    row_seeds,
    sampling_params,
    stack_outputs,
)
from textrl.generation.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    Fingerprint,
    LoadWatch,
    WeightFingerprintError,
    check_taken,
    fingerprint,
)

__all__ = ["CPU_MIN_HEAD_SIZE", "CPU_NO_CHUNKED_PREFILL", "CPU_STEP_TOKENS", "DEFAULT_BUCKET_BYTES", "EngineOptions",
           "Fingerprint", "Launch", "LoadWatch", "VLLMEngine", "VLLMMissing", "VLLM_INSTALL", "WeightFingerprintError",
           "base_state_dict", "check_lora_trainable", "check_model", "check_processes", "check_taken", "drawn_logprobs",
           "fingerprint", "head_size", "import_vllm", "is_lora_name", "kv_cache_bytes", "launch_of",
           "launcher_group_kept", "llm_options", "lora_base", "lora_of", "merged_state_dict", "model_length",
           "prompt_token_ids", "reload_weights", "row_seeds", "run_bucket_bytes", "sampling_params", "sleeps",
           "stack_outputs", "write_model_folder"]
