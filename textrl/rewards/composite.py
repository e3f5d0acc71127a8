"""A weighted sum of named reward functions that also returns each one's raw score.

A component that returns None for a row does not apply to it (TRL's ``reward_funcs``
convention): the row's total is the weighted sum over the components that apply, and a row no
component applies to gets 0 with a :class:`NoApplicableRewardWarning`, as TRL's
``GRPOTrainer`` does (its ``nansum`` over the functions, and its warning).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from textrl.rewards.base import (
    Completion,
    Prompt,
    RewardFn,
    check_batch,
    check_finite_weight,
    evaluate_reward,
)

_MAX_ROWS_SHOWN = 10


class NoApplicableRewardWarning(UserWarning):
    """Every reward function returned None for some rows: their total reward is 0."""


@dataclass(frozen=True)
class RewardBreakdown:
    """What :meth:`CompositeReward.evaluate` returns for a batch of ``B`` rows."""

    total: Tensor
    """float32 ``[B]``: sum over the applying components of ``weight * score``; 0 where none applies."""
    components: dict[str, Tensor]
    """name -> float32 ``[B]`` raw (unweighted) score; NaN where the component does not apply."""
    applies: dict[str, Tensor]
    """name -> bool ``[B]``: False where the component returned None for the row."""


def combine_scores(
    scores: Mapping[str, Tensor],
    applies: Mapping[str, Tensor],
    weights: Mapping[str, float],
) -> Tensor:
    """``total[i] = sum_k weight_k * scores_k[i]`` over the ``k`` with ``applies_k[i]``, float32 ``[B]``.

    A row no component applies to gets 0 and a :class:`NoApplicableRewardWarning` names it
    (TRL: a ``nansum`` over the functions, with a warning). A NaN/inf score of an applying
    component is a fault and stays in the total. All tensors are ``[B]``; the total lives on
    the first component's device.

    >>> import math
    >>> nan = math.nan
    >>> combine_scores({"a": torch.tensor([1.0, nan]), "b": torch.tensor([nan, 3.0])},
    ...                {"a": torch.tensor([True, False]), "b": torch.tensor([False, True])},
    ...                {"a": 2.0, "b": 0.5}).tolist()
    [2.0, 1.5]
    """
    if not scores:
        raise ValueError("combine_scores needs at least one component")
    device = next(iter(scores.values())).device
    n = next(iter(scores.values())).shape[0]
    total = torch.zeros(n, dtype=torch.float32, device=device)
    any_applies = torch.zeros(n, dtype=torch.bool, device=device)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    for name, score in scores.items():
        mask = applies[name].to(device)
        total = total + torch.where(mask, weights[name] * score.to(device), zero)
        any_applies |= mask
    none = torch.nonzero(~any_applies).flatten().tolist()
    if none:
        shown = none[:_MAX_ROWS_SHOWN]
        more = f" and {len(none) - len(shown)} more" if len(none) > len(shown) else ""
        warnings.warn(
            f"no reward function applies to rows {shown}{more} (each of {list(scores)} returned "
            "None there), so their total reward is 0; make at least one reward function return "
            "a score for every row",
            NoApplicableRewardWarning,
            stacklevel=2,
        )
    return total


class CompositeReward:
    """``total = sum_k weight_k * reward_k(prompts, completions, **kwargs)``, float32 ``[B]``.

    ``components`` maps a name to ``(fn, weight)`` or to a bare ``fn`` (weight 1.0). Every
    component goes through :func:`~textrl.rewards.base.evaluate_reward`, so a failing one raises
    a :class:`~textrl.rewards.base.RewardError` naming it. A component that returns None for a
    row does not count in that row's total (:func:`combine_scores`). :meth:`components` also
    returns each component's raw (unweighted) score, NaN where it does not apply, for the
    rollout keys ``("reward_components", name)``. The object holds only its configuration:
    calling it twice on the same batch gives the same result.

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

    def evaluate(
        self,
        prompts: Sequence[Prompt],
        completions: Sequence[Completion],
        *,
        allow_nonfinite: bool = False,
        **kwargs: Any,
    ) -> RewardBreakdown:
        """Total, raw scores and ``applies`` flags of every component (:class:`RewardBreakdown`).

        ``allow_nonfinite=True`` lets NaN/inf scores of applying rows through instead of
        raising (see :func:`~textrl.rewards.base.evaluate_reward`); the total of such a row is
        then NaN/inf too, while a row a component does not apply to stays finite.
        """
        check_batch(prompts, completions)
        raw: dict[str, Tensor] = {}
        applies: dict[str, Tensor] = {}
        for name, fn in self._fns.items():
            raw[name], applies[name] = evaluate_reward(
                fn, prompts, completions, allow_nonfinite=allow_nonfinite, **kwargs
            )
        return RewardBreakdown(combine_scores(raw, applies, self._weights), raw, applies)

    def components(
        self,
        prompts: Sequence[Prompt],
        completions: Sequence[Completion],
        *,
        allow_nonfinite: bool = False,
        **kwargs: Any,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``(total [B], {name: raw score [B]})``; raw scores are before weighting, NaN where
        the component returned None (see :meth:`evaluate`, which also gives the flags)."""
        out = self.evaluate(prompts, completions, allow_nonfinite=allow_nonfinite, **kwargs)
        return out.total, out.components

    def __call__(
        self, prompts: Sequence[Prompt], completions: Sequence[Completion], **kwargs: Any
    ) -> Tensor:
        """The weighted total, float32 ``[B]``."""
        return self.evaluate(prompts, completions, **kwargs).total

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}:{w:g}" for k, w in self._weights.items())
        return f"CompositeReward({parts})"


__all__ = ["CompositeReward", "NoApplicableRewardWarning", "RewardBreakdown", "combine_scores"]
