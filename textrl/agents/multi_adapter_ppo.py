"""Token-level PPO on one base model with LoRA adapters (MA-RLHF; docs/design.md, "Agents").

One copy of the base weights (optionally 4-bit NF4) carries every model PPO needs:

- the **policy**: a trainable LoRA adapter ``"policy"`` (B zero-initialised);
- the **reference**: the base with every adapter disabled (``with model.disable_adapter():``);
- the **critic**: a zero-initialised ``Linear(H, 1)`` value head on the policy's final hidden
  states (``critic_type='value_head'``; the hidden states are detached, so the value loss trains
  only the head and the policy gradient is GAEPPO's), or a separate trainable LoRA adapter
  ``"critic"`` under the head (``critic_type='lora'``);
- the **reward model**: a frozen LoRA adapter ``"reward"`` plus its score head, loaded from a
  ``textrl rm --lora`` folder (:func:`textrl.models.adapters.load_reward_adapter`) and exposed
  as :attr:`MultiAdapterPPO.reward_model`, a sequence classifier (``.logits`` ``[B, 1]``) that
  the trainer wraps in ``textrl.rewards.NeuralReward`` for batched scoring.

Each of these is an ``nn.Module`` *view* of the shared PeftModel (:mod:`textrl.agents.adapter_views`): calling it activates its
adapter, and its ``parameters()`` are only that adapter's weights (plus the head). So GAEPPO's
estimator, losses, update loop and optimisers apply unchanged: the actor optimiser holds the
policy LoRA, the critic optimiser the value head (+ critic LoRA). peft flips ``requires_grad``
when adapters are switched; the views restore the flags the agent set after every switch.

Start-up checks: the policy equals the reference on a probe batch (KL 0), the reward adapter and
score head are frozen; after every update they are checked bit-identical and gradient-free.
A base that shows a LoRA merge (:func:`textrl.models.adapters.merge_info`) gets a warning.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDictBase
from torch import Tensor, nn
from torch.nn.modules.module import _IncompatibleKeys

from textrl.agents.adapter_views import (
    POLICY,
    REWARD,
    AdapterCritic,
    AdapterPolicy,
    AdapterRewardModel,
    AdapterStack,
    build_adapter_stack,
    value_critic,
)
from textrl.agents.base import LORA_OPTIONS
from textrl.agents.build import (
    load_tokenizer,
    lora_rank,
    policy_name,
    run_precision,
    tokenizer_name,
    warmup_none,
)
from textrl.agents.gae_ppo import GAEPPO
from textrl.config import TrainConfig
from textrl.core.agent_registry import register_agent
from textrl.core.env_facts import EnvFacts, env_facts_of
from textrl.core.precision import Precision
from textrl.models.adapters import (
    is_peft,
    keep_4bit_differentiable,
    load_base_model,
    lora_config,
    read_reward_meta,
    warn_if_merged,
)
from textrl.models.checks import check_tokenizer_fits

if TYPE_CHECKING:
    from textrl.parallel import Backend


@register_agent("multi_adapter_ppo")
class MultiAdapterPPO(GAEPPO):
    """GAEPPO on one base model: policy / critic / reward LoRA adapters, reference = no adapters.

    Args:
        policy: the base causal LM (a plain ``PreTrainedModel``, e.g. from
            :func:`textrl.models.adapters.load_base_model`, optionally 4-bit); the adapters are
            injected into it in place.
        tokenizer: its tokenizer.
        config: ``lora_*``, ``critic_type`` and ``reward_adapter`` are read besides GAEPPO's fields.
        reward_adapter: folder of a ``textrl rm --lora`` reward adapter (default
            ``config.reward_adapter``); without one the agent has no ``reward_model`` and the task
            reward comes from the rule rewards alone.
        merged: whether the base is a LoRA merge (a warning says the reference is then the merged
            model); ``None`` detects it from ``textrl_merged.json`` / ``config.textrl_merged`` /
            a leftover ``adapter_config.json`` in the model's folder; ``False`` silences it.
    """

    lora = "required"
    default_lora_r = 8
    shardable = False
    pipeline_reward = "reward_adapter"
    options = (GAEPPO.options - {"critic_init", "ref_refresh_every", "critic"}) | LORA_OPTIONS | {"reward_adapter", "critic_type"}
    not_read = {
        "critic_init": "it builds its critic from critic_type ('value_head' or 'lora') on its own base",
        "critic": "it builds its critic from critic_type ('value_head' or 'lora') on its own base",
        "ref_refresh_every": "its reference is the base with adapters disabled and cannot be refreshed",
        "old_policy_refresh_every": GAEPPO.not_read["old_policy_refresh_every"],
    }

    @classmethod
    def validate_config(cls, config: TrainConfig) -> None:
        """The declarations (:meth:`PPOAgent.validate_config`), then: no full reward model (its
        reward model is ``--reward-adapter``), and the reward adapter's folder is readable."""
        super().validate_config(config)
        if config.reward_model:
            raise ValueError(
                f"reward_model={config.reward_model!r}: {config.agent} scores with a LoRA reward "
                "adapter on its own base (--reward-adapter PATH from `textrl rm --lora`); drop --reward-model"
            )
        if config.reward_adapter:
            read_reward_meta(config.reward_adapter)  # names a missing file before any model loads

    @classmethod
    def brings_reward(cls, config: TrainConfig) -> bool:
        """Its reward adapter (``--reward-adapter``) scores responses on its own."""
        return bool(config.reward_adapter)

    @classmethod
    def from_config(cls, config: TrainConfig, device: torch.device | str = "cpu", log: Any = print,
                    env_facts: EnvFacts | None = None) -> MultiAdapterPPO:
        """The base model (4-bit with ``load_in_4bit``) and its tokenizer; the agent adds its adapters,
        critic and reward model to the base. No SFT warm-up: the base must stay exactly the model the
        reward adapter was trained on (fine-tune first with `textrl sft` + `textrl merge`, or run
        `textrl pipeline`)."""
        config.validate(cls)
        if env_facts is None and config.warmup_sft_steps > 0:
            env_facts = env_facts_of(config)
        warmup = warmup_none(config, env_facts, agent_warms=False)
        if warmup["asked_steps"] > 0 and env_facts.warmup_pairs:
            log(f"{config.agent}: no SFT warm-up (the base is shared with the reward adapter)")
        tokenizer = load_tokenizer(config)
        precision = run_precision(config, device)  # the run's, decided once
        agent = cls(cls.load_policy(config, tokenizer, precision.device, log, precision=precision), tokenizer, config,
                    precision=precision)
        agent.env_facts, agent.warmup_record = env_facts, warmup
        return agent

    @classmethod
    def load_policy(cls, config: TrainConfig, tokenizer: Any, device: torch.device, log: Any = print, *,
                    precision: Precision | None = None) -> nn.Module:
        """The plain base model in the run's ``precision`` (no warm-up, see :meth:`from_config`), checked
        against the tokenizer."""
        base = load_base_model(config.model, load_in_4bit=config.load_in_4bit, device=device,
                               precision=run_precision(config, device, precision))
        check_tokenizer_fits(tokenizer, base, tokenizer_name=tokenizer_name(config), model_name=policy_name(config))
        return base

    def __init__(
        self,
        policy: nn.Module,
        tokenizer: Any,
        config: TrainConfig | None = None,
        *,
        reward_adapter: str | os.PathLike[str] | None = None,
        ref_policy: nn.Module | None = None,
        critic: nn.Module | None = None,
        total_updates: int | None = None,
        merged: bool | None = None,
        precision: Precision | None = None,
    ) -> None:
        config = (config or TrainConfig(agent=self.name)).validate(type(self))
        if ref_policy is not None or critic is not None:
            raise ValueError(
                "MultiAdapterPPO builds its own reference (the base with adapters disabled) and "
                "critic (config.critic_type); pass only the base model, not ref_policy / critic"
            )
        if is_peft(policy):
            raise ValueError(
                "MultiAdapterPPO takes the plain base model and adds its own adapters; merge an "
                "SFT LoRA into its base first (textrl merge, textrl.models.adapters.merge_adapter)"
            )
        warn_if_merged(policy, merged)
        keep_4bit_differentiable(policy)
        lora = lora_config(lora_rank(type(self), config), config.lora_alpha, config.lora_dropout, config.lora_target_modules,
                           model=policy)
        lora_critic = config.critic_type == "lora"
        stack, score_head = build_adapter_stack(
            policy, lora, critic_adapter=lora_critic,
            reward_adapter=reward_adapter if reward_adapter is not None else config.reward_adapter,
        )
        super().__init__(
            AdapterPolicy(stack, POLICY), tokenizer, config, ref_policy=AdapterPolicy(stack, None),
            critic=value_critic(stack, lora_critic), total_updates=total_updates, precision=precision,
        )
        self.stack = stack
        self.reward_model = AdapterRewardModel(stack, score_head) if score_head is not None else None
        self._frozen_snapshot = {name: p.detach().clone() for name, p in self.frozen_trainables()}
        self.check_start()

    # -- safety checks --------------------------------------------------------------------------
    def frozen_trainables(self) -> list[tuple[str, nn.Parameter]]:
        """The reward adapter's LoRA weights and the score head: must never change."""
        params = list(self.stack.lora.get(REWARD, []))
        if self.reward_model is not None:
            params += [(f"score_head.{n}", p) for n, p in self.reward_model.score_head.named_parameters()]
        return params

    @torch.no_grad()
    def check_start(self) -> None:
        """KL(policy || reference) = 0 on a probe batch; only policy / critic weights train."""
        nonzero = [n for n, p in self.stack.lora[POLICY] if "lora_B" in n and bool(p.any())]
        if nonzero:
            raise RuntimeError(
                f"the policy LoRA starts non-zero ({nonzero[0]} ...), so the policy is not the "
                "reference at step 0; MultiAdapterPPO starts from a fresh adapter (B = 0)"
            )
        ids = torch.tensor([self.tokenizer("textrl probe: 2+3=5")["input_ids"]], device=self.device)
        mask = torch.ones_like(ids)
        policy = self.policy(input_ids=ids, attention_mask=mask, use_cache=False).logits
        reference = AdapterPolicy(self.stack, None)(input_ids=ids, attention_mask=mask, use_cache=False).logits
        if not torch.equal(policy, reference):
            raise RuntimeError(
                "KL(policy || reference) is not 0 before the first update: the policy adapter "
                f"changes the logits by up to {(policy - reference).abs().max().item():.3g}; "
                "check that no adapter other than the fresh policy LoRA is active"
            )
        trainable = {id(p) for p in [*self.policy.parameters(), *self.critic.parameters()]}
        wrong = [n for n, p in self.stack.model.named_parameters() if p.requires_grad and id(p) not in trainable]
        frozen_wrong = [n for n, p in self.frozen_trainables() if p.requires_grad]
        if wrong or frozen_wrong:
            raise RuntimeError(f"parameters outside the policy / critic adapters require grad: {(wrong + frozen_wrong)[:3]}")

    def check_frozen(self) -> None:
        """Raise when the reward adapter or score head changed or got a gradient, or the base got one."""
        for name, param in self.frozen_trainables():
            if param.requires_grad or param.grad is not None:
                raise RuntimeError(f"frozen reward weight {name} requires or received a gradient")
            if not torch.equal(param, self._frozen_snapshot[name]):
                raise RuntimeError(
                    f"frozen reward weight {name} changed during the update: the reward model must "
                    "stay fixed; something stepped it (an optimiser over the whole model?)"
                )
        trainable = {id(p) for p in [*self.policy.parameters(), *self.critic.parameters()]}
        leaked = [n for n, p in self.stack.model.named_parameters() if p.grad is not None and id(p) not in trainable]
        if leaked:
            raise RuntimeError(f"frozen base weights received a gradient: {leaked[:3]}")

    def check_backend(self, backend: Backend) -> None:
        """One process or replicated only: the one base carries every role, so it is not split."""
        if backend.gathers_state:
            raise ValueError(
                f"multi_adapter_ppo does not shard ({backend.name}: FSDP or DeepSpeed ZeRO): its one base "
                "carries every role; it fits large models with --load-in-4bit instead"
            )

    def update(self, td: TensorDictBase) -> dict[str, float]:
        """GAEPPO's update, then :meth:`check_frozen`."""
        metrics = super().update(td)
        self.check_frozen()
        return metrics

    # -- resume: trainable weights and agent state only -------------------------------------------
    def trainable_state(self) -> dict[str, nn.Parameter]:
        """``policy.<lora name>`` and ``critic.<head / lora name>`` -> parameter."""
        out = {f"policy.{n}": p for n, p in self.policy.named_parameters()}
        out.update({f"critic.{n}": p for n, p in self.critic.named_parameters()})
        return out

    def weights_state(self) -> dict[str, Tensor]:
        """Policy LoRA, value head (+ critic LoRA): never the (4-bit) base."""
        return {k: p.detach().clone() for k, p in self.trainable_state().items()}

    @torch.no_grad()
    def load_weights_state(self, state: dict[str, Tensor], strict: bool = True, assign: bool = False):
        own = self.trainable_state()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"MultiAdapterPPO state mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}; "
                "was it saved with the same lora_r / lora_target_modules / critic_type?"
            )
        for key, param in own.items():
            if key in state:
                param.copy_(state[key])
        return _IncompatibleKeys(missing, unexpected)


__all__ = ["AdapterCritic", "AdapterPolicy", "AdapterRewardModel", "AdapterStack", "MultiAdapterPPO"]
