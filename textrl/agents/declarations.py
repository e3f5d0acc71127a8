"""An agent class's declarations, resolved and checked: what construction reads of the class
(:class:`AgentClass`), an option's agent default (:func:`option`), the LoRA rank, whether a
reference is kept, and :func:`validate_config`, the check of a config against the declarations
(samples per prompt, options read, rollout corrections, LoRA, memory options, sharding) that runs
before any model loads. :mod:`textrl.agents.build` builds the agent from them.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from textrl.config import AGENT_OPTIONS, TrainConfig


class AgentClass(Protocol):
    """What construction reads of an agent class (:class:`textrl.agents.base.PPOAgent` or a subclass):
    its declarations and its construction hooks. A protocol, so that this module does not import the
    agent it builds."""

    name: str
    needs_critic: bool
    min_samples_per_prompt: int
    lora: str
    default_lora_r: int | None
    shardable: bool
    options: frozenset[str]
    not_read: dict[str, str]
    rollout_corrections: tuple[str, ...]

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def load_policy(self, *args: Any, **kwargs: Any) -> nn.Module: ...

    def build_critic(self, *args: Any, **kwargs: Any) -> nn.Module: ...


def option(cls: AgentClass, config: TrainConfig, name: str) -> Any:
    """An agent option whose unset value (None) means "the agent's default": ``config``'s value,
    else the agent class's attribute ``default_<name>`` (e.g. ``clip_eps_high``)."""
    value = getattr(config, name)
    return getattr(cls, f"default_{name}", None) if value is None else value


def lora_rank(cls: AgentClass, config: TrainConfig) -> int | None:
    """The policy LoRA's rank: ``lora_r``, else ``cls.default_lora_r`` (None: no LoRA)."""
    return config.lora_r if config.lora_r is not None else cls.default_lora_r


def needs_reference(config: TrainConfig) -> bool:
    """Whether the agent keeps a reference model: something reads it, the KL penalty
    (``kl_coef > 0``, in the reward or the loss), the adaptive KL controller (fed the measured
    KL) or the ``kl/after_update`` monitor. At ``kl_coef=0`` without those none is built or
    loaded, no reference forward runs, and the KL monitors are absent from the metrics."""
    return config.kl_coef > 0 or config.adaptive_kl or config.kl_after_update


# -- validation -----------------------------------------------------------------------------------
def validate_config(cls: AgentClass, config: TrainConfig) -> None:
    """Check ``config`` against ``cls``'s declarations (samples per prompt, options read, rollout
    corrections, LoRA, sharding); ``ValueError`` names the agent, the option and what to do."""
    agent = config.agent
    if config.n_samples_per_prompt < cls.min_samples_per_prompt:
        raise ValueError(
            f"n_samples_per_prompt={config.n_samples_per_prompt}: agent={agent!r} compares samples "
            f"within a group, so it needs n_samples_per_prompt >= {cls.min_samples_per_prompt}"
        )
    for option in sorted(AGENT_OPTIONS - cls.options):
        if not config.is_default(option):
            raise ValueError(_ignored_option(cls, agent, option, getattr(config, option)))
    if config.rollout_correction not in cls.rollout_corrections:
        raise ValueError(f"rollout_correction={config.rollout_correction!r}: {agent} applies "
                         f"{', '.join(cls.rollout_corrections)} only; choose one of them, or another --agent")
    served = str(config.reward_model).strip().lower().startswith(("http://", "https://"))  # no weights here
    if "critic_init" in cls.options and config.critic_init == "reward_model" and (served or not config.reward_model):
        raise ValueError(f"critic_init='reward_model' starts the critic from the reward model's weights: give "
                         f"--reward-model PATH (a folder or hub id{', not a server' if served else ''}) or --critic-init policy")
    if config.ref_refresh_every and not needs_reference(config):
        raise ValueError(f"ref_refresh_every={config.ref_refresh_every} refreshes the reference model, which "
                         "kl_coef=0 does not build (nothing reads it): drop --ref-refresh-every, or set --kl-coef > 0")
    _validate_lora(cls, config)
    _validate_memory_options(cls, config)
    sharded = config.sharding()
    if sharded and not cls.shardable:
        setting, flag = sharded
        raise ValueError(
            f"{setting} shards full-precision models; {agent} keeps one (4-bit) base per process "
            f"instead: drop {flag}, or use another agent without --load-in-4bit"
        )


def _validate_lora(cls: AgentClass, config: TrainConfig) -> None:
    """A LoRA policy shares one (4-bit) base with its reference (adapters disabled): that
    reference cannot be refreshed, nor the base sharded; LoRA options need a rank."""
    agent, rank = config.agent, lora_rank(cls, config)
    if cls.lora == "required" and not rank:
        raise ValueError(f"lora_r={config.lora_r}: {agent} trains a policy LoRA; give --lora-r >= 1")
    if not rank:
        if config.load_in_4bit:
            raise ValueError("load_in_4bit=True freezes the base model, so only a LoRA policy can train on it: "
                             f"add --lora-r 8 (with --agent {agent}), or drop --load-in-4bit")
        for option in ("lora_alpha", "lora_target_modules", "critic_type"):
            if option in cls.options and not config.is_default(option):
                raise ValueError(f"{option}={getattr(config, option)!r} is read only with a LoRA policy: "
                                 f"add --lora-r 8, or drop --{option.replace('_', '-')}")
        return
    if config.ref_refresh_every:
        raise ValueError(f"ref_refresh_every={config.ref_refresh_every}: with a LoRA policy ({agent}, lora_r={rank}) "
                         "the reference is the base with adapters disabled and cannot be refreshed; set it to 0")
    if cls.needs_critic and config.critic_init != "policy":
        raise ValueError(f"critic_init={config.critic_init!r}: with a LoRA policy ({agent}, lora_r={rank}) the critic "
                         "is a value head on the shared base (critic_type); leave critic_init='policy'")
    sharded = config.sharding()
    if sharded:
        setting, flag = sharded
        raise ValueError(f"{setting} shards full-precision models; a LoRA policy ({agent}, lora_r={rank}) "
                         f"shares one base per process instead: drop {flag}, or drop --lora-r")


def _validate_memory_options(cls: AgentClass, config: TrainConfig) -> None:
    """bf16 trained weights need an optimiser that keeps their updates; the critic kinds of a fully
    fine-tuned policy; the optimisers and critics the sharded backends build."""
    from textrl.core.optim import check_optim

    lora = bool(lora_rank(cls, config))
    check_optim(config.optim, config.dtype, trains_full_weights=not lora)
    if config.critic != "separate":
        if lora:
            raise ValueError(f"critic={config.critic!r}: with a LoRA policy ({config.agent}, lora_r="
                             f"{lora_rank(cls, config)}) the critic is set by --critic-type (value_head or lora); "
                             "drop --critic")
        if config.critic_init != "policy":
            raise ValueError(f"critic={config.critic!r} with critic_init={config.critic_init!r}: a {config.critic} "
                             "critic is built on the policy's body; drop one of them")
    sharded = config.sharding()
    if sharded and (config.optim != "adamw_torch" or config.critic != "separate"):
        setting, flag = sharded
        what = f"optim={config.optim!r}" if config.optim != "adamw_torch" else f"critic={config.critic!r}"
        raise ValueError(f"{what} with {setting}: the sharded backends build torch's AdamW and separate "
                         f"models; drop {flag}, or use the defaults")


def _ignored_option(cls: AgentClass, agent: str, option: str, value: Any) -> str:
    """The refusal of an option the agent does not read: why, and which agents read it."""
    from textrl.core.agent_registry import AGENTS

    readers = [name for name, other in AGENTS.items() if option in other.options]
    why = cls.not_read.get(option, "its algorithm has no use for it")
    flag = "--" + option.replace("_", "-")
    where = (f"{option} is read only by agent={readers[0]}" if len(readers) == 1
             else f"{option} is read by agent={'/'.join(readers)}" if readers else "")
    choose = f" or choose --agent {readers[0]}" if readers else ""
    return f"{agent} does not read {option}={value!r} ({why}); {where + ': ' if where else ''}drop {flag}{choose}"


__all__ = ["AgentClass", "lora_rank", "needs_reference", "option", "validate_config"]
