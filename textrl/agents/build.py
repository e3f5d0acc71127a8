"""An agent's construction: validation of a config against the agent's declarations
(:mod:`textrl.agents.declarations`), the run's precision (decided once, in :func:`from_config`), the
tokenizer, the policy (and its format warm-up), the reference, the critic, a policy LoRA, the actor
and its generation engine (:func:`build_actor`), the reward the agent scores with, and what the
declarations and the handed facts resolve to (an option's agent default, the LoRA rank, whether a
reference is kept, the episode budget).
:class:`~textrl.agents.base.PPOAgent` keeps the classmethod hooks (``from_config``,
``load_policy``, ``build_critic``, ``validate_config``) that call these functions; subclasses
override the hooks.

What construction needs of the run's environment (the warm-up pairs, the episode budget) is
handed in as a :class:`textrl.core.env_facts.EnvFacts` (the trainer builds it from the environment it
already holds); without one it is asked of the provider ``textrl.envs`` registers. Nothing here
imports the environments.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from textrl.agents.actor import Actor
from textrl.agents.declarations import (
    AgentClass,
    lora_rank,
    needs_reference,
    option,
    validate_config,
)
from textrl.agents.forwards import own_behaviour_logprobs
from textrl.agents.teacher import load_teacher
from textrl.config import TrainConfig
from textrl.core.env_facts import EnvFacts, env_facts_of
from textrl.core.precision import Precision
from textrl.generation import engine_for
from textrl.generation.base import run_engine_name
from textrl.models.checks import check_tokenizer_fits, name_of


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


# -- the declarations, resolved (the rest: textrl/agents/declarations.py) ----------------------------
def episode_budget(config: TrainConfig, facts: EnvFacts | None) -> int:
    """The run's token budget of an episode after the prompt (agent and observation tokens):
    the one the trainer handed over (``facts``, an agent's ``env_facts``: ``max_episode_tokens``,
    else the environment's default, fitted to the context), else ``max_episode_tokens``, else the
    environment's default read through :func:`textrl.core.env_facts.env_facts_of` (``max_new_tokens``
    for a single turn: :func:`run_facts` keeps it). The constant of the length terms (Dr. GRPO's
    denominator, DAPO's overlong penalty); never a batch's padded ``T``."""
    if facts is None and config.max_episode_tokens is not None:
        return int(config.max_episode_tokens)
    return run_facts(config, facts).episode_budget


def run_facts(config: TrainConfig, facts: EnvFacts | None) -> EnvFacts:
    """``facts`` (what the trainer handed over), else the environment's read through
    :func:`textrl.core.env_facts.env_facts_of` (without the warm-up pairs): an agent keeps them as
    its ``env_facts``, so that the environment is read once."""
    return facts if facts is not None else env_facts_of(config, warmup=False)


def run_precision(config: TrainConfig, device: torch.device | str, precision: Precision | None = None) -> Precision:
    """The run's :class:`~textrl.core.precision.Precision`: ``precision`` where the run's set-up decided it
    (:func:`from_config` hands it to the hooks and the agent), else decided here from ``config`` on
    ``device`` (an agent, a hook or a loader called directly; the same object, one per setting and device)."""
    return precision if precision is not None else Precision.of(config, device)


def call_hook(hook: Any, *args: Any, **new: Any) -> Any:
    """``hook(*args, **new)`` with only the keyword arguments of ``new`` that ``hook`` takes (by name or
    through ``**kwargs``): a hook written before it was handed them (a user's ``load_policy``,
    ``build_critic`` or ``__init__`` without ``precision``) is called as it was written."""
    params = inspect.signature(hook).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        names = {p.name for p in params}
        new = {k: v for k, v in new.items() if k in names}
    return hook(*args, **new)


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
def from_config(cls: AgentClass, config: TrainConfig, device: torch.device | str = "cpu", log: Any = print,
                env_facts: EnvFacts | None = None, own_loader: bool = False) -> Any:
    """The agent of ``config`` (:meth:`PPOAgent.from_config`): tokenizer, policy (the format
    warm-up included, unless ``own_loader``: ``cls`` overrides ``load_policy``), a frozen reference
    copy, a critic when ``needs_critic``, optimisers; the agent keeps ``env_facts`` (its episode
    budget) and what its warm-up did (``warmup_record``).

    The run's precision is decided here, once (:meth:`textrl.core.precision.Precision.of`: one the
    device cannot run is refused before any model loads), and handed to the hooks that take it
    (``load_policy``, ``build_critic``, the agent's ``__init__``: ``precision=``; :func:`call_hook`)."""
    config.validate(cls)
    device = torch.device(device)
    precision = Precision.of(config, device)  # the run's, decided once
    tokenizer = load_tokenizer(config)
    if lora_rank(cls, config):
        return _from_config_lora(cls, config, tokenizer, precision, log, env_facts, own_loader)
    critic_from_reward_model = cls.needs_critic and config.critic_init == "reward_model"
    if critic_from_reward_model:  # before the policy loads: only the tokenizers are compared
        check_critic_tokenizer(config, tokenizer)
    policy, record, env_facts = _policy_and_warmup(cls, config, tokenizer, precision, log, env_facts, own_loader)
    critic = call_hook(cls.build_critic, config, policy, precision=precision) if cls.needs_critic else None
    if critic_from_reward_model:
        check_tokenizer_fits(tokenizer, critic, tokenizer_name=tokenizer_name(config),
                             model_name=str(config.reward_model))
    reference = precision.frozen_copy(policy) if needs_reference(config) else None
    agent = call_hook(cls, policy, tokenizer, config, ref_policy=reference, critic=critic, precision=precision)
    agent.env_facts, agent.warmup_record = env_facts, record  # summary.json writes the record
    return agent


def _policy_and_warmup(cls: AgentClass, config: TrainConfig, tokenizer: Any, precision: Precision, log: Any,
                       env_facts: EnvFacts | None, own: bool) -> tuple[nn.Module, dict[str, Any], EnvFacts | None]:
    """The policy, the record of its warm-up and the environment facts it read: the agent's own
    ``load_policy`` when it overrides it (which loads without the warm-up; handed ``precision`` when
    it takes it), else :func:`load_policy`."""
    if own:
        policy = call_hook(cls.load_policy, config, tokenizer, precision.device, log, precision=precision)
        if env_facts is None and config.warmup_sft_steps > 0:
            env_facts = env_facts_of(config)
        return policy, warmup_none(config, env_facts, agent_warms=False), env_facts
    return load_policy(config, tokenizer, precision.device, log, env_facts, precision=precision)


def _from_config_lora(cls: AgentClass, config: TrainConfig, tokenizer: Any, precision: Precision, log: Any,
                      env_facts: EnvFacts | None, own_loader: bool) -> Any:
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
        base, record, env_facts = _policy_and_warmup(cls, config, tokenizer, precision, log, env_facts, own_loader)
    lora = lora_config(lora_rank(cls, config), config.lora_alpha, config.lora_dropout, config.lora_target_modules,
                       model=base)
    lora_critic = cls.needs_critic and config.critic_type == "lora"
    stack, _ = build_adapter_stack(base, lora, critic_adapter=lora_critic)
    policy = _own_lora_weights(AdapterPolicy(stack, POLICY), stack.lora[POLICY])
    critic = None
    if cls.needs_critic:
        critic = _own_lora_weights(value_critic(stack, lora_critic), stack.lora[CRITIC] if lora_critic else [])
    reference = AdapterPolicy(stack, None) if needs_reference(config) else None
    agent = call_hook(cls, policy, tokenizer, config, ref_policy=reference, critic=critic, precision=precision)
    agent.stack, agent.env_facts, agent.warmup_record = stack, env_facts, record
    return agent


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
                env_facts: EnvFacts | None = None, *,
                precision: Precision | None = None) -> tuple[nn.Module, dict[str, Any], EnvFacts | None]:
    """The policy of ``config.model`` on ``device`` in the run's precision (``dtype``,
    ``attn_implementation``: :class:`textrl.core.precision.Precision`), eval mode, and the record of its
    warm-up: an environment with warm-up pairs (``env_facts``; the built-in tasks) gets a short
    supervised format warm-up first (``warmup_sft_steps``), under the run's autocast. Returns
    ``(policy, record, env_facts)``, the facts read from the environment when none were given.
    ``precision``: the run's (:func:`run_precision`)."""
    from textrl.models import load_causal_lm

    precision = run_precision(config, device, precision)
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


def build_critic(config: TrainConfig, policy: nn.Module, precision: Precision | None = None) -> nn.Module:
    """``V(s_t)``, on the policy's device and in the run's precision: a value head on a copy of the
    policy, or on the reward model (``critic_init``); with ``critic='shared'`` a value head on the
    policy's own body, with ``critic='lora'`` a LoRA adapter and a value head on a frozen copy of
    that body (docs/training.md, "Memory"). ``precision``: the run's (:func:`run_precision`)."""
    from textrl.models.value import SharedTrunkValue, ValueModel, lora_value_model

    if config.critic == "shared":
        return SharedTrunkValue.on(policy)
    precision = run_precision(config, next(policy.parameters()).device, precision)
    if config.critic == "lora":
        return lora_value_model(policy, precision.frozen, precision.dtype)
    if config.critic_init == "reward_model":
        from textrl.models import load_reward_model

        return ValueModel.from_reward_model(  # its head on the backbone's device, in its dtype
            load_reward_model(config.reward_model, device=precision.device, **precision.model_kwargs()))
    return ValueModel.from_causal_lm(policy)


# -- the actor ------------------------------------------------------------------------------------
def run_lengths(config: Any, facts: Any) -> tuple[int, int] | None:
    """``(prompts' cap, episode budget)`` the engine is told (:meth:`GenerationEngine.fit_lengths`):
    the ones the trainer resolved (``facts``, :class:`textrl.core.env_facts.EnvFacts`), else the config's
    ``max_prompt_length`` and ``max_episode_tokens``; None while either is unknown."""
    prompts = getattr(facts, "max_prompt_length", None) or getattr(config, "max_prompt_length", None)
    budget = facts.episode_budget if facts is not None else getattr(config, "max_episode_tokens", None)
    return None if prompts is None or budget is None else (int(prompts), int(budget))


def build_actor(agent: Any) -> Actor:
    """``agent``'s actor for its backend and device, over its models and its forwards (the learner's,
    one precision). The one place the generation engine is chosen: ``config.generation_engine``
    (``vllm-server`` with ``config.vllm_server``), ``auto`` resolved for the device and for a backend that partitions the weights (its forwards are
    collectives), and checked against the backend (``ValueError`` naming both). An agent that
    overrides ``behaviour_logprobs`` (an old-policy snapshot) has the actor call it."""
    backend, config = agent.backend, agent.config
    name = run_engine_name(config.generation_engine, getattr(config, "vllm_server", None))
    engine = engine_for(name, agent.device, partitions_weights=backend.partitions_weights)
    engine.configure(config)
    if (lengths := run_lengths(config, getattr(agent, "env_facts", None))) is not None:
        engine.fit_lengths(*lengths)
    engine.check_backend(backend.partitions_weights)
    teacher = agent.teacher = load_teacher(config, agent.tokenizer, agent.learner.forwards, getattr(agent, "teacher", None))
    actor = Actor(agent.config, agent.policy, agent.ref_policy, agent.critic, agent.learner.forwards, engine, backend,
                  eos_token_id=agent.eos_token_id, pad_token_id=agent.pad_token_id, device=agent.device,
                  behaviour=None if own_behaviour_logprobs(type(agent)) else agent.behaviour_logprobs,
                  teacher=teacher)
    if not int(getattr(config, "max_staleness", 0) or 0):  # an asynchronous run's actor starts an engine of its
        actor.start_engine()  # own (AsyncActor.of); the learner's is never called there, and stays unstarted
    return actor


# -- the reward the agent scores with -------------------------------------------------------------
def task_reward(agent: Any, spec: str, default: Any = None) -> Any:
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
    place_neural_rewards(rules, agent.precision, agent.config.padding_free)
    if model is None:
        return rules
    neural = NeuralReward(model, agent.tokenizer, batch_size=agent.config.forward_batch_size,
                          autocast=agent.precision.autocast, padding_free=agent.config.padding_free)
    if isinstance(rules, CompositeReward):
        parts = {name: (fn, rules.weights[name]) for name, fn in rules.functions.items()}
    else:
        parts = {} if rules is None else {reward_name(rules): (rules, 1.0)}
    return CompositeReward({**parts, "reward_model": (neural, 1.0)})


def place_neural_rewards(reward: Any, precision: Precision, padding_free: bool) -> None:
    """Move every reward model among ``reward``'s functions (a :class:`NeuralReward`, alone or
    in a ``CompositeReward``) to the run's device, in its ``precision``, scoring under its
    autocast and with ``padding_free``: a ``reward_model:PATH`` spec loads on the CPU."""
    from textrl.rewards import CompositeReward, NeuralReward

    functions = reward.functions.values() if isinstance(reward, CompositeReward) else [reward]
    for fn in functions:
        if isinstance(fn, NeuralReward):
            fn.place(precision, padding_free=padding_free)


__all__ = [
    "AgentClass", "build_actor", "build_critic", "call_hook", "check_critic_tokenizer", "episode_budget", "from_config", "load_policy",
    "load_tokenizer", "lora_rank", "needs_reference", "option", "place_neural_rewards", "policy_name", "run_facts", "run_lengths", "run_precision", "task_reward",
    "tokenizer_name", "validate_config", "warmup_none", "warmup_pairs",
]
