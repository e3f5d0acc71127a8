"""Sequence-level PPO: the whole response is one action (MiniMind ``train_ppo.py``).

``A = R - V(s_last)`` (V read at the last valid token), ``ratio = exp(sum_t logp - sum_t
logp_old)`` against a frozen old-policy snapshot refreshed every ``old_policy_refresh_every``
iterations, ``loss = -mean(min(ratio A, clip(ratio, 1 +- eps) A)) + vf_coef * MSE(V_last, R)
+ kl_coef * mean(sum_t (logp - logp_ref))``. Clip epsilon 0.1 by default; no whitening.

Its action is the whole response, so it applies the sequence-level rollout corrections only
(``mis``, ``geo_mean``: one weight per row, which multiplies the row's policy loss; a rejected row
counts 0 in the mean over rows); the value and KL terms are not corrected.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import Tensor, nn

from textrl.agents import forwards
from textrl.agents.base import CRITIC_OPTIONS, SCORE, SHARED_OPTIONS, PPOAgent
from textrl.agents.update import LossTerms
from textrl.config import TrainConfig
from textrl.core.agent_registry import register_agent
from textrl.functional import (
    clipped_policy_loss,
    masked_mean,
    masked_sum,
    one_step_advantage,
)
from textrl.functional.advantages import last_valid
from textrl.keys import KEYS


@register_agent("one_step_ppo")
class OneStepPPO(PPOAgent):
    """MiniMind's PPO: one action per response, summed log-probs, old-policy snapshot (docs/design.md, "Agents")."""

    needs_critic = True
    pipeline_reward = "reward_model"
    options = SHARED_OPTIONS | CRITIC_OPTIONS | {"old_policy_refresh_every"}
    not_read = {
        "entropy_coef": "it has no entropy bonus",
        "kl_in": "its sequence KL always goes into the loss",
        "kl_hinge": "its sequence KL is never hinged",
        "loss_aggregation": "its loss is a mean over responses, one action each",
        "whiten_advantages": "its advantage R - V(s_last) is not whitened",
        "gamma": "a response is one action: there is nothing to discount",
        "lam": "a response is one action: there is no GAE",
        "value_clip_eps": "its value loss is an unclipped MSE",
        "reward_placement": "the score is the one action's reward",
        "reward_adapter": "its reward comes from --reward / --reward-model",
        "critic_type": "its critic is a full value model (critic_init)",
        "lora_r": "its old-policy snapshot is a copy of the whole policy",
        "lora_alpha": "it trains every weight of the policy",
        "lora_target_modules": "it trains every weight of the policy",
        "load_in_4bit": "it trains every weight of the policy, which a 4-bit base would freeze",
    }
    default_clip_eps = 0.1
    rollout_corrections = ("none", "mis", "geo_mean")
    """One action per response: a token-level correction (tis, icepop) has no token to weigh."""

    def __init__(self, policy: nn.Module, tokenizer: Any, config: TrainConfig | None = None, **kwargs: Any) -> None:
        super().__init__(policy, tokenizer, config, **kwargs)
        self.old_policy = copy.deepcopy(self.policy).eval().requires_grad_(False)

    def behaviour_logprobs(self, input_ids: Tensor, attention_mask: Tensor, prompt_len: int, action: Tensor) -> Tensor:
        """The ratio's denominator comes from the old-policy snapshot, as in MiniMind."""
        return self.learner.forwards.logprobs(self.old_policy, input_ids, attention_mask, prompt_len, action)

    def estimate(self, td: TensorDictBase) -> None:
        """``advantage = R - V(s_last)`` and ``value_target = R`` on every valid token (``[B, T, 1]``)."""
        mask = td.get(KEYS.mask)  # [B, T]
        score = td.get(SCORE)  # [B]
        values = td.get(KEYS.state_value).squeeze(-1)  # [B, T]
        advantage = one_step_advantage(score, last_valid(values, mask))  # [B]
        zero = torch.zeros((), dtype=values.dtype, device=values.device)
        td.set(KEYS.advantage, torch.where(mask, advantage.unsqueeze(1), zero).unsqueeze(-1))
        td.set(KEYS.value_target, torch.where(mask, score.unsqueeze(1).to(values.dtype), zero).unsqueeze(-1))

    def micro_weight(self, sub: TensorDictBase, sub_mask: Tensor, mb_tokens: Tensor, micro: int, mb_size: int) -> float:
        """Every loss term is a mean over rows, so a micro-batch weighs its share of rows."""
        return micro / mb_size

    def loss(self, mb: TensorDictBase) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Terms ``policy`` (clipped surrogate on sequence ratios), ``value`` (vf_coef * MSE(V_last, R))
        and ``kl`` (beta * sequence KL)."""
        cfg = self.config
        mask = mb.get(KEYS.mask)  # [B, T]
        logp, entropy = forwards.forward_policy(self, mb)  # [B, T]
        seq_logp = masked_sum(logp, mask, dim=1)  # [B]
        old_seq_logp = masked_sum(mb.get(KEYS.action_log_prob), mask, dim=1)  # [B]
        advantage = last_valid(mb.get(KEYS.advantage).squeeze(-1), mask)  # [B]
        rows = torch.ones_like(seq_logp, dtype=torch.bool).unsqueeze(1)  # [B, 1]: one action per row
        pg_loss, pg_stats = clipped_policy_loss(
            seq_logp.unsqueeze(1),
            old_seq_logp.unsqueeze(1),
            advantage.unsqueeze(1),
            rows,
            clip_eps=self.clip_eps,
            dual_clip=cfg.dual_clip,
            aggregation="token_mean",
            normaliser=rows.shape[0],  # every row, a rejected one too: micro-batches weigh their share of rows
            weights=row_weights(mb.get(KEYS.correction_weight, None), mask),
        )
        value_last = last_valid(forwards.forward_values(self, mb), mask)  # [B]
        v_loss = torch.nn.functional.mse_loss(value_last, mb.get(SCORE).to(value_last.dtype))
        seq_kl = masked_sum(self.reference_kl(logp, mb), mask, dim=1)  # [B]
        kl_loss = self.kl_ctl.value * seq_kl.mean()
        terms = LossTerms(policy=pg_loss, value=cfg.vf_coef * v_loss, kl=kl_loss)
        stats = {
            "loss/policy": pg_loss,
            "loss/value": v_loss,
            "loss/kl": kl_loss,
            "entropy": masked_mean(entropy, mask),
            "clip_fraction": pg_stats["clip_fraction"],
            "kl/policy_old": pg_stats["approx_kl"],
            "kl/ref_sequence": seq_kl.mean(),
            "ratio/mean": pg_stats["ratio_mean"],
            "ratio/max": pg_stats["ratio_max"],
            "ratio/min": pg_stats["ratio_min"],
            "value/mean": value_last.mean(),
        }
        return terms, stats

    def after_update(self) -> None:
        """Reference refresh and counters (base), then the old-policy snapshot every N iterations."""
        super().after_update()
        if self.iteration % self.config.old_policy_refresh_every == 0:
            self.backend.copy_weights(self.old_policy, self.policy)


def row_weights(weights: Tensor | None, mask: Tensor) -> Tensor | None:
    """A sequence-level correction's one weight per row, ``[B, T] -> [B, 1]`` (its value on the row's
    agent tokens ``mask``, 0 for a rejected row); None stays None."""
    if weights is None:
        return None
    return torch.where(mask, weights, 0.0).amax(dim=1, keepdim=True)


__all__ = ["OneStepPPO", "row_weights"]
