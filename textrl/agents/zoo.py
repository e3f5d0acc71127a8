"""The 2025 agent zoo: Dr. GRPO, DAPO, GSPO, CISPO, REINFORCE++ (and its baseline) and VAPO as
registered agents, each a short class over :mod:`textrl.functional` (docs/design.md, "Agents").

Every loss here adds up over micro-batches: a micro-batch's loss times
:meth:`~textrl.agents.base.PPOAgent.micro_weight` sums to the loss of its minibatch whatever the
split (token-level losses weigh a micro-batch by its share of the minibatch's tokens, sequence-
level ones by its share of rows over a denominator that counts every row).
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torch import Tensor

from textrl.agents import build
from textrl.agents.base import (
    LORA_OPTIONS,
    POLICY_OBJECTIVE_OPTIONS,
    SCORE,
    SHARED_OPTIONS,
    CriticFreePPO,
    attended_response,
    ppo_stats,
)
from textrl.agents.gae_ppo import GAEPPO
from textrl.agents.group_ppo import GRPO, GroupPPO
from textrl.agents.teacher import token_rewards
from textrl.core.agent_registry import register_agent
from textrl.functional import (
    aggregate_loss,
    cispo_loss,
    clipped_policy_loss,
    dr_grpo_advantage,
    dr_grpo_aggregate,
    dynamic_sampling_keep,
    gspo_loss,
    kl_shaped_rewards,
    last_true_index,
    overlong_penalty,
    reinforce_pp_advantages,
)
from textrl.keys import KEYS

FIXED_AGGREGATION = "the algorithm fixes how its loss is reduced"


@register_agent("dr_grpo")
class DrGRPO(GroupPPO):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
    arXiv:2503.20783): the group advantage without the std division (``dr_grpo_advantage``), and
    the clipped surrogate summed over tokens and divided by a constant, rows x the episode's token
    budget (:meth:`~textrl.agents.group_ppo.GroupPPO.episode_budget`), never a count of tokens: no
    length bias and no difficulty bias."""

    aggregation = "seq_mean_token_sum"
    options = GroupPPO.options - {"loss_aggregation"}
    not_read = {**GroupPPO.not_read, "loss_aggregation": f"{FIXED_AGGREGATION}: sum / (rows x budget)"}

    def group_advantage(self, rewards: Tensor, group_size: int) -> Tensor:
        """``r_i - mean_g(r)``. ``[B] -> [B]``."""
        return dr_grpo_advantage(rewards, group_size)

    def surrogate(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                  weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """The clipped surrogate ``[B, T]`` (times the correction ``weights``) summed over valid
        tokens / (B x budget)."""
        loss, stats = clipped_policy_loss(
            logp, old_logp, advantages, mask, clip_eps=self.clip_eps, dual_clip=self.config.dual_clip,
            aggregation="seq_mean_token_sum", clip_eps_high=self.clip_eps_high,
            normaliser=mask.shape[0] * self.episode_budget(), weights=weights,
        )
        return loss, ppo_stats(stats)

    def aggregate(self, loss_mat: Tensor, mask: Tensor) -> Tensor:
        """``dr_grpo_aggregate`` with the episode budget. ``[B, T] -> []``."""
        return dr_grpo_aggregate(loss_mat, mask, max_len=self.episode_budget(), num_seqs=mask.shape[0])


@register_agent("dapo")
class DAPO(GRPO):
    """DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    arXiv:2503.14476): GRPO's advantage with

    - clip-higher: ``clip_eps=0.2``, ``clip_eps_high=0.28`` by default (eq. 10);
    - no KL term in the paper: the KL options act as GRPO's (``--kl-coef 0`` for the paper's);
    - a token-level loss: every valid token of the minibatch weighs the same (eq. 8);
    - dynamic sampling (``dynamic_sampling``, on by default): a group whose sequence rewards are
      all equal (the task score with the overlong penalty, before any KL term) has a zero
      advantage; its rows are left out of the loss (``KEYS.loss_mask``), so
      they do not dilute the token mean. There is no re-sampling to refill the batch: the share
      of groups kept is logged as ``dapo/kept_groups``; a minibatch left empty does not step;
    - soft overlong punishment (``overlong_buffer``, eq. 13): ``overlong_penalty`` of the
      episode's length (its tokens after the prompt) against the episode's token budget is
      added to the score on the row's last agent token. Default buffer: a quarter of the budget
      (the paper: 4096 of 20480 tokens, a fifth); 0 turns it off.
    """

    aggregation = "token_mean"
    default_clip_eps_high = 0.28
    default_dynamic_sampling = True
    options = (GRPO.options - {"loss_aggregation"}) | {"dynamic_sampling", "overlong_buffer"}
    not_read = {**GRPO.not_read, "loss_aggregation": f"{FIXED_AGGREGATION}: DAPO's token-level mean"}

    def overlong_buffer(self) -> int:
        """The punishment interval ``L_cache`` in tokens: ``overlong_buffer``, else a quarter of
        the episode budget (at least 1); 0 = off."""
        value = self.config.overlong_buffer
        return max(1, self.episode_budget() // 4) if value is None else value

    def task_token_rewards(self, td: TensorDictBase) -> Tensor:
        """The task reward per token ``[B, T]`` plus the overlong penalty on each row's last agent token."""
        rewards = super().task_token_rewards(td)
        buffer, budget = self.overlong_buffer(), self.episode_budget()
        if buffer == 0:
            return rewards
        if buffer > budget:
            raise ValueError(f"overlong_buffer={buffer}: must be <= the episode's token budget {budget} "
                             "(max_episode_tokens, or max_new_tokens for a single turn); lower it")
        mask = td.get(KEYS.mask)  # [B, T]
        penalty = overlong_penalty(attended_response(td).sum(1), budget, buffer)  # [B]
        self.overlong_mean = float(penalty.mean()) if penalty.numel() else 0.0
        last = last_true_index(mask)  # [B]; -1 for an empty row
        at_last = torch.arange(mask.shape[1], device=mask.device)[None, :] == last[:, None]  # [B, T]
        return rewards + torch.where(at_last & mask, penalty[:, None].to(rewards.dtype), 0.0)

    def estimate(self, td: TensorDictBase) -> None:
        """GRPO's estimate, then the dynamic-sampling loss mask (``KEYS.loss_mask``)."""
        super().estimate(td)
        if KEYS.loss_mask in td.keys():
            del td[KEYS.loss_mask]
        self.kept_groups = 1.0
        if not build.option(type(self), self.config, "dynamic_sampling"):
            return
        mask = td.get(KEYS.mask)  # [B, T]
        # the task score (overlong penalty included) before any KL term, as DAPO filters on accuracy
        sequence_reward = torch.where(mask, token_rewards(self, td), 0.0).sum(1)  # [B]: with a teacher, its reward too
        n = self.config.n_samples_per_prompt
        keep = dynamic_sampling_keep(sequence_reward.view(-1, n))  # [G]
        self.kept_groups = float(keep.float().mean()) if keep.numel() else 0.0
        td.set(KEYS.loss_mask, mask & keep.repeat_interleave(n)[:, None])

    def update(self, td: TensorDictBase) -> dict[str, float]:
        """The update's metrics plus ``dapo/kept_groups`` (share of groups in the loss) and
        ``dapo/overlong_penalty`` (the mean penalty added to the score)."""
        metrics = super().update(td)
        metrics["dapo/kept_groups"] = getattr(self, "kept_groups", 1.0)
        metrics["dapo/overlong_penalty"] = getattr(self, "overlong_mean", 0.0)
        return metrics


def _rows_advantage(advantages: Tensor, mask: Tensor) -> Tensor:
    """The one advantage of each row (constant over its valid tokens): ``[B, T] -> [B]``, 0 for an empty row."""
    total = torch.where(mask, advantages, 0.0).sum(1)
    return total / mask.sum(1).clamp(min=1)


@register_agent("gspo")
class GSPO(GRPO):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071): GRPO's
    advantage with a sequence-level importance ratio ``exp(mean_t log ratio)`` clipped to
    ``[1 - 3e-4, 1 + 4e-4]`` (the paper's range: ``clip_eps`` / ``clip_eps_high`` defaults);
    every response weighs the same. Its denominator counts every row of the minibatch, so the
    micro-batches add up exactly (rows share)."""

    default_clip_eps = 3e-4
    default_clip_eps_high = 4e-4
    aggregation = "seq_mean"
    options = GRPO.options - {"loss_aggregation", "dual_clip"}
    not_read = {**GRPO.not_read, "loss_aggregation": f"{FIXED_AGGREGATION}: a mean over sequences",
                "dual_clip": "its ratio is per sequence, clipped by clip_eps / clip_eps_high"}

    def surrogate(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                  weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """``gspo_loss`` over the rows ``[B]`` of a (micro-)batch, divided by its row count; with the
        correction ``weights`` ``[B, T]``, GSPO's token-level form weighs each token."""
        loss, stats = gspo_loss(logp, old_logp, _rows_advantage(advantages, mask), mask, clip_eps_low=self.clip_eps,
                                clip_eps_high=self.clip_eps_high, num_seqs=max(1, mask.shape[0]), weights=weights)
        return loss, {
            "clip_fraction": stats["clip_fraction"], "kl/policy_old": stats["approx_kl"],
            "ratio/mean": stats["seq_ratio_mean"], "ratio/max": stats["seq_ratio_max"],
            "ratio/min": stats["seq_ratio_min"],
        }

    def aggregate(self, loss_mat: Tensor, mask: Tensor) -> Tensor:
        """Each row's token mean, summed over rows / the row count. ``[B, T] -> []``."""
        return aggregate_loss(loss_mat, mask, "seq_mean", max(1, mask.shape[0]))


@register_agent("cispo")
class CISPO(GRPO):
    """CISPO (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585, eq. 4): GRPO's advantage, and a
    REINFORCE term weighted by the clipped, stop-gradient importance ratio
    (``cispo_loss``): no token's gradient is dropped by the clip. Upper clip ``clip_eps_high``
    0.28 by default (DAPO's; the paper does not publish its value); no lower clip unless
    ``clip_eps`` is given (MiniMax-M1 tunes only the upper one). Token-level mean."""

    default_clip_eps = None
    default_clip_eps_high = 0.28
    aggregation = "token_mean"
    options = GRPO.options - {"loss_aggregation", "dual_clip"}
    not_read = {**GRPO.not_read, "loss_aggregation": f"{FIXED_AGGREGATION}: a token-level mean",
                "dual_clip": "its importance weight is clipped and detached, never the loss"}

    def surrogate(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                  weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """``cispo_loss`` (token mean of this micro-batch, each token times its correction weight;
        weighted by its token share)."""
        loss, stats = cispo_loss(logp, old_logp, advantages, mask, clip_eps_low=self.clip_eps,
                                 clip_eps_high=self.clip_eps_high, weights=weights)
        return loss, ppo_stats(stats)


@register_agent("reinforce_pp")
class ReinforcePP(CriticFreePPO):
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models", arXiv:2501.03262): no critic; the token reward is ``-beta * KL_t`` (the
    ``kl_kind`` estimator, k1 by default, ``beta = kl_coef``) plus the score on the last agent
    token; the advantage is the undiscounted return normalised over every valid token of the
    rollout (``reinforce_pp_advantages``), optimised with the clipped PPO surrogate."""

    group_size_of_config = False
    """REINFORCE++-baseline: subtract each group's mean score first (groups of n_samples_per_prompt)."""
    options = SHARED_OPTIONS | (POLICY_OBJECTIVE_OPTIONS - {"kl_in", "kl_hinge"}) | LORA_OPTIONS
    not_read = {
        **CriticFreePPO.not_read,
        "gamma": "its return is undiscounted (gamma = 1)",
        "whiten_advantages": "its advantages are normalised over the whole rollout already",
        "kl_in": "its KL always goes into the reward", "kl_hinge": "its KL is never hinged",
        "reward_placement": "the score sits on the last agent token (an outcome reward)",
    }

    def estimate(self, td: TensorDictBase) -> None:
        """Write ``("next","reward")`` (score at the last agent token - beta * KL_t), ``advantage``
        (globally normalised returns) and ``value_target`` (the returns) ``[B, T, 1]``."""
        cfg = self.config
        mask = td.get(KEYS.mask)  # [B, T]
        group = cfg.n_samples_per_prompt if self.group_size_of_config else None
        if group is not None and td.shape[0] % group:
            raise ValueError(f"{type(self).__name__} subtracts the mean of the {group} responses of a prompt, but "
                             f"the rollout has {td.shape[0]} rows (not whole groups: did reward_nonfinite='drop' "
                             "remove rows? use 'zero')")
        kl = self.reference_kl(td.get(KEYS.action_log_prob), td)  # [B, T]
        beta = self.kl_ctl.value
        score = td.get(SCORE).to(kl.dtype)  # [B]
        advantages, returns = reinforce_pp_advantages(score, mask, kl, kl_coef=beta, group_size=group)
        rewards = kl_shaped_rewards(score, kl, mask, beta, "last")  # [B, T]
        td.set(KEYS.reward, rewards.unsqueeze(-1))
        td.set(KEYS.advantage, advantages.to(rewards.dtype).unsqueeze(-1))
        td.set(KEYS.value_target, returns.to(rewards.dtype).unsqueeze(-1))


@register_agent("reinforce_pp_baseline")
class ReinforcePPBaseline(ReinforcePP):
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): REINFORCE++ with each score minus its
    group's mean (the ``n_samples_per_prompt`` responses of a prompt) before the global
    normalisation."""

    min_samples_per_prompt = 2
    group_size_of_config = True


@register_agent("vapo")
class VAPO(GAEPPO):
    """VAPO (Yue et al. 2025, "VAPO: Efficient and Reliable Reinforcement Learning for Advanced
    Reasoning Tasks", arXiv:2504.05118): ``gae_ppo`` with its pieces on by default

    - decoupled GAE: the critic's value targets with ``lam_critic=1.0`` (unbiased returns);
    - length-adaptive policy lambda ``1 - 1/(alpha * l)`` (``lam_length_alpha=0.05``, ``l`` the
      response's agent tokens; clamped to [0, 1], so a response under 20 tokens gets 0);
    - value pre-training: the first ``critic_warmup_iterations=5`` iterations train only the
      critic (the paper: 50 steps of a long run; 5 of the 300-iteration demo);
    - clip-higher ``clip_eps=0.2``, ``clip_eps_high=0.28``, and the token-level loss
      (``loss_aggregation='token_mean'``, the default).

    Its group sampling is ``n_samples_per_prompt``; its positive-example LM loss is not included.
    """

    pipeline_reward = None  # not (yet) one of `textrl pipeline`'s agents
    default_clip_eps_high = 0.28
    default_lam_critic = 1.0
    default_lam_length_alpha = 0.05
    default_critic_warmup_iterations = 5


__all__ = ["CISPO", "DAPO", "GSPO", "VAPO", "DrGRPO", "ReinforcePP", "ReinforcePPBaseline"]
