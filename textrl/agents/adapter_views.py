"""``nn.Module`` views of one shared PeftModel: each role (policy, reference, critic, reward model)
is the base with one adapter active (or none), and owns only that adapter's weights.

Used by every agent that trains a policy LoRA (``--lora-r``; docs/design.md, "Agents"): the
reference is the base with every adapter disabled (``with model.disable_adapter():``, as TRL does
with peft), so it needs no copy of the weights. peft flips ``requires_grad`` when adapters are
switched; :class:`AdapterStack` restores the flags the agent set after every switch.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from transformers.modeling_outputs import SequenceClassifierOutput

from textrl.models.adapters import (
    final_hidden,
    hidden_size,
    last_token_hidden,
    load_reward_adapter,
    save_adapter,
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

    def get_output_embeddings(self) -> nn.Module | None:
        """The shared base's LM head (:func:`textrl.models.forward.response_logits` gathers before it)."""
        return self.stack.model.get_output_embeddings()

    def forward(self, **kwargs: Any) -> Any:
        with self.stack.use(self.adapter):
            return self.stack.model(**kwargs)

    def generation_modules(self) -> list[nn.Module]:
        """The model :meth:`generate` runs (the shared base), whose ``generation_config``
        :func:`textrl.models.sampling.sample` keeps out of rollouts."""
        return [self.stack.model]

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

    @property
    def backbone(self) -> nn.Module:
        """The shared base its hidden states come from (whose packed forwards
        :func:`textrl.models.packed_forward.critic_layout` probes)."""
        return self.stack.model

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None = None) -> Tensor:
        """``input_ids``, ``attention_mask`` ``[B, L]`` -> values ``[B, L]``; ``attention_mask=None`` with
        ``position_ids``: packed rows (:mod:`textrl.models.packing`)."""
        with self.stack.use(self.adapter), torch.set_grad_enabled(self.train_trunk and torch.is_grad_enabled()):
            hidden = final_hidden(self.stack.model, input_ids, attention_mask, position_ids)  # [B, L, H]
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

    @property
    def backbone(self) -> nn.Module:
        """The shared base its hidden states come from (whose packed forwards
        :func:`textrl.models.packed_forward.scorer_layout` probes)."""
        return self.stack.model

    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None = None,
                **_: Any) -> SequenceClassifierOutput:
        """``attention_mask=None`` with ``position_ids``: packed rows (:mod:`textrl.models.packing`), the
        score head on every position ``[k, w, 1]`` (read at each row's last token by
        :func:`textrl.models.packed_forward.packed_scores`), ``logits`` each packed row's last slot's."""
        with self.stack.use(REWARD):
            if attention_mask is None:
                hidden = final_hidden(self.stack.model, input_ids, None, position_ids).float()  # [k, w, H]
                return SequenceClassifierOutput(logits=self.score_head(hidden)[:, -1])  # [k, 1]
            hidden = last_token_hidden(self.stack.model, input_ids, attention_mask)  # [B, H]
        return SequenceClassifierOutput(logits=self.score_head(hidden))  # [B, 1]


def build_adapter_stack(base: nn.Module, lora: Any, *, critic_adapter: bool,
                        reward_adapter: str | os.PathLike[str] | None = None) -> tuple[AdapterStack, nn.Linear | None]:
    """One base with its adapters, as every LoRA agent sets it up: the policy adapter ``lora``
    (active), a critic adapter of the same shape when ``critic_adapter``, the frozen reward
    adapter and its score head from ``reward_adapter`` (a ``textrl rm --lora`` folder). Returns
    the stack (policy and critic adapters trainable) and the score head (None without one)."""
    from peft import get_peft_model  # here: importing agents must not import bitsandbytes

    model = get_peft_model(base.eval(), lora, adapter_name=POLICY)
    if critic_adapter:
        model.add_adapter(CRITIC, copy.deepcopy(lora))
    score_head = None
    if reward_adapter:
        model, score_head = load_reward_adapter(model, reward_adapter, adapter_name=REWARD)
    model.set_adapter(POLICY)
    return AdapterStack(model.eval(), trainable={POLICY, CRITIC}), score_head


def value_critic(stack: AdapterStack, critic_adapter: bool) -> AdapterCritic:
    """The critic on the stack's base: a value head under the critic adapter (which trains too),
    or under the policy adapter (the head alone trains), on the base's device."""
    critic = AdapterCritic(stack, CRITIC if critic_adapter else POLICY, hidden_size(stack.model), critic_adapter)
    return critic.to(next(stack.model.parameters()).device)


__all__ = [
    "CRITIC", "POLICY", "REWARD", "AdapterCritic", "AdapterPolicy", "AdapterRewardModel", "AdapterStack",
    "build_adapter_stack", "value_critic",
]
