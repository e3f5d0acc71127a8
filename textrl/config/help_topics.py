"""The topics ``--help`` groups the options of ``textrl train`` and the stages under: the one place
each config field is given its topic (``tests/test_help_topics.py`` checks that every field of
:class:`textrl.config.TrainConfig` and :class:`textrl.stages.common.StageConfig` has one)."""

from __future__ import annotations

TOPICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "model": (
        "The policy (and the supervised format warm-up before RL), its tokenizer, a reward model, LoRA adapters.",
        ("model", "tokenizer", "reward_model", "reward_adapter", "adapter", "base_model", "lora", "lora_r", "lora_alpha", "lora_dropout",
         "lora_target_modules", "warmup_sft_steps", "warmup_sft_lr", "warmup_sft_batch_size",
         "warmup_answer_accuracy"),
    ),
    "environment and reward": (
        "What the agent acts in and is scored by: the environment or a prompt file, the rewards (a teacher's among "
        "them: on-policy distillation), the held-out "
        "prompts and the lengths of prompts and episodes.",
        ("env", "env_args", "reward", "reward_weights", "dataset", "data", "format", "sft_data", "preference_data",
         "prompts", "eval_size", "rm_eval_size", "max_prompt_length", "max_episode_tokens", "max_length",
         "sft_max_length", "rm_max_length", "reward_placement", "reward_nonfinite", "env_timeout",
         "reward_concurrency", "teacher", "teacher_coef"),
    ),
    "agent": (
        "The algorithm: the agent and its losses, advantages, KL control and learning rates. Three options "
        "shape the critic of the agents that have one, each for another case: --critic, where a fully "
        "fine-tuned policy's critic lives (a model of its own, a head on the policy's body, a LoRA on a frozen "
        "copy); --critic-init, what that separate critic starts from (the policy or the reward model); "
        "--critic-type, what trains as the critic of a LoRA policy (a value head, or a critic adapter too).",
        ("agent", "ppo_epochs", "num_minibatches", "gradient_accumulation_steps", "clip_eps", "clip_eps_high",
         "dual_clip", "value_clip_eps", "vf_coef", "entropy_coef", "gamma", "lam", "lam_critic", "lam_length_alpha",
         "critic_warmup_iterations", "dynamic_sampling", "overlong_buffer", "whiten_advantages", "loss_aggregation",
         "rollout_correction", "rollout_correction_upper", "rollout_correction_lower", "old_logprobs", "kl_coef",
         "kl_kind", "kl_in", "adaptive_kl", "kl_target", "kl_horizon", "kl_hinge", "kl_early_stop",
         "ratio_threshold", "kl_after_update", "ref_refresh_every", "old_policy_refresh_every", "actor_lr",
         "critic_lr", "lr_schedule", "lr_warmup_steps", "max_grad_norm", "critic", "critic_init", "critic_type",
         "steps", "batch_size", "lr", "beta", "sft_steps", "sft_lr", "rm_steps", "rm_lr", "ppo_iterations"),
    ),
    "sampling": (
        "The rollouts: how many prompts and samples an iteration draws, how long and with which warping.",
        ("prompts_per_iteration", "n_samples_per_prompt", "max_new_tokens", "temperature", "top_k", "top_p"),
    ),
    "memory and precision": (
        "Weights' dtypes, autocast, attention, optimiser state, activation checkpointing and the batch sizes "
        "of the forwards and of generation (docs/training.md, \"Memory\").",
        ("dtype", "mixed_precision", "frozen_dtype", "attn_implementation", "optim", "gradient_checkpointing",
         "logprob_chunk_size", "padding_free", "microbatch_tokens", "forward_batch_size", "generation_batch_size", "load_in_4bit"),
    ),
    "engine": (
        "What generates the rollouts (docs/generation.md, docs/vllm.md) and, with --max-staleness, an actor "
        "drawing them beside the learner (docs/async.md).",
        ("generation_engine", "vllm_server", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
         "vllm_max_model_length", "vllm_max_num_seqs", "vllm_quantization", "weight_sync_bucket_mb", "max_staleness",
         "partial_rollouts", "max_weight_gap"),
    ),
    "run and checkpoints": (
        "Where the run writes, its length, seed and device, evaluations, checkpoints and resume, and what a "
        "NaN/inf does (docs/reliability.md).",
        ("output_dir", "seed", "device", "iterations", "resume", "eval_every", "checkpoint_every",
         "keep_checkpoints", "progress", "max_nonfinite_updates", "nonfinite_weights", "rollback_copy"),
    ),
    "parallel": (
        "Several processes (accelerate launch / torchrun): FSDP sharding or DeepSpeed ZeRO; CPU threads "
        "(docs/parallelism.md).",
        ("fsdp", "fsdp_reshard_after_forward", "zero_stage", "deepspeed_config", "threads"),
    ),
}
"""Topic -> (its description under the heading, the config fields it holds), in the order ``--help``
prints them (the topics, and the options under each)."""

FIELD_TOPIC: dict[str, str] = {name: topic for topic, (_, names) in TOPICS.items() for name in names}
"""Config field -> its topic."""


def topic_of(name: str) -> str | None:
    """The topic of config field ``name``; None for a field no topic holds."""
    return FIELD_TOPIC.get(name)


__all__ = ["FIELD_TOPIC", "TOPICS", "topic_of"]
