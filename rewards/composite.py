"""A weighted sum of named reward functions that also returns each one's raw score."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from textrl.rewards.base import RewardFn, call_reward, check_batch, check_finite_weight
from torch import Tensor


class CompositeReward:
    """``total = sum_k weight_k * reward_k(prompts, completions, **kwargs)``, float32 ``[B]``.

    ``components`` maps a name to ``(fn, weight)`` or to a bare ``fn`` (weight 1.0). Every
    component goes through :func:`~textrl.rewards.base.call_reward`, so a failing one raises a
    :class:`~textrl.rewards.base.RewardError` naming it. :meth:`components` also returns each
    component's raw (unweighted) score, for the rollout keys ``("reward_components", name)``.
    The object holds only its configuration: calling it twice on the same batch gives the
    same result.

    >>> from textrl.rewards.rules import tag_count_reward, think_format_reward
    >>> reward = CompositeReward({"format": (think_format_reward, 2.0), "tags": tag_count_reward})
    >>> total, raw = reward.components(["q"], ["<think>\\nx\\n</think>\\n<answer>\\ny\\n</answer>"])
    >>> total.tolist(), {k: v.tolist() for k, v in raw.items()}
    ([2.0], {'format': [0.5], 'tags': [1.0]})
    """

    name = "composite"

    def __init__(self, components: Mapping[str, tuple[RewardFn, float] | RewardFn]) -> None:
        if not components:
            raise ValueError("CompositeReward needs at least one component")
        self._fns: dict[str, RewardFn] = {}
        self._weights: dict[str, float] = {}
        for name, spec in components.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"CompositeReward: component name {name!r} is not a non-empty str")
            if isinstance(spec, (tuple, list)):
                if len(spec) != 2:
                    raise ValueError(
                        f"CompositeReward: component {name!r} is {spec!r}; give (fn, weight) or fn"
                    )
                fn, weight = spec
            else:
                fn, weight = spec, 1.0
            if not callable(fn):
                raise ValueError(f"CompositeReward: component {name!r} is not callable: {fn!r}")
            self._fns[name] = fn
            self._weights[name] = check_finite_weight(weight, f"CompositeReward component {name!r}")

    @property
    def weights(self) -> dict[str, float]:
        """Component name -> weight (a copy)."""
        return dict(self._weights)

    @property
    def functions(self) -> dict[str, Callable[..., Tensor]]:
        """Component name -> reward function (a copy)."""
        return dict(self._fns)

    def components(
        self,
        prompts: list[str],
        completions: list[str],
        *,
        allow_nonfinite: bool = False,
        **kwargs: Any,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``(total [B], {name: raw score [B]})``; raw scores are before weighting.

        ``allow_nonfinite=True`` lets NaN/inf scores through instead of raising (see
        :func:`~textrl.rewards.base.call_reward`); the total of such a row is then NaN/inf too.
        """
        n = check_batch(prompts, completions)
        raw = {
            name: call_reward(fn, prompts, completions, allow_nonfinite=allow_nonfinite, **kwargs)
            for name, fn in self._fns.items()
        }
        device = next(iter(raw.values())).device
        total = torch.zeros(n, dtype=torch.float32, device=device)
        for name, score in raw.items():
            total = total + self._weights[name] * score.to(device)
        return total, raw

    def __call__(self, prompts: list[str], completions: list[str], **kwargs: Any) -> Tensor:
        """The weighted total, float32 ``[B]``."""
        return self.components(prompts, completions, **kwargs)[0]

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}:{w:g}" for k, w in self._weights.items())
        return f"CompositeReward({parts})"


__all__ = ["CompositeReward"]
