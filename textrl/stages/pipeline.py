"""``textrl pipeline``: SFT -> reward model -> PPO, end to end.

With no arguments it runs offline on the built-in ``case`` task (:mod:`textrl.envs.synthetic`)
with the tiny model:

1. ``sft``: supervised fine-tuning on instruction prompts whose responses follow the letter-case
   constraint only half of the time (the SFT policy follows it at chance);
2. ``rm``: a full reward model initialised from the SFT model, trained on chosen (right case) /
   rejected (wrong case) pairs; pairwise accuracy on held-out pairs;
3. ``ppo``: :func:`textrl.training.trainer.train` with the reward model as the only optimised reward
   (``--reward-model``) on prompts that neither SFT nor the reward model saw; the trainer holds
   out ``eval_size`` of them and evaluates before and after. On the built-in task the rule
   :func:`~textrl.envs.synthetic.case_follow_reward` rides along with weight 0, so the share
   of responses that really follow the constraint is logged next to the reward.

``--agent multi_adapter_ppo`` runs the MA-RLHF recipe instead: SFT as above (every weight), then
``textrl rm --lora`` on the SFT model (a LoRA reward adapter + score head, ``rm/model`` holds
``textrl_reward.json``), then ``textrl train --agent multi_adapter_ppo --reward-adapter rm/model``
with ``--model sft/model``: one copy of the SFT weights carries the trainable policy LoRA, the
value head, the frozen reward adapter, and the reference (the SFT model: the base with adapters
disabled). ``--load-in-4bit`` quantises that base to NF4 in both LoRA stages. LoRA moves fewer
weights from a zero start, so the learning rates left unset default per agent
(:data:`LR_DEFAULTS`).

Outputs: ``<output_dir>/{sft,rm,ppo}/`` (each stage's usual files), ``data/prompts.jsonl``,
``config.yaml`` and ``summary.json`` (the figures printed at the end).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from textrl.agents import AGENTS, agent_class
from textrl.config import shared
from textrl.config.io import (
    check_at_least,
    check_bitsandbytes,
    check_output_dir,
    check_positive,
    save_config,
)
from textrl.core.agent_registry import is_spec
from textrl.core.precision import check_precision
from textrl.run import holds_run_folder, take_run_folder, torch_threads
from textrl.stages.common import MODEL_DIR
from textrl.stages.rm import RMConfig, train_rm
from textrl.stages.sft import SFTConfig, train_sft

MONITOR = "case_follow_reward"
"""The rule of the built-in task, logged (weight 0) next to the reward-model score."""


def pipeline_agents() -> list[str]:
    """Registered agents that declare the reward model the pipeline trains for them
    (``pipeline_reward``): those taking a full reward model first, then those taking an adapter."""
    kinds = ("reward_model", "reward_adapter")
    found = [(kinds.index(cls.pipeline_reward), name) for name, cls in AGENTS.items() if cls.pipeline_reward in kinds]
    return [name for _, name in sorted(found, key=lambda kind_name: kind_name[0])]


def lora_agents() -> list[str]:
    """Pipeline agents whose reward model is a LoRA adapter on the SFT model (their policy is a LoRA too)."""
    return [name for name, cls in AGENTS.items() if cls.pipeline_reward == "reward_adapter"]

def ma_rlhf_targets(model: str) -> str:
    """The LoRA stages' target modules: the four attention projections where the model has them (as
    MA-RLHF adapts them, and as docs/stages.md's figures were measured: peft's Llama default,
    q_proj and v_proj only, did not raise the rule share in 60 iterations), else ``auto``."""
    import json

    config = Path(model) / "config.json"
    kind = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    llama_like = {"llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3"}
    return "q_proj,k_proj,v_proj,o_proj" if kind in llama_like else "auto"


LR_DEFAULTS = {"full": {"rm_lr": 1e-3, "actor_lr": 3e-4}, "lora": {"rm_lr": 3e-3, "actor_lr": 3e-3}}
"""Learning rates used when ``rm_lr`` / ``actor_lr`` are left unset: 'full' fine-tunes every
weight (gae_ppo, one_step_ppo), 'lora' trains adapters (multi_adapter_ppo). Measured on the
built-in task (docs/stages.md): in 100 iterations the policy LoRA barely moves at 3e-4 or 1e-3
and games the reward adapter at 1e-2 (score up, rule down); the reward adapter reaches 0.97-0.98
held-out accuracy at 1e-3 and 3e-3 on seeds 0-2, 0.84 on one seed at 1e-2, and diverges at 3e-2."""


@dataclass
class PipelineConfig:
    """``textrl pipeline``. Defaults: the offline demo (tiny model, built-in ``case`` task)."""

    output_dir: str = "runs/pipeline"
    """Where sft/, rm/, ppo/, data/, config.yaml and summary.json go."""
    seed: int = 0
    """Seed of every stage."""
    device: str = shared("device")
    model: str = "tiny"
    """Starting causal LM: a local path or hub id; 'tiny' is the offline tiny model."""
    dtype: str = "float32"
    """Every stage's weights' dtype: float32 | bfloat16 (TRL's dtype / torch_dtype)."""
    mixed_precision: str = "auto"
    """Every stage's autocast: bf16 | no | auto (bf16 on a CUDA device that has it, else no)."""
    attn_implementation: str | None = None
    """Every stage's attention: sdpa | eager | flash_attention_2 (flash-attn, CUDA); None: the model's."""
    sft_data: str = "builtin:case"
    """SFT data: 'builtin:case' or a .jsonl of {prompt, response} / {messages} rows."""
    preference_data: str = "builtin:case"
    """Reward-model data: 'builtin:case' or a .jsonl of generic / hh-rlhf / PKU-SafeRLHF rows."""
    prompts: str = "builtin:case"
    """PPO prompts: 'builtin:case' (held-out task prompts) or a .jsonl of {prompt} rows."""
    sft_steps: int = 300
    """SFT optimiser steps."""
    sft_lr: float = 3e-3
    """SFT learning rate."""
    rm_steps: int = 100
    """Reward-model optimiser steps."""
    rm_lr: float | None = None
    """Reward-model learning rate (None: 1e-3 for the full model, 3e-3 for multi_adapter_ppo's LoRA)."""
    rm_eval_size: int = 64
    """Held-out preference pairs for the reward model's accuracy."""
    batch_size: int = 32
    """Batch size of SFT and reward-model training."""
    agent: str = "gae_ppo"
    """PPO agent: a registered agent that declares the reward model the pipeline trains for it
    (``pipeline_reward``): gae_ppo, one_step_ppo (a full reward model), multi_adapter_ppo (a LoRA
    reward adapter and policy LoRA on one SFT base, MA-RLHF), or one of your own (file.py:Class)."""
    ppo_iterations: int = 100
    """PPO iterations."""
    actor_lr: float | None = None
    """PPO policy learning rate (None: 3e-4 for a full policy, 3e-3 for multi_adapter_ppo's LoRA)."""
    kl_coef: float = 0.02
    """PPO KL coefficient (beta)."""
    max_new_tokens: int = 24
    """Length cap of a PPO response."""
    max_prompt_length: int | None = None
    """PPO's longest prompt in tokens (chat template included; a longer one is refused). None: the
    longest of the PPO prompts, bounded by the SFT model's context minus max_new_tokens (as
    `textrl train`)."""
    max_episode_tokens: int | None = None
    """PPO's cap of an episode's tokens after the prompt (None: max_new_tokens for single-turn
    prompts, bounded to the context; as `textrl train`)."""
    sft_max_length: int = 256
    """SFT's longest training sequence in tokens (prompt + response; `textrl sft --max-length`)."""
    rm_max_length: int = 256
    """The reward model's longest sequence in tokens (`textrl rm --max-length`)."""
    eval_size: int = 32
    """PPO held-out prompts."""
    load_in_4bit: bool = False
    """multi_adapter_ppo: quantise the SFT base to 4-bit NF4 (bitsandbytes) under the reward
    adapter and under PPO's adapters."""
    threads: int = 1
    """torch CPU threads during the run (0 = torch's default). The tiny model gains nothing from a
    second thread, and on a busy 2-core machine a second thread can be tens of times slower."""
    progress: bool = True
    """Show progress bars."""
    resume: bool = False
    """Continue an interrupted pipeline in output_dir: finished stages are kept, the interrupted one
    resumes from its newest checkpoint (pass the run's --config OUTPUT_DIR/config.yaml)."""

    def validate(self) -> PipelineConfig:
        """Check every field; raise ``ValueError`` naming the field, its value and what is allowed."""
        check_output_dir(self.output_dir)
        for name in ("sft_steps", "rm_steps", "batch_size", "ppo_iterations", "max_new_tokens",
                     "sft_max_length", "rm_max_length"):
            check_at_least(name, getattr(self, name), 1)
        if self.max_prompt_length is not None:
            check_at_least("max_prompt_length", self.max_prompt_length, 1)
        if self.max_episode_tokens is not None:
            check_at_least("max_episode_tokens", self.max_episode_tokens, self.max_new_tokens)
        for name in ("rm_eval_size", "threads"):
            check_at_least(name, getattr(self, name), 0)
        check_at_least("eval_size", self.eval_size, 1)
        check_positive("sft_lr", self.sft_lr)
        for name in ("rm_lr", "actor_lr"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name))
        check_at_least("kl_coef", self.kl_coef, 0.0)
        check_precision(self)
        cls = self.agent_class()
        if cls is None or not cls.pipeline_reward:
            hint = (f"; run {self.agent} after the pipeline: `textrl train --agent {self.agent} "
                    "--model OUT/sft/model --reward-model OUT/rm/model`" if cls is not None else "")
            raise ValueError(f"agent={self.agent!r}: must be one of {', '.join(pipeline_agents())}{hint}")
        if self.load_in_4bit:
            if not self.lora:
                raise ValueError(
                    f"load_in_4bit=True with agent={self.agent!r}: a 4-bit base is frozen, so only "
                    f"LoRA stages can use it; add --agent {' or --agent '.join(lora_agents())}, or drop --load-in-4bit"
                )
            check_bitsandbytes("load_in_4bit")
        out = Path(self.output_dir)
        if self.resume:
            check_resumable(self)
        elif any(_has_checkpoints(out / stage) or (out / stage / "summary.json").is_file() for stage in STAGES):
            raise ValueError(
                f"output_dir={self.output_dir!r} holds an earlier pipeline run; continue it with "
                f"`textrl pipeline --config {out / 'config.yaml'} --resume`, or choose another "
                "--output-dir (or delete that one) to start over"
            )
        return self

    def agent_class(self) -> type | None:
        """The class of ``agent`` (None for a name nobody registered)."""
        try:
            return agent_class(self.agent)
        except ValueError:
            if is_spec(self.agent):  # a file or module the user named: say what is wrong with it
                raise
            return None

    @property
    def lora(self) -> bool:
        """Whether the reward model and the PPO policy are LoRA adapters (the agent's ``pipeline_reward``)."""
        cls = self.agent_class()
        return cls is not None and cls.pipeline_reward == "reward_adapter"

    def resolved(self) -> PipelineConfig:
        """A copy with ``rm_lr`` / ``actor_lr`` filled in from :data:`LR_DEFAULTS` where unset."""
        defaults = LR_DEFAULTS["lora" if self.lora else "full"]
        unset = {name: value for name, value in defaults.items() if getattr(self, name) is None}
        return dataclasses.replace(self, **unset)


STAGES = ("sft", "rm", "ppo")
RESUME_FREE = {"resume", "progress", "threads", "device", "mixed_precision", "attn_implementation"}
"""Fields a resumed pipeline may change; every other must equal the interrupted run's."""


def _has_checkpoints(stage_dir: Path) -> bool:
    """Whether a stage left complete checkpoints (listed, not hashed: the stage verifies on resume)."""
    from textrl.run import complete_checkpoints

    return bool(complete_checkpoints(stage_dir / "checkpoints"))


def check_resumable(config: PipelineConfig) -> None:
    """``--resume``: ``output_dir`` holds a pipeline run whose config matches this one."""
    from textrl.config import load_yaml

    saved_path = Path(config.output_dir) / "config.yaml"
    if not saved_path.is_file():
        raise ValueError(f"--resume: {saved_path} does not exist; there is no pipeline run in "
                         f"{config.output_dir!r} to continue (run without --resume to start one)")
    saved = PipelineConfig(**load_yaml(saved_path, PipelineConfig))
    differ = [f.name for f in dataclasses.fields(PipelineConfig) if f.name not in RESUME_FREE
              and getattr(saved, f.name) != getattr(config.resolved(), f.name)]
    if differ:
        shown = ", ".join(f"{k}={getattr(config, k)!r} (run: {getattr(saved, k)!r})" for k in differ)
        raise ValueError(f"--resume: {shown} differ from the run in {config.output_dir!r}; resume with "
                         f"`textrl pipeline --config {saved_path} --resume`")


def write_prompts(spec: str, path: Path) -> tuple[str, bool]:
    """(dataset for the trainer, whether the ``case`` rule can monitor it)."""
    from textrl.envs.synthetic import BUILTIN_PROMPTS

    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in BUILTIN_PROMPTS:
            raise ValueError(f"prompts={spec!r}: unknown; available: "
                             + ", ".join(f"builtin:{k}" for k in BUILTIN_PROMPTS))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in BUILTIN_PROMPTS[name]()))
        return str(path), name == "case"
    if not Path(spec).is_file():
        raise ValueError(f"prompts={spec!r}: no such file; pass a .jsonl of prompts or 'builtin:case'")
    return spec, False


@holds_run_folder
def run_pipeline(config: PipelineConfig) -> dict[str, Any]:
    """Run SFT, the reward model and PPO; return the summary (also in ``summary.json``). The
    pipeline's folder is locked for the whole run, each stage's subfolder by the stage."""
    config = config.validate().resolved()
    with torch_threads(config.threads):
        return _run(config)


def _run(config: PipelineConfig) -> dict[str, Any]:
    from textrl.config import TrainConfig
    from textrl.training.trainer import train

    start = time.perf_counter()
    out = Path(config.output_dir)
    take_run_folder(out)  # one pipeline per folder; each stage locks its own subfolder
    save_config(dataclasses.replace(config, resume=False), out / "config.yaml")
    common = {"seed": config.seed, "device": config.device, "progress": config.progress, "dtype": config.dtype,
              "mixed_precision": config.mixed_precision, "attn_implementation": config.attn_implementation}

    print("== 1/3 sft ==", flush=True)
    sft = _stage(config, "sft", lambda resume: train_sft(SFTConfig(
        output_dir=str(out / "sft"), model=config.model, data=config.sft_data, steps=config.sft_steps,
        lr=config.sft_lr, batch_size=config.batch_size, max_length=config.sft_max_length, resume=resume,
        **common)))
    sft_model = str(out / "sft" / MODEL_DIR)

    print(f"== 2/3 reward model{' (LoRA adapter on the SFT model)' if config.lora else ''} ==", flush=True)
    rm = _stage(config, "rm", lambda resume: train_rm(RMConfig(
        output_dir=str(out / "rm"), model=sft_model, data=config.preference_data, steps=config.rm_steps,
        lr=config.rm_lr, batch_size=config.batch_size, eval_size=config.rm_eval_size, lora=config.lora,
        max_length=config.rm_max_length, lora_target_modules=ma_rlhf_targets(sft_model),
        load_in_4bit=config.load_in_4bit, resume=resume, **common)))
    rm_model = str(out / "rm" / MODEL_DIR)

    print(f"== 3/3 ppo ({config.agent}) ==", flush=True)
    dataset, monitor = write_prompts(config.prompts, out / "data" / "prompts.jsonl")
    # the option the agent takes its reward model by; a LoRA reward adapter rides on the SFT base
    # that PPO's policy LoRA shares (MA-RLHF)
    reward_models = {config.agent_class().pipeline_reward: rm_model}
    if config.lora:
        reward_models["load_in_4bit"] = config.load_in_4bit
        reward_models["lora_target_modules"] = ma_rlhf_targets(sft_model)
    every = max(1, config.ppo_iterations // 4)
    ppo = _stage(config, "ppo", lambda resume: train(TrainConfig(
        output_dir=str(out / "ppo"), model=sft_model, agent=config.agent,
        reward=_monitor_spec(monitor), **reward_models,
        dataset=dataset, iterations=config.ppo_iterations, eval_size=config.eval_size,
        eval_every=every, checkpoint_every=every, keep_checkpoints=1, warmup_sft_steps=0,
        actor_lr=config.actor_lr, kl_coef=config.kl_coef, max_new_tokens=config.max_new_tokens,
        max_prompt_length=config.max_prompt_length, max_episode_tokens=config.max_episode_tokens,
        resume=resume, **common,
    )))

    policy = out / "ppo" / "checkpoints" / f"iter_{config.ppo_iterations:06d}" / "policy"
    summary = {
        "seconds": time.perf_counter() - start,
        "agent": config.agent,
        "sft": {"eval_loss": [sft["before"].get("loss"), sft["after"].get("loss")], "model": sft_model},
        "rm": {"eval_accuracy": [rm["before"].get("accuracy"), rm["after"].get("accuracy")],
               "eval_margin": [rm["before"].get("margin"), rm["after"].get("margin")],
               "model": rm_model, "lora": config.lora},
        "ppo": {"eval": {key: [ppo["before"][f"eval/{key}"], ppo["after"][f"eval/{key}"]]
                         for key in _ppo_keys(monitor) if f"eval/{key}" in ppo["after"]},
                "policy": str(policy), "lora": config.lora},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _stage(config: PipelineConfig, name: str, run: Any) -> dict[str, Any]:
    """Run one stage (``run(resume) -> summary``). Resuming: a finished stage (its ``summary.json``
    saying it completed) is read back, not rerun; an interrupted one continues from its newest checkpoint. A signal
    stopping the stage stops the pipeline with the command that resumes it."""
    from textrl.run import TrainingStopped

    stage_dir = Path(config.output_dir) / name
    kept = json.loads((stage_dir / "summary.json").read_text()) if (stage_dir / "summary.json").is_file() else None
    # a stage that stopped or failed writes summary.json too, saying so (``ended``): only a completed one is kept
    if config.resume and kept is not None and kept.get("ended", "completed") == "completed":
        print(f"{name}: finished in the interrupted run; kept", flush=True)
        return kept
    try:
        return run(config.resume and _has_checkpoints(stage_dir))
    except TrainingStopped as stop:
        message = (f"textrl pipeline: stopped in the {name} stage. Resume the pipeline with: textrl "
                   f"pipeline --config {Path(config.output_dir) / 'config.yaml'} --resume")
        print(message, file=sys.stderr, flush=True)
        raise TrainingStopped(message, stop.code) from None


def _monitor_spec(monitor: bool) -> str:
    """The weight-0 rule reward PPO logs next to the reward-model score (the built-in task's rule);
    empty otherwise: the reward model (``--reward-model``, or multi_adapter_ppo's reward adapter)
    is then the whole reward."""
    if monitor:
        from textrl.envs import synthetic

        return f"{synthetic.__file__}:{MONITOR}:0"
    return ""


def _ppo_keys(monitor: bool) -> list[str]:
    names = ["reward_model", MONITOR] if monitor else ["reward_model"]
    return [f"{mode}/reward_components/{name}" for mode in ("sampled", "greedy") for name in names]


def format_pipeline_summary(summary: dict[str, Any]) -> str:
    """The before -> after figures of each stage, one line each."""
    def pair(values: list[float | None]) -> str:
        return " -> ".join("-" if v is None else f"{v:.3f}" for v in values)

    names = {"reward_components/reward_model": "reward-model score",
             f"reward_components/{MONITOR}": "follows the constraint (rule)"}
    lines = ["== summary (held-out, before -> after) ==",
             f"{'sft   completion loss':<46}{pair(summary['sft']['eval_loss'])}",
             f"{'rm    pairwise accuracy':<46}{pair(summary['rm']['eval_accuracy'])}",
             f"{'rm    margin r_chosen - r_rejected':<46}{pair(summary['rm']['eval_margin'])}"]
    for key, values in summary["ppo"]["eval"].items():
        mode, _, metric = key.partition("/")
        lines.append(f"{'ppo   ' + mode + ' ' + names.get(metric, metric):<46}{pair(values)}")
    kind = " (a LoRA adapter on the SFT model)" if summary["ppo"].get("lora") else ""
    lines.append(f"total {summary['seconds']:.0f}s; policy: {summary['ppo']['policy']}{kind}")
    return "\n".join(lines)


__all__ = ["LR_DEFAULTS", "PipelineConfig", "lora_agents", "pipeline_agents", "format_pipeline_summary", "run_pipeline", "write_prompts"]
