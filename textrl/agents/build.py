"""An agent's construction: validation of a config against the agent's declarations, the
tokenizer, the policy (and its format warm-up), the reference, the critic, a policy LoRA, the
reward the agent scores with, and what the declarations and the handed facts resolve to (an
option's agent default, the LoRA rank, whether a reference is kept, the episode budget).
:class:`~textrl.agents.base.PPOAgent` keeps the classmethod hooks (``from_config``,
``load_policy``, ``build_critic``, ``validate_config``) that call these functions; subclasses
override the hooks.

What construction needs of the run's environment (the warm-up pairs, the episode budget) is
handed in as a :class:`textrl.core.env_facts.EnvFacts` (the trainer builds it from the environment it
already holds); without one it is asked of the provider ``textrl.envs`` registers. Nothing here
imports the environments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from textrl.config import AGENT_OPTIONS, TrainConfig
from textrl.core.env_facts import EnvFacts, env_facts_of
from textrl.core.precision import Precision
from textrl.models.checks import check_tokenizer_fits, name_of

if TYPE_CHECKING:
    from textrl.agents.base import PPOAgent


def policy_name(config: TrainConfig) -> str:
    """How messages name the policy: ``config.model`` (a path or hub id), or the model object's."""
    return config.model if isinstance(config.model, str) else name_of(config.model)


def tokenizer_name(config: TrainConfig) -> str:
    """How messages name the tokenizer: ``config.tokenizer``, else the policy's (its own tokenizer)."""
    if config.tokenizer is None:
        return policy_name(config)
    return config.tokenizer if isinstance(config.tokenizer, str) else name_of(config.tokenizer)


def warmup_pairs(config: TrainConfig) -> list[tuple[Any, str]] | None:
    """The (prompt, completion) pairs of the run's environment's format warm-up, drawn from its
    training rows (None: it has none, as a plain ``--dataset`` has none), through the environment
    provider (:func:`textrl.core.env_facts.env_facts_of`)."""
    return env_facts_of(config).warmup_pairs


def _own_lora_weights(view: nn.Module, weights: list[tuple[str, nn.Parameter]]) -> nn.Module:
    """Register the LoRA ``weights`` of a view of the shared base on ``view`` itself, so that the
    agent's ``state_dict`` (checkpoints, resume) and ``parameters`` hold them; the base stays out."""
    for name, param in weights:
        view.register_parameter(name.replace(".", "__"), param)
    return view


# -- the declarations, resolved ---------------------------------------------------------------------
def option(agent: PPOAgent, name: str) -> Any:
    """An agent option whose unset value (None) means "the agent's default": the config's
    value, else the class attribute ``default_<name>`` (e.g. ``clip_eps_high``)."""
    value = getattr(agent.config, name)
    return getattr(type(agent), f"default_{name}", None) if value is None else value


def lora_rank(cls: type[PPOAgent], config: TrainConfig) -> int | None:
    """The policy LoRA's rank: ``lora_r``, else ``cls.default_lora_r`` (None: no LoRA)."""
    return config.lora_r if config.lora_r is not None else cls.default_lora_r


def needs_reference(config: TrainConfig) -> bool:
    """Whether the agent keeps a reference model: something reads it, the KL penalty
    (``kl_coef > 0``, in the reward or the loss), the adaptive KL controller (fed the measured
    KL) or the ``kl/after_update`` monitor. At ``kl_coef=0`` without those none is built or
    loaded, no reference forward runs, and the KL monitors are absent from the metrics."""
    return config.kl_coef > 0 or config.adaptive_kl or config.kl_after_update


def episode_budget(agent: PPOAgent) -> int:
    """The run's token budget of an episode after the prompt (agent and observation tokens):
    the one the trainer handed over (``agent.env_facts``: ``max_episode_tokens``, else the
    environment's default, fitted to the context), else ``max_episode_tokens``, else the
    environment's default read through :func:`textrl.core.env_facts.env_facts_of` (``max_new_tokens``
    for a single turn). The constant of the length terms (Dr. GRPO's denominator, DAPO's
    overlong penalty); never a batch's padded ``T``."""
    if agent.env_facts is None:
        if agent.config.max_episode_tokens is not None:
            return int(agent.config.max_episode_tokens)
        agent.env_facts = env_facts_of(agent.config, warmup=False)
    return agent.env_facts.episode_budget


# -- validation -----------------------------------------------------------------------------------
def validate_config(cls: type[PPOAgent], config: TrainConfig) -> None:
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


def _validate_lora(cls: type[PPOAgent], config: TrainConfig) -> None:
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


def _validate_memory_options(cls: type[PPOAgent], config: TrainConfig) -> None:
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


def _ignored_option(cls: type[PPOAgent], agent: str, option: str, value: Any) -> str:
    """The refusal of an option the agent does not read: why, and which agents read it."""
    from textrl.core.agent_registry import AGENTS

    readers = [name for name, other in AGENTS.items() if option in other.options]
    why = cls.not_read.get(option, "its algorithm has no use for it")
    flag = "--" + option.replace("_", "-")
    where = (f"{option} is read only by agent={readers[0]}" if len(readers) == 1
             else f"{option} is read by agent={'/'.join(readers)}" if readers else "")
    choose = f" or choose --agent {readers[0]}" if readers else ""
    return f"{agent} does not read {option}={value!r} ({why}); {where + ': ' if where else ''}drop {flag}{choose}"


# -- the warm-up's record -------------------------------------------------------------------------
def warmup_none(config: TrainConfig, facts: EnvFacts | None, *, agent_warms: bool = True) -> dict[str, Any] | None:
    """The warm-up record when none runs (``asked_steps``, ``ran_steps`` 0, the ``reason``: no
    steps asked, an environment without warm-up examples, an agent that loads its policy without
    the warm-up); None when it runs."""
    asked = int(config.warmup_sft_steps)
    if asked == 0:
        return {"asked_steps": 0, "ran_steps": 0, "reason": "warmup_sft_steps=0"}
    if facts is not None and not facts.warmup_pairs:
        return {"asked_steps": asked, "ran_steps": 0,
                "reason": f"environment {facts.env_id!r} has no warm-up examples (its warmup_examples() gives none)"}
    if not agent_warms:
        return {"asked_steps": asked, "ran_steps": 0,
                "reason": f"agent {config.agent!r} loads its policy without the warm-up"}
    return None


# -- models ---------------------------------------------------------------------------------------
def from_config(cls: type[PPOAgent], config: TrainConfig, device: torch.device | str = "cpu", log: Any = print,
                env_facts: EnvFacts | None = None, own_loader: bool = False) -> PPOAgent:
    """The agent of ``config`` (:meth:`PPOAgent.from_config`): tokenizer, policy (the format
    warm-up included, unless ``own_loader``: ``cls`` overrides ``load_policy``), a frozen reference
    copy, a critic when ``needs_critic``, optimisers; the agent keeps ``env_facts`` (its episode
    budget) and what its warm-up did (``warmup_record``)."""
    config.validate(cls)
    device = torch.device(device)
    precision = Precision.of(config, device)  # the run's; one the device cannot run is refused before any model loads
    tokenizer = load_tokenizer(config)
    if lora_rank(cls, config):
        return _from_config_lora(cls, config, tokenizer, precision, log, env_facts, own_loader)
    critic_from_reward_model = cls.needs_critic and config.critic_init == "reward_model"
    if critic_from_reward_model:  # before the policy loads: only the tokenizers are compared
        check_critic_tokenizer(config, tokenizer)
    policy, record, env_facts = _policy_and_warmup(cls, config, tokenizer, device, log, env_facts, own_loader)
    critic = cls.build_critic(config, policy) if cls.needs_critic else None
    if critic_from_reward_model:
        check_tokenizer_fits(tokenizer, critic, tokenizer_name=tokenizer_name(config),
                             model_name=str(config.reward_model))
    reference = precision.frozen_copy(policy) if needs_reference(config) else None
    agent = cls(policy, tokenizer, config, ref_policy=reference, critic=critic)
    return keep_construction(agent, env_facts, record)


def keep_construction(agent: PPOAgent, env_facts: EnvFacts | None, warmup: dict[str, Any]) -> PPOAgent:
    """Keep on ``agent`` what its construction was handed and did: ``env_facts`` and the warm-up
    record (``asked_steps``, ``ran_steps``, ``reason``) ``summary.json`` writes."""
    agent.env_facts = env_facts
    agent.warmup_record = warmup
    return agent


def _policy_and_warmup(cls: type[PPOAgent], config: TrainConfig, tokenizer: Any, device: torch.device, log: Any,
                       env_facts: EnvFacts | None, own: bool) -> tuple[nn.Module, dict[str, Any], EnvFacts | None]:
    """The policy, the record of its warm-up and the environment facts it read: the agent's own
    ``load_policy`` when it overrides it (which loads without the warm-up), else :func:`load_policy`."""
    if own:
        policy = cls.load_policy(config, tokenizer, device, log)
        if env_facts is None and config.warmup_sft_steps > 0:
            env_facts = env_facts_of(config)
        return policy, warmup_none(config, env_facts, agent_warms=False), env_facts
    return load_policy(config, tokenizer, device, log, env_facts)


def _from_config_lora(cls: type[PPOAgent], config: TrainConfig, tokenizer: Any, precision: Precision, log: Any,
                      env_facts: EnvFacts | None, own_loader: bool) -> PPOAgent:
    """The agent with a policy LoRA (``lora_r``) on one base, as TRL does with peft: the
    reference is that base with adapters disabled; the critic (if any) a value head on the
    base's final hidden states under the policy adapter (``critic_type='value_head'``: only the
    head trains) or under a critic adapter of its own (``'lora'``). ``load_in_4bit`` loads the
    base in 4-bit NF4; a full-precision tiny base gets the format warm-up first."""
    from textrl.agents.adapter_views import (
        CRITIC,
        POLICY,
        AdapterPolicy,
        build_adapter_stack,
        value_critic,
    )
    from textrl.models.adapters import load_base_model, lora_config

    if config.load_in_4bit:
        base = load_base_model(config.model, load_in_4bit=True, device=precision.device, precision=precision)
        check_tokenizer_fits(tokenizer, base, tokenizer_name=tokenizer_name(config), model_name=policy_name(config))
        record = warmup_none(config, env_facts) or {
            "asked_steps": int(config.warmup_sft_steps), "ran_steps": 0,
            "reason": "load_in_4bit=True: the 4-bit base is not warmed up"}
    else:
        base, record, env_facts = _policy_and_warmup(cls, config, tokenizer, precision.device, log, env_facts,
                                                     own_loader)
    lora = lora_config(lora_rank(cls, config), config.lora_alpha, config.lora_dropout, config.lora_target_modules,
                       model=base)
    lora_critic = cls.needs_critic and config.critic_type == "lora"
    stack, _ = build_adapter_stack(base, lora, critic_adapter=lora_critic)
    policy = _own_lora_weights(AdapterPolicy(stack, POLICY), stack.lora[POLICY])
    critic = None
    if cls.needs_critic:
        critic = _own_lora_weights(value_critic(stack, lora_critic), stack.lora[CRITIC] if lora_critic else [])
    reference = AdapterPolicy(stack, None) if needs_reference(config) else None
    agent = cls(policy, tokenizer, config, ref_policy=reference, critic=critic)
    agent.stack = stack
    return keep_construction(agent, env_facts, record)


def load_tokenizer(config: TrainConfig) -> Any:
    """``config.tokenizer`` (a path, hub id or tokenizer object), else the model's own tokenizer
    (found by the model object's ``name_or_path`` when ``config.model`` is an object)."""
    from textrl.models import load_tokenizer as load

    if config.tokenizer is not None:
        return load(config.tokenizer)
    if isinstance(config.model, str):
        return load(config.model)
    name = getattr(config.model, "name_or_path", None)
    if not name:
        raise ValueError(f"model is a {type(config.model).__name__} object without a name_or_path; "
                         "pass its tokenizer too (TrainConfig(tokenizer=...))")
    return load(name)


def load_policy(config: TrainConfig, tokenizer: Any, device: torch.device, log: Any = print,
                env_facts: EnvFacts | None = None) -> tuple[nn.Module, dict[str, Any], EnvFacts | None]:
    """The policy of ``config.model`` on ``device`` in the run's precision (``dtype``,
    ``attn_implementation``: :class:`textrl.core.precision.Precision`), eval mode, and the record of its
    warm-up: an environment with warm-up pairs (``env_facts``; the built-in tasks) gets a short
    supervised format warm-up first (``warmup_sft_steps``), under the run's autocast. Returns
    ``(policy, record, env_facts)``, the facts read from the environment when none were given."""
    from textrl.models import load_causal_lm

    precision = Precision.of(config, device)
    policy = load_causal_lm(config.model, device=device, **precision.model_kwargs())
    check_tokenizer_fits(tokenizer, policy, tokenizer_name=tokenizer_name(config), model_name=policy_name(config))
    if env_facts is None and config.warmup_sft_steps > 0:
        env_facts = env_facts_of(config)
    record = warmup_none(config, env_facts)
    if record is None:  # the warm-up, or (a resumed run) the start the run kept after it
        from textrl.core.user_files import absolute_local
        from textrl.run.warmup import warm_up

        stats = warm_up(policy, tokenizer, env_facts.warmup_pairs, steps=config.warmup_sft_steps,
                        lr=config.warmup_sft_lr, batch_size=config.warmup_sft_batch_size, seed=config.seed,
                        model_name=absolute_local(policy_name(config)), log=log, autocast=precision.autocast)
        record = {"asked_steps": int(config.warmup_sft_steps), "ran_steps": int(stats["steps"]), "reason": None,
                  "loaded": bool(stats["loaded"])}
    return policy.eval(), record, env_facts


def check_critic_tokenizer(config: TrainConfig, tokenizer: Any) -> None:
    """``critic_init='reward_model'``: the critic reads the policy's token ids with the reward
    model's body, so the reward model's tokenizer must give each policy token the same id
    (:func:`textrl.models.checks.check_critic_tokenizer`); refused before any model loads."""
    from textrl.models import load_tokenizer as load
    from textrl.models.checks import check_critic_tokenizer as check

    try:
        reward_tokenizer = load(config.reward_model)
    except ValueError as err:
        raise ValueError(f"critic_init='reward_model': the tokenizer of reward model {config.reward_model!r} "
                         f"cannot be compared with the policy's: {err}") from None
    check(tokenizer, reward_tokenizer, policy=tokenizer_name(config), reward_model=str(config.reward_model))


def build_critic(config: TrainConfig, policy: nn.Module) -> nn.Module:
    """``V(s_t)``, on the policy's device and in the run's precision: a value head on a copy of the
    policy, or on the reward model (``critic_init``); with ``critic='shared'`` a value head on the
    policy's own body, with ``critic='lora'`` a LoRA adapter and a value head on a frozen copy of
    that body (docs/training.md, "Memory")."""
    from textrl.models.value import SharedTrunkValue, ValueModel, lora_value_model

    if config.critic == "shared":
        return SharedTrunkValue.on(policy)
    precision = Precision.of(config, next(policy.parameters()).device)  # the run's (one object a setting and device)
    if config.critic == "lora":
        return lora_value_model(policy, precision.frozen, precision.dtype)
    if config.critic_init == "reward_model":
        from textrl.models import load_reward_model

        return ValueModel.from_reward_model(  # its head on the backbone's device, in its dtype
            load_reward_model(config.reward_model, device=precision.device, **precision.model_kwargs()))
    return ValueModel.from_causal_lm(policy)


# -- the reward the agent scores with -------------------------------------------------------------
def task_reward(agent: PPOAgent, spec: str, default: Any = None) -> Any:
    """The task reward of reward ``spec`` (``textrl.rewards.parse_reward_spec``; when empty,
    ``default``, a reward callable such as an environment's own), joined by the agent's own
    ``reward_model`` (if it has one) as component 'reward_model', scored in batches by
    ``NeuralReward``; None when there is none of them."""
    from textrl.rewards import CompositeReward, NeuralReward, parse_reward_spec, reward_name

    model = getattr(agent, "reward_model", None)
    rules = parse_reward_spec(spec) if spec.strip() else None
    if callable(default) and rules is not None:  # the environment's own function and --reward-model's spec
        parts = {reward_name(default): (default, 1.0)} if not isinstance(default, CompositeReward) else \
            {name: (fn, default.weights[name]) for name, fn in default.functions.items()}
        rules = CompositeReward({**parts, **{k: (f, rules.weights[k]) for k, f in rules.functions.items()}})
    elif callable(default):
        rules = default
    place_neural_rewards(agent, rules)
    if model is None:
        return rules
    neural = NeuralReward(model, agent.tokenizer, batch_size=agent.config.forward_batch_size,
                          autocast=agent.precision.autocast, padding_free=agent.config.padding_free)
    if isinstance(rules, CompositeReward):
        parts = {name: (fn, rules.weights[name]) for name, fn in rules.functions.items()}
    else:
        parts = {} if rules is None else {reward_name(rules): (rules, 1.0)}
    return CompositeReward({**parts, "reward_model": (neural, 1.0)})


def place_neural_rewards(agent: PPOAgent, reward: Any) -> None:
    """Move every reward model among ``reward``'s functions (a :class:`NeuralReward`, alone or
    in a ``CompositeReward``) to the agent's device, in the run's precision, scoring under its
    autocast and with its ``padding_free``: a ``reward_model:PATH`` spec loads on the CPU."""
    from textrl.rewards import CompositeReward, NeuralReward

    functions = reward.functions.values() if isinstance(reward, CompositeReward) else [reward]
    for fn in functions:
        if isinstance(fn, NeuralReward):
            fn.place(agent.precision, padding_free=agent.config.padding_free)


__all__ = [
    "build_critic", "check_critic_tokenizer", "episode_budget", "from_config", "keep_construction", "load_policy",
    "load_tokenizer", "lora_rank", "needs_reference", "option", "place_neural_rewards", "policy_name", "task_reward",
    "tokenizer_name", "validate_config", "warmup_none", "warmup_pairs",
]
