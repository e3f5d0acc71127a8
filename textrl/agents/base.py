"""What every PPO-family agent shares: generation, prefill forwards, optimisers, the update loop.

An agent owns its models and optimisers and consumes one rollout TensorDict (docs/design.md, "The rollout TensorDict"):

- :meth:`PPOAgent.act` samples responses for a batch of prompts (``model.generate`` with a KV
  cache, in micro-batches);
- :meth:`PPOAgent.evaluate` recomputes log-probs (and values) of given tokens in one prefill
  forward per micro-batch;
- :meth:`PPOAgent.process_rollout` writes the behaviour/reference log-probs, values, the shaped
  per-token reward and the advantages into the rollout (each agent's own estimator);
- :meth:`PPOAgent.update` runs K epochs of shuffled minibatch updates and returns metrics; steps
  that leave NaN/inf weights are rolled back (the backend's rollback copy, staged while the
  rollout is processed: ``Backend.stage_rollback`` / ``take_rollback`` / ``roll_back_nonfinite``).

Subclasses implement :meth:`~PPOAgent.estimate` (advantages) and :meth:`~PPOAgent.loss`
(the minibatch loss); the math itself lives in :mod:`textrl.functional`. How the backward, the
optimiser step, weight gathering and full-state save / restore run over processes is the
agent's backend's (:attr:`PPOAgent.backend`, :mod:`textrl.parallel`; docs/parallelism.md).
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn

from textrl.agents import forwards
from textrl.agents import update as update_loop
from textrl.agents.forwards import (
    RolloutForward,
    attended_response,
    position_ids_for,
    sequence_inputs,
    warp_logits,
)
from textrl.agents.update import LossTerms, UpdateTally, total_loss
from textrl.config import AGENT_OPTIONS, TrainConfig
from textrl.distributed import Distributed
from textrl.functional import aggregate_loss, clipped_policy_loss, kl_penalty, kl_shaped_rewards
from textrl.keys import KEYS
from textrl.kl_control import make_kl_controller
from textrl.models.checks import check_tokenizer_fits, name_of
from textrl.models.sampling import neutralised_notice
from textrl.parallel import Backend, SingleProcess
from textrl.precision import Precision

SCORE = KEYS.score
"""Key of the task score per row ``[B]`` (float), before any KL shaping."""

SHARED_OPTIONS = frozenset({
    "ppo_epochs", "num_minibatches", "gradient_accumulation_steps", "clip_eps", "dual_clip", "kl_coef",
    "kl_kind", "adaptive_kl", "kl_target", "kl_horizon", "kl_early_stop", "ratio_threshold",
    "kl_after_update", "ref_refresh_every", "actor_lr", "lr_schedule", "lr_warmup_steps", "max_grad_norm",
})
"""Options :class:`PPOAgent`'s own machinery reads for every agent (update loop, KL control, optimisers)."""
POLICY_OBJECTIVE_OPTIONS = frozenset({"entropy_coef", "loss_aggregation", "kl_in", "kl_hinge", "clip_eps_high"})
"""Options of :meth:`PPOAgent.policy_objective` (the token-level clipped surrogate)."""
CRITIC_OPTIONS = frozenset({"critic_lr", "vf_coef", "critic_init"})
"""Options of an agent with a critic (:attr:`PPOAgent.needs_critic`)."""
LORA_OPTIONS = frozenset({"lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit"})
"""Options of a policy LoRA (``lora`` 'required' or 'optional')."""


def _own_lora_weights(view: nn.Module, weights: list[tuple[str, nn.Parameter]]) -> nn.Module:
    """Register the LoRA ``weights`` of a view of the shared base on ``view`` itself, so that the
    agent's ``state_dict`` (checkpoints, resume) and ``parameters`` hold them; the base stays out."""
    for name, param in weights:
        view.register_parameter(name.replace(".", "__"), param)
    return view


def policy_name(config: TrainConfig) -> str:
    """How messages name the policy: ``config.model`` (a path or hub id), or the model object's."""
    return config.model if isinstance(config.model, str) else name_of(config.model)


def warmup_pairs(config: TrainConfig) -> list[tuple[Any, str]] | None:
    """The (prompt, completion) pairs of the run's environment's format warm-up, drawn from its
    training rows (None: it has none, as a plain ``--dataset`` has none). An environment whose
    ``warmup_examples`` takes ``answer_accuracy`` gets ``warmup_answer_accuracy``."""
    from textrl.envs.registry import split_rows, task_environment

    env = task_environment(config.env, config.dataset, config.reward, config.env_args)
    train_rows, _ = split_rows(env, config.eval_size, config.seed)
    settings = {}
    if "answer_accuracy" in inspect.signature(env.warmup_examples).parameters:
        settings["answer_accuracy"] = config.warmup_answer_accuracy
    return env.warmup_examples(list(train_rows), config.seed, **settings)


def tokenizer_name(config: TrainConfig) -> str:
    """How messages name the tokenizer: ``config.tokenizer``, else the policy's (its own tokenizer)."""
    if config.tokenizer is None:
        return policy_name(config)
    return config.tokenizer if isinstance(config.tokenizer, str) else name_of(config.tokenizer)


class PPOAgent(nn.Module):
    """Base of the PPO-family agents. Subclasses implement the estimator and the loss, and declare
    what they need and which options they read; :meth:`validate_config` checks a config against
    those declarations and :meth:`from_config` builds the agent's models and optimisers."""

    name = "ppo"
    """The ``--agent`` name (set by :func:`textrl.agents.register_agent`)."""
    needs_critic = True
    """Whether the agent trains a value model (:meth:`from_config` builds none when False)."""
    min_samples_per_prompt = 1
    """Fewest responses per prompt the estimator works with (a group baseline needs 2)."""
    lora = "no"
    """Policy LoRA: 'required' (the policy is an adapter), 'optional' (``--lora-r``) or 'no'."""
    default_lora_r: int | None = None
    """LoRA rank when ``lora_r`` is left unset (None: every policy weight trains)."""
    shardable = True
    """Whether FSDP / DeepSpeed ZeRO may shard the agent's models (full-precision copies)."""
    pipeline_reward: str | None = None
    """The reward model ``textrl pipeline`` trains for the agent: 'reward_model' (a full one),
    'reward_adapter' (a LoRA adapter on the SFT base), or None (not a pipeline agent)."""
    options: frozenset[str] = SHARED_OPTIONS
    """The :data:`textrl.config.AGENT_OPTIONS` the agent reads; another one set is refused."""
    not_read: dict[str, str] = {}
    """Why the agent does not read an option: the refusal names it (option -> reason)."""
    default_clip_eps = 0.2
    default_clip_eps_high: float | None = None
    """Upper clip when ``clip_eps_high`` is left unset (None: symmetric, ``clip_eps``)."""
    aggregation: str | None = None
    """The loss aggregation the algorithm fixes (None: ``config.loss_aggregation``); see
    :attr:`loss_aggregation`."""
    reuse_rollout_forward = True
    """See :meth:`reuses_rollout_forward`; set False to always run the update's own forward."""
    _rollout_forward: RolloutForward | None = None
    _reused: RolloutForward | None = None

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def validate_config(cls, config: TrainConfig) -> None:
        """Check ``config`` against the declarations (samples per prompt, options read, LoRA,
        sharding); ``ValueError`` names the agent, the option and what to do. Runs inside
        :meth:`TrainConfig.validate`, before any model loads; subclasses add their own checks."""
        agent = config.agent
        if config.n_samples_per_prompt < cls.min_samples_per_prompt:
            raise ValueError(
                f"n_samples_per_prompt={config.n_samples_per_prompt}: agent={agent!r} compares samples "
                f"within a group, so it needs n_samples_per_prompt >= {cls.min_samples_per_prompt}"
            )
        for option in sorted(AGENT_OPTIONS - cls.options):
            if not config.is_default(option):
                raise ValueError(cls._ignored_option(agent, option, getattr(config, option)))
        if "critic_init" in cls.options and config.critic_init == "reward_model" and not config.reward_model:
            raise ValueError("critic_init='reward_model' needs --reward-model PATH")
        if config.ref_refresh_every and not cls.needs_reference(config):
            raise ValueError(f"ref_refresh_every={config.ref_refresh_every} refreshes the reference model, which "
                             "kl_coef=0 does not build (nothing reads it): drop --ref-refresh-every, or set --kl-coef > 0")
        cls._validate_lora(config)
        sharded = config.sharding()
        if sharded and not cls.shardable:
            setting, flag = sharded
            raise ValueError(
                f"{setting} shards full-precision models; {agent} keeps one (4-bit) base per process "
                f"instead: drop {flag}, or use another agent without --load-in-4bit"
            )

    @classmethod
    def needs_reference(cls, config: TrainConfig) -> bool:
        """Whether the agent keeps a reference model: something reads it, the KL penalty
        (``kl_coef > 0``, in the reward or the loss), the adaptive KL controller (fed the measured
        KL) or the ``kl/after_update`` monitor. At ``kl_coef=0`` without those none is built or
        loaded, no reference forward runs, and the KL monitors are absent from the metrics."""
        return config.kl_coef > 0 or config.adaptive_kl or config.kl_after_update

    @classmethod
    def lora_rank(cls, config: TrainConfig) -> int | None:
        """The policy LoRA's rank: ``lora_r``, else :attr:`default_lora_r` (None: no LoRA)."""
        return config.lora_r if config.lora_r is not None else cls.default_lora_r

    @classmethod
    def _validate_lora(cls, config: TrainConfig) -> None:
        """A LoRA policy shares one (4-bit) base with its reference (adapters disabled): that
        reference cannot be refreshed, nor the base sharded; LoRA options need a rank."""
        agent, rank = config.agent, cls.lora_rank(config)
        if cls.lora == "required" and not rank:
            raise ValueError(f"lora_r={config.lora_r}: {agent} trains a policy LoRA; give --lora-r >= 1")
        if not rank:
            if config.load_in_4bit:
                raise ValueError("load_in_4bit=True freezes the base model, so only a LoRA policy can train on it: "
                                 f"add --lora-r 8 (with --agent {agent}), or drop --load-in-4bit")
            for option in ("lora_alpha", "lora_dropout", "lora_target_modules", "critic_type"):
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

    @classmethod
    def _ignored_option(cls, agent: str, option: str, value: Any) -> str:
        """The refusal of an option the agent does not read: why, and which agents read it."""
        from textrl.agent_registry import AGENTS

        readers = [name for name, other in AGENTS.items() if option in other.options]
        why = cls.not_read.get(option, "its algorithm has no use for it")
        flag = "--" + option.replace("_", "-")
        where = (f"{option} is read only by agent={readers[0]}" if len(readers) == 1
                 else f"{option} is read by agent={'/'.join(readers)}" if readers else "")
        choose = f" or choose --agent {readers[0]}" if readers else ""
        return f"{agent} does not read {option}={value!r} ({why}); {where + ': ' if where else ''}drop {flag}{choose}"

    @classmethod
    def brings_reward(cls, config: TrainConfig) -> bool:
        """Whether the agent scores responses with a reward model of its own (then ``--reward`` may be empty)."""
        return False

    @classmethod
    def from_config(cls, config: TrainConfig, device: torch.device | str = "cpu", log: Any = print) -> PPOAgent:
        """The agent of ``config``: tokenizer, policy (the tiny model's format warm-up included),
        a frozen reference copy, a critic when :attr:`needs_critic`, optimisers.

        ``config`` is validated for this class first, before any model loads.
        """
        config.validate(cls)
        Precision.of(config, device)  # a precision the device cannot run is refused before any model loads
        tokenizer = cls.load_tokenizer(config)
        if cls.lora_rank(config):
            return cls._from_config_lora(config, tokenizer, torch.device(device), log)
        critic_from_reward_model = cls.needs_critic and config.critic_init == "reward_model"
        if critic_from_reward_model:  # before the policy loads: only the tokenizers are compared
            cls.check_critic_tokenizer(config, tokenizer)
        policy = cls.load_policy(config, tokenizer, torch.device(device), log)
        critic = cls.build_critic(config, policy) if cls.needs_critic else None
        if critic_from_reward_model:
            check_tokenizer_fits(tokenizer, critic, tokenizer_name=tokenizer_name(config),
                                 model_name=str(config.reward_model))
        reference = copy.deepcopy(policy) if cls.needs_reference(config) else None
        return cls(policy, tokenizer, config, ref_policy=reference, critic=critic)

    @classmethod
    def _from_config_lora(cls, config: TrainConfig, tokenizer: Any, device: torch.device, log: Any) -> PPOAgent:
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
            base = load_base_model(config.model, load_in_4bit=True, device=device,
                                   precision=Precision.of(config, device))
            check_tokenizer_fits(tokenizer, base, tokenizer_name=tokenizer_name(config), model_name=policy_name(config))
        else:
            base = cls.load_policy(config, tokenizer, device, log)
        lora = lora_config(cls.lora_rank(config), config.lora_alpha, config.lora_dropout, config.lora_target_modules,
                           model=base)
        lora_critic = cls.needs_critic and config.critic_type == "lora"
        stack, _ = build_adapter_stack(base, lora, critic_adapter=lora_critic)
        policy = _own_lora_weights(AdapterPolicy(stack, POLICY), stack.lora[POLICY])
        critic = None
        if cls.needs_critic:
            critic = _own_lora_weights(value_critic(stack, lora_critic), stack.lora[CRITIC] if lora_critic else [])
        reference = AdapterPolicy(stack, None) if cls.needs_reference(config) else None
        agent = cls(policy, tokenizer, config, ref_policy=reference, critic=critic)
        agent.stack = stack
        return agent

    @classmethod
    def load_tokenizer(cls, config: TrainConfig) -> Any:
        """``config.tokenizer`` (a path, hub id or tokenizer object), else the model's own tokenizer
        (found by the model object's ``name_or_path`` when ``config.model`` is an object)."""
        from textrl.models import load_tokenizer

        if config.tokenizer is not None:
            return load_tokenizer(config.tokenizer)
        if isinstance(config.model, str):
            return load_tokenizer(config.model)
        name = getattr(config.model, "name_or_path", None)
        if not name:
            raise ValueError(f"model is a {type(config.model).__name__} object without a name_or_path; "
                             "pass its tokenizer too (TrainConfig(tokenizer=...))")
        return load_tokenizer(name)

    @classmethod
    def load_policy(cls, config: TrainConfig, tokenizer: Any, device: torch.device, log: Any = print) -> nn.Module:
        """The policy of ``config.model`` on ``device`` in the run's precision (``dtype``,
        ``attn_implementation``: :class:`textrl.precision.Precision`), eval mode; an environment
        with a warm-up source (the built-in tasks) gets a short supervised format warm-up first
        (``warmup_sft_steps``, :func:`warmup_pairs`), under the run's autocast."""
        from textrl.models import load_causal_lm

        precision = Precision.of(config, device)
        policy = load_causal_lm(config.model, device=device, **precision.model_kwargs())
        check_tokenizer_fits(tokenizer, policy, tokenizer_name=tokenizer_name(config), model_name=policy_name(config))
        pairs = warmup_pairs(config) if config.warmup_sft_steps > 0 else None
        if pairs:
            from textrl.warmup import sft_warmup

            stats = sft_warmup(
                policy, tokenizer, pairs, steps=config.warmup_sft_steps, lr=config.warmup_sft_lr,
                batch_size=config.warmup_sft_batch_size, seed=config.seed, autocast=precision.autocast,
            )
            log(f"warm-up: {stats['steps']} SFT steps on the format, loss {stats['loss_first']:.2f} -> "
                f"{stats['loss_last']:.2f} in {stats['seconds']:.1f}s")
        return policy.eval()

    @classmethod
    def check_critic_tokenizer(cls, config: TrainConfig, tokenizer: Any) -> None:
        """``critic_init='reward_model'``: the critic reads the policy's token ids with the reward
        model's body, so the reward model's tokenizer must give each policy token the same id
        (:func:`textrl.models.checks.check_critic_tokenizer`); refused before any model loads."""
        from textrl.models import load_tokenizer
        from textrl.models.checks import check_critic_tokenizer

        try:
            reward_tokenizer = load_tokenizer(config.reward_model)
        except ValueError as err:
            raise ValueError(f"critic_init='reward_model': the tokenizer of reward model {config.reward_model!r} "
                             f"cannot be compared with the policy's: {err}") from None
        check_critic_tokenizer(tokenizer, reward_tokenizer, policy=tokenizer_name(config),
                               reward_model=str(config.reward_model))

    @classmethod
    def build_critic(cls, config: TrainConfig, policy: nn.Module) -> nn.Module:
        """``V(s_t)``: a value head on a copy of the policy, or on the reward model (``critic_init``),
        on the policy's device and in the run's precision."""
        from textrl.models.value import ValueModel

        if config.critic_init == "reward_model":
            from textrl.models import load_reward_model

            precision = Precision.of(config, next(policy.parameters()).device)
            return ValueModel.from_reward_model(  # its head on the backbone's device, in its dtype
                load_reward_model(config.reward_model, device=precision.device, **precision.model_kwargs()))
        return ValueModel.from_causal_lm(policy)

    def task_reward(self, spec: str, default: Any = None) -> Any:
        """The task reward of reward ``spec`` (``textrl.rewards.parse_reward_spec``; when empty,
        ``default``, a reward callable such as an environment's own), joined by the agent's own
        ``reward_model`` (if it has one) as component 'reward_model', scored in batches by
        ``NeuralReward``; None when there is none of them."""
        from textrl.rewards import CompositeReward, NeuralReward, parse_reward_spec, reward_name

        model = getattr(self, "reward_model", None)
        rules = parse_reward_spec(spec) if spec.strip() else None
        if callable(default) and rules is not None:  # the environment's own function and --reward-model's spec
            parts = {reward_name(default): (default, 1.0)} if not isinstance(default, CompositeReward) else \
                {name: (fn, default.weights[name]) for name, fn in default.functions.items()}
            rules = CompositeReward({**parts, **{k: (f, rules.weights[k]) for k, f in rules.functions.items()}})
        elif callable(default):
            rules = default
        self.place_neural_rewards(rules)
        if model is None:
            return rules
        neural = NeuralReward(model, self.tokenizer, batch_size=self.config.forward_batch_size,
                              autocast=self.precision.autocast)
        if isinstance(rules, CompositeReward):
            parts = {name: (fn, rules.weights[name]) for name, fn in rules.functions.items()}
        else:
            parts = {} if rules is None else {reward_name(rules): (rules, 1.0)}
        return CompositeReward({**parts, "reward_model": (neural, 1.0)})

    def place_neural_rewards(self, reward: Any) -> None:
        """Move every reward model among ``reward``'s functions (a :class:`NeuralReward`, alone or
        in a ``CompositeReward``) to the agent's device, in the run's precision, scoring under its
        autocast: a ``reward_model:PATH`` spec loads on the CPU."""
        from textrl.rewards import CompositeReward, NeuralReward

        functions = reward.functions.values() if isinstance(reward, CompositeReward) else [reward]
        for fn in functions:
            if isinstance(fn, NeuralReward):
                fn.place(self.precision)

    def __init__(
        self,
        policy: nn.Module,
        tokenizer: Any,
        config: TrainConfig | None = None,
        *,
        ref_policy: nn.Module | None = None,
        critic: nn.Module | None = None,
        total_updates: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config = (config or TrainConfig(agent=self.name)).validate(type(self))
        self.tokenizer = tokenizer
        self.policy = policy.eval()  # dropout off everywhere: PPO ratios must be exactly 1 at step 0
        self.sampling_notice = neutralised_notice(policy, temperature=config.temperature, top_k=config.top_k,
                                                  top_p=config.top_p)
        """What of the model's ``generation_config`` :meth:`act` samples without (None: nothing);
        warned once here."""
        if self.sampling_notice:
            warnings.warn(self.sampling_notice, stacklevel=2)
        if not self.needs_reference(config):
            ref_policy = None  # kl_coef=0: nothing reads a reference (needs_reference)
        elif ref_policy is None:
            ref_policy = copy.deepcopy(policy)
        self.ref_policy: nn.Module | None = ref_policy.eval().requires_grad_(False) if ref_policy is not None else None
        """The frozen reference of the KL penalty; None when nothing reads it (:meth:`needs_reference`)."""
        if self.needs_critic and critic is None:
            raise ValueError(f"{type(self).__name__} needs a critic (e.g. ValueModel.from_causal_lm)")
        self.critic = critic.eval() if critic is not None and self.needs_critic else None
        self.clip_eps = config.clip_eps if config.clip_eps is not None else self.default_clip_eps
        self.clip_eps_high = self.option("clip_eps_high")
        self.kl_ctl = make_kl_controller(config.kl_coef, config.adaptive_kl, config.kl_target, config.kl_horizon)
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.iteration = 0
        self.nonfinite_streak = 0  # consecutive skipped (NaN/inf) updates; the trainer stops at the max
        self.total_updates = total_updates or config.iterations * config.ppo_epochs * config.num_minibatches
        self.backend: Backend = SingleProcess(device=self.device)
        """How training is spread over processes (:mod:`textrl.parallel`); ``Backend.prepare`` swaps it."""
        self._build_optimizers()

    def param_groups(self) -> list[dict[str, Any]]:
        """The trained weights by model, each with its learning rate: the actor's, then the critic's."""
        groups = [{"params": [p for p in self.policy.parameters() if p.requires_grad], "lr": self.config.actor_lr}]
        if self.critic is not None:
            groups.append({"params": [p for p in self.critic.parameters() if p.requires_grad],
                           "lr": self.config.critic_lr})
        return groups

    def _build_optimizers(self) -> None:
        """One AdamW (no weight decay) per trained model, over its weights as they are now (a
        backend that replaces the weights, e.g. by shards, calls this again), and their schedules."""
        actor, *critic = (torch.optim.AdamW([group], weight_decay=0.0) for group in self.param_groups())
        self.actor_optimizer = actor
        self.critic_optimizer = critic[0] if critic else None
        self.schedulers = [self._scheduler(opt, self.total_updates) for opt in self.optimizers]

    def check_backend(self, backend: Backend) -> None:
        """Refuse a backend this agent cannot train under (``ValueError`` saying what to do instead)."""

    @property
    def dist(self) -> Distributed:
        """The process group this agent trains over (its backend's)."""
        return self.backend.dist

    @property
    def gathers_state(self) -> bool:
        """:meth:`state_dict` is a collective (FSDP or DeepSpeed): every process calls it, the main writes."""
        return self.backend.gathers_state

    def _copy_weights(self, dst: nn.Module, src: nn.Module) -> None:
        """``dst`` takes ``src``'s weights (reference / old-policy refresh), as the backend holds them."""
        self.backend.copy_weights(dst, src)

    # -- helpers --------------------------------------------------------------------------------
    def option(self, name: str) -> Any:
        """An agent option whose unset value (None) means "the agent's default": the config's
        value, else the class attribute ``default_<name>`` (e.g. ``clip_eps_high``)."""
        value = getattr(self.config, name)
        return getattr(type(self), f"default_{name}", None) if value is None else value

    @property
    def loss_aggregation(self) -> str:
        """How the token losses of a (micro-)batch are reduced: the class's :attr:`aggregation`
        (an algorithm that fixes it), else ``config.loss_aggregation``."""
        return self.aggregation or self.config.loss_aggregation

    def episode_budget(self) -> int:
        """The run's token budget of an episode after the prompt (agent and observation tokens):
        ``max_episode_tokens``, else the environment's default (``max_new_tokens`` for a single
        turn; :func:`textrl.envs.episodes.default_episode_tokens`). The constant of the length
        terms (Dr. GRPO's denominator, DAPO's overlong penalty); never a batch's padded ``T``."""
        cached = getattr(self, "_episode_budget", None)
        if cached is None:
            cfg = self.config
            if cfg.max_episode_tokens is not None:
                cached = cfg.max_episode_tokens
            else:
                from textrl.envs.episodes import default_episode_tokens
                from textrl.envs.registry import task_environment

                env = task_environment(cfg.env, cfg.dataset, cfg.reward, cfg.env_args)
                cached = default_episode_tokens(env, cfg.max_new_tokens)
            self._episode_budget = int(cached)
        return self._episode_budget

    def loss_mask(self, td: TensorDictBase) -> Tensor:
        """The tokens the loss counts, bool ``[B, T]``: ``KEYS.loss_mask`` where the estimator
        left rows out (DAPO's dynamic sampling), else the agent mask ``KEYS.mask``."""
        mask = td.get(KEYS.loss_mask, None)
        return td.get(KEYS.mask) if mask is None else mask

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.actor_optimizer, self.critic_optimizer) if o is not None]

    def _scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int):
        warmup = self.config.lr_warmup_steps
        cosine = self.config.lr_schedule == "cosine"

        def factor(step: int) -> float:
            if warmup and step < warmup:
                return (step + 1) / warmup
            if not cosine:
                return 1.0
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return 0.5 * (1.0 + math.cos(math.pi * progress))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    @property
    def precision(self) -> Precision:
        """The run's precision on the agent's device (:class:`textrl.precision.Precision`: the
        weights' dtype, the autocast every forward of the agent runs under, the attention
        implementation), from ``config``; follows the agent when it moves (``agent.to("cuda")``)."""
        device = self.device
        cached = self.__dict__.get("_precision")
        if cached is None or cached.device != device:
            cached = self.__dict__["_precision"] = Precision.of(self.config, device)
        return cached

    # -- acting and forwards (textrl/agents/forwards.py) ---------------------------------------
    def act(self, input_ids: Tensor, attention_mask: Tensor, *, greedy: bool = False) -> Tensor:
        """Sample responses ``[B, T]`` (T <= max_new_tokens) for left-padded prompts ``[B, P]``.

        Rows that end early are padded with ``pad_token_id`` after their EOS; generation stops
        when every row has emitted EOS or after ``max_new_tokens``. The sampler applies exactly
        the processors :meth:`logprobs` computes (:func:`~textrl.agents.forwards.rollout_generation_config`);
        nothing of the model's own ``generation_config`` (:func:`textrl.models.sampling.sample`).
        """
        return forwards.act(self, input_ids, attention_mask, greedy=greedy)

    def _response_logits(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> Tensor:
        """Logits that predict each response token, ``[B, T, V]``, under the run's precision
        (:func:`~textrl.agents.forwards.precise_response_logits`)."""
        return forwards.precise_response_logits(self, model, input_ids, attention_mask, prompt_len)

    def logprobs(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int, action: Tensor) -> Tensor:
        """Log-probs of the response tokens under the sampling distribution of ``model``: ``[B, T]``."""
        return forwards.logprobs(self, model, input_ids, attention_mask, prompt_len, action)

    def evaluate(self, td: TensorDictBase, *, keep_graph: bool = False) -> TensorDict:
        """Recompute ``action_log_prob``, ``ref_log_prob`` (when the agent keeps a reference) and
        ``state_value`` (with a critic) for a rollout.

        One prefill forward per micro-batch over the finished sequences, never token by token.
        Returns a TensorDict with those keys (``[B, T]`` log-probs, ``[B, T, 1]`` values).
        With ``keep_graph`` the policy and critic forwards run with grad and their graphs are
        kept (:class:`RolloutForward`) for the one optimiser step of :meth:`update` to reuse.
        """
        return forwards.evaluate(self, td, keep_graph=keep_graph)

    def reuses_rollout_forward(self) -> bool:
        """Whether :meth:`update` is one optimiser step over the whole rollout from the behaviour
        policy itself (1 epoch, 1 minibatch, no accumulation, no old-policy snapshot).

        Then that step's forward is the behaviour forward: :meth:`process_rollout` runs it with
        grad, the advantages are computed from its detached log-probs and values, and the step
        back-propagates through it instead of running the policy and critic again (one forward
        each fewer per iteration; the graph is held from the prefill to the step, as the step's
        own forward would hold it). ``reuse_rollout_forward = False`` on an agent turns it off.
        """
        return forwards.reuses_rollout_forward(self)

    def behaviour_logprobs(self, input_ids: Tensor, attention_mask: Tensor, prompt_len: int, action: Tensor) -> Tensor:
        """Log-probs the ratio's denominator uses; the policy itself unless a snapshot is kept."""
        return self.logprobs(self.policy, input_ids, attention_mask, prompt_len, action)

    behaviour_logprobs.policy_own = True  # an override is an old-policy snapshot (forwards.own_behaviour_logprobs)

    def _forward_policy(self, mb: TensorDictBase) -> tuple[Tensor, Tensor]:
        """Current ``(logp [B, T], entropy [B, T])`` of a minibatch's actions, with grad (the kept
        behaviour forward when the update put one in ``mb``: :func:`~textrl.agents.forwards.forward_policy`)."""
        return forwards.forward_policy(self, mb)

    def _forward_values(self, mb: TensorDictBase) -> Tensor:
        """Current ``V(s_t)`` ``[B, T]`` of a minibatch, with grad (:func:`~textrl.agents.forwards.forward_values`)."""
        return forwards.forward_values(self, mb)

    # -- the estimator ----------------------------------------------------------------------------
    def process_rollout(self, td: TensorDictBase, *, timings: dict[str, float] | None = None) -> TensorDictBase:
        """Fill log-probs, values, the per-token reward, ``advantage`` and ``value_target``; in place.

        The task reward is kept before any shaping, on the first call: the score per row as
        ``KEYS.score`` ``[B]`` (the sum over time of the fast path's ``("next","reward")``) and
        the placed reward as ``KEYS.task_reward`` ``[B, T, 1]`` (unless the collector wrote it:
        a multi-turn episode's per-turn rewards); later calls reuse both, so calling this twice
        does not shape the reward twice. ``("next","state_value")`` is V at the row's next agent
        token (0 after its last: docs/design.md, "Multi-turn episodes"). The adaptive KL
        controller is then fed the mean sequence KL of this rollout. With a ``timings`` dict, the
        seconds of the prefill forwards (``forward``) and of the shaping and estimator
        (``advantages``) are added to it.
        """
        return forwards.process_rollout(self, td, timings=timings)

    def task_token_rewards(self, td: TensorDictBase) -> Tensor:
        """The task reward per token before any shaping, ``[B, T]`` (0 off the agent mask).

        ``reward_placement='last'``: the rollout's ``KEYS.task_reward`` (each turn's reward on its
        last agent token; for a single turn, the score on the last valid token), or the score
        on the row's last agent token when the rollout has no such key. ``'uniform'``: the
        score spread evenly over the row's agent tokens (docs/design.md, "Multi-turn episodes").
        """
        mask = td.get(KEYS.mask)  # [B, T]
        placement = self.config.reward_placement
        if placement == "last" and KEYS.task_reward in td.keys(include_nested=True):
            return td.get(KEYS.task_reward).squeeze(-1)
        zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        return kl_shaped_rewards(td.get(SCORE), zeros, mask, 0.0, placement) + 0.0  # +0.0: no -0.0

    def estimate(self, td: TensorDictBase) -> None:  # pragma: no cover - abstract
        """Write ``("next","reward")``, ``advantage`` and ``value_target`` (``[B, T, 1]``)."""
        raise NotImplementedError

    # -- 4. updating ----------------------------------------------------------------------------
    def loss(self, mb: TensorDictBase) -> tuple[dict[str, Tensor], dict[str, Tensor]]:  # pragma: no cover - abstract
        """``(terms, stats)`` of a (micro-)batch, as TorchRL's ``ClipPPOLoss`` returns
        ``loss_objective`` / ``loss_critic`` / ``loss_entropy``: ``terms`` the named, weighted
        scalar terms of the loss (``policy``, ``entropy``, ``kl``, ``value``, ...), which
        :meth:`update` sums in the order they were added (:func:`textrl.agents.update.total_loss`),
        weighs by :meth:`micro_weight`, back-propagates and logs as ``loss/total``; ``stats`` the
        numbers it logs (``loss/policy``, ``loss/value``, ``entropy``, ``ratio/mean``, ...).

        A loss that returns ``(loss [], stats)``, one tensor as before the named terms, keeps
        working: that tensor is the loss (and ``loss/total`` is logged only if ``stats`` has it).
        """
        raise NotImplementedError

    def policy_objective(self, mb: TensorDictBase) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Token-level clipped surrogate - entropy_coef * H (+ beta * KL to the reference when
        ``kl_in='loss'``, hinged at ``kl_target`` with ``kl_hinge``): ``(terms, stats)``, the
        terms ``policy``, ``entropy`` (``-entropy_coef * H``) and, in the loss, ``kl``.

        The policy part of every token-level agent's loss; a critic agent adds its value loss.
        """
        cfg = self.config
        mask = self.loss_mask(mb)  # [B, T]
        logp, entropy = self._forward_policy(mb)  # [B, T] each
        pg_loss, stats = self.surrogate(logp, mb.get(KEYS.action_log_prob), mb.get(KEYS.advantage).squeeze(-1), mask)
        entropy_loss = self.aggregate(entropy, mask)
        terms = LossTerms(policy=pg_loss, entropy=-cfg.entropy_coef * entropy_loss)
        stats = {"loss/policy": pg_loss, "entropy": entropy_loss, **stats}
        if cfg.kl_in == "loss" and self.ref_policy is not None:
            kl_mean = self.aggregate(self.reference_kl(logp, mb), mask)
            if cfg.kl_hinge:  # seed 000: only the KL above the target is penalised
                kl_mean = (kl_mean - cfg.kl_target).clamp(min=0)
            stats["loss/kl"] = terms["kl"] = self.kl_ctl.value * kl_mean
        return terms, stats

    def reference_kl(self, logp: Tensor, td: TensorDictBase, kind: str | None = None) -> Tensor:
        """Per-token KL(policy || reference) ``[B, T]`` of ``logp`` against the rollout's
        ``ref_log_prob`` (estimator ``kind``, default ``config.kl_kind``); zeros when the rollout
        has none (the agent keeps no reference: :meth:`needs_reference`, so ``kl_coef`` is 0)."""
        ref = td.get(KEYS.ref_log_prob, None)
        if ref is None:
            return torch.zeros_like(logp)
        return kl_penalty(logp, ref, kind=kind or self.config.kl_kind)

    def surrogate(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy-gradient loss of a (micro-)batch, all ``[B, T]``: PPO's clipped surrogate
        (clip-higher with ``clip_eps_high``), reduced by :attr:`loss_aggregation`. Returns
        ``(loss [], stats)`` with the stats named as the update logs them (``clip_fraction``,
        ``kl/policy_old``, ``ratio/mean``: the ratio threshold reads it)."""
        pg_loss, pg_stats = clipped_policy_loss(
            logp, old_logp, advantages, mask, clip_eps=self.clip_eps, dual_clip=self.config.dual_clip,
            aggregation=self.loss_aggregation, clip_eps_high=self.clip_eps_high,
        )
        return pg_loss, ppo_stats(pg_stats)

    def aggregate(self, loss_mat: Tensor, mask: Tensor) -> Tensor:
        """A token loss ``[B, T]`` (entropy, KL in the loss) reduced as the surrogate is, so that
        :meth:`micro_weight` makes every term of the loss add up over micro-batches. ``[]``."""
        return aggregate_loss(loss_mat, mask, self.loss_aggregation)

    def update(self, td: TensorDictBase) -> dict[str, float]:
        """K epochs of shuffled minibatch updates with gradient accumulation; returns metrics.

        The loop of CleanRL's ppo.py: for each epoch, for each minibatch, one optimiser step
        (:meth:`_minibatch_step`) over its micro-batches; the backend (:mod:`textrl.parallel`)
        does the backward and the step, so the loop is the same on one process, replicated, FSDP
        and DeepSpeed. The rollout is split into ``num_minibatches`` x
        ``gradient_accumulation_steps`` as evenly as possible (uneven only when
        ``reward_nonfinite='drop'`` removed rows).

        Besides the losses (averaged over minibatches), it reports seed 003's three KL monitors,
        each the mean per-token KL(policy || ref) of ``config.kl_kind``: ``kl/collection`` (the
        behaviour log-probs stored in the rollout), ``kl/before_update`` and, with
        ``config.kl_after_update``, ``kl/after_update`` (the policy re-evaluated before and after
        this update; the first is free, the second costs a policy forward).

        Skips, the same on every backend (docs/parallelism.md):

        - ratio threshold (MA-RLHF): a micro-batch whose mean policy ratio, averaged over the
          processes, exceeds ``config.ratio_threshold`` is judged before its backward and left
          out of the step, actor and critic (its samples are stale or broken); the minibatch
          counts once in ``ppo/ratio_threshold_skips``; when all its micro-batches are left out
          nothing steps;
        - numerical faults: a rollout with NaN/inf log-probs, values, rewards or advantages on
          valid tokens is skipped as a whole (one skipped update); a minibatch with a NaN/inf
          loss or gradient on any process is skipped (no optimiser or scheduler step, weights
          untouched) on every process. Both count in ``nonfinite/skipped_updates`` and in
          ``nonfinite_streak`` (consecutive skips, reset by a good step); at
          ``config.max_nonfinite_updates`` the update stops and the trainer stops the run;
        - steps that leave NaN/inf weights (finite gradients, a step too large):
          with ``config.nonfinite_weights='rollback'`` (the default) the whole update is undone
          (:meth:`_guarded_epochs`) and counts as one skipped update, ``nonfinite/rolled_back`` = 1;
          with ``'stop'`` the weights stay as they are and the trainer's check stops the run.
          ``guard/bytes`` is the size of the rollback's copy on this process (0 with ``'stop'``);
          the host seconds its staging, copy, check and restore took are not a metric (metrics
          are deterministic): ``Backend.rollback_seconds``.

        The reference refresh (:meth:`after_update`) runs last, so it copies checked weights.
        """
        return update_loop.update(self, td)

    def micro_weight(self, sub: TensorDictBase, sub_mask: Tensor, mb_tokens: Tensor, micro: int, mb_size: int) -> float:
        """Share of a micro-batch in its minibatch's loss, so that accumulation equals the full batch.

        token_mean: valid tokens of the micro-batch / valid tokens of the minibatch (exact even with
        uneven lengths); the sequence-level aggregations: rows / minibatch rows.
        """
        if self.loss_aggregation == "token_mean":
            return float(sub_mask.sum() / mb_tokens)
        return micro / mb_size

    def after_update(self) -> None:
        """End of an iteration's updates: reference refresh (seed 000) and counters. Runs after a
        rollback, so a refresh copies the restored weights, never NaN/inf ones."""
        self.iteration += 1
        every = self.config.ref_refresh_every
        if every and self.ref_policy is not None and self.iteration % every == 0:
            self._copy_weights(self.ref_policy, self.policy)

    # -- resume ---------------------------------------------------------------------------------
    def agent_state_dict(self) -> dict[str, Any]:
        """Everything but model weights: optimisers (full tensors, as the backend saves them),
        schedulers, KL controller, counters. A collective where the backend gathers."""
        return {
            "optimizers": self.backend.optimizer_state(self),
            "schedulers": [s.state_dict() for s in self.schedulers],
            "kl_ctl": self.kl_ctl.state_dict(),
            "iteration": self.iteration,
        }

    def load_agent_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`agent_state_dict`'s output."""
        self.backend.invalidate_rollback()
        self.backend.load_optimizer_state(self, state["optimizers"])
        for sch, s in zip(self.schedulers, state["schedulers"]):
            sch.load_state_dict(s)
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.iteration = int(state["iteration"])

    SCHEDULE_SETTINGS = frozenset({"actor_lr", "critic_lr", "lr_schedule", "lr_warmup_steps", "iterations",
                                   "ppo_epochs", "num_minibatches"})
    """Settings the learning-rate schedule is built from (its length counts optimiser steps)."""

    def take_changed_settings(self, names: set[str]) -> None:
        """After a resume that changed the settings ``names``: the restored state holds the
        checkpoint's learning rates and KL coefficient, so set the config's (each learning rate
        where the schedule puts it at this step; the KL controller, adaptive or not, continues
        from the new ``kl_coef``). Every other setting is read from the config where it is used."""
        self.backend.invalidate_rollback()
        if names & self.SCHEDULE_SETTINGS:
            rates = iter(group["lr"] for group in self.param_groups())  # the actor's, then the critic's
            for scheduler in self.schedulers:  # one per optimiser, or one over both groups (ZeRO)
                scheduler.base_lrs = [next(rates) for _ in scheduler.optimizer.param_groups]
                for group, lr, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs,
                                             scheduler.lr_lambdas):
                    group["initial_lr"] = lr
                    group["lr"] = lr * factor(scheduler.last_epoch)
        if "kl_coef" in names:
            self.kl_ctl.value = float(self.config.kl_coef)

    def weights_state(self) -> dict[str, Tensor]:
        """The weights a checkpoint holds: every model's (policy, reference, critic, snapshots),
        full tensors as the backend gathers them (on the main process; all processes call)."""
        return self.backend.model_state(self)

    def load_weights_state(self, state: dict[str, Tensor], strict: bool = True, assign: bool = False) -> Any:
        """Restore :meth:`weights_state`'s output (every process passes the same ``state``).

        The reference follows this run's settings (:meth:`needs_reference`): a checkpoint's
        reference is left out when the agent keeps none (resumed with ``kl_coef`` 0), and an agent
        that keeps one keeps the one it built, the starting policy, when the checkpoint holds none
        (its run had ``kl_coef`` 0 and kept no reference)."""
        self.backend.invalidate_rollback()
        prefix = "ref_policy."
        if self.ref_policy is None:
            state = {k: v for k, v in state.items() if not k.startswith(prefix)}
        elif state and not any(k.startswith(prefix) for k in state):
            own = [k for k in nn.Module.state_dict(self) if k.startswith(prefix)]
            if own and self.backend.gathers_state:
                raise ValueError("the checkpoint holds no reference model (its run had kl_coef=0) and this "
                                 f"{self.backend.name} run cannot rebuild one from sharded weights: resume with "
                                 "--kl-coef 0, or without sharding")
            state = {**state, **{k: v for k, v in nn.Module.state_dict(self).items() if k.startswith(prefix)}}
        return self.backend.load_model_state(self, state, strict=strict, assign=assign)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """:meth:`weights_state` plus ``agent_state`` (:meth:`agent_state_dict`); a collective
        where the backend gathers."""
        state = self.weights_state()
        state["agent_state"] = self.agent_state_dict()
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # type: ignore[override]
        self.backend.invalidate_rollback()
        state_dict = dict(state_dict)
        agent_state = state_dict.pop("agent_state", None)
        result = self.load_weights_state(state_dict, strict=strict, assign=assign)
        if agent_state is not None:
            self.load_agent_state_dict(agent_state)
        return result


class CriticFreePPO(PPOAgent):
    """An agent without a critic whose loss is :meth:`PPOAgent.policy_objective` alone (clipped
    surrogate - entropy_coef * H, + beta * KL with ``kl_in='loss'``); subclasses write
    :meth:`estimate` (the group baselines, REINFORCE++)."""

    needs_critic = False
    lora = "optional"
    not_read = {
        "lam": "it has no critic, so no GAE", "vf_coef": "it has no critic",
        "value_clip_eps": "it has no critic", "critic_lr": "it has no critic",
        "critic_init": "it has no critic", "critic_type": "it has no critic",
        "old_policy_refresh_every": "it keeps no old-policy snapshot",
        "reward_adapter": "its reward comes from --reward / --reward-model",
        "lam_critic": "it has no critic", "lam_length_alpha": "it has no critic, so no GAE",
        "critic_warmup_iterations": "it has no critic",
    }

    def loss(self, mb: TensorDictBase) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """:meth:`policy_objective`: clipped surrogate - entropy_coef * H (+ beta * KL)."""
        return self.policy_objective(mb)


def ppo_stats(pg_stats: dict[str, Tensor]) -> dict[str, Tensor]:
    """:func:`clipped_policy_loss`'s stats under the names the update logs."""
    stats = {
        "clip_fraction": pg_stats["clip_fraction"],
        "kl/policy_old": pg_stats["approx_kl"],
        "ratio/mean": pg_stats["ratio_mean"],
        "ratio/max": pg_stats["ratio_max"],
        "ratio/min": pg_stats["ratio_min"],
    }
    if "dual_clip_fraction" in pg_stats:
        stats["dual_clip_fraction"] = pg_stats["dual_clip_fraction"]
    return stats


__all__ = [
    "CRITIC_OPTIONS", "LORA_OPTIONS", "POLICY_OBJECTIVE_OPTIONS", "SCORE", "SHARED_OPTIONS", "CriticFreePPO", "PPOAgent",
    "LossTerms", "RolloutForward", "UpdateTally", "attended_response", "ppo_stats", "position_ids_for", "sequence_inputs", "total_loss", "warp_logits",
]
