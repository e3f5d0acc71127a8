"""What ``tests/test_option_sweep.py`` tries of each ``textrl train`` option, and what it expects to see.

One entry per option of ``textrl train --help`` (every :class:`textrl.config.TrainConfig` field, plus
``--config`` and ``--debug``): a :class:`Try` (or a few, for an option that names one of a few
choices), or an :class:`Exempt` with the reason the sweep cannot run it here. A new option without an
entry fails ``test_every_train_option_has_an_entry``.

Each :class:`Try` runs two tiny iterations of :data:`BASE` with ``base`` and the option's value on top,
and compares that run with the baseline of :data:`BASE` + ``base`` (the same settings without the
option) through ``observe``; the rule is written at the top of the test. Values are Python values (as
the field holds them; the sweep writes the flag); ``{warm}`` stands for the warmed-up tiny policy the
baseline trains, ``{tiny}`` for the cold tiny causal LM, ``{tiny_rm}`` for the tiny reward model,
``{here}`` for this folder, ``{tmp}`` for the run's own temporary folder, where ``files`` are written.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Try:
    """One value of an option, what it does, and what differs from the baseline when it acts.

    ``observe``: ``"same"`` (the run equals the baseline: metrics within a float tolerance, the
    same samples; for an option that must not change the computation), ``"recorded"`` (the run
    records the value and nothing else is checked: ``why`` must say why nothing observable changes
    at this size and where the effect is tested), or what must differ from the baseline:
    ``"metrics"`` (any metric, timings and memory left out), a metric's name (``"kl/coef"``: its
    values or its presence; ``"samples"``: the rows sampled), ``"samples.jsonl"`` (the logged samples), ``"rows"`` (the number of metric rows),
    ``"summary:KEY/KEY"`` (a value of summary.json), ``"file:PATH"`` (a file of the run folder the
    baseline's lacks), ``"output:TEXT"`` (printed by the run, not by the baseline); or a predicate of
    the run alone (``Run -> bool``) where the baseline cannot run (a NaN reward under the default
    ``reward_nonfinite='raise'``)."""

    value: Any
    why: str
    observe: str | Callable[[Any], bool] = "metrics"
    base: dict[str, Any] = field(default_factory=dict)
    """Settings the option needs to act (its agent, LoRA, a multi-turn environment); its baseline runs with them too."""
    before: dict[str, Any] | None = None
    """Settings of a run into the same folder before this one (``resume`` continues it)."""
    files: dict[str, str] = field(default_factory=dict)
    """Files written into ``{tmp}`` before the run: name -> text."""
    prepare: Callable[[Path], None] | None = None
    """Writes what the run needs into ``{tmp}`` (the folder given) before it starts."""


@dataclass(frozen=True)
class Exempt:
    """An option the sweep cannot run on a CPU-only single process, and why."""

    reason: str


BASE: dict[str, Any] = {
    "agent": "gae_ppo",  # a critic agent reads most options (rloo, the default, refuses the critic's)
    "model": "{warm}",  # 30 warm-up steps already taken: rewards vary, so advantages and losses are not all 0
    "device": "cpu",  # the same run on any machine (auto would take a GPU where there is one)
    "iterations": 2, "warmup_sft_steps": 0, "prompts_per_iteration": 4, "n_samples_per_prompt": 2,
    "max_new_tokens": 8, "eval_size": 2, "eval_every": 0, "progress": False,
}
"""The baseline: two tiny iterations on the CPU (the defaults of every other option: 2 PPO epochs of 2
minibatches, so that the ratio moves off 1 and the clips can act)."""


def nan_on_every_other_row(prompts, completions, **kwargs):
    """A reward that is NaN on every other row and 1 elsewhere (``reward_nonfinite``'s case)."""
    return [math.nan if i % 2 else 1.0 for i in range(len(completions))]


def _nonfinite_rows_counted(run: Any) -> bool:
    return any(row.get("reward/nonfinite_rows", 0) > 0 for row in run.metrics) and all(
        math.isfinite(row["reward/mean"]) for row in run.metrics)


def write_reward_adapter(folder: Path) -> None:
    """``{tmp}/reward_adapter``: a LoRA reward adapter on the tiny base (B != 0) with a score head, as
    ``textrl rm --lora`` writes one."""
    import torch
    from peft import get_peft_model

    from textrl.models import build_tiny_causal_lm, build_tiny_tokenizer
    from textrl.models.adapters import lora_config, save_reward_adapter

    model = get_peft_model(build_tiny_causal_lm(build_tiny_tokenizer(), seed=0), lora_config(), adapter_name="default")
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        head = torch.nn.Linear(model.config.hidden_size, 1)
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * 0.1)
    save_reward_adapter(model, head, folder / "reward_adapter", base_model="tiny")


def _only_the_newest_checkpoint(run: Any) -> bool:
    return sorted(p.name for p in (run.folder / "checkpoints").iterdir()) == ["iter_000002"]


NAN_REWARD = {"reward": "{here}/option_sweep_values.py:nan_on_every_other_row"}
LORA = {"lora_r": 4}
ADAPTIVE = {"adaptive_kl": True}
DATASET = "".join(json.dumps({"prompt": f"Say {i} twice.", "answer": str(i)}) + "\n" for i in range(16))

VALUES: dict[str, Try | tuple[Try, ...] | Exempt] = {
    # -- run ------------------------------------------------------------------------------------
    "output_dir": Try("{tmp}/elsewhere", "the run writes its records into the folder named",
                      observe=lambda run: (run.folder.name == "elsewhere" and (run.folder / "metrics.jsonl").is_file())),
    "seed": Try(1, "another seed draws other prompts and tokens", "samples.jsonl"),
    "device": Exempt("the baseline already runs with --device cpu (not the default, auto); cuda needs a GPU "
                     "(tests/cuda run the front door there)"),
    "dtype": Try("bfloat16", "bf16 weights round every log-prob", base={"optim": "adamw_anyprecision"}),
    "mixed_precision": Try("bf16", "bf16 autocast of every forward", "summary:precision/autocast"),
    "frozen_dtype": Try("bfloat16", "the reference in bf16: the KL to it moves", "summary:precision/frozen_dtype"),
    "optim": (Try("adamw_anyprecision", "on float32 weights the same operations as torch's AdamW (the Kahan sum "
                  "acts on bf16 weights only)", "same"),
              Try("adamw_bnb_8bit", "8-bit moments: other steps")),
    "gradient_checkpointing": Try(True, "recomputes activations in the backward: the same gradients", "same"),
    "logprob_chunk_size": Try(3, "the fused LM head + log-softmax in chunks of 3 positions: the same log-probs", "same"),
    "padding_free": Try(True, "the forwards and backward on the packed real tokens: the padded ones' numbers", "same"),
    "microbatch_tokens": Try(48, "micro-batches of at most 48 real tokens (about one row each) instead of the whole "
                             "minibatch: the same gradient", "same"),
    "attn_implementation": Try("eager", "eager attention instead of sdpa: the same function", "same"),
    "iterations": Try(3, "one more iteration, one more metrics row", "rows"),
    "resume": Try(True, "continues the run stopped after iteration 1 (its checkpoint) and ends where the "
                  "uninterrupted run ends, bit for bit", "same", before={"iterations": 1, "checkpoint_every": 1}),
    "agent": tuple(Try(name, f"{name} instead of gae_ppo: another objective", "metrics", base=base)
                   for name, base in (("rloo", {}), ("grpo", {}), ("dr_grpo", {}), ("dapo", {}), ("cispo", {}),
                                      ("gspo", {}), ("reinforce_pp", {}), ("reinforce_pp_baseline", {}),
                                      ("one_step_ppo", {}), ("vapo", {}), ("multi_adapter_ppo", {}))),

    # -- models and data ------------------------------------------------------------------------
    "model": Try("{tiny}", "the cold tiny model (no warm-up) samples other tokens", "samples.jsonl"),
    "tokenizer": Try("{warm}", "the policy's own tokenizer, named: nothing changes", "same"),
    "reward_model": Try("{tiny_rm}", "adds the reward model's score as a reward component",
                        "reward_components/reward_model/mean"),
    "env": (Try("arithmetic", "another single-turn task: other prompts", "samples.jsonl"),
            Try("guess_number", "a multi-turn task: episodes of several turns", "episode/turns/mean"),
            Try("calculator", "a multi-turn task with a tool", "samples.jsonl")),
    "env_args": Try("seed=7", "the environment's rows drawn with another seed", "samples.jsonl", base={"env": "digits"}),
    "reward": Try("think_format", "one reward component instead of three", "reward/mean"),
    "reward_weights": Try([1.0, 0.5, 2.0], "weighs the three components of the task's reward",
                          "reward/mean", base={"reward": "think_format,tag_count,accuracy"}),
    "dataset": Try("{tmp}/prompts.jsonl", "prompts of a file instead of the built-in task", "samples.jsonl",
                   files={"prompts.jsonl": DATASET}),
    "eval_size": Try(3, "three held-out prompts instead of two", "summary:after/eval/sampled/n"),
    "max_prompt_length": Try(60, "a cap above the longest prompt: the run's recorded lengths change, not the "
                             "computation", "summary:lengths/max_prompt_length"),
    "warmup_sft_steps": Try(2, "two more supervised steps before RL", "summary:warmup/ran_steps"),
    "warmup_sft_lr": Try(1e-2, "another warm-up learning rate", base={"warmup_sft_steps": 2}),
    "warmup_sft_batch_size": Try(4, "another warm-up batch", base={"warmup_sft_steps": 2}),
    "warmup_answer_accuracy": Try(1.0, "every warm-up example shows the correct answer",
                                  base={"warmup_sft_steps": 2}),

    # -- generation ------------------------------------------------------------------------------
    "prompts_per_iteration": Try(3, "three prompts an iteration instead of four", "samples",
                                 base={"num_minibatches": 1}),
    "n_samples_per_prompt": Try(3, "three samples a prompt instead of two", "samples"),
    "max_new_tokens": Try(12, "longer responses", "summary:lengths/max_episode_tokens"),
    "max_episode_tokens": Try(12, "a multi-turn episode's budget after the prompt", "summary:lengths/max_episode_tokens",
                              base={"env": "guess_number"}),
    "temperature": Try(0.7, "sharper sampling, log-probs at that temperature"),
    "top_k": Try(3, "sampling from the 3 likeliest tokens: a cut close to the sampled tokens, so that two tiny "
                 "iterations draw tokens at its edge (a learner or reference that cuts there too gives them -inf)"),
    "top_p": Try(0.5, "nucleus sampling with a small nucleus, for the same reason (0.9 needs more iterations to "
                 "draw a token at the edge; issue 49: every --top-p 0.9 cell skipped updates)"),
    "generation_batch_size": Try(3, "generation in micro-batches of 3 rows: the same distribution, but the rows draw "
                                 "from the random stream in other batches, so other tokens"),
    "generation_engine": (Try("hf", "transformers' generate samples the rollouts", "summary:generation_engine/ran"),
                          Try("static", "generate with a static cache", "summary:generation_engine/ran")),
    "vllm_server": Exempt("needs a running vLLM server (textrl vllm-serve); tests/ marked vllm"),
    "vllm_gpu_memory_utilization": Exempt("acts only with --generation-engine vllm on CUDA: needs vLLM and a GPU "
                                          "(tests/ marked vllm)"),
    "vllm_tensor_parallel_size": Exempt("acts only with --generation-engine vllm on several GPUs (refused on the CPU: "
                                        "tests/test_config.py; passed to vLLM: tests/generation/test_vllm.py)"),
    "vllm_max_model_length": Exempt("acts only with --generation-engine vllm: needs vLLM (tests/ marked vllm)"),
    "vllm_max_num_seqs": Exempt("acts only with --generation-engine vllm: needs vLLM (tests/ marked vllm)"),
    "vllm_quantization": Exempt("acts only with --generation-engine vllm: vLLM's online quantization needs a GPU "
                                "(passed to vLLM: tests/generation/test_vllm.py)"),
    "weight_sync_bucket_mb": Exempt("acts only with the vLLM engines: needs vLLM (buckets: tests/generation/"
                                    "test_weight_sync.py; tests/ marked vllm)"),
    "forward_batch_size": Try(3, "log-prob / value forwards in micro-batches of 3 rows: the same numbers", "same"),

    # -- PPO -------------------------------------------------------------------------------------
    "ppo_epochs": Try(3, "a third pass over each rollout", "ppo/epochs_run"),
    "num_minibatches": Try(4, "four minibatches of 2 rows: more optimiser steps"),
    "gradient_accumulation_steps": Try(2, "each minibatch in 2 accumulated micro-batches: the same gradient", "same"),
    "clip_eps": Try(0.01, "a tight clip: more of the ratio clipped", "clip_fraction", base={"actor_lr": 1e-2}),
    "clip_eps_high": Try(0.01, "a tight upper clip", "clip_fraction", base={"actor_lr": 1e-2}),
    "dual_clip": Try(1.01, "negative advantages' loss capped at 1.01 x the advantage", "loss/policy",
                     base={"actor_lr": 1e-2}),
    "value_clip_eps": Try(0.001, "a tight clip of the value update", "value_clip_fraction"),
    "vf_coef": Try(1.0, "the value loss weighed 1 instead of 0.5", "loss/total"),
    "entropy_coef": Try(0.01, "an entropy bonus in the loss", "loss/total"),
    "gamma": Try(0.9, "discounted returns", "value/return_mean"),
    "lam": Try(0.5, "another GAE lambda"),
    "lam_critic": Try(0.5, "the critic's targets with their own lambda", "loss/value"),
    "lam_length_alpha": Try(0.05, "length-adaptive lambda of the policy's advantages"),
    "critic_warmup_iterations": Try(1, "the first iteration trains the critic alone: the policy does not move",
                                    "grad_norm/actor"),
    "dynamic_sampling": Try(False, "dapo keeps the groups whose rewards are all equal", base={"agent": "dapo"}),
    "overlong_buffer": Try(6, "dapo's overlong punishment over the last 6 tokens of 8 (default 2), added to the token rewards",
                           base={"agent": "dapo"}),
    "whiten_advantages": Try(False, "advantages left unnormalised"),
    "loss_aggregation": (Try("seq_mean", "each sequence's token mean, then the mean over sequences", "loss/policy"),
                         Try("seq_mean_token_sum", "each sequence's token sum, then the mean", "loss/policy")),
    "rollout_correction": tuple(Try(kind, f"{kind}: the engine-vs-learner weights enter the loss",
                                    "rollout/correction_weight_mean") for kind in ("tis", "mis", "geo_mean", "icepop")),
    "rollout_correction_upper": Try(
        0.9999, "icepop's band [0.5, 0.9999] leaves out ratios of 1: the textrl engine's log-probs agree with the "
        "learner's to ~1e-7, so every token is rejected", "rollout/correction_rejected_fraction",
        base={"rollout_correction": "icepop"}),
    "rollout_correction_lower": Try(
        1.0001, "icepop's band [1.0001, 5]: as rollout_correction_upper, every token is rejected",
        "rollout/correction_rejected_fraction", base={"rollout_correction": "icepop"}),
    "max_weight_gap": Try(0.0, "0 turns the check of the engine's weights off: its metric is gone", "rollout/weight_gap"),
    "max_staleness": Try(1, "the actor samples iteration 2 with the weights of iteration 1", "rollout/staleness"),
    "partial_rollouts": Try("continue", "an episode in flight takes the next weights at its next turn (from rollout 2 "
                            "on at K=2: the third iteration)", "rollout/staleness",
                            base={"max_staleness": 2, "env": "guess_number", "iterations": 3}),
    "old_logprobs": Try("engine", "the engine's log-probs as the ratio's denominator (bypass)"),
    "kl_coef": Try(0.1, "a stronger KL penalty", "kl/coef"),
    "teacher": Try("{tiny}", "the cold tiny model as a teacher: its per-token reward replaces the task's (no --reward)",
                   "teacher/reverse_kl"),
    "teacher_coef": Try(0.5, "a weaker distillation reward per token", "metrics", base={"teacher": "{tiny}"}),
    "kl_kind": tuple(Try(kind, f"the {kind} estimator of the KL", "kl/before_update") for kind in ("k2", "k3", "abs")),
    "kl_in": Try("loss", "the KL penalty in the loss, not the reward"),
    "adaptive_kl": Try(True, "the KL coefficient follows the measured KL", "kl/coef"),
    "kl_target": Try(10.0, "a target far above the KL: the coefficient falls at iteration 2, where it rises with 0.1", "kl/coef", base=ADAPTIVE),
    "kl_horizon": Try(100, "a shorter horizon of the adaptive controller", "kl/coef", base=ADAPTIVE),
    "kl_hinge": Try(True, "penalises max(0, KL - kl_target) in the loss", base={"kl_in": "loss"}),
    "kl_early_stop": Try("target", "an iteration's epochs stop once the KL passes 1.5 x kl_target", "ppo/epochs_run",
                         base={"kl_target": 1e-6, "actor_lr": 1e-2}),
    "reward_placement": Try("uniform", "the score spread over the response's tokens"),
    "ratio_threshold": Try(1.0, "a minibatch whose mean ratio passes 1 has its policy loss zeroed",
                           "ppo/ratio_threshold_skips", base={"actor_lr": 1e-2}),
    "kl_after_update": Try(True, "logs the KL after the update", "kl/after_update"),
    "ref_refresh_every": Try(1, "the reference becomes the policy after each iteration", "kl/before_update"),
    "old_policy_refresh_every": Try(2, "one_step_ppo keeps its old-policy snapshot for two iterations",
                                    base={"agent": "one_step_ppo"}),
    "actor_lr": Try(1e-3, "another policy learning rate", "lr/actor"),
    "critic_lr": Try(1e-2, "another critic learning rate", "lr/critic"),
    "lr_schedule": Try("cosine", "a cosine decay of the learning rates", "lr/actor"),
    "lr_warmup_steps": Try(8, "a linear warm-up over 8 optimiser steps (4 an iteration)", "lr/actor"),
    "max_grad_norm": Try(0.1, "a tighter gradient clip"),
    "critic_init": Try("reward_model", "the critic starts from the reward model's body", "value/mean",
                       base={"reward_model": "{tiny_rm}"}),
    "critic": (Try("shared", "a value head on the policy's body", "value/mean"),
               Try("lora", "a LoRA critic on a frozen copy of the policy", "value/mean")),

    # -- LoRA ------------------------------------------------------------------------------------
    "reward_adapter": Try("{tmp}/reward_adapter", "multi_adapter_ppo scores with a LoRA reward adapter written "
                          "by the sweep", "reward/mean", base={"agent": "multi_adapter_ppo", "model": "tiny"},
                          prepare=write_reward_adapter),
    "load_in_4bit": Try(True, "the frozen base in 4-bit NF4 (bitsandbytes)", base=LORA),
    "lora_r": Try(4, "a rank-4 LoRA policy instead of full fine-tuning"),
    "lora_alpha": Try(32, "the LoRA update scaled by 32/4 instead of 16/4", base=LORA),
    "lora_dropout": Exempt("refused above 0 by textrl train in one line (the policy runs in eval mode, so LoRA "
                           "dropout would act on no forward): tests/test_config.py::test_lora_dropout_is_refused_by_train"),
    "lora_target_modules": Try("all-linear", "LoRA on every linear layer", base=LORA),
    "critic_type": Try("lora", "a critic LoRA adapter of its own instead of a value head", "value/mean", base=LORA),

    # -- several processes -----------------------------------------------------------------------
    "fsdp": Exempt("shards over several processes (refused in one): accelerate launch / torchrun, "
                   "tests/test_distributed.py"),
    "fsdp_reshard_after_forward": Exempt("acts with --fsdp only, which needs several processes (tests/test_distributed.py)"),
    "zero_stage": Exempt("DeepSpeed ZeRO shards over several processes (refused in one): tests/test_zero.py"),
    "deepspeed_config": Exempt("acts with DeepSpeed ZeRO only, which needs several processes (tests/test_zero.py)"),

    # -- numerical faults ------------------------------------------------------------------------
    "reward_nonfinite": (Try("zero", "a NaN reward scores 0 and is counted", _nonfinite_rows_counted, base=NAN_REWARD),
                         Try("drop", "a row with a NaN reward is left out and counted", _nonfinite_rows_counted,
                             base=NAN_REWARD)),
    "env_timeout": Try(30.0, "a limit no call reaches changes nothing (a call past it: "
                       "tests/envs/test_env_faults.py)", "recorded"),
    "reward_concurrency": Try(2, "the built-in rewards are scored in the loop; an async or does_io reward in the "
                              "background gives the same rollout (tests/envs/test_async_rewards.py)", "same"),
    "max_nonfinite_updates": Try(1, "acts on non-finite updates only; none happen in a clean run (the stop: "
                                 "tests/agents/test_traps.py)", "recorded"),
    "nonfinite_weights": Try("stop", "no rollback copy of the weights is kept", "guard/bytes"),
    "rollback_copy": Try("device", "the rollback copy on the run's device: on the CPU the same memory as 'auto' "
                         "(host); the placement is tested in tests/test_rollback_guard.py", "recorded"),

    # -- logging, evaluation, checkpoints --------------------------------------------------------
    "eval_every": Try(1, "a held-out evaluation after iteration 1 too", "eval/sampled/reward/mean"),
    "checkpoint_every": Try(1, "a checkpoint after iteration 1 too", "file:checkpoints/iter_000001"),
    "keep_checkpoints": Try(1, "only the newest checkpoint kept (2 with the default)", _only_the_newest_checkpoint,
                            base={"checkpoint_every": 1}),
    "progress": Try(True, "a progress bar on stderr", "output:it/s"),

    # -- the command line's own ------------------------------------------------------------------
    "config": Try("{tmp}/run.yaml", "a YAML file of options (here seed: 1)", "samples.jsonl", files={"run.yaml": "seed: 1\n"}),
    "debug": Try(True, "other libraries' messages and tracebacks shown", "output:Loading weights"),
}
"""Option -> what the sweep tries of it (:class:`Try`, or a tuple of them) or why it cannot (:class:`Exempt`)."""
