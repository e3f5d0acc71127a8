"""What every PPO-family agent shares: its declarations, its hooks, and the actor and learner it runs.

An agent consumes one rollout TensorDict (docs/design.md, "The rollout TensorDict"). It holds its
models (policy, reference, critic: its ``state_dict`` is theirs) and two parts built over them
(docs/design.md, "Actor and learner"):

- the actor (:class:`textrl.agents.actor.Actor`, :attr:`PPOAgent.actor`) makes rollouts:
  :meth:`PPOAgent.act` samples responses through the generation engine, :meth:`PPOAgent.evaluate`
  recomputes the behaviour and reference log-probs and the values of given tokens;
- the learner (:class:`textrl.agents.learner.Learner`, :attr:`PPOAgent.learner`) learns from them:
  :meth:`PPOAgent.process_rollout` runs the agent's estimator, :meth:`PPOAgent.update` K epochs of
  its loss (:func:`textrl.agents.update.update`), the optimisers and the guard against NaN/inf.

Subclasses implement :meth:`~PPOAgent.estimate` (advantages) and :meth:`~PPOAgent.loss`
(the minibatch loss); the math itself lives in :mod:`textrl.functional`. How the backward, the
optimiser step, weight gathering and full-state save / restore run over processes is the
agent's backend's (:attr:`PPOAgent.backend`, :mod:`textrl.parallel`; docs/parallelism.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn

from textrl.agents import build, forwards
from textrl.agents import state as resume
from textrl.agents import update as update_loop
from textrl.agents.actor import Actor, Sampled
from textrl.agents.build import _own_lora_weights, policy_name, tokenizer_name, warmup_pairs  # noqa: F401
from textrl.agents.forwards import (
    Forwards,
    RolloutForward,
    attended_response,
    position_ids_for,
    sequence_inputs,
    warp_logits,
)
from textrl.agents.learner import Learner, learner_attribute, process_rollout
from textrl.agents.update import LossTerms, Objective, UpdateTally, total_loss
from textrl.config import TrainConfig
from textrl.core.env_facts import EnvFacts
from textrl.core.kl_control import make_kl_controller
from textrl.core.precision import Precision
from textrl.functional import (
    MISMATCH_KINDS,
    aggregate_loss,
    clipped_policy_loss,
    kl_penalty,
    kl_shaped_rewards,
)
from textrl.keys import KEYS
from textrl.models.checkpointing import enable_gradient_checkpointing
from textrl.models.sampling import neutralised_notice
from textrl.parallel import Backend, SingleProcess

SCORE = KEYS.score
"""Key of the task score per row ``[B]`` (float), before any KL shaping."""

SHARED_OPTIONS = frozenset({
    "ppo_epochs", "num_minibatches", "gradient_accumulation_steps", "clip_eps", "dual_clip", "kl_coef",
    "kl_kind", "adaptive_kl", "kl_target", "kl_horizon", "kl_early_stop", "ratio_threshold",
    "kl_after_update", "ref_refresh_every", "actor_lr", "lr_schedule", "lr_warmup_steps", "max_grad_norm",
    "rollout_correction", "rollout_correction_upper", "rollout_correction_lower",
})
"""Options :class:`PPOAgent`'s own machinery reads for every agent (update loop, KL control, optimisers,
the rollout correction's weights)."""
POLICY_OBJECTIVE_OPTIONS = frozenset({"entropy_coef", "loss_aggregation", "kl_in", "kl_hinge", "clip_eps_high"})
"""Options of :meth:`PPOAgent.policy_objective` (the token-level clipped surrogate)."""
CRITIC_OPTIONS = frozenset({"critic_lr", "vf_coef", "critic_init", "critic"})
"""Options of an agent with a critic (:attr:`PPOAgent.needs_critic`)."""
LORA_OPTIONS = frozenset({"lora_r", "lora_alpha", "lora_target_modules", "load_in_4bit"})
"""(``lora_dropout`` is no agent's: ``textrl train`` refuses any value but 0, its policy runs in eval mode.)"""
"""Options of a policy LoRA (``lora`` 'required' or 'optional')."""


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
    rollout_corrections: tuple[str, ...] = MISMATCH_KINDS
    """The ``rollout_correction`` kinds its policy loss applies (:data:`textrl.functional.MISMATCH_KINDS`);
    another one is refused."""
    reuse_rollout_forward = True
    """See :func:`textrl.agents.forwards.reuses_rollout_forward`; set False to always run the update's own forward."""

    # -- construction (textrl/agents/build.py) ----------------------------------------------------
    env_facts: EnvFacts | None = None
    """What construction was handed of the run's environment (:class:`textrl.core.env_facts.EnvFacts`:
    the warm-up pairs, the episode budget); None for an agent built directly."""
    warmup_record: dict[str, Any] | None = None
    """What the format warm-up did: ``asked_steps``, ``ran_steps``, ``reason`` (``summary.json``)."""

    @classmethod
    def validate_config(cls, config: TrainConfig) -> None:
        """Check ``config`` against the declarations (samples per prompt, options read, LoRA,
        sharding); ``ValueError`` names the agent, the option and what to do. Runs inside
        :meth:`TrainConfig.validate`, before any model loads; subclasses add their own checks."""
        build.validate_config(cls, config)

    @classmethod
    def brings_reward(cls, config: TrainConfig) -> bool:
        """Whether the agent scores responses with a reward model of its own (then ``--reward`` may be empty)."""
        return False

    @classmethod
    def from_config(cls, config: TrainConfig, device: torch.device | str = "cpu", log: Any = print,
                    env_facts: EnvFacts | None = None) -> PPOAgent:
        """The agent of ``config``: tokenizer, policy (the tiny model's format warm-up included),
        a frozen reference copy, a critic when :attr:`needs_critic`, optimisers
        (:func:`textrl.agents.build.from_config`).

        ``config`` is validated for this class first, before any model loads. ``env_facts`` is
        what the run's environment gives (the trainer hands it over); without it, it is read
        through the provider ``textrl.envs`` registers (:func:`textrl.core.env_facts.env_facts_of`).
        """
        return build.from_config(cls, config, device, log, env_facts, own_loader=forwards.overrides(cls, "load_policy"))

    @classmethod
    def load_policy(cls, config: TrainConfig, tokenizer: Any, device: torch.device, log: Any = print,
                    env_facts: EnvFacts | None = None, *, precision: Precision | None = None) -> nn.Module:
        """The policy of ``config.model`` on ``device`` in the run's ``precision`` (the one
        :meth:`from_config` decided; an override that does not take it is called without), eval mode; an
        environment with a warm-up source (the built-in tasks) gets a short supervised format
        warm-up first (``warmup_sft_steps``), under the run's autocast (:func:`textrl.agents.build.load_policy`)."""
        return build.load_policy(config, tokenizer, device, log, env_facts, precision=precision)[0]

    @classmethod
    def build_critic(cls, config: TrainConfig, policy: nn.Module, precision: Precision | None = None) -> nn.Module:
        """``V(s_t)``: a value head on a copy of the policy, or on the reward model (``critic_init``),
        on the policy's device and in the run's ``precision`` (handed over as :meth:`load_policy`'s)."""
        return build.build_critic(config, policy, precision)

    def __init__(
        self,
        policy: nn.Module,
        tokenizer: Any,
        config: TrainConfig | None = None,
        *,
        ref_policy: nn.Module | None = None,
        critic: nn.Module | None = None,
        total_updates: int | None = None,
        precision: Precision | None = None,
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
        precision = build.run_precision(config, self.device, precision)  # from_config's, else decided for a direct agent
        if not build.needs_reference(config):
            ref_policy = None  # kl_coef=0: nothing reads a reference (build.needs_reference)
        elif ref_policy is None:
            ref_policy = precision.frozen_copy(policy)
        self.ref_policy: nn.Module | None = ref_policy.eval().requires_grad_(False) if ref_policy is not None else None
        """The frozen reference of the KL penalty; None when nothing reads it (:func:`textrl.agents.build.needs_reference`)."""
        if self.needs_critic and critic is None:
            raise ValueError(f"{type(self).__name__} needs a critic (e.g. ValueModel.from_causal_lm)")
        self.critic = critic.eval() if critic is not None and self.needs_critic else None
        self.clip_eps = config.clip_eps if config.clip_eps is not None else self.default_clip_eps
        self.clip_eps_high = build.option(type(self), config, "clip_eps_high")
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if config.gradient_checkpointing:
            for name, model in (("policy", self.policy), ("critic", self.critic)):
                if model is not None:
                    enable_gradient_checkpointing(model, name)
        self._actor: Actor | None = None
        self.learner = Learner(
            config, self.policy, self.critic, Forwards(config, precision), SingleProcess(device=self.device),
            kl_ctl=make_kl_controller(config.kl_coef, config.adaptive_kl, config.kl_target, config.kl_horizon),
            total_updates=total_updates or config.iterations * config.ppo_epochs * config.num_minibatches,
        )
        """What an update changes (:class:`textrl.agents.learner.Learner`): the trained weights, the
        optimisers and their schedules (one AdamW per trained model), the KL controller, the counters."""

    # -- the actor and the learner --------------------------------------------------------------------
    @property
    def actor(self) -> Actor:
        """What makes a rollout (:class:`textrl.agents.actor.Actor`), built once for the run's backend
        and device (:func:`textrl.agents.build.build_actor`: where the generation engine is chosen);
        the trainer builds it right after ``Backend.prepare`` set :attr:`backend`, a direct agent on first use."""
        actor, device = self._actor, self.precision.device  # the shared precision follows a move first
        if actor is None or actor.backend is not self.backend or actor.device != device:
            actor = self._actor = build.build_actor(self)
        return actor

    def check_backend(self, backend: Backend) -> None:
        """Refuse a backend this agent cannot train under (``ValueError`` saying what to do instead)."""

    backend = learner_attribute("backend", "How training is spread over processes (:mod:`textrl.parallel`; its "
                                "process group: ``backend.dist``); ``Backend.prepare`` sets it.")
    actor_optimizer = learner_attribute("actor_optimizer", "The policy's optimiser.")
    critic_optimizer = learner_attribute("critic_optimizer", "The critic's optimiser (None without a critic).")
    optimizers = learner_attribute("optimizers", "The optimisers that exist (the actor's, the critic's).")
    schedulers = learner_attribute("schedulers", "One learning-rate schedule per optimiser.")
    kl_ctl = learner_attribute("kl_ctl", "The KL controller the estimator feeds (fixed or adaptive).")
    iteration = learner_attribute("iteration", "Updates done.")
    nonfinite_streak = learner_attribute("nonfinite_streak", "Consecutive skipped (NaN/inf) updates.")
    total_updates = learner_attribute("total_updates", "Optimiser steps the learning-rate schedules span.")

    # -- properties -----------------------------------------------------------------------------
    @property
    def loss_aggregation(self) -> str:
        """How the token losses of a (micro-)batch are reduced: the class's :attr:`aggregation`
        (an algorithm that fixes it), else ``config.loss_aggregation``."""
        return self.aggregation or self.config.loss_aggregation

    @property
    def device(self) -> torch.device:
        """Where the policy's weights are; follows the agent when it moves (``agent.to("cuda")``)."""
        return next(self.policy.parameters()).device

    @property
    def precision(self) -> Precision:
        """The run's precision on the agent's device (:class:`textrl.core.precision.Precision`: the
        weights' dtype, the autocast every forward of the agent runs under, the attention
        implementation): the actor's and the learner's; follows the agent when it moves (``agent.to("cuda")``)."""
        shared = self.learner.forwards
        if shared.precision.device != self.device:  # moved: the same settings on the new device
            shared.precision = build.run_precision(self.config, self.device)
        return shared.precision

    # -- acting (the actor) ------------------------------------------------------------------------
    def act(self, input_ids: Tensor, attention_mask: Tensor, *, greedy: bool = False) -> Tensor:
        """Sample responses ``[B, T]`` (T <= max_new_tokens) for left-padded prompts ``[B, P]``.

        Rows that end early are padded with ``pad_token_id`` after their EOS; generation stops
        when every row has emitted EOS or after ``max_new_tokens``. The sampler applies exactly
        the processors textrl accounts for (:meth:`textrl.agents.actor.Actor.sampling`), by
        the actor's engine (``hf``: nothing of the model's own ``generation_config``).
        """
        return self.actor.act(input_ids, attention_mask, greedy=greedy)

    @contextmanager
    def rollout(self, *, greedy: bool = False) -> Iterator[Sampled]:
        """One rollout's sampling (:meth:`textrl.agents.actor.Actor.rollout`: each turn's tokens and
        the engine's log-probs, the version of the weights), after the actor loaded the learner's
        weights (:meth:`~textrl.agents.actor.Actor.load_weights_from`: nothing to copy when it samples
        with them). :func:`textrl.run.rollout.collect` opens it around an environment's episodes."""
        actor = self.actor
        actor.load_weights_from(self.learner)
        with actor.rollout(greedy=greedy) as sampled:
            yield sampled

    def evaluate(self, td: TensorDictBase, *, keep_graph: bool = False) -> TensorDict:
        """Recompute ``action_log_prob``, ``ref_log_prob`` (when the agent keeps a reference) and
        ``state_value`` (with a critic) for a rollout (:meth:`textrl.agents.actor.Actor.evaluate`).

        One prefill forward per micro-batch over the finished sequences, never token by token.
        Returns a TensorDict with those keys (``[B, T]`` log-probs, ``[B, T, 1]`` values).
        With ``keep_graph`` the policy and critic forwards run with grad and their graphs are
        kept (:class:`RolloutForward`) for the one optimiser step of :meth:`update` to reuse.
        """
        return self.actor.evaluate(td, keep_graph=keep_graph)

    def behaviour_logprobs(self, input_ids: Tensor, attention_mask: Tensor, prompt_len: int, action: Tensor) -> Tensor:
        """Log-probs the ratio's denominator uses; the policy itself unless a snapshot is kept
        (:meth:`textrl.agents.actor.Actor.logprobs` of the model that sampled)."""
        return self.actor.logprobs(self.policy, input_ids, attention_mask, prompt_len, action)

    # -- the estimator (the learner) -------------------------------------------------------------------
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
        (``advantages``) are added to it (:func:`textrl.agents.learner.process_rollout`).
        """
        keep_graph = forwards.reuses_rollout_forward(self.config, self.reuse_rollout_forward,
                                                     forwards.own_behaviour_logprobs(type(self)))
        return process_rollout(self.actor, self.learner, td, estimate=self.estimate, reference_kl=self.reference_kl,
                               keep_graph=keep_graph, timings=timings)

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

        With a rollout correction the surrogate gets its weights (``KEYS.correction_weight``);
        the entropy and KL terms are not weighted, and every term leaves out the rejected tokens
        (:func:`textrl.agents.update.loss_mask`).

        The policy part of every token-level agent's loss; a critic agent adds its value loss.
        """
        cfg = self.config
        mask = update_loop.loss_mask(mb)  # [B, T]: without the tokens the rollout correction rejected
        logp, entropy = forwards.forward_policy(self, mb)  # [B, T] each: the kept behaviour forward, or a new one
        weights = mb.get(KEYS.correction_weight, None)  # [B, T], or None: rollout_correction='none'
        corrected = {} if weights is None else {"weights": weights}
        pg_loss, stats = self.surrogate(logp, mb.get(KEYS.action_log_prob), mb.get(KEYS.advantage).squeeze(-1), mask,
                                        **corrected)
        entropy_loss = self.aggregate(entropy, mask)
        terms = LossTerms(policy=pg_loss, entropy=-cfg.entropy_coef * entropy_loss)
        stats = {"loss/policy": pg_loss, "entropy": entropy_loss, **stats}
        if cfg.kl_in == "loss" and self.ref_policy is not None:
            kl_mean = self.aggregate(self.reference_kl(logp, mb), mask)
            if cfg.kl_hinge:  # `kl_hinge`: only the KL above the target is penalised
                kl_mean = (kl_mean - cfg.kl_target).clamp(min=0)
            stats["loss/kl"] = terms["kl"] = self.kl_ctl.value * kl_mean
        return terms, stats

    def reference_kl(self, logp: Tensor, td: TensorDictBase, kind: str | None = None) -> Tensor:
        """Per-token KL(policy || reference) ``[B, T]`` of ``logp`` against the rollout's
        ``ref_log_prob`` (estimator ``kind``, default ``config.kl_kind``); zeros when the rollout
        has none (the agent keeps no reference: :func:`textrl.agents.build.needs_reference`, so ``kl_coef`` is 0)."""
        ref = td.get(KEYS.ref_log_prob, None)
        if ref is None:
            return torch.zeros_like(logp)
        return kl_penalty(logp, ref, kind=kind or self.config.kl_kind)

    def surrogate(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                  weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy-gradient loss of a (micro-)batch, all ``[B, T]``: PPO's clipped surrogate
        (clip-higher with ``clip_eps_high``), each token's times its rollout correction weight
        (``weights``; passed only with a correction), reduced by :attr:`loss_aggregation`. Returns
        ``(loss [], stats)`` with the stats named as the update logs them (``clip_fraction``,
        ``kl/policy_old``, ``ratio/mean``: the ratio threshold reads it)."""
        pg_loss, pg_stats = clipped_policy_loss(
            logp, old_logp, advantages, mask, clip_eps=self.clip_eps, dual_clip=self.config.dual_clip,
            aggregation=self.loss_aggregation, clip_eps_high=self.clip_eps_high,
            normaliser=rows_normaliser(self.loss_aggregation, mask), weights=weights,
        )
        return pg_loss, ppo_stats(pg_stats)

    def aggregate(self, loss_mat: Tensor, mask: Tensor) -> Tensor:
        """A token loss ``[B, T]`` (entropy, KL in the loss) reduced as the surrogate is, so that
        :meth:`micro_weight` makes every term of the loss add up over micro-batches. ``[]``."""
        return aggregate_loss(loss_mat, mask, self.loss_aggregation, rows_normaliser(self.loss_aggregation, mask))

    def update(self, td: TensorDictBase) -> dict[str, float]:
        """K epochs of shuffled minibatch updates with gradient accumulation; returns metrics: the
        learner's epochs over this agent's loss (:func:`textrl.agents.update.update`: the loop, its
        skips and its metrics), then :meth:`after_update` (the reference refresh copies checked weights)."""
        reuse = forwards.reuses_rollout_forward(self.config, self.reuse_rollout_forward,
                                                forwards.own_behaviour_logprobs(type(self)))
        objective = Objective(self.loss, self.micro_weight, reuse)
        metrics = update_loop.update(self.learner, self.actor, td, objective)
        self.after_update()
        return metrics

    def micro_weight(self, sub: TensorDictBase, sub_mask: Tensor, mb_tokens: Tensor, micro: int, mb_size: int) -> float:
        """Share of a micro-batch in its minibatch's loss, so that accumulation equals the full batch.

        token_mean: valid tokens of the micro-batch / valid tokens of the minibatch (exact even with
        uneven lengths); the sequence-level aggregations: rows / minibatch rows.
        """
        if self.loss_aggregation == "token_mean":
            return float(sub_mask.sum() / mb_tokens)
        return micro / mb_size

    def after_update(self) -> None:
        """End of an iteration's updates: reference refresh (`ref_refresh_every`) and counters. Runs after a
        rollback, so a refresh copies the restored weights, never NaN/inf ones."""
        self.iteration += 1
        every = self.config.ref_refresh_every
        if every and self.ref_policy is not None and self.iteration % every == 0:
            self.backend.copy_weights(self.ref_policy, self.policy)  # as the backend holds them

    # -- resume (textrl/agents/state.py) ------------------------------------------------------------
    SCHEDULE_SETTINGS = resume.SCHEDULE_SETTINGS

    def weights_state(self) -> dict[str, Tensor]:
        """The weights a checkpoint holds: every model's (policy, reference, critic, snapshots),
        full tensors as the backend gathers them (on the main process; all processes call)."""
        return self.backend.model_state(self)

    def load_weights_state(self, state: dict[str, Tensor], strict: bool = True, assign: bool = False) -> Any:
        """Restore :meth:`weights_state`'s output (every process passes the same ``state``;
        :func:`textrl.agents.state.load_weights`: the reference follows this run's settings)."""
        return resume.load_weights(self, self.backend, state, keeps_reference=self.ref_policy is not None,
                                   strict=strict, assign=assign)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """:meth:`weights_state` plus ``agent_state`` (:func:`textrl.agents.state.agent_state`: the
        learner's); a collective where the backend gathers."""
        state = self.weights_state()
        state["agent_state"] = resume.agent_state(self.learner)
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # type: ignore[override]
        self.backend.invalidate_rollback()
        state_dict = dict(state_dict)
        agent_state = state_dict.pop("agent_state", None)
        result = self.load_weights_state(state_dict, strict=strict, assign=assign)
        if agent_state is not None:
            resume.load_agent_state(self.learner, agent_state)
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
        "critic_init": "it has no critic", "critic_type": "it has no critic", "critic": "it has no critic",
        "old_policy_refresh_every": "it keeps no old-policy snapshot",
        "reward_adapter": "its reward comes from --reward / --reward-model",
        "lam_critic": "it has no critic", "lam_length_alpha": "it has no critic, so no GAE",
        "critic_warmup_iterations": "it has no critic",
    }

    def loss(self, mb: TensorDictBase) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """:meth:`policy_objective`: clipped surrogate - entropy_coef * H (+ beta * KL)."""
        return self.policy_objective(mb)


def rows_normaliser(aggregation: str, mask: Tensor) -> int | None:
    """The denominator of a mean over rows (``seq_mean``, ``seq_mean_token_sum``: ``aggregation``, an
    agent's :attr:`PPOAgent.loss_aggregation`): the rows of the (micro-)batch ``mask`` ``[B, T]``, a row
    left without tokens in the loss (the rollout correction rejected it) among them, so that rows-share
    micro-weights add up exactly; None for ``token_mean`` (its count of tokens)."""
    return None if aggregation == "token_mean" else max(1, mask.shape[0])


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
    "EnvFacts", "LossTerms", "RolloutForward", "UpdateTally", "attended_response", "policy_name", "ppo_stats",
    "rows_normaliser", "tokenizer_name", "warmup_pairs", "position_ids_for", "sequence_inputs", "total_loss", "warp_logits",
]
