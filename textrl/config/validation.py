"""The checks of :class:`textrl.config.TrainConfig` that :meth:`~textrl.config.TrainConfig.validate`
runs before any model loads: each raises ``ValueError`` naming the field, its value and what is
allowed. :func:`check_types` runs first (before the agent is looked up), then :func:`check_fields`
runs the others in their order. The fields and their docstrings (the options' one home, the
``--help`` text) stay on ``TrainConfig``; ``config`` below is one.
"""

from __future__ import annotations

from typing import Any

from textrl.config.io import (
    OBJECT_FIELDS,
    check_at_least,
    check_bitsandbytes,
    check_choice,
    check_in_range,
    check_output_dir,
    check_positive,
    check_values,
    refuse_saved_object,
)
from textrl.config.reward_option import check_reward_shape

# What the checks compare against the engines, the precision and the mismatch corrections is imported
# where it runs: ``textrl.config`` (and ``textrl train --help``, built from it) loads without torch.

KL_KINDS = ("k1", "k2", "k3", "abs")

PARTIAL_ROLLOUTS = ("finish", "continue")
"""``partial_rollouts``: an episode in flight when the weights move on is finished with the weights it
started with (``finish``) or continues with the new ones (``continue``)."""


def check_types(config: Any) -> None:
    """Each field holds a value of its type (an object only where the Python API allows one, not
    one recorded in a config.yaml), and ``output_dir`` can be a run folder."""
    for name in OBJECT_FIELDS:
        refuse_saved_object(name, getattr(config, name))
    check_values(config, skip=OBJECT_FIELDS)
    check_output_dir(config.output_dir)


def check_fields(config: Any) -> None:
    """Every check but :func:`check_types`, in the order ``validate`` runs them."""
    _check_choices(config)
    _check_rollout_correction(config)
    _check_async(config)
    _check_counts(config)
    _check_vllm_engine(config)
    _check_task(config)
    _check_coefficients(config)
    _check_lora(config)
    _check_batches(config)
    _check_sharding(config)


def _check_choices(config: Any) -> None:
    """The fields that name one of a few choices, the precision fields and the reward's shape."""
    check_choice("kl_kind", config.kl_kind, KL_KINDS)
    check_choice("kl_in", config.kl_in, ("reward", "loss"))
    check_choice("kl_early_stop", config.kl_early_stop, ("none", "target", "beta_target"))
    check_choice("reward_placement", config.reward_placement, ("last", "uniform"))
    check_choice("loss_aggregation", config.loss_aggregation, ("token_mean", "seq_mean", "seq_mean_token_sum"))
    check_choice("lr_schedule", config.lr_schedule, ("constant", "cosine"))
    check_choice("critic_init", config.critic_init, ("policy", "reward_model"))
    check_choice("critic_type", config.critic_type, ("value_head", "lora"))
    from textrl.core.precision import check_memory_options, check_precision
    from textrl.generation.base import engine_named, run_engine_name

    engine_named(config.generation_engine)  # a registered generation engine, before any work
    _check_vllm_base(config, run_engine_name(config.generation_engine, config.vllm_server))  # servers only with vLLM
    check_choice("critic", config.critic, ("separate", "shared", "lora"))
    check_memory_options(config)
    check_choice("reward_nonfinite", config.reward_nonfinite, ("raise", "zero", "drop"))
    if config.env_timeout is not None:
        check_positive("env_timeout", config.env_timeout)
    check_choice("nonfinite_weights", config.nonfinite_weights, ("rollback", "stop"))
    check_choice("rollback_copy", config.rollback_copy, ("auto", "device", "host"))
    check_precision(config)
    check_reward_shape(config.reward, config.reward_weights)  # the names in a spec: when the run builds its env


def _check_async(config: Any) -> None:
    """``max_staleness`` >= 0; ``partial_rollouts`` and ``old_logprobs`` among their choices, and not
    asked where they change nothing."""
    if isinstance(config.max_staleness, bool) or not isinstance(config.max_staleness, int) or config.max_staleness < 0:
        raise ValueError(f"max_staleness={config.max_staleness!r}: the most updates a rollout's weights may lag "
                         "behind the learner's, an integer >= 0 (0: the synchronous loop)")
    check_choice("partial_rollouts", config.partial_rollouts, PARTIAL_ROLLOUTS)
    gap = config.max_weight_gap
    if gap is not None and (isinstance(gap, bool) or not isinstance(gap, (int, float)) or not gap >= 0):
        raise ValueError(f"max_weight_gap={gap!r}: the largest mean log-prob gap per token between the engine and "
                         "a prefill of its weights, a number >= 0 (0: no check; unset: the precision's bound)")
    check_choice("old_logprobs", config.old_logprobs, ("recompute", "engine"))
    if config.partial_rollouts == "continue" and config.max_staleness == 0:
        raise ValueError("partial_rollouts='continue' lets an episode in flight take newer weights, and with "
                         "max_staleness=0 no weights move during a rollout: set --max-staleness K >= 2, or drop it")
    if config.partial_rollouts == "continue" and config.max_staleness == 1:
        raise ValueError("partial_rollouts='continue' lets a turn take weights up to one update behind the "
                         "learner's (the newest published beside its update), and with max_staleness=1 every turn "
                         "is drawn with those already: it would change nothing; set --max-staleness K >= 2, or drop it")
    if config.old_logprobs == "engine" and config.rollout_correction != "none":
        raise ValueError(f"old_logprobs='engine' makes the engine's log-probs the ratio's denominator, so "
                         f"rollout_correction={config.rollout_correction!r} (the learner's against the engine's) would "
                         "weigh every token by 1: drop one of the two (--old-logprobs recompute keeps the correction)")


def _check_rollout_correction(config: Any) -> None:
    """The mismatch correction's kind, bounds only where the kind takes them, and a band that keeps something."""
    from textrl.functional.mismatch import MISMATCH_KINDS, mismatch_bounds

    kind, upper, lower = config.rollout_correction, config.rollout_correction_upper, config.rollout_correction_lower
    check_choice("rollout_correction", kind, MISMATCH_KINDS)
    for name, value in (("rollout_correction_upper", upper), ("rollout_correction_lower", lower)):
        if value is not None:
            check_positive(name, value)
    takes = mismatch_bounds(kind)
    if not takes and (upper is not None or lower is not None):
        raise ValueError("rollout_correction_upper / rollout_correction_lower are bounds of a correction, and "
                         "rollout_correction='none': choose --rollout-correction tis, mis, geo_mean or icepop, or drop them")
    if lower is not None and "lower" not in takes:
        raise ValueError(f"rollout_correction_lower={lower!r}: {kind} truncates from above only (its cap is "
                         "--rollout-correction-upper); drop --rollout-correction-lower")
    if "lower" in takes:
        hi = upper if upper is not None else takes["upper"]
        lo = lower if lower is not None else takes["lower"]
        lo = 1.0 / hi if lo is None else lo
        if lo > hi:
            raise ValueError(f"rollout_correction={kind!r} keeps ratios in [lower, upper] = [{lo:g}, {hi:g}], which is "
                             "empty: raise --rollout-correction-upper or lower --rollout-correction-lower")


def _check_counts(config: Any) -> None:
    """Iterations, sizes, cadences and lengths: whole numbers at least 1 (or 0 where 0 means off)."""
    for name in ("iterations", "prompts_per_iteration", "n_samples_per_prompt", "max_new_tokens",
                 "generation_batch_size", "forward_batch_size", "ppo_epochs", "num_minibatches",
                 "gradient_accumulation_steps", "warmup_sft_batch_size",
                 "kl_horizon", "keep_checkpoints", "lora_alpha", "max_nonfinite_updates", "reward_concurrency"):
        check_at_least(name, getattr(config, name), 1)
    for name in ("eval_size", "warmup_sft_steps", "eval_every", "checkpoint_every",
                 "ref_refresh_every", "lr_warmup_steps", "top_k"):
        check_at_least(name, getattr(config, name), 0)
    if config.lora_r is not None:
        check_at_least("lora_r", config.lora_r, 1)
    if config.max_prompt_length is not None:
        check_at_least("max_prompt_length", config.max_prompt_length, 1)
    if config.max_episode_tokens is not None:
        check_at_least("max_episode_tokens", config.max_episode_tokens, config.max_new_tokens)
    check_at_least("old_policy_refresh_every", config.old_policy_refresh_every, 1)


def _check_task(config: Any) -> None:
    """One source of episodes: an environment, or a dataset (not both)."""
    if config.env is not None and config.dataset is not None:
        raise ValueError(f"env={_shown(config.env)} and dataset={_shown(config.dataset)} are both set: an "
                         "environment carries its own rows; give --env, or --dataset (with --reward)")


def _check_coefficients(config: Any) -> None:
    """Rates, probabilities, clip ranges and loss weights in their ranges."""
    for name in ("gamma", "lam", "warmup_answer_accuracy"):
        check_in_range(name, getattr(config, name), 0.0, 1.0)
    check_in_range("top_p", config.top_p, 0.0, 1.0, low_open=True)
    for name in ("temperature", "actor_lr", "critic_lr", "warmup_sft_lr"):
        check_positive(name, getattr(config, name))
    for name in ("clip_eps", "value_clip_eps", "clip_eps_high"):
        if getattr(config, name) is not None:
            check_positive(name, getattr(config, name))
    if config.lam_critic is not None:
        check_in_range("lam_critic", config.lam_critic, 0.0, 1.0)
    for name, low in (("lam_length_alpha", 0.0), ("critic_warmup_iterations", 0), ("overlong_buffer", 0)):
        if getattr(config, name) is not None:
            check_at_least(name, getattr(config, name), low)
    if config.overlong_buffer is not None and config.max_episode_tokens is not None \
            and config.overlong_buffer > config.max_episode_tokens:
        raise ValueError(f"overlong_buffer={config.overlong_buffer}: must be <= max_episode_tokens="
                         f"{config.max_episode_tokens} (the budget it punishes the end of); lower it")
    if config.dual_clip is not None and not config.dual_clip > 1.0:
        raise ValueError(f"dual_clip={config.dual_clip!r}: must be > 1 (or None to disable)")
    for name in ("vf_coef", "entropy_coef", "kl_coef", "teacher_coef", "kl_target", "ratio_threshold", "max_grad_norm"):
        check_at_least(name, getattr(config, name), 0.0)


def _check_lora(config: Any) -> None:
    """LoRA's dropout and target modules; bitsandbytes for a 4-bit base."""
    check_in_range("lora_dropout", config.lora_dropout, 0.0, 1.0)
    if config.lora_dropout > 0:
        raise ValueError(f"lora_dropout={config.lora_dropout}: textrl train runs the policy in eval mode (PPO's ratio "
                         "must be exactly 1 before the first step), so LoRA dropout would act on no forward; drop "
                         "--lora-dropout (the sft and dpo stages take it)")
    if not config.lora_target_modules.strip():
        raise ValueError("lora_target_modules='': name at least one module (e.g. q_proj,v_proj), 'auto' or 'all-linear'")
    if config.load_in_4bit:
        check_bitsandbytes("load_in_4bit")


def _check_vllm_base(config: Any, engine: str) -> None:
    """No vLLM engine (in this process or served) over a bitsandbytes-quantised base (``load_in_4bit``, or
    a model object loaded in 4 or 8 bits): vLLM would hold the base in full precision, another policy
    than the learner's; refused before any model loads."""
    from textrl.generation.base import SERVED_ENGINE

    quantised = config.load_in_4bit or any(getattr(config.model, f"is_loaded_in_{bits}bit", False) for bits in (4, 8))
    if engine in ("vllm", SERVED_ENGINE) and quantised:
        flag = "--vllm-server" if engine == SERVED_ENGINE else "--generation-engine vllm"
        raise ValueError(f"{flag} with a 4-bit base (--load-in-4bit): vLLM holds the base in full precision (the "
                         "LoRA merged into it or sent beside it), the learner a bitsandbytes-quantised one, so the engine "
                         "would sample another policy, and textrl hands vLLM no quantised weights: drop --load-in-4bit, "
                         "or use --generation-engine textrl or hf")


VLLM_ENGINE_OPTIONS = ("vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_max_model_length",
                       "vllm_max_num_seqs", "vllm_quantization")
"""The colocated vLLM engine's options (``--generation-engine vllm``, docs/vllm.md, "Engine options")."""


def _check_vllm_engine(config: Any) -> None:
    """The colocated vLLM engine's options: set only where that engine runs (another would ignore
    them), in range, tensor parallelism on as many CUDA devices, and a ``vllm_max_model_length`` that
    holds what the settings already say a sequence reaches (the run's measured lengths are checked
    again when the engine is built: :func:`textrl.generation.vllm_engine.model_length`)."""
    from textrl.generation.base import SERVED_ENGINE, run_engine_name

    if not 0 < config.vllm_gpu_memory_utilization <= 1:
        raise ValueError(f"vllm_gpu_memory_utilization={config.vllm_gpu_memory_utilization}: a share of the GPU's memory, in (0, 1]")
    for name in ("vllm_tensor_parallel_size", "vllm_max_num_seqs", "vllm_max_model_length"):
        if getattr(config, name) is not None:
            check_at_least(name, getattr(config, name), 1)
    if config.vllm_quantization is not None and not config.vllm_quantization.strip():
        raise ValueError("vllm_quantization='': name one of vLLM's online methods (fp8_per_tensor, ...) or drop it")
    engine = run_engine_name(config.generation_engine, config.vllm_server)
    check_at_least("weight_sync_bucket_mb", config.weight_sync_bucket_mb, 1)
    if not config.is_default("weight_sync_bucket_mb") and engine not in ("vllm", SERVED_ENGINE):
        raise ValueError(f"weight_sync_bucket_mb={config.weight_sync_bucket_mb} sizes the weight hand-over of the vLLM "
                         f"engines, and this run generates with --generation-engine {engine}, which samples the policy's "
                         "weights in place: add --generation-engine vllm or --vllm-server URL, or drop it")
    given = [name for name in VLLM_ENGINE_OPTIONS if not config.is_default(name)]
    if given and engine != "vllm":
        runs, fix = (("vLLM servers (--vllm-server)", "a server takes vLLM's own options: textrl vllm-serve MODEL "
                      "--max-model-len N ...") if engine == SERVED_ENGINE
                     else (f"--generation-engine {engine}", "add --generation-engine vllm"))
        raise ValueError(f"{given[0]}={getattr(config, given[0])!r} is an option of the colocated vLLM engine, and this "
                         f"run generates with {runs}: {fix}, or drop it")
    if config.vllm_quantization is not None and config.max_weight_gap is None:
        raise ValueError(f"vllm_quantization={config.vllm_quantization!r}: vLLM samples from quantised weights, whose "
                         "log-probs part from the learner's by the quantization's error, which the weight check's "
                         "bound for the run's precision does not allow: set --max-weight-gap (the mean gap per token "
                         "it may reach; 0: no check)")
    _check_tensor_parallel(config.vllm_tensor_parallel_size, config.device)
    need = (config.max_prompt_length or 1) + (config.max_episode_tokens or config.max_new_tokens)
    if config.vllm_max_model_length is not None and config.vllm_max_model_length < need:
        says = f"max_prompt_length={config.max_prompt_length}" if config.max_prompt_length else "a prompt of 1 token"
        raise ValueError(f"vllm_max_model_length={config.vllm_max_model_length}: {says} plus an episode of "
                         f"{config.max_episode_tokens or config.max_new_tokens} tokens reach {need}; raise it to "
                         f"{need} or more, or leave it unset (what the run needs)")


def _check_tensor_parallel(size: int, device: str) -> None:
    """vLLM's tensor parallelism over ``size`` CUDA devices: refused on the CPU, or past the devices seen."""
    if size == 1:
        return
    import torch

    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    seen = torch.cuda.device_count() if cuda else 0
    if not cuda or seen < size:
        where = f"{seen} CUDA device{'s' if seen != 1 else ''}" if cuda else "the CPU"
        raise ValueError(f"vllm_tensor_parallel_size={size}: vLLM splits the policy over that many GPUs, and this run "
                         f"has {where}; lower it to {max(seen, 1)}")


def _check_batches(config: Any) -> None:
    """The rollout divides into minibatches, and each minibatch into micro-batches."""
    rollout = config.rollout_batch_size
    if rollout % config.num_minibatches:
        raise ValueError(
            f"num_minibatches={config.num_minibatches}: the rollout batch of {rollout} rows "
            f"(prompts_per_iteration={config.prompts_per_iteration} x n_samples_per_prompt="
            f"{config.n_samples_per_prompt}) does not divide into it; choose a divisor of {rollout}"
        )
    minibatch = rollout // config.num_minibatches
    tokens = config.microbatch_tokens
    if tokens is not None:
        check_at_least("microbatch_tokens", tokens, 1)
        if config.gradient_accumulation_steps != 1:
            raise ValueError(f"microbatch_tokens={tokens} splits each minibatch by tokens and gradient_accumulation_steps="
                             f"{config.gradient_accumulation_steps} by rows: give one of them")
    if minibatch % config.gradient_accumulation_steps:
        raise ValueError(
            f"gradient_accumulation_steps={config.gradient_accumulation_steps}: the minibatch of "
            f"{minibatch} rows does not divide into it; choose a divisor of {minibatch}"
        )


def _check_sharding(config: Any) -> None:
    """A ZeRO stage, float32 weights under DeepSpeed, one kind of sharding, and no 4-bit base with it."""
    check_choice("zero_stage", config.zero_stage, (0, 1, 2, 3))
    if config.zero_stage and config.dtype != "float32":
        raise ValueError(f"dtype={config.dtype!r} with zero_stage={config.zero_stage}: DeepSpeed's engine here keeps "
                         "float32 weights and master copies (bf16 comes from the autocast, --mixed-precision); "
                         "use --dtype float32")
    if config.zero_stage and config.fsdp:
        raise ValueError(f"zero_stage={config.zero_stage} and fsdp=True both shard the training state; "
                         "choose one (DeepSpeed ZeRO or FSDP)")
    sharded = config.sharding()
    if sharded and config.load_in_4bit:
        setting, flag = sharded
        raise ValueError(
            f"{setting} shards full-precision models; load_in_4bit keeps one 4-bit base per "
            f"process instead: drop {flag}, or drop --load-in-4bit"
        )


def _shown(value: Any) -> str:
    """A field's value for a message: a string as it is, an object by its type."""
    return repr(value) if isinstance(value, str) else f"a {type(value).__name__}"
