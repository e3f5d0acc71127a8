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

Each of these is an ``nn.Module`` *view* of the shared PeftModel: calling it activates its
adapter, and its ``parameters()`` are only that adapter's weights (plus the head). So GAEPPO's
estimator, losses, update loop and optimisers apply unchanged: the actor optimiser holds the
policy LoRA, the critic optimiser the value head (+ critic LoRA). peft flips ``requires_grad``
when adapters are switched; the views restore the flags the agent set after every switch.

Start-up checks: the policy equals the reference on a probe batch (KL 0), the reward adapter and
score head are frozen; after every update they are checked bit-identical and gradient-free.
A base that shows a LoRA merge (:func:`textrl.models.adapters.merge_info`) gets a warning.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDictBase
from textrl.agents.base import LORA_OPTIONS
from textrl.agents.gae_ppo import GAEPPO
from torch import Tensor, nn
from torch.nn.modules.module import _IncompatibleKeys
from transformers.modeling_outputs import SequenceClassifierOutput

from textrl.agent_registry import register_agent
from textrl.config import TrainConfig
from textrl.models.adapters import (
    final_hidden,
    hidden_size,
    is_peft,
    keep_4bit_differentiable,
    last_token_hidden,
    load_base_model,
    load_reward_adapter,
    lora_config,
    read_reward_meta,
    save_adapter,
    warn_if_merged,
)

if TYPE_CHECKING:
    from peft import PeftModel

POLICY, CRITIC, REWARD = "policy", "critic", "reward"


class AdapterStack:
    """The shared PeftModel and which adapter is active; ``requires_grad`` of LoRA weights fixed.

    ``trainable`` names the adapters whose weights train; every other parameter stays frozen,
    whatever peft's ``set_adapter`` / ``disable_adapter`` do to the flags.
    """

    def __init__(self, model: PeftModel, trainable: set[str]) -> None:
        self.model = model
        self.lora: dict[str, list[tuple[str, nn.Parameter]]] = {name: [] for name in model.peft_config}
        for pname, param in model.named_parameters():
            adapter = next((a for a in self.lora if f".{a}." in pname and "lora_" in pname), None)
            if adapter is not None:
                self.lora[adapter].append((pname, param))
            param.requires_grad_(adapter in trainable)
        self._flags = [(p, a in trainable) for a, params in self.lora.items() for _, p in params]

    def _restore_flags(self) -> None:
        for param, flag in self._flags:
            param.requires_grad_(flag)

    @contextmanager
    def use(self, adapter: str | None) -> Iterator[None]:
        """Run the block with ``adapter`` active; ``None`` disables every adapter (the reference)."""
        previous = self.model.active_adapter
        try:
            if adapter is None:
                with self.model.disable_adapter():
                    self._restore_flags()
                    yield
            else:
                if adapter != previous:
                    self.model.set_adapter(adapter)
                    self._restore_flags()
                yield
        finally:
            if adapter is not None and self.model.active_adapter != previous:
                self.model.set_adapter(previous)
            self._restore_flags()


class AdapterPolicy(nn.Module):
    """A causal LM that is the shared base with ``adapter`` active (``None``: adapters disabled).

    ``forward`` / ``generate`` as the HF model; ``parameters()`` are the adapter's LoRA weights
    only (none for the reference); ``save_pretrained`` writes the adapter in peft format.
    """

    def __init__(self, stack: AdapterStack, adapter: str | None) -> None:
        super().__init__()
        self.stack = stack  # a plain object: the base is shared, not owned by this module
        self.adapter = adapter

    @property
    def config(self):
        return self.stack.model.config

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):  # type: ignore[override]
        for name, param in self.stack.lora.get(self.adapter, []):
            yield prefix + name, param

    def forward(self, **kwargs: Any) -> Any:
        with self.stack.use(self.adapter):
            return self.stack.model(**kwargs)

    def generate(self, **kwargs: Any) -> Tensor:
        with self.stack.use(self.adapter):
            return self.stack.model.generate(**kwargs)

    def save_pretrained(self, path: str | os.PathLike[str], **_: Any) -> None:
        """The adapter's ``adapter_config.json`` + ``adapter_model.safetensors`` in ``path``."""
        if self.adapter is None:
            raise ValueError("the reference is the base with adapters disabled; save the base itself")
        save_adapter(self.stack.model, self.adapter, path)


class AdapterCritic(nn.Module):
    """``V(s_t)`` ``[B, L]`` float32: ``value_head(final hidden state)`` under ``adapter``.

    With ``train_trunk=False`` (value-head critic on the policy adapter) the hidden states come
    from a no-grad pass, so only the head trains; with ``True`` (a critic LoRA) the adapter trains too.
    """

    def __init__(self, stack: AdapterStack, adapter: str, hidden: int, train_trunk: bool) -> None:
        super().__init__()
        self.stack = stack
        self.adapter = adapter
        self.train_trunk = train_trunk
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):  # type: ignore[override]
        yield from super().named_parameters(prefix, recurse, remove_duplicate)
        if self.train_trunk:
            for name, param in self.stack.lora[self.adapter]:
                yield prefix + name, param

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``input_ids``, ``attention_mask`` ``[B, L]`` -> values ``[B, L]``."""
        with self.stack.use(self.adapter), torch.set_grad_enabled(self.train_trunk and torch.is_grad_enabled()):
            hidden = final_hidden(self.stack.model, input_ids, attention_mask)  # [B, L, H]
        return self.value_head(hidden.float()).squeeze(-1)  # [B, L]


class AdapterRewardModel(nn.Module):
    """The frozen reward adapter + score head as a scalar sequence classifier.

    ``forward(input_ids [B, L], attention_mask [B, L]) -> SequenceClassifierOutput(logits [B, 1])``:
    the score head at each row's last attended token, under ``torch.no_grad``. Shaped like an HF
    ``*ForSequenceClassification`` (``config.num_labels == 1``) so ``textrl.rewards.NeuralReward`` batches it.
    """

    def __init__(self, stack: AdapterStack, score_head: nn.Linear) -> None:
        super().__init__()
        self.stack = stack
        self.score_head = score_head
        self.config = copy.copy(stack.model.config)
        self.config.num_labels = 1

    def get_input_embeddings(self) -> nn.Module:
        return self.stack.model.get_input_embeddings()

    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Tensor, **_: Any) -> SequenceClassifierOutput:
        with self.stack.use(REWARD):
            hidden = last_token_hidden(self.stack.model, input_ids, attention_mask)  # [B, H]
        return SequenceClassifierOutput(logits=self.score_head(hidden))  # [B, 1]


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
    options = (GAEPPO.options - {"critic_init", "ref_refresh_every"}) | LORA_OPTIONS | {"reward_adapter", "critic_type"}
    not_read = {
        "critic_init": "it builds its critic from critic_type ('value_head' or 'lora') on its own base",
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
    def from_config(cls, config: TrainConfig, device: torch.device | str = "cpu", log: Any = print) -> MultiAdapterPPO:
        """The base model (4-bit with ``load_in_4bit``) and its tokenizer; the agent adds its adapters,
        critic and reward model to the base. No SFT warm-up: the base must stay exactly the model the
        reward adapter was trained on (fine-tune first with `textrl sft` + `textrl merge`, or run
        `textrl pipeline`)."""
        config.validate(cls)
        if config.warmup_sft_steps > 0 and config.dataset == "builtin:digits":
            log(f"{config.agent}: no SFT warm-up (the base is shared with the reward adapter)")
        tokenizer = cls.load_tokenizer(config)
        return cls(load_base_model(config.model, load_in_4bit=config.load_in_4bit, device=device), tokenizer, config)

    @classmethod
    def load_policy(cls, config: TrainConfig, tokenizer: Any, device: torch.device, log: Any = print) -> nn.Module:
        """The plain base model (no warm-up, see :meth:`from_config`)."""
        return load_base_model(config.model, load_in_4bit=config.load_in_4bit, device=device)

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
        from peft import get_peft_model  # here: importing agents must not import bitsandbytes

        lora = lora_config(self.lora_rank(config), config.lora_alpha, config.lora_dropout, config.lora_target_modules)
        model = get_peft_model(policy.eval(), lora, adapter_name=POLICY)
        if config.critic_type == "lora":
            model.add_adapter(CRITIC, copy.deepcopy(lora))
        reward_adapter = reward_adapter if reward_adapter is not None else config.reward_adapter
        score_head = None
        if reward_adapter:
            model, score_head = load_reward_adapter(model, reward_adapter, adapter_name=REWARD)
        model.set_adapter(POLICY)
        stack = AdapterStack(model.eval(), trainable={POLICY, CRITIC})
        device = next(model.parameters()).device
        lora_critic = config.critic_type == "lora"
        value_critic = AdapterCritic(stack, CRITIC if lora_critic else POLICY, hidden_size(model), lora_critic)
        super().__init__(
            AdapterPolicy(stack, POLICY), tokenizer, config, ref_policy=AdapterPolicy(stack, None),
            critic=value_critic.to(device), total_updates=total_updates,
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
        reference = self.ref_policy(input_ids=ids, attention_mask=mask, use_cache=False).logits
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

    def shard(self, mesh: Any, reshard_after_forward: bool = True) -> None:
        raise ValueError(
            "multi_adapter_ppo does not shard (FSDP): its one base carries every role; it fits large "
            "models with --load-in-4bit instead"
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

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """Policy LoRA, value head (+ critic LoRA) and ``agent_state``: never the (4-bit) base."""
        state: dict[str, Any] = {k: p.detach().clone() for k, p in self.trainable_state().items()}
        state["agent_state"] = self.agent_state_dict()
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False):  # type: ignore[override]
        state = dict(state_dict)
        agent_state = state.pop("agent_state", None)
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
        if agent_state is not None:
            self.load_agent_state_dict(agent_state)
        return _IncompatibleKeys(missing, unexpected)


__all__ = ["AdapterCritic", "AdapterPolicy", "AdapterRewardModel", "AdapterStack", "MultiAdapterPPO"]
