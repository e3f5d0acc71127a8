"""Dataclass configs with attribute docstrings, YAML loading and command-line overrides.

One flat :class:`TrainConfig` drives ``textrl train`` (CleanRL's ``Args`` habit): every knob of
every PPO variant in the seeds is a field here, documented where it is declared, validated by
:meth:`TrainConfig.validate` before any model loads. The command line is built from the fields
(``--max-new-tokens`` and ``--max_new_tokens`` both work); help text comes from the attribute
docstrings. Precedence: dataclass defaults < ``--config file.yaml`` < command-line flags.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import math
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import yaml

from textrl.agent_registry import agent_class
from textrl.precision import check_precision
from textrl.reward_option import check_reward_shape, refuse_recorded_callable, reward_record
from textrl.trl_names import trl_hint

KL_KINDS = ("k1", "k2", "k3", "abs")


@dataclass(frozen=True)
class ResumeRules:
    """What ``--resume`` may change, for one config class (:mod:`textrl.run.resume` applies it).
    A field not in ``applied`` or ``invocation`` is fixed: a change is refused."""

    applied: frozenset[str]
    """Fields that take effect from the resumed iteration on; a change is applied, logged and
    recorded in ``resumes.jsonl``."""
    fixed: frozenset[str] | None = None
    """Fields that define the run (the checkpoint's weights, data position or objective depend on
    them), listed to make every field a decision (:meth:`check_covers`); None: every field not
    applied or invocation."""
    invocation: frozenset[str] = frozenset({"output_dir", "resume", "progress"})
    """Fields about this command only (where, whether resuming, the progress bar); not compared."""

    def check_covers(self, cls: type) -> None:
        """``ValueError`` unless ``fixed``, ``applied`` and ``invocation`` partition ``cls``'s fields."""
        fixed = self.fixed or frozenset()
        names = {f.name for f in fields(cls)}
        listed = fixed | self.applied | self.invocation
        twice = (fixed & self.applied) | ((fixed | self.applied) & self.invocation)
        if names != listed or twice:
            raise ValueError(f"{cls.__name__}.RESUME_RULES: not classified {sorted(names - listed)}, "
                             f"in two sets {sorted(twice)}, not fields {sorted(listed - names)}")


@dataclass
class TrainConfig:
    """Everything ``textrl train`` needs. Defaults are the embedded CPU demo."""

    # -- run ---------------------------------------------------------------------------------
    output_dir: str = "runs/textrl"
    """Where metrics.jsonl, TensorBoard events, plots, samples and checkpoints go."""
    seed: int = 0
    """Seed of every random generator (Python, NumPy, torch, prompt sampler)."""
    device: str = "auto"
    """'auto' (CUDA when available, else CPU), 'cpu', 'cuda' or 'cuda:N'."""
    dtype: str = "float32"
    """The trained weights' dtype: float32 | bfloat16 (TRL's dtype / torch_dtype). bfloat16 halves
    the weights' and AdamW's memory and trains in pure bf16."""
    mixed_precision: str = "auto"
    """Autocast of every forward: bf16 | no | auto (bf16 on a CUDA device that has it, else no;
    TRL's bf16=True)."""
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
    """Optional sequence-classification reward model (path or hub id), added as 'reward_model'."""
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
    forward_batch_size: int = 64
    """Micro-batch size of the log-prob / value / reward forwards."""

    # -- PPO -----------------------------------------------------------------------------------
    ppo_epochs: int = 2
    """K: passes over the rollout per iteration."""
    num_minibatches: int = 2
    """Minibatches per epoch; the rollout batch must divide into them."""
    gradient_accumulation_steps: int = 1
    """Micro-batches accumulated per minibatch; the minibatch must divide into them."""
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
    kl_coef: float = 0.02
    """beta: initial KL coefficient."""
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
    """Task score on the last valid token ('last') or spread as r/T ('uniform', seed 000)."""
    ratio_threshold: float = 10.0
    """Zero a minibatch's policy loss when its mean ratio exceeds this (MA-RLHF; 0 = off)."""
    kl_after_update: bool = False
    """Log kl/after_update: KL(policy || ref) on the rollout re-evaluated after the update (one more policy forward per iteration)."""
    ref_refresh_every: int = 0
    """Copy the policy into the reference every N iterations (seed 000; 0 = never)."""
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
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 = off)."""
    critic_init: str = "policy"
    """Initialise the critic from the 'policy' or the 'reward_model'."""

    # -- multi-adapter PPO (one base, LoRA adapters) -------------------------------------------
    reward_adapter: str | None = None
    """multi_adapter_ppo: folder of a LoRA reward adapter + score head written by `textrl rm --lora`."""
    load_in_4bit: bool = False
    """Quantise the frozen base model to 4-bit NF4 with bitsandbytes (needs a LoRA policy: --lora-r)."""
    lora_r: int | None = None
    """LoRA rank of the trainable adapters (None: the agent's default, 8 for multi_adapter_ppo, every
    weight trained for the others; a rank trains a policy LoRA whose reference is the base)."""
    lora_alpha: int = 16
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_r)."""
    lora_dropout: float = 0.0
    """Dropout inside LoRA layers (kept at 0 so PPO ratios are exactly 1 before the first step)."""
    lora_target_modules: str = "auto"
    """Modules LoRA wraps: 'auto' (peft's choice for the architecture: c_attn on GPT-2, q_proj,v_proj
    on Llama / Qwen2; every linear layer but the head where peft has none), 'all-linear', or a
    comma list of module names (a list that matches no module is refused, naming the model's)."""
    critic_type: str = "value_head"
    """multi_adapter_ppo critic: 'value_head' on the policy's hidden states, or a separate 'lora' adapter."""

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
    progress: bool = True
    """Show a progress bar."""

    RESUME_RULES: ClassVar[ResumeRules] = ResumeRules(
        # how long and how hard it trains from here, cadences, micro-batching, sharding (checkpoints
        # hold full tensors: docs/parallelism.md), fault handling
        applied=frozenset({
            "device", "iterations", "generation_batch_size", "forward_batch_size", "ppo_epochs",
            "num_minibatches", "gradient_accumulation_steps", "clip_eps", "clip_eps_high", "dual_clip",
            "value_clip_eps",
            "vf_coef", "entropy_coef", "kl_coef", "kl_target", "kl_horizon", "kl_early_stop", "ratio_threshold",
            "kl_after_update", "ref_refresh_every", "old_policy_refresh_every", "actor_lr", "critic_lr",
            "lr_schedule", "lr_warmup_steps", "max_grad_norm", "fsdp", "fsdp_reshard_after_forward", "zero_stage",
            "deepspeed_config", "reward_nonfinite", "env_timeout", "max_nonfinite_updates", "nonfinite_weights", "rollback_copy",
            "mixed_precision", "attn_implementation", "eval_every",
            "checkpoint_every", "keep_checkpoints",
            "load_in_4bit",  # the frozen base's quantisation: the trained LoRA weights carry over
        }),
        # the models, the data and its split, the task and the sampling distribution, the objective
        fixed=frozenset({
            "seed", "agent", "model", "dtype", "tokenizer", "reward_model", "env", "env_args", "reward", "reward_weights", "dataset",
            "eval_size",
            "max_episode_tokens",
            "max_prompt_length", "warmup_sft_steps", "warmup_sft_lr", "warmup_sft_batch_size",
            "warmup_answer_accuracy", "prompts_per_iteration", "n_samples_per_prompt", "max_new_tokens",
            "temperature", "top_k", "top_p", "gamma", "lam", "whiten_advantages", "loss_aggregation",
            "kl_kind", "kl_in", "adaptive_kl", "kl_hinge", "reward_placement", "critic_init",
            "lam_critic", "lam_length_alpha", "critic_warmup_iterations", "dynamic_sampling", "overlong_buffer",
            "reward_adapter", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
            "critic_type",
        }),
    )
    """What ``--resume`` may change (docs/reliability.md, "Resuming with other settings")."""

    def validate(self, agent: type | None = None) -> TrainConfig:
        """Check every field, then the agent's own rules (``agent.validate_config``: what it needs
        and which options it reads); raise ``ValueError`` naming the field, its value and what is
        allowed. ``agent`` defaults to the class ``self.agent`` names."""
        for name in OBJECT_FIELDS:
            _refuse_saved_object(name, getattr(self, name))
        check_values(self, skip=OBJECT_FIELDS)
        check_output_dir(self.output_dir)
        agent = agent if agent is not None else agent_class(self.agent)
        _choice("kl_kind", self.kl_kind, KL_KINDS)
        _choice("kl_in", self.kl_in, ("reward", "loss"))
        _choice("kl_early_stop", self.kl_early_stop, ("none", "target", "beta_target"))
        _choice("reward_placement", self.reward_placement, ("last", "uniform"))
        _choice("loss_aggregation", self.loss_aggregation, ("token_mean", "seq_mean", "seq_mean_token_sum"))
        _choice("lr_schedule", self.lr_schedule, ("constant", "cosine"))
        _choice("critic_init", self.critic_init, ("policy", "reward_model"))
        _choice("critic_type", self.critic_type, ("value_head", "lora"))
        _choice("reward_nonfinite", self.reward_nonfinite, ("raise", "zero", "drop"))
        if self.env_timeout is not None:
            _positive("env_timeout", self.env_timeout)
        _choice("nonfinite_weights", self.nonfinite_weights, ("rollback", "stop"))
        _choice("rollback_copy", self.rollback_copy, ("auto", "device", "host"))
        check_precision(self)
        check_reward_shape(self.reward, self.reward_weights)  # the names in a spec: when the run builds its env
        for name in ("iterations", "prompts_per_iteration", "n_samples_per_prompt", "max_new_tokens",
                     "generation_batch_size", "forward_batch_size", "ppo_epochs", "num_minibatches",
                     "gradient_accumulation_steps", "warmup_sft_batch_size",
                     "kl_horizon", "keep_checkpoints", "lora_alpha", "max_nonfinite_updates"):
            _at_least(name, getattr(self, name), 1)
        for name in ("eval_size", "warmup_sft_steps", "eval_every", "checkpoint_every",
                     "ref_refresh_every", "lr_warmup_steps", "top_k"):
            _at_least(name, getattr(self, name), 0)
        if self.lora_r is not None:
            _at_least("lora_r", self.lora_r, 1)
        if self.max_prompt_length is not None:
            _at_least("max_prompt_length", self.max_prompt_length, 1)
        if self.max_episode_tokens is not None:
            _at_least("max_episode_tokens", self.max_episode_tokens, self.max_new_tokens)
        if self.env is not None and self.dataset is not None:
            raise ValueError(f"env={_shown(self.env)} and dataset={_shown(self.dataset)} are both set: an "
                             "environment carries its own rows; give --env, or --dataset (with --reward)")
        _at_least("old_policy_refresh_every", self.old_policy_refresh_every, 1)
        for name in ("gamma", "lam", "warmup_answer_accuracy"):
            _in_range(name, getattr(self, name), 0.0, 1.0)
        _in_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        for name in ("temperature", "actor_lr", "critic_lr", "warmup_sft_lr"):
            _positive(name, getattr(self, name))
        if self.clip_eps is not None:
            _positive("clip_eps", self.clip_eps)
        if self.value_clip_eps is not None:
            _positive("value_clip_eps", self.value_clip_eps)
        if self.clip_eps_high is not None:
            _positive("clip_eps_high", self.clip_eps_high)
        if self.lam_critic is not None:
            _in_range("lam_critic", self.lam_critic, 0.0, 1.0)
        if self.lam_length_alpha is not None:
            _at_least("lam_length_alpha", self.lam_length_alpha, 0.0)
        for name in ("critic_warmup_iterations", "overlong_buffer"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 0)
        if self.overlong_buffer is not None and self.max_episode_tokens is not None \
                and self.overlong_buffer > self.max_episode_tokens:
            raise ValueError(f"overlong_buffer={self.overlong_buffer}: must be <= max_episode_tokens="
                             f"{self.max_episode_tokens} (the budget it punishes the end of); lower it")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip={self.dual_clip!r}: must be > 1 (or None to disable)")
        for name in ("vf_coef", "entropy_coef", "kl_coef", "kl_target", "ratio_threshold",
                     "max_grad_norm"):
            _at_least(name, getattr(self, name), 0.0)
        _in_range("lora_dropout", self.lora_dropout, 0.0, 1.0)
        if not self.lora_target_modules.strip():
            raise ValueError("lora_target_modules='': name at least one module (e.g. q_proj,v_proj), 'auto' or 'all-linear'")
        if self.load_in_4bit:
            check_bitsandbytes("load_in_4bit")
        rollout = self.rollout_batch_size
        if rollout % self.num_minibatches:
            raise ValueError(
                f"num_minibatches={self.num_minibatches}: the rollout batch of {rollout} rows "
                f"(prompts_per_iteration={self.prompts_per_iteration} x n_samples_per_prompt="
                f"{self.n_samples_per_prompt}) does not divide into it; choose a divisor of {rollout}"
            )
        minibatch = rollout // self.num_minibatches
        if minibatch % self.gradient_accumulation_steps:
            raise ValueError(
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}: the minibatch of "
                f"{minibatch} rows does not divide into it; choose a divisor of {minibatch}"
            )
        _choice("zero_stage", self.zero_stage, (0, 1, 2, 3))
        if self.zero_stage and self.dtype != "float32":
            raise ValueError(f"dtype={self.dtype!r} with zero_stage={self.zero_stage}: DeepSpeed's engine here keeps "
                             "float32 weights and master copies (bf16 comes from the autocast, --mixed-precision); "
                             "use --dtype float32")
        if self.zero_stage and self.fsdp:
            raise ValueError(f"zero_stage={self.zero_stage} and fsdp=True both shard the training state; "
                             "choose one (DeepSpeed ZeRO or FSDP)")
        sharded = self.sharding()
        if sharded and self.load_in_4bit:
            setting, flag = sharded
            raise ValueError(
                f"{setting} shards full-precision models; load_in_4bit keeps one 4-bit base per "
                f"process instead: drop {flag}, or drop --load-in-4bit"
            )
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


def _unknown_options(names: typing.Iterable[str]) -> str:
    """``unknown option(s) a, b`` with, for a TRL name, the option textrl calls it."""
    hints = [trl_hint(name) for name in names if trl_hint(name)]
    listed = ", ".join(names)
    return f"unknown option(s) {listed}" + (f"; {'; '.join(hints)}" if hints else "")


def _with_trl_hints(cls: type) -> type:
    """Make ``cls(**kwargs)`` name the option textrl uses for a TRL option name."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unknown = [name for name in kwargs if name not in cls.__dataclass_fields__]
        if unknown:
            raise TypeError(_unknown_options(unknown) + "; see `textrl train --help`")
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


_with_trl_hints(TrainConfig)

AGENT_OPTIONS = frozenset({
    "ppo_epochs", "num_minibatches", "gradient_accumulation_steps", "clip_eps", "clip_eps_high", "dual_clip",
    "value_clip_eps", "lam_critic", "lam_length_alpha", "critic_warmup_iterations", "dynamic_sampling",
    "overlong_buffer", "vf_coef", "entropy_coef", "gamma", "lam", "whiten_advantages",
    "loss_aggregation", "kl_coef", "kl_kind", "kl_in", "adaptive_kl", "kl_target", "kl_horizon",
    "kl_hinge", "kl_early_stop", "reward_placement", "ratio_threshold", "kl_after_update",
    "ref_refresh_every", "old_policy_refresh_every", "actor_lr", "critic_lr", "lr_schedule",
    "lr_warmup_steps", "max_grad_norm", "critic_init", "reward_adapter", "load_in_4bit", "lora_r",
    "lora_alpha", "lora_dropout", "lora_target_modules", "critic_type",
})
"""The fields an agent reads (the algorithm's options); each agent declares the ones it reads
(``options``), and one it does not read, set to another value than its default, is refused."""


def check_bitsandbytes(field_name: str) -> None:
    """Raise ``ValueError`` naming ``field_name`` when bitsandbytes 4-bit is not importable."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(
            f"{field_name}=True needs bitsandbytes for 4-bit NF4: `pip install bitsandbytes`, "
            f"or set {field_name}=false"
        )


def _choice(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: must be one of {', '.join(map(str, allowed))}")


def _at_least(name: str, value: float, low: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) or value < low:
        raise ValueError(f"{name}={value!r}: must be a number >= {low}")


def _positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be > 0")


def _in_range(name: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name}={value!r}: must lie in {bracket}{low}, {high}]")


# -- attribute docstrings, YAML and the command line -------------------------------------------------


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal right after each annotated field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(getattr(nxt, "value", None), ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, optional) of a field annotation such as ``float | None``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _of_type(tp: type, value: Any) -> bool:
    """``value`` is already of the field's type: a bool only for a bool field, an int for a float."""
    if isinstance(value, bool):
        return tp is bool
    return isinstance(value, tp) or (tp is float and isinstance(value, int))


def parse_value(tp: type, optional: bool, value: Any) -> Any:
    """A field's value from a flag or a YAML file, parsed the same way: text is read as the field's
    type (``"no"`` -> False, ``"1e-4"`` -> 0.0001: PyYAML reads ``1e-4`` as text), numbers must
    fit it (2.5 is not an integer; a bool is not a number). ``ValueError`` says what is expected."""
    kind = _KINDS.get(tp, tp.__name__)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ValueError(f"must be {kind}, not null")
    if tp is list and isinstance(value, str):  # reward_weights: 1.0,0.5 (or [1.0, 0.5])
        try:
            return [float(item) for item in value.strip().strip("[]").split(",") if item.strip()]
        except ValueError:
            raise ValueError("must be a comma-separated list of numbers") from None
    if isinstance(value, str) and tp is not str:
        try:
            return _parse_bool(value) if tp is bool else tp(value)
        except (ValueError, argparse.ArgumentTypeError):
            raise ValueError(f"must be {kind}") from None
    if not _of_type(tp, value):
        raise ValueError(f"must be {kind}")
    return float(value) if tp is float else value


def _converter(tp: type, optional: bool):
    def convert(text: str):
        try:
            return parse_value(tp, optional, text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{err}, got {text!r}") from None

    convert.__name__ = tp.__name__  # argparse names the type in its error
    return convert


def check_values(config: Any, skip: tuple[str, ...] = ()) -> None:
    """Every field of a config dataclass holds a value of its type (no text standing for one:
    the Python API and YAML get the checks the flags get), finite where it is a number;
    ``ValueError`` names the field."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        if f.name not in skip:
            check_value(f.name, hints[f.name], getattr(config, f.name))


def check_value(name: str, hint: Any, value: Any) -> None:
    """One field of :func:`check_values`: ``value`` is of the type ``hint`` names, finite where it
    is a number (None where the field is optional; fields of other types are not checked)."""
    tp, optional = _base_type(hint)
    if tp not in _KINDS or (value is None and optional):
        return
    if value is None:
        raise ValueError(f"{name}=None: must be {_KINDS[tp]}, not null")
    if not _of_type(tp, value):
        text = f", not {type(value).__name__}" if isinstance(value, str) else ""
        raise ValueError(f"{name}={value!r}: must be {_KINDS[tp]}{text}")
    if tp is float and not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: must be a finite number")


NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
"""What argparse should take for a negative number (``-1e-4`` too), not for an option."""


def add_config_arguments(parser: argparse.ArgumentParser, cls: type = TrainConfig) -> None:
    """One ``--field-name`` / ``--field_name`` option per dataclass field, default: not given."""
    parser._negative_number_matcher = NEGATIVE_NUMBER  # argparse's own misses -1e-4
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in fields(cls):
        tp, optional = _base_type(hints[f.name])
        names = [f"--{f.name.replace('_', '-')}"]
        if "_" in f.name:
            names.append(f"--{f.name}")
        help_text = f"{docs.get(f.name, '')} (default: {f.default!r})"
        if tp is bool:
            parser.add_argument(
                *names, dest=f.name, nargs="?", const=True, default=argparse.SUPPRESS,
                type=_converter(bool, optional), help=help_text, metavar="BOOL",
            )
        else:
            parser.add_argument(
                *names, dest=f.name, default=argparse.SUPPRESS, type=_converter(tp, optional),
                help=help_text, metavar=tp.__name__.upper(),
            )


class _TRLOption(argparse.Action):
    """A TRL option name that is not ours: the parser error says which option we call it."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[override]
        parser.error(f"{option_string}: {trl_hint(self.dest)}")


def add_trl_names(parser: argparse.ArgumentParser, cls: type = TrainConfig) -> None:
    """Hidden ``--trl-name`` options for TRL option names ``cls`` lacks; each is an error that names
    our option (``--learning-rate`` -> ``actor_lr``)."""
    from textrl.trl_names import TRL_OPTIONS

    taken = {name for action in parser._actions for name in action.option_strings}
    for name in TRL_OPTIONS:
        if name in cls.__dataclass_fields__:
            continue
        flags = [f for f in dict.fromkeys([f"--{name.replace('_', '-')}", f"--{name}"]) if f not in taken]
        if flags:
            parser.add_argument(*flags, dest=name, nargs="?", action=_TRLOption, default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is an error naming the key and
    both lines (PyYAML would keep the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in seen:
                raise ValueError(f"the key {key!r} is given twice (lines {seen[key]} and {line}); keep one")
            if isinstance(key, typing.Hashable):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def check_input_file(path: Path, what: str) -> None:
    """``ValueError`` naming ``path`` (``what``: "--config") when it is a folder or does not exist."""
    if path.is_dir():
        raise ValueError(f"{what} {path}: is a folder, not a file; give the file's path")
    if not path.is_file():
        raise ValueError(f"{what} {path}: no such file")


def check_output_dir(value: Any) -> None:
    """``ValueError`` for an ``output_dir`` that cannot be a run folder: empty (it would write into
    the working folder), or a path that is, or runs through, a file."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"output_dir={value!r}: an empty folder name would write the run into the working "
                         "folder; give a folder, e.g. --output-dir runs/x (or '.' to mean this folder)")
    path = Path(value).expanduser()
    for part in (path, *path.parents):
        if part.exists() and not part.is_dir():
            what = "is a file" if part == path else f"runs through the file {str(part)!r}"
            raise ValueError(f"output_dir={value!r} {what}, not a folder; give a folder path (or move the file)")


def load_yaml(path: str | Path, cls: type = TrainConfig) -> dict[str, Any]:
    """Read a YAML mapping of field -> value; unknown keys, and a key given twice, are an error
    naming them."""
    path = Path(path)
    check_input_file(path, "--config")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as err:
        raise ValueError(f"--config {path}: not valid YAML: {_yaml_problem(err)}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"--config {path}: not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    except ValueError as err:  # a key given twice
        raise ValueError(f"--config {path}: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of option: value, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    data = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"--config {path}: {_unknown_options(unknown)}; see `textrl train --help`")
    hints = typing.get_type_hints(cls)
    for name, value in data.items():
        try:
            _refuse_saved_object(name, value)
            tp, optional = _base_type(hints[name])
            if tp in _KINDS and not (name in OBJECT_FIELDS and not isinstance(value, str)):
                data[name] = parse_value(tp, optional, value)
                check_value(name, hints[name], data[name])
        except ValueError as err:
            message = str(err) if str(err).startswith(f"{name}=") else f"{name}={value!r}: {err}"
            raise ValueError(f"--config {path}: {message}") from None
    return data


def _shown(value: Any) -> str:
    """A field's value for a message: a string as it is, an object by its type."""
    return repr(value) if isinstance(value, str) else f"a {type(value).__name__}"


def _yaml_problem(err: Exception) -> str:
    """PyYAML's error as one line with the 1-based line and column (it names no file)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def build_config(namespace: argparse.Namespace, cls: type = TrainConfig) -> Any:
    """Defaults, then the YAML file of ``namespace.config`` (if any), then explicit flags."""
    values: dict[str, Any] = {}
    config_path = getattr(namespace, "config", None)
    if config_path:
        values.update(load_yaml(config_path, cls))
    known = {f.name for f in fields(cls)}
    values.update({k: v for k, v in vars(namespace).items() if k in known})
    try:
        return cls(**values)
    except TypeError as err:  # pragma: no cover - dataclass signature mismatch
        raise ValueError(str(err)) from err


OBJECT_FIELDS = ("model", "tokenizer", "dataset", "env", "reward")
"""Fields the Python API may set to an object (a model, a tokenizer, a dataset or list of rows, an
environment, a reward function or list of them)."""


def describe_object(value: Any) -> dict[str, Any]:
    """What ``config.yaml`` says of an object given for a field: its class, ``name_or_path`` and
    length where it has them (``{"object": "transformers...LlamaForCausalLM", ...}``)."""
    cls = type(value)
    out: dict[str, Any] = {"object": f"{cls.__module__}.{cls.__qualname__}"}
    name = getattr(value, "name_or_path", None) or getattr(getattr(value, "config", None), "_name_or_path", None)
    if name:
        out["name_or_path"] = str(name)
    if isinstance(value, (list, tuple)) or hasattr(value, "column_names"):
        out["rows"] = len(value)
    return out


def yaml_value(value: Any) -> Any:
    """A field's value as YAML can hold it: itself, or :func:`describe_object` of an object."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return describe_object(value)


def _refuse_saved_object(name: str, value: Any) -> None:
    """A field read back from a config.yaml that recorded an object: say to pass the object again."""
    if name == "reward" and isinstance(value, (dict, list)):  # a recorded function: re-imported or refused
        refuse_recorded_callable(value)
        return
    if isinstance(value, dict) and "object" in value:
        what = value["object"] + (f" ({value['name_or_path']})" if value.get("name_or_path") else "")
        raise ValueError(
            f"{name}: this config was saved from a run given a {what} object, which a YAML file cannot hold; "
            f"pass the object again (TrainConfig({name}=...) in Python) or a path / hub id for {name}"
        )


def save_config(config: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (loadable again with ``--config``); an object given to the
    Python API is recorded by :func:`describe_object` (loading that file back asks for it again)."""
    Path(path).write_text(config_yaml(config))


def config_values(config: Any) -> dict[str, Any]:
    """Each field of a config dataclass as ``config.yaml`` holds it (:func:`yaml_value`)."""
    recorded = {"reward": reward_record, "reward_weights": lambda w: None if w is None else [float(x) for x in w]}
    return {f.name: recorded.get(f.name, yaml_value)(getattr(config, f.name)) for f in fields(config)}


def config_yaml(config: Any) -> str:
    """The text of ``config.yaml`` (:func:`config_values`, in field order)."""
    return yaml.safe_dump(config_values(config), sort_keys=False)


__all__ = [
    "AGENT_OPTIONS",
    "ResumeRules",
    "config_values",
    "config_yaml",
    "KL_KINDS",
    "TrainConfig",
    "add_config_arguments",
    "add_trl_names",
    "build_config",
    "field",
    "field_docs",
    "check_value",
    "check_values",
    "load_yaml",
    "parse_value",
    "save_config",
]
