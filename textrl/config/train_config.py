"""``textrl train``'s config: :class:`TrainConfig`, one flat dataclass (CleanRL's ``Args`` habit).

Every knob of every agent is a field here, documented where it is declared (the attribute
docstring is the ``--help`` text), checked by :meth:`TrainConfig.validate` before any model loads.
The fields ``textrl train`` and the stages (:class:`textrl.stages.common.StageConfig`) declare
alike live once in :class:`SharedFields`. The general machinery (flags from the fields, YAML in
and out, value checks) is :mod:`textrl.config.io`, the checks ``validate`` runs are
:mod:`textrl.config.validation`; the names users import from here
(:func:`build_config`, :func:`load_yaml`, :func:`save_config`, ...) stay importable from here.
Precedence: dataclass defaults < ``--config file.yaml`` < command-line flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from textrl.config.io import (
    OBJECT_FIELDS,
    ResumeRules,
    check_bitsandbytes,
    check_output_dir,
    check_value,
    check_values,
    config_values,
    config_yaml,
    copy_field,
    describe_object,
    field_docs,
    parse_value,
    save_config,
    with_trl_hints,
    yaml_value,
)
from textrl.config.io import add_config_arguments as _add_config_arguments
from textrl.config.io import add_trl_names as _add_trl_names
from textrl.config.io import build_config as _build_config
from textrl.config.io import load_yaml as _load_yaml
from textrl.config.validation import check_fields, check_types
from textrl.core.agent_registry import agent_class


@dataclass
class SharedFields:
    """The fields ``textrl train`` (:class:`TrainConfig`) and the stages
    (:class:`textrl.stages.common.StageConfig`) declare alike: one default, one help text. A config
    takes one with :func:`shared`. (Fields of the same name whose default, type or help differ,
    such as ``output_dir`` or ``lora_r``, are declared by each config.)"""

    device: str = "auto"
    """'auto' (CUDA when available, else CPU), 'cpu', 'cuda' or 'cuda:N'."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 = off)."""
    lora_alpha: int = 16
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_r)."""
    lora_target_modules: str = "auto"
    """Modules LoRA wraps: 'auto' (peft's choice for the architecture: c_attn on GPT-2, q_proj,v_proj
    on Llama / Qwen2; every linear layer but the head where peft has none), 'all-linear', or a
    comma list of module names (a list that matches no module is refused, naming the model's)."""
    progress: bool = True
    """Show a progress bar."""


def shared(name: str) -> Any:
    """Field ``name`` of :class:`SharedFields` for another config: ``device: str = shared("device")``."""
    return copy_field(SharedFields, name)


@dataclass
class TrainConfig:
    """Everything ``textrl train`` needs. Defaults are the embedded CPU demo."""

    # -- run ---------------------------------------------------------------------------------
    output_dir: str = "runs/textrl"
    """Where metrics.jsonl, TensorBoard events, plots, samples and checkpoints go."""
    seed: int = 0
    """Seed of every random generator (Python, NumPy, torch, prompt sampler)."""
    device: str = shared("device")
    dtype: str = "float32"
    """The trained weights' dtype: float32 | bfloat16 (TRL's dtype / torch_dtype). bfloat16 halves
    the weights' and AdamW's memory and trains in pure bf16."""
    mixed_precision: str = "auto"
    """Autocast of every forward: bf16 | no | auto (bf16 on a CUDA device that has it, else no; TRL's bf16)."""
    frozen_dtype: str = "auto"
    """The reference's and reward models' weights: float32 | bfloat16 | auto (bfloat16 on a CUDA
    device that has it, else the trained weights' dtype)."""
    optim: str = "adamw_torch"
    """Optimiser (TRL's optim): adamw_torch | adamw_bnb_8bit (8-bit states, float32 weights) |
    adamw_anyprecision (float32 states, Kahan-summed weights: the one for --dtype bfloat16)."""
    gradient_checkpointing: bool = False
    """Recompute each transformer layer in the backward instead of keeping its activations (the
    policy's and the critic's; TRL's gradient_checkpointing): less memory, ~1/3 more compute."""
    logprob_chunk_size: int | None = None
    """Response positions per chunk of the fused LM head + log-softmax (no [positions, vocabulary]
    logits held whole): None = auto (on CUDA 2^24 logits a chunk, off on the CPU), 0 = off."""
    padding_free: bool = False
    """The policy's, reference's and critic's forwards and backward, and the reward models' scores, on
    the real tokens only (TRL's padding_free): each micro-batch's rows packed end to end, positions
    restarting per row, attention within a row; the padded forwards' numbers to float32 rounding
    (docs/training.md, "Memory")."""
    attn_implementation: str | None = None
    """Attention kernels: sdpa | eager | flash_attention_2 (needs the flash-attn package and CUDA);
    None: the model's default (sdpa where the architecture has it)."""
    iterations: int = 500
    """Number of PPO iterations (rollout + update)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in output_dir (the data's rows may have been
    edited since, e.g. a bad row fixed, not added, removed or reordered)."""
    agent: str = "rloo"
    """Agent: a registered name (`textrl train --help` lists them) or path/to/file.py:Class."""

    # -- models and data -----------------------------------------------------------------------
    model: str = "tiny"
    """Policy: a local path or hub id of a causal LM; 'tiny' builds the offline tiny model (Python
    API: also a loaded PreTrainedModel)."""
    tokenizer: str | None = None
    """Tokenizer: a path or hub id (None: the model's own; Python API: also a tokenizer object)."""
    reward_model: str | None = None
    """Optional sequence-classification reward model (path, hub id or a vLLM server's URL), added as 'reward_model'."""
    teacher: str | None = None
    """On-policy distillation's teacher, a model (path or hub id) or a vLLM server's URL: each agent token's reward gets
    teacher_coef * (log teacher - log policy); alone without --reward (docs/rewards.md, "On-policy distillation")."""
    env: str | None = None
    """Environment: a registered id (`textrl envs` lists them), PATH.py:Class, reasoning_gym:TASK or
    textarena:ID (Python API: also an Environment); None: --dataset scored by --reward, or without
    a dataset the built-in digits task."""
    env_args: str | None = None
    """Settings of the environment's constructor, KEY=VALUE,... (values read as YAML scalars:
    'max_n=16,turn_cost=0.1'); `textrl envs` names each environment's settings."""
    reward: str | list | None = None
    """Reward spec: NAME[:weight],... from the registry, file.py:function or package.module.function.
    None: the environment's own (think_format,tag_count,accuracy for a --dataset); with --env it
    replaces the environment's final reward. Python API and YAML: also a reward function or a list of
    functions and names (TRL's reward_funcs)."""
    reward_weights: list | None = None
    """One weight per reward (TRL's reward_weights): per comma entry of --reward (1.0,0.5) or per
    list entry; None: 1 each, or the spec's own NAME:weight."""
    dataset: str | None = None
    """Prompts of a single-turn task (instead of --env): 'builtin:NAME', a .jsonl file (MiniMind
    'conversations' or {'prompt': ...}); Python API: also a datasets.Dataset or a list of rows."""
    eval_size: int = 32
    """Held-out prompts for evaluation."""
    max_prompt_length: int | None = None
    """Longest prompt in tokens (after the chat template); a longer one is refused, naming it. None:
    what the environment's prompts need, the longest of its rows (a seeded sample of a source over
    20000 rows, plus a quarter), bounded by the model's context minus max_new_tokens (prompts over
    the bound keep their last tokens; the run says so in one line)."""
    warmup_sft_steps: int = 200
    """Supervised warm-up steps on the built-in task's format before PPO (0 = none)."""
    warmup_sft_lr: float = 3e-3
    """Learning rate of the supervised warm-up."""
    warmup_sft_batch_size: int = 32
    """Batch size of the supervised warm-up."""
    warmup_answer_accuracy: float = 0.3
    """Share of warm-up examples that show the correct answer (the rest a random one)."""

    # -- generation ----------------------------------------------------------------------------
    prompts_per_iteration: int = 16
    """Distinct prompts sampled per iteration."""
    n_samples_per_prompt: int = 4
    """Responses sampled per prompt (rollout batch = prompts_per_iteration x this)."""
    max_new_tokens: int = 24
    """Length cap of a response (of each agent turn); a response that hits it is truncated."""
    max_episode_tokens: int | None = None
    """Cap of a multi-turn episode's tokens after the prompt, the agent's and the environment's
    (None: max_new_tokens per turn plus the environment's max_observation_tokens per observation,
    bounded so that the longest prompt plus the episode fits the model's context, said in one line).
    A multi-turn turn cut by max_new_tokens is still answered by the environment, flagged truncated."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are computed at the same temperature)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling (1.0 = off)."""
    generation_batch_size: int = 64
    """Micro-batch size of generation."""
    generation_engine: str = "auto"
    """hf (generate) | static (generate, static cache) | textrl (own decode loop) | vllm (vLLM in this
    process, docs/vllm.md) | auto (textrl on CPU/CUDA; vllm-server with --vllm-server)."""
    vllm_server: str | None = None
    """URL[,URL...] of vLLM servers (``textrl vllm-serve``) to sample from, the rollouts spread over them
    and the weights pushed to them after each update (None: generate in this process; docs/vllm.md)."""
    vllm_gpu_memory_utilization: float = 0.3
    """--generation-engine vllm on CUDA: the share of the GPU's memory vLLM takes (weights and KV cache)."""
    vllm_tensor_parallel_size: int = 1
    """--generation-engine vllm on CUDA: the GPUs vLLM splits the policy over (vLLM's tensor_parallel_size,
    TRL's name); 1 on the CPU."""
    vllm_max_model_length: int | None = None
    """--generation-engine vllm: the longest sequence vLLM holds, prompt plus episode (vLLM's max_model_len,
    TRL's name). None: what the run needs, max_prompt_length plus the episode's token budget; less is refused."""
    vllm_max_num_seqs: int | None = None
    """--generation-engine vllm: the most sequences vLLM decodes at once (vLLM's max_num_seqs; None: vLLM's
    default, 256 to 1024 by device); more rows of a call wait their turn."""
    vllm_quantization: str | None = None
    """--generation-engine vllm: vLLM's quantization of the policy's weights as it loads them (vLLM's
    quantization: an online method such as fp8_per_tensor; None: the run's dtype). Needs --max-weight-gap."""
    weight_sync_bucket_mb: int = 512
    """The vLLM engines (--generation-engine vllm, --vllm-server): the most MiB of weights moved or sent
    together when they are handed over (one bucket; time/weight_sync_s logs the seconds; docs/vllm.md)."""
    forward_batch_size: int = 64
    """Rows per micro-batch of the rollout-time log-prob / value forwards (the behaviour and reference
    log-probs, the values; microbatch_tokens replaces it there) and of the agent's own reward model (a
    reward adapter); a reward_model:PATH spec scores 32 rows a batch."""

    # -- PPO -----------------------------------------------------------------------------------
    ppo_epochs: int = 2
    """K: passes over the rollout per iteration."""
    num_minibatches: int = 2
    """Minibatches per epoch; the rollout batch must divide into them."""
    gradient_accumulation_steps: int = 1
    """Micro-batches accumulated per minibatch; the minibatch must divide into them."""
    microbatch_tokens: int | None = None
    """Micro-batches filled up to N real tokens each (prompt + response, padding left out; a longer
    row alone), as many on every process: the update's, instead of gradient_accumulation_steps equal
    row counts, and the rollout-time log-prob / value forwards', instead of forward_batch_size rows;
    the same gradient and numbers either way (docs/training.md, "Memory"). None: off."""
    clip_eps: float | None = None
    """PPO clip epsilon of the policy ratio (None = the agent's default: 0.2, one_step_ppo 0.1, gspo 3e-4,
    cispo none: no lower clip)."""
    clip_eps_high: float | None = None
    """Upper clip of the policy ratio, 1 + clip_eps_high (DAPO's clip-higher; None = the agent's
    default: symmetric, dapo/cispo/vapo 0.28, gspo 4e-4)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages (None = off)."""
    value_clip_eps: float | None = 0.2
    """Clip range of the value update around the old value (None = unclipped)."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    entropy_coef: float = 0.0
    """Entropy bonus: loss -= entropy_coef * H."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 0.95
    """GAE lambda."""
    lam_critic: float | None = None
    """GAE lambda of the critic's value targets (VAPO's decoupled GAE; None = the agent's default:
    lam, vapo 1.0)."""
    lam_length_alpha: float | None = None
    """Length-adaptive GAE lambda of the policy, 1 - 1/(alpha x response length) (VAPO; 0 = off,
    lam is used; None = the agent's default: off, vapo 0.05)."""
    critic_warmup_iterations: int | None = None
    """Train only the critic for the first N iterations, the policy does not move (VAPO's value
    pre-training; None = the agent's default: 0, vapo 5)."""
    dynamic_sampling: bool | None = None
    """dapo: leave out of the loss the groups whose rewards are all equal (DAPO's dynamic sampling,
    without re-sampling; None = the agent's default: on for dapo)."""
    overlong_buffer: int | None = None
    """dapo: soft overlong punishment over the last N tokens of the episode's token budget, from 0
    down to -1 added to the score (0 = off; None = the agent's default: a quarter of the budget)."""
    whiten_advantages: bool = True
    """Normalise advantages to mean 0, std 1 over valid tokens."""
    loss_aggregation: str = "token_mean"
    """token_mean | seq_mean | seq_mean_token_sum."""
    rollout_correction: str = "none"
    """Weigh the policy loss by rho_t = p_learner / p_engine of each token (rollout/training mismatch):
    none | tis (min(rho_t, cap)) | mis (the row's prod rho_t, or the row is rejected outside the bounds)
    | geo_mean (rows whose geometric-mean rho is outside the bounds rejected) | icepop (rho_t, or the
    token rejected outside the bounds). Rejected tokens leave the loss; needs the engine's log-probs."""
    rollout_correction_upper: float | None = None
    """tis's cap, the upper bound of mis, geo_mean and icepop (None = the kind's default: tis 2,
    mis 2, geo_mean 1.001, icepop 5)."""
    rollout_correction_lower: float | None = None
    """Lower bound of mis, geo_mean and icepop (None = the kind's default: 1 / upper, icepop 0.5)."""
    max_weight_gap: float | None = None
    """The check that the engine samples with the weights the actor claims: after every hand-over, the
    mean |log-prob| gap per token between the engine's log-probs of its own draws and a prefill of those
    weights (a few rows) may be at most this, else the run stops (None: the precision's bound, float32
    1e-3, bfloat16 2e-2; 0: no check; docs/training.md, "Does the engine have the learner's weights?")."""
    max_staleness: int = 0
    """Asynchronous RL: the actor draws the rollouts of the next iterations while the learner updates,
    rollout n from the weights of iteration max(0, n - K), never more than K updates old (0: the
    synchronous loop; docs/async.md)."""
    partial_rollouts: str = "finish"
    """With max_staleness > 0, a multi-turn episode in flight when the weights move on: 'finish' (with
    the weights it started with) or 'continue' (each turn with the next weights, at most the
    iteration's own; every token tagged with the weights that sampled it; refused on a single-turn env)."""
    old_logprobs: str = "recompute"
    """The PPO ratio's denominator: 'recompute' (the learner's prefill before the update, the proximal
    policy; with a rollout correction against the engine's log-probs, the decoupled objective) or
    'engine' (the engine's log-probs of the weights that drew the tokens: the bypass objective)."""
    kl_coef: float = 0.02
    """beta: initial KL coefficient."""
    teacher_coef: float = 1.0
    """With --teacher: the weight of the distillation reward teacher_coef * (log teacher - log policy) per token."""
    kl_kind: str = "k1"
    """KL estimator: k1 | k2 | k3 | abs."""
    kl_in: str = "reward"
    """Where the KL penalty goes: 'reward' (r_t = -beta * KL_t) or 'loss'."""
    adaptive_kl: bool = False
    """Adaptive KL coefficient (Ziegler et al. 2019) instead of a fixed one."""
    kl_target: float = 0.1
    """Target KL of the adaptive controller (and of the early stop / hinge)."""
    kl_horizon: int = 10000
    """Horizon of the adaptive controller, in samples."""
    kl_hinge: bool = False
    """Seed 000: penalise max(0, KL - kl_target) instead of KL (loss placement)."""
    kl_early_stop: str = "none"
    """Stop an iteration's updates when mean KL exceeds: none | target (1.5x) | beta_target (2x)."""
    reward_placement: str = "last"
    """Task score on the last valid token ('last') or spread as r/T ('uniform')."""
    ratio_threshold: float = 10.0
    """Zero a minibatch's policy loss when its mean ratio exceeds this (MA-RLHF; 0 = off)."""
    kl_after_update: bool = False
    """Log kl/after_update: KL(policy || ref) on the rollout re-evaluated after the update (one more policy forward per iteration)."""
    ref_refresh_every: int = 0
    """Copy the policy into the reference every N iterations (0 = never)."""
    old_policy_refresh_every: int = 1
    """one_step_ppo: refresh the old-policy snapshot every N iterations (MiniMind)."""
    actor_lr: float = 3e-4
    """Policy learning rate."""
    critic_lr: float = 1e-3
    """Critic learning rate."""
    lr_schedule: str = "constant"
    """constant | cosine (with warmup)."""
    lr_warmup_steps: int = 0
    """Optimiser steps of linear warmup."""
    max_grad_norm: float = shared("max_grad_norm")
    critic_init: str = "policy"
    """What a separate critic (--critic separate) starts from: a copy of the 'policy', or the
    'reward_model' (its body under a new value head)."""
    critic: str = "separate"
    """Where a fully fine-tuned policy's critic lives: 'separate' (a model of its own, critic_init), 'shared' (a
    value head on the policy's body, which the value loss trains too) or 'lora' (a LoRA adapter and
    a value head on a frozen copy of that body, in frozen_dtype)."""

    # -- multi-adapter PPO (one base, LoRA adapters) -------------------------------------------
    reward_adapter: str | None = None
    """multi_adapter_ppo: folder of a LoRA reward adapter + score head written by `textrl rm --lora`."""
    load_in_4bit: bool = False
    """Quantise the frozen base model to 4-bit NF4 with bitsandbytes (needs a LoRA policy: --lora-r)."""
    lora_r: int | None = None
    """LoRA rank of the trainable adapters (None: the agent's default, 8 for multi_adapter_ppo, every
    weight trained for the others; a rank trains a policy LoRA whose reference is the base)."""
    lora_alpha: int = shared("lora_alpha")
    lora_dropout: float = 0.0
    """Dropout inside LoRA layers: must stay 0 (textrl train runs the policy in eval mode, so PPO ratios are exactly
    1 before the first step, and refuses more); the sft and dpo stages take it."""
    lora_target_modules: str = shared("lora_target_modules")
    critic_type: str = "value_head"
    """What trains as the critic of a LoRA policy (--lora-r, multi_adapter_ppo): a 'value_head' on the
    policy adapter's hidden states (the head alone), or a critic 'lora' adapter of its own with its head."""

    # -- several processes ---------------------------------------------------------------------
    fsdp: bool = False
    """Shard every model, gradient and AdamW state over the processes (FSDP2; also on with an accelerate FSDP config)."""
    fsdp_reshard_after_forward: bool = True
    """FSDP: free each layer's gathered weights after its forward (least memory, as ZeRO-3); False
    keeps them until the backward (one all-gather fewer per layer, as ZeRO-2 / SHARD_GRAD_OP)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage (1: AdamW states, 2: + gradients, 3: + weights partitioned over the
    processes; 0 = no DeepSpeed). Also set by an accelerate DeepSpeed config. Needs textrl[deepspeed]."""
    deepspeed_config: str = ""
    """A DeepSpeed JSON config whose zero_optimization section is used (its stage unless --zero-stage is given)."""

    # -- numerical faults ----------------------------------------------------------------------
    reward_nonfinite: str = "raise"
    """A NaN/inf task reward: 'raise' (default), 'zero' (score 0) or 'drop' (row left out); counted."""
    env_timeout: float | None = None
    """Seconds an environment's start(), step() or final reward call may run before it is stopped
    with an error naming the environment and the row (None: no limit). Either way a call running
    for a minute is named on stderr."""
    reward_concurrency: int = 8
    """Reward calls in flight at once for an async or does_io reward, scored in the background while generation
    goes on (docs/rewards.md, "Asynchronous rewards"); other rewards are scored in the loop."""
    max_nonfinite_updates: int = 3
    """Stop (with a checkpoint of the last good state) after this many consecutive skipped updates."""
    nonfinite_weights: str = "rollback"
    """An update whose steps leave NaN/inf weights: 'rollback' (restore the weights, optimiser and
    scheduler states from before it and count one skipped update; costs a copy of the trained
    weights and optimiser state per iteration, see rollback_copy) or 'stop' (no copy: stop at
    once, no checkpoint)."""
    rollback_copy: str = "auto"
    """Where nonfinite_weights='rollback' keeps its copy: 'device' (the run's device), 'host'
    (CPU memory; on CUDA pinned and filled asynchronously) or 'auto' (CUDA: the device when the
    copy takes at most a tenth of its memory, else host; CPU: host)."""

    # -- logging, evaluation, checkpoints ------------------------------------------------------
    eval_every: int = 50
    """Held-out evaluation (greedy and sampled) every N iterations (0 = only before/after)."""
    checkpoint_every: int = 50
    """Checkpoint every N iterations (and at the end; 0 = only at the end)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept on disk."""
    progress: bool = shared("progress")

    RESUME_RULES: ClassVar[ResumeRules] = ResumeRules(
        # how long and how hard it trains from here, cadences, micro-batching, sharding (full tensors: docs/parallelism.md), faults
        applied=frozenset({
            "device", "iterations", "generation_batch_size", "forward_batch_size", "ppo_epochs",
            "num_minibatches", "gradient_accumulation_steps", "microbatch_tokens", "clip_eps", "clip_eps_high", "dual_clip", "value_clip_eps",
            "vf_coef", "entropy_coef", "kl_coef", "teacher_coef", "kl_target", "kl_horizon", "kl_early_stop", "ratio_threshold",
            "kl_after_update", "ref_refresh_every", "old_policy_refresh_every", "actor_lr", "critic_lr",
            "lr_schedule", "lr_warmup_steps", "max_grad_norm", "fsdp", "fsdp_reshard_after_forward", "zero_stage",
            "deepspeed_config", "reward_nonfinite", "env_timeout", "reward_concurrency", "max_nonfinite_updates", "nonfinite_weights", "rollback_copy",
            "mixed_precision", "attn_implementation", "eval_every", "frozen_dtype", "gradient_checkpointing", "logprob_chunk_size",
            "padding_free",
            "generation_engine", "vllm_server", "vllm_gpu_memory_utilization",  # the same distribution either way (docs/generation.md)
            "vllm_tensor_parallel_size", "vllm_max_model_length", "vllm_max_num_seqs",  # the engine's capacity
            "vllm_quantization",  # the engine's numerics: its gap to the learner is measured and checked either way
            "weight_sync_bucket_mb",  # how the same weights travel to the engine
            "max_weight_gap",  # the weight check's bound: a check, not the run's arithmetic
            "checkpoint_every", "keep_checkpoints",
            "load_in_4bit",  # the frozen base's quantisation: the trained LoRA weights carry over
        }),
        # the models, the data and its split, the task and the sampling distribution, the objective
        fixed=frozenset({
            "seed", "agent", "model", "dtype", "tokenizer", "reward_model", "teacher", "env", "env_args", "reward", "reward_weights", "dataset",
            "eval_size", "max_episode_tokens",
            "max_prompt_length", "warmup_sft_steps", "warmup_sft_lr", "warmup_sft_batch_size",
            "warmup_answer_accuracy", "prompts_per_iteration", "n_samples_per_prompt", "max_new_tokens",
            "temperature", "top_k", "top_p", "gamma", "lam", "whiten_advantages", "loss_aggregation",
            "rollout_correction", "rollout_correction_upper", "rollout_correction_lower",
            "max_staleness", "partial_rollouts", "old_logprobs",
            "kl_kind", "kl_in", "adaptive_kl", "kl_hinge", "reward_placement", "critic_init",
            "lam_critic", "lam_length_alpha", "critic_warmup_iterations", "dynamic_sampling", "overlong_buffer",
            "reward_adapter", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
            "critic_type", "critic", "optim",
        }),
    )
    """What ``--resume`` may change (docs/reliability.md, "Resuming with other settings")."""

    def validate(self, agent: type | None = None) -> TrainConfig:
        """Check every field, then the agent's own rules (``agent.validate_config``: what it needs
        and which options it reads); raise ``ValueError`` naming the field, its value and what is
        allowed. ``agent`` defaults to the class ``self.agent`` names."""
        check_types(self)
        agent = agent if agent is not None else agent_class(self.agent)
        check_fields(self)  # textrl.config.validation
        agent.validate_config(self)
        return self

    def sharding(self) -> tuple[str, str] | None:
        """``(setting, flag)`` of the sharding asked for (``("fsdp=True", "--fsdp")`` or
        ``("zero_stage=N", "--zero-stage")``) for messages that refuse it; None without sharding."""
        if self.fsdp:
            return "fsdp=True", "--fsdp"
        if self.zero_stage:
            return f"zero_stage={self.zero_stage}", "--zero-stage"
        return None

    def is_default(self, name: str) -> bool:
        """Whether field ``name`` holds its default value (an option left unset), or a former
        default that a config.yaml of an earlier textrl holds (:data:`FORMER_DEFAULTS`)."""
        value = getattr(self, name)
        return value == _DEFAULTS[name] or value in FORMER_DEFAULTS.get(name, ())

    def rollout_correction_bounds(self) -> dict[str, float]:
        """The keyword bounds of :func:`textrl.functional.mismatch_weights` for ``rollout_correction``:
        ``{"cap": upper}`` for tis, ``{"upper": ..., "lower": ...}`` for the others, the unset ones
        left out (the kind's defaults)."""
        if self.rollout_correction == "tis":
            given = {"cap": self.rollout_correction_upper}
        else:
            given = {"upper": self.rollout_correction_upper, "lower": self.rollout_correction_lower}
        return {name: value for name, value in given.items() if value is not None}

    @property
    def rollout_batch_size(self) -> int:
        """Rows per rollout: prompts_per_iteration x n_samples_per_prompt."""
        return self.prompts_per_iteration * self.n_samples_per_prompt

    def to_dict(self) -> dict[str, Any]:
        """Field -> value (objects given to the Python API as they are, not copied)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


_DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}
FORMER_DEFAULTS: dict[str, tuple[Any, ...]] = {"lora_target_modules": ("q_proj,k_proj,v_proj,o_proj",)}
"""Defaults of earlier releases, still an option left unset where an agent does not read it (a
LoRA run that holds one still means exactly that list)."""

with_trl_hints(TrainConfig)

AGENT_OPTIONS = frozenset({
    "ppo_epochs", "num_minibatches", "gradient_accumulation_steps", "clip_eps", "clip_eps_high", "dual_clip",
    "value_clip_eps", "lam_critic", "lam_length_alpha", "critic_warmup_iterations", "dynamic_sampling",
    "overlong_buffer", "vf_coef", "entropy_coef", "gamma", "lam", "whiten_advantages",
    "loss_aggregation", "rollout_correction", "rollout_correction_upper", "rollout_correction_lower",
    "kl_coef", "kl_kind", "kl_in", "adaptive_kl", "kl_target", "kl_horizon", "kl_hinge", "kl_early_stop", "reward_placement", "ratio_threshold", "kl_after_update",
    "ref_refresh_every", "old_policy_refresh_every", "actor_lr", "critic_lr", "lr_schedule",
    "lr_warmup_steps", "max_grad_norm", "critic_init", "reward_adapter", "load_in_4bit", "lora_r",
    "lora_alpha", "lora_target_modules", "critic_type", "critic", "teacher", "teacher_coef",
})
"""The fields an agent reads (the algorithm's options); each agent declares the ones it reads
(``options``), and one it does not read, set to another value than its default, is refused."""


# -- the config machinery (textrl.config.io) for TrainConfig by default -------------------------------


def add_config_arguments(parser: argparse.ArgumentParser, cls: type = TrainConfig) -> None:
    """One ``--field-name`` / ``--field_name`` option per field of ``cls``
    (:func:`textrl.config.io.add_config_arguments`)."""
    _add_config_arguments(parser, cls)


def add_trl_names(parser: argparse.ArgumentParser, cls: type = TrainConfig) -> None:
    """Hidden options for the TRL option names ``cls`` lacks (:func:`textrl.config.io.add_trl_names`)."""
    _add_trl_names(parser, cls)


def load_yaml(path: str | Path, cls: type = TrainConfig) -> dict[str, Any]:
    """The field -> value mapping of a YAML file for ``cls`` (:func:`textrl.config.io.load_yaml`)."""
    return _load_yaml(path, cls)


def build_config(namespace: argparse.Namespace, cls: type = TrainConfig) -> Any:
    """Defaults, then ``--config``'s YAML file, then explicit flags (:func:`textrl.config.io.build_config`)."""
    return _build_config(namespace, cls)


__all__ = [
    "AGENT_OPTIONS",
    "FORMER_DEFAULTS",
    "OBJECT_FIELDS",
    "ResumeRules",
    "SharedFields",
    "TrainConfig",
    "add_config_arguments",
    "add_trl_names",
    "build_config",
    "check_bitsandbytes",
    "check_output_dir",
    "check_value",
    "check_values",
    "config_values",
    "config_yaml",
    "describe_object",
    "field",
    "field_docs",
    "load_yaml",
    "parse_value",
    "save_config",
    "shared",
    "yaml_value",
]
