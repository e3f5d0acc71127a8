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
full-weight load the worker's :class:`~textrl.generation.weight_sync.LoadWatch` report (the :class:`~textrl.generation.weight_sync.Fingerprint` of the tensors its
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
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from textrl.core.quiet import progress_bars
from textrl.generation.base import GenerationEngine, Sampling, register_engine
from textrl.generation.vllm.checks import check_lora_trainable, check_model, import_vllm
from textrl.generation.vllm.handover import (
    base_state_dict,
    lora_base,
    lora_of,
    reload_weights,
    write_model_folder,
)
from textrl.generation.vllm.launch import Launch, launch_of, launcher_group_kept
from textrl.generation.vllm.options import (
    EngineOptions,
    kv_cache_bytes,
    llm_options,
    model_length,
    sleeps,
)
from textrl.generation.vllm.sampling import (
    drawn_logprobs,
    prompt_token_ids,
    row_seeds,
    sampling_params,
    stack_outputs,
)
from textrl.generation.vllm_worker import quiet_rotary_reloads
from textrl.generation.weight_sync import Sent, WeightSync, buckets, check_taken
from textrl.models.adapters import save_adapter
from textrl.models.checks import context_length
from textrl.run.rng import keeping_rng


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



__all__ = ["VLLMEngine"]
