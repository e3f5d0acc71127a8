"""``textrl.generation.vllm_server`` and ``textrl.generation.vllm_engine``, the paths users import the
vLLM engines' names by, name the objects of the modules under ``textrl.generation.vllm`` (no vLLM
needed), and a budget set through ``vllm_server`` is the one the served engine reads."""

from __future__ import annotations

import importlib

import pytest

from textrl.generation import vllm_engine, vllm_server

SERVER_NAMES = (
    "ABANDON_WAIT_S BACKOFF_S CLAIMS COMPLETION_FLOOR_S Claims DROPPED_VERSION ESSENTIALS HEALTH_EVERY_S HEALTH_MISSES "
    "HEALTH_TIMEOUT_S HTTPClient IN_FLIGHT Job LEASE_S LeaseBook PROBE_TIMEOUT_S RENEW_EVERY_S REQUEST_TIMEOUT_S RETRIES "
    "SECONDS_PER_TOKEN SERVE_HINT Server ServerBusy ServerDown ServerRefused TRANSFER_TIMEOUT_S TRANSIENT_STATUS "
    "VLLMServerEngine WEIGHT_ROUTES busy_message check_servers choice_rows claim_all completion_budget completion_request "
    "cpu_prefill_options describe error_detail exchange failure_reason first_difference first_server free_port "
    "model_essentials on_thread own_address release_servers requested_tokens run_id say serve_command server_urls "
    "trained_essentials world_rank").split()
"""The public names of ``vllm_server`` when it was one module."""

ENGINE_NAMES = (
    "CPU_MIN_HEAD_SIZE CPU_NO_CHUNKED_PREFILL CPU_STEP_TOKENS DEFAULT_BUCKET_BYTES EngineOptions Fingerprint Launch "
    "LoadWatch VLLMEngine VLLMMissing VLLM_INSTALL WeightFingerprintError base_state_dict check_lora_trainable "
    "check_model check_processes check_taken drawn_logprobs fingerprint head_size import_vllm is_lora_name "
    "kv_cache_bytes launch_of launcher_group_kept llm_options lora_base lora_of merged_state_dict model_length "
    "prompt_token_ids reload_weights row_seeds run_bucket_bytes sampling_params sleeps stack_outputs "
    "write_model_folder").split()
"""The public names of ``vllm_engine`` when it was one module."""


@pytest.mark.parametrize("module, names", [(vllm_server, SERVER_NAMES), (vllm_engine, ENGINE_NAMES)],
                         ids=["vllm_server", "vllm_engine"])
def test_each_former_name_is_its_homes_object(module, names):
    assert sorted(module.__all__) == sorted(names)
    for name in names:
        value = getattr(module, name)
        home = getattr(value, "__module__", None)
        if home and home.startswith("textrl.generation.vllm.") and not isinstance(value, (int, float, str, tuple)):
            assert getattr(importlib.import_module(home), name) is value, name


def test_the_engines_register_from_their_homes():
    from textrl.generation import get_engine

    assert type(get_engine("vllm")) is vllm_engine.VLLMEngine
    assert type(get_engine("vllm-server")) is vllm_server.VLLMServerEngine
    assert vllm_engine.VLLMEngine.__module__ == "textrl.generation.vllm.colocated"
    assert vllm_server.VLLMServerEngine.__module__ == "textrl.generation.vllm.served"
