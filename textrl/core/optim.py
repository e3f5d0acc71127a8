"""The optimisers of the trained weights (``--optim``, TRL's names) and the one for bf16 weights.

- ``adamw_torch``: ``torch.optim.AdamW`` (the default): its two moment states are in the weights'
  dtype, so float32 weights take 16 bytes a weight with their gradient (4 + 4 + 2 x 4).
- ``adamw_bnb_8bit``: bitsandbytes' ``AdamW8bit``: both moments in 8-bit blocks (tensors of fewer than
  4,096 elements keep float32 moments), 10 bytes a float32 weight.
- ``adamw_anyprecision``: :class:`AnyPrecisionAdamW`: float32 moments and a Kahan compensation of
  every weight not in float32, so that bf16 weights gather the updates that rounding would drop.

Why bf16 weights need the last one: a bf16 number keeps 8 significant bits, so adding an update
smaller than about 1/256 of a weight leaves the weight as it was. At a learning rate of 1e-6 the
AdamW step (about ``lr`` per weight) of a weight of size 0.01 is 1/10,000 of it: torch's AdamW on
bf16 weights (and bitsandbytes', which writes its update into the weights the same way) loses
every such step. :func:`check_optim` refuses those pairs before any model loads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

OPTIMIZERS = ("adamw_torch", "adamw_bnb_8bit", "adamw_anyprecision")
"""``--optim`` values."""
BF16_SAFE = ("adamw_anyprecision",)
"""The optimisers that keep the updates of bf16 weights (:mod:`textrl.core.optim`'s docstring)."""


def check_optim(optim: str, dtype: str, trains_full_weights: bool = True) -> None:
    """``ValueError`` naming ``optim`` (and ``dtype``) when it is not one textrl builds, needs a
    package that is missing, or would lose the updates of bf16 trained weights
    (``trains_full_weights``: the model's own weights train, not float32 LoRA adapters)."""
    if optim not in OPTIMIZERS:
        hint = " (TRL's adamw_8bit / paged_adamw_8bit: use adamw_bnb_8bit)" if "8bit" in str(optim) else ""
        raise ValueError(f"optim={optim!r}: must be one of {', '.join(OPTIMIZERS)}{hint}")
    if optim == "adamw_bnb_8bit":
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError("optim='adamw_bnb_8bit' needs bitsandbytes: `pip install bitsandbytes`, "
                             "or use --optim adamw_torch")
    if dtype == "bfloat16" and trains_full_weights and optim not in BF16_SAFE:
        raise ValueError(f"dtype='bfloat16' with optim={optim!r}: that optimiser adds each update to the bf16 "
                         "weights, which round away any update under 1/256 of a weight (most of them); use "
                         "--optim adamw_anyprecision (float32 states, Kahan-summed weights) or --dtype float32")


def make_optimizer(optim: str, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """The ``optim`` optimiser over parameter ``groups`` (each with its ``lr``), no weight decay."""
    if optim == "adamw_torch":
        return torch.optim.AdamW(groups, weight_decay=0.0)
    if optim == "adamw_bnb_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, weight_decay=0.0)
    if optim == "adamw_anyprecision":
        return AnyPrecisionAdamW(groups, weight_decay=0.0)
    raise ValueError(f"optim={optim!r}: must be one of {', '.join(OPTIMIZERS)}")


class AnyPrecisionAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) whose moments are float32 whatever the weights' dtype, and whose
    updates of weights not in float32 are Kahan-summed.

    For a weight ``p`` with gradient ``g`` at step ``t`` (all in float32)::

        p <- p * (1 - lr * wd)
        m <- b1 m + (1 - b1) g,    v <- b2 v + (1 - b2) g^2
        u = -lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    A float32 weight then takes ``p <- p + u``: the same operations, in the same order, as
    ``torch.optim.AdamW(foreach=False)`` (tests/test_optim.py). A bf16 weight keeps a compensation
    ``c`` (bf16, what earlier roundings lost): ``s = p + (u + c)`` in float32, ``p <- bf16(s)``,
    ``c <- s - p``, so the weight follows the float32 sum of its updates to within one rounding.
    State per weight: ``exp_avg``, ``exp_avg_sq`` (float32), ``compensation`` (weights not in
    float32), ``step``. Source: the AnyPrecisionAdamW of PyTorch's torchdistx (Kahan summation).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        if not lr > 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or not eps > 0 or weight_decay < 0:
            raise ValueError(f"AnyPrecisionAdamW: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}: "
                             "need lr > 0, 0 <= betas < 1, eps > 0, weight_decay >= 0")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, but the moments stay float32 (torch casts every floating state to its weight's dtype)."""
        moments = {pid: {k: v for k, v in state.items() if k in ("exp_avg", "exp_avg_sq") and torch.is_tensor(v)}
                   for pid, state in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for pid, p in zip(ids, params):
            for key, value in moments.get(pid, {}).items():
                self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("AnyPrecisionAdamW does not take sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32,
                                                           memory_format=torch.preserve_format)
                    if p.dtype != torch.float32:
                        state["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                _adamw_step(p, p.grad, state, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd)
        return loss


def _adamw_step(p: Tensor, grad: Tensor, state: dict[str, Tensor], *, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float) -> None:
    """One AdamW step of weight ``p`` (any float dtype) in place; ``state`` as :class:`AnyPrecisionAdamW` keeps it."""
    step = float(state["step"])
    m, v = state["exp_avg"], state["exp_avg_sq"]
    g = grad.float()
    exact = p.dtype == torch.float32
    w = p if exact else p.float()  # [same shape], float32
    if weight_decay:
        w.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    if exact:
        p.addcdiv_(m, denom, value=-step_size)
        return
    c = state["compensation"]
    update = (m / denom).mul_(-step_size).add_(c.float())  # u + c
    total = w.add_(update)  # s = p + u + c, float32
    p.copy_(total)  # rounded to p's dtype
    c.copy_(total.sub_(p.float()))  # what the rounding lost


__all__ = ["BF16_SAFE", "OPTIMIZERS", "AnyPrecisionAdamW", "check_optim", "make_optimizer"]
