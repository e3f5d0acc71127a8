"""TRL option names and ours: one table drives the error message and docs/migrating-from-trl.md.

:data:`TRL_OPTIONS` maps an option of TRL's ``PPOConfig`` (the ``PPOTrainer`` config, both the
older one with ``ppo_epochs`` / ``init_kl_coef`` and the later one with ``num_ppo_epochs`` /
``kl_coef``) or ``GRPOConfig`` to the :class:`textrl.config.TrainConfig` field that does the same
job, or to none, with a note on the difference. An unknown option that is a TRL name (in YAML, in
``TrainConfig(**kwargs)``, on the command line) is answered with :func:`trl_hint`.
"""

from __future__ import annotations

TRL_OPTIONS: dict[str, tuple[str, str, str]] = {
    # name: (TRL config(s), our option or "" when we have none, note)
    "learning_rate": ("PPO, GRPO", "actor_lr", "the critic has its own critic_lr"),
    "cliprange": ("PPO", "clip_eps", "None takes the agent's default (0.2; one_step_ppo 0.1)"),
    "epsilon": ("GRPO", "clip_eps", ""),
    "epsilon_high": ("GRPO", "clip_eps_high", "DAPO's clip-higher: the upper clip 1 + clip_eps_high"),
    "cliprange_value": ("PPO", "value_clip_eps", "None = unclipped"),
    "vf_coef": ("PPO", "vf_coef", "same name"),
    "gamma": ("PPO", "gamma", "same name"),
    "lam": ("PPO", "lam", "same name"),
    "kl_coef": ("PPO", "kl_coef", "same name"),
    "init_kl_coef": ("PPO", "kl_coef", "the initial value of the adaptive controller"),
    "beta": ("GRPO", "kl_coef", "with --kl-in loss --kl-kind k3 for GRPO's placement"),
    "adap_kl_ctrl": ("PPO", "adaptive_kl", ""),
    "target": ("PPO", "kl_target", ""),
    "horizon": ("PPO", "kl_horizon", ""),
    "kl_penalty": ("PPO", "kl_kind", "kl -> k1, abs -> abs, mse -> k2; 'full' has no counterpart"),
    "kl_estimator": ("PPO", "kl_kind", "same values: k1, k3 (and k2, abs)"),
    "ppo_epochs": ("PPO", "ppo_epochs", "same name"),
    "num_ppo_epochs": ("PPO", "ppo_epochs", ""),
    "num_iterations": ("GRPO", "ppo_epochs", "passes over each rollout"),
    "num_mini_batches": ("PPO", "num_minibatches", ""),
    "mini_batch_size": ("PPO", "num_minibatches", "a count, not a size: num_minibatches = batch_size / mini_batch_size"),
    "batch_size": ("PPO", "prompts_per_iteration", "rows per rollout = prompts_per_iteration x n_samples_per_prompt"),
    "per_device_train_batch_size": ("PPO, GRPO", "prompts_per_iteration",
                                    "rows per rollout = prompts_per_iteration x n_samples_per_prompt"),
    "num_generations": ("GRPO", "n_samples_per_prompt", ""),
    "gradient_accumulation_steps": ("PPO, GRPO", "gradient_accumulation_steps",
                                    "same name; here it splits each minibatch, it does not enlarge it"),
    "max_grad_norm": ("PPO, GRPO", "max_grad_norm", "same name; 0 = off"),
    "whiten_rewards": ("PPO", "whiten_advantages", "we whiten the advantages, not the rewards"),
    "ratio_threshold": ("PPO", "ratio_threshold", "same name; 0 = off"),
    "early_stopping": ("PPO", "kl_early_stop", "'target' (1.5 x kl_target) or 'beta_target' (2 x)"),
    "target_kl": ("PPO", "kl_target", "with --kl-early-stop target"),
    "response_length": ("PPO", "max_new_tokens", ""),
    "max_completion_length": ("GRPO", "max_new_tokens", ""),
    "max_prompt_length": ("GRPO", "max_prompt_length", "same name"),
    "temperature": ("PPO, GRPO", "temperature", "same name"),
    "top_k": ("GRPO", "top_k", "same name; 0 = off"),
    "top_p": ("GRPO", "top_p", "same name"),
    "local_rollout_forward_batch_size": ("PPO", "forward_batch_size", ""),
    "generation_batch_size": ("GRPO", "generation_batch_size", "same name (rows per generate call)"),
    "total_episodes": ("PPO", "iterations", "episodes = iterations x prompts_per_iteration x n_samples_per_prompt"),
    "max_steps": ("PPO, GRPO", "iterations", "one iteration = one rollout and its updates"),
    "num_train_epochs": ("PPO, GRPO", "iterations", "we count rollouts, not passes over the prompt set"),
    "lr_scheduler_type": ("PPO, GRPO", "lr_schedule", "constant or cosine"),
    "warmup_steps": ("PPO, GRPO", "lr_warmup_steps", ""),
    "seed": ("PPO, GRPO", "seed", "same name"),
    "output_dir": ("PPO, GRPO", "output_dir", "same name"),
    "sft_model_path": ("PPO", "model", "a path, a hub id, or a PreTrainedModel (Python API)"),
    "reward_model_path": ("PPO", "reward_model", ""),
    "value_model_path": ("PPO", "critic_init", "'reward_model' starts the critic from --reward-model"),
    "model_adapter_name": ("PPO", "lora_r", "multi_adapter_ppo names its adapters itself"),
    "ref_adapter_name": ("PPO", "", "the reference is the base with adapters disabled"),
    "sync_ref_model": ("GRPO", "ref_refresh_every", "copy the policy into the reference every N iterations"),
    "ref_model_sync_steps": ("GRPO", "ref_refresh_every", ""),
    "loss_type": ("GRPO", "loss_aggregation", "grpo -> seq_mean, bnpo and dapo -> token_mean, dr_grpo -> "
                                              "seq_mean_token_sum (up to the constant 1 / max_completion_length)"),
    "scale_rewards": ("GRPO", "agent", "--agent grpo divides by the group std, --agent rloo does not"),
    "reward_funcs": ("GRPO", "reward", "a function, a list of functions and names, or a spec string name:weight,..."),
    "reward_weights": ("GRPO", "reward_weights", "same name: one weight per reward (or name:weight in the spec)"),
    "missing_eos_penalty": ("PPO", "reward", "a reward of the spec: --reward ...,missing_eos_penalty:WEIGHT"),
    "stop_token": ("PPO", "", "generation stops at the tokenizer's EOS"),
    "stop_token_id": ("PPO", "", "generation stops at the tokenizer's EOS"),
    "num_sample_generations": ("PPO", "eval_every", "held-out samples are written at each evaluation"),
    "logging_steps": ("PPO, GRPO", "", "every iteration is logged"),
    "save_steps": ("PPO, GRPO", "checkpoint_every", ""),
    "use_peft": ("PPO, GRPO", "lora_r", "a LoRA rank turns a policy LoRA on (agents that support it)"),
    "lora_r": ("PPO, GRPO", "lora_r", "same name"),
    "lora_alpha": ("PPO, GRPO", "lora_alpha", "same name"),
    "load_in_4bit": ("PPO, GRPO", "load_in_4bit", "same name"),
    "ds3_gather_for_generation": ("PPO, GRPO", "zero_stage", "ZeRO-3 always gathers the policy to generate"),
    "bf16": ("PPO, GRPO", "mixed_precision", "bf16=True is --mixed-precision bf16 (already the default on a CUDA "
                                             "device that has bf16: auto)"),
    "fp16": ("PPO, GRPO", "mixed_precision", "fp16 needs loss scaling, which textrl does not do: use bf16"),
    "torch_dtype": ("ModelConfig", "dtype", "float32 or bfloat16 (the trained weights' dtype)"),
    "dtype": ("ModelConfig", "dtype", "same name; float32 or bfloat16 ('auto' has no counterpart)"),
    "attn_implementation": ("ModelConfig", "attn_implementation", "same name: sdpa, eager, flash_attention_2"),
    "gradient_checkpointing": ("PPO, GRPO", "gradient_checkpointing", "same name: the policy's and the critic's layers"),
    "optim": ("PPO, GRPO", "optim", "same name: adamw_torch, adamw_bnb_8bit, adamw_anyprecision"),
    "use_vllm": ("GRPO", "vllm_server", "TRL's default vllm_mode is server: --vllm-server URL of a textrl vllm-serve "
                                        "server, which has no default (TRL's 0.0.0.0:8000 is http://localhost:8000); "
                                        "colocate is --generation-engine vllm"),
    "vllm_mode": ("GRPO", "generation_engine", "colocate -> --generation-engine vllm; server (TRL's default) -> "
                                               "--vllm-server URL[,URL...]"),
    "vllm_server_base_url": ("GRPO", "vllm_server", "the same URL, of a textrl vllm-serve server; several, "
                                                    "comma-separated, share the rollouts"),
    "vllm_server_host": ("GRPO", "vllm_server", "--vllm-server http://HOST:PORT (TRL's 0.0.0.0:8000 is "
                                                "http://localhost:8000)"),
    "vllm_server_port": ("GRPO", "vllm_server", "--vllm-server http://HOST:PORT (TRL's 0.0.0.0:8000 is "
                                                "http://localhost:8000)"),
    "vllm_gpu_memory_utilization": ("GRPO", "vllm_gpu_memory_utilization",
                                    "same name and default (0.3); colocated vLLM only (--generation-engine vllm)"),
    "vllm_tensor_parallel_size": ("GRPO", "vllm_tensor_parallel_size",
                                  "same name and default (1); colocated vLLM only, on as many GPUs"),
    "vllm_max_model_length": ("GRPO", "vllm_max_model_length", "same name; unset, what the run needs "
                                                               "(max_prompt_length + the episode's token budget)"),
    "vllm_enable_sleep_mode": ("GRPO", "", "colocated vLLM sleeps after each rollout on CUDA in the synchronous loop, "
                                           "never with --max-staleness (the learner runs beside it)"),
}
"""TRL option -> (the TRL config(s) that have it, our TrainConfig field or '', note)."""


def trl_hint(name: str) -> str | None:
    """What to write instead of TRL's option ``name`` (None when ``name`` is not a TRL option)."""
    entry = TRL_OPTIONS.get(name.replace("-", "_"))
    if entry is None:
        return None
    _, ours, note = entry
    if not ours:
        return f"{name} is TRL's option; textrl has no counterpart: {note}"
    return f"{name} is TRL's name: textrl calls it {ours}" + (f" ({note})" if note else "")


def markdown_table() -> str:
    """The table of docs/migrating-from-trl.md, one row per TRL option (a test keeps them equal)."""
    rows = ["| TRL option | in TRL's | textrl option | note |", "|---|---|---|---|"]
    for name, (where, ours, note) in TRL_OPTIONS.items():
        rows.append(f"| `{name}` | {where} | {f'`{ours}`' if ours else '-'} | {note} |")
    return "\n".join(rows) + "\n"


__all__ = ["TRL_OPTIONS", "markdown_table", "trl_hint"]
