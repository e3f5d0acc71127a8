"""A critic: a causal-LM backbone with a scalar value head, ``V(s_t)`` at every position.

The backbone is the transformer body of a ``*ForCausalLM`` (its ``.model``) or of a
``*ForSequenceClassification`` reward model; the head is ``nn.Linear(hidden, 1)``, made on the
backbone's device and in its dtype. Position ids are computed from the attention mask, so
left-padded prompts see the positions of unpadded ones, and no attention row is fully masked
(:func:`textrl.models.forward.hidden_states`).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from textrl.models.forward import hidden_states


def _backbone(model: nn.Module) -> nn.Module:
    """The transformer body of an HF model (``base_model`` of a head model, or itself)."""
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) and base is not model else model


def _placement(backbone: nn.Module) -> dict[str, torch.device | torch.dtype]:
    """``device`` and ``dtype`` of a new layer on ``backbone``: those of its first floating-point
    weight (a 4-bit base's packed weights are not floating point); the defaults without one."""
    for tensor in (*backbone.parameters(), *backbone.buffers()):
        if tensor.is_floating_point():
            return {"device": tensor.device, "dtype": tensor.dtype}
    return {}


def _hidden_size(backbone: nn.Module) -> int:
    config = getattr(backbone, "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if hidden is None:
        raise ValueError(
            f"{type(backbone).__name__} has no config.hidden_size: pass a transformers model "
            "(e.g. the output of load_causal_lm) to ValueModel"
        )
    return int(hidden)


class ValueModel(nn.Module):
    """``V(s_t)`` for every position of a sequence: backbone hidden states -> ``Linear(hidden, 1)``.

    ``forward(input_ids [B, L], attention_mask [B, L]) -> values [B, L]`` in float32. The value at
    position ``i`` is that of the state made of tokens ``0..i``.
    """

    def __init__(self, backbone: nn.Module, value_head: nn.Linear | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = _hidden_size(backbone)
        if value_head is None:
            value_head = nn.Linear(hidden, 1, **_placement(backbone))
            nn.init.zeros_(value_head.weight)
            nn.init.zeros_(value_head.bias)
        if value_head.in_features != hidden or value_head.out_features != 1:
            raise ValueError(
                f"value_head must be Linear({hidden}, 1) to match the backbone, got "
                f"Linear({value_head.in_features}, {value_head.out_features})"
            )
        self.value_head = value_head

    @property
    def config(self):
        return self.backbone.config

    @classmethod
    def from_causal_lm(cls, model: nn.Module) -> ValueModel:
        """A critic initialised from a policy: a deep copy of its backbone, a zero value head.

        A zero head makes ``V = 0`` at the start, so the first advantages are the rewards
        themselves (no random baseline noise).
        """
        return cls(copy.deepcopy(_backbone(model)))

    @classmethod
    def from_reward_model(cls, model: nn.Module) -> ValueModel:
        """A critic initialised from a scalar reward model: its backbone and its score head.

        ``model`` is a ``*ForSequenceClassification`` with ``num_labels=1`` (head ``score`` or
        ``classifier``); both are deep-copied, so the reward model stays untouched.
        """
        head = getattr(model, "score", None)
        if head is None:
            head = getattr(model, "classifier", None)
        if not isinstance(head, nn.Linear) or head.out_features != 1:
            raise ValueError(
                f"{type(model).__name__} has no scalar Linear score head (score/classifier with "
                "num_labels=1): pass a sequence-classification reward model"
            )
        backbone = copy.deepcopy(_backbone(model))
        value_head = nn.Linear(head.in_features, 1, **_placement(backbone))
        with torch.no_grad():
            value_head.weight.copy_(head.weight)
            if head.bias is not None:
                value_head.bias.copy_(head.bias)
            else:
                value_head.bias.zero_()
        return cls(backbone, value_head)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None = None) -> Tensor:
        """``input_ids`` int64 ``[B, L]``, ``attention_mask`` ``[B, L]`` -> values float32 ``[B, L]``;
        ``attention_mask=None`` with ``position_ids``: packed rows (:mod:`textrl.models.packing`)."""
        hidden = hidden_states(self.backbone, input_ids, attention_mask, position_ids)  # [B, L, H]
        values = self.value_head(hidden.to(self.value_head.weight.dtype))  # [B, L, 1]
        # a new tensor rather than a view of the head's output: FSDP2 hooks the backward on it
        return values.squeeze(-1).float().clone()  # [B, L]


class SharedTrunkValue(ValueModel):
    """``V(s_t)`` from a value head on another model's body, which it does not own (``critic='shared'``).

    The body (the policy's) is held by reference, not as a submodule: :meth:`parameters`,
    ``state_dict`` and the critic's optimiser hold the head alone, while the value loss's gradient
    reaches the body too, whose own optimiser (the policy's) steps it. Same ``forward`` as
    :class:`ValueModel`.
    """

    def __init__(self, body: nn.Module, value_head: nn.Linear | None = None) -> None:
        nn.Module.__init__(self)
        object.__setattr__(self, "_body", body)
        hidden = _hidden_size(body)
        head = value_head if value_head is not None else nn.Linear(hidden, 1, **_placement(body))
        if value_head is None:
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
        self.value_head = head

    @property
    def backbone(self) -> nn.Module:  # type: ignore[override]
        return self._body

    @classmethod
    def on(cls, model: nn.Module) -> SharedTrunkValue:
        """A zero value head on ``model``'s own body (a ``*ForCausalLM``'s ``.model``)."""
        return cls(_backbone(model))


def lora_value_model(model: nn.Module, frozen_dtype: torch.dtype, head_dtype: torch.dtype, *, r: int = 8,
                     alpha: int = 16, dropout: float = 0.0, target_modules: str = "auto") -> ValueModel:
    """``V(s_t)`` as a LoRA adapter and a value head on a frozen copy of ``model``'s body
    (``critic='lora'``): the copy's weights in ``frozen_dtype`` (bf16 on CUDA by default), the
    adapter's and the head's (the trained ones) in ``head_dtype``. Only those train."""
    from peft import inject_adapter_in_model

    from textrl.core.precision import frozen_copy
    from textrl.models.adapters import lora_config

    body = frozen_copy(_backbone(model), frozen_dtype)
    config = lora_config(r, alpha, dropout, target_modules, model=model)
    body = inject_adapter_in_model(config, body)
    for name, param in body.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(head_dtype)
            param.requires_grad_(True)
        else:
            param.requires_grad_(False)
    place = _placement(body)
    head = nn.Linear(_hidden_size(body), 1, device=place.get("device"), dtype=head_dtype)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return ValueModel(body, head)


__all__ = ["SharedTrunkValue", "ValueModel", "lora_value_model"]
