"""Critic-free PPO with group baselines: GRPO (Shao et al. 2024) and RLOO (Ahmadian et al. 2024).

Each prompt is sampled ``n_samples_per_prompt`` times (consecutive rows of the rollout, as
:class:`textrl.envs.PromptSampler` lays them out). A response's sequence reward is its task score, minus
``beta * sum_t KL_t`` when the KL goes into the reward (``kl_in="reward"``); its advantage is
that reward against the other responses of its group:

- GRPO: ``(r - mean_group) / (std_group + eps)`` (DeepSeekMath, verl ``compute_grpo_outcome_advantage``);
- RLOO: ``r - mean of the other k - 1 rewards`` (leave-one-out, unbiased).

The advantage is given to every valid token of the response; the loss is the token-level clipped
PPO surrogate (``loss_aggregation``), minus ``entropy_coef`` x entropy, plus ``beta`` x KL when
``kl_in="loss"`` (GRPO's usual placement, with ``kl_kind="k3"``). No value model is trained.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torch import Tensor

from textrl.agents import build
from textrl.agents.base import (
    LORA_OPTIONS,
    POLICY_OBJECTIVE_OPTIONS,
    SHARED_OPTIONS,
    CriticFreePPO,
)
from textrl.agents.teacher import TEACHER_OPTIONS, token_rewards
from textrl.core.agent_registry import register_agent
from textrl.functional import (
    shaped_token_rewards,
)
from textrl.functional.advantages import grpo_advantage, rloo_advantage
from textrl.keys import KEYS


class GroupPPO(CriticFreePPO):
    """PPO with a group baseline instead of a critic; subclasses pick :meth:`group_advantage`."""

    name = "group_ppo"
    min_samples_per_prompt = 2
    options = SHARED_OPTIONS | POLICY_OBJECTIVE_OPTIONS | LORA_OPTIONS | TEACHER_OPTIONS | {"reward_placement"}
    not_read = {
        **CriticFreePPO.not_read,
        "gamma": "the group baseline replaces discounted returns",
        "whiten_advantages": "the group baseline is its own normalisation",
    }
    default_clip_eps = 0.2

    def episode_budget(self) -> int:
        """The run's token budget of an episode after the prompt (:func:`textrl.agents.build.episode_budget`:
        the length terms' constant); the environment read once where the trainer handed no facts over."""
        if self.env_facts is None and self.config.max_episode_tokens is None:
            self.env_facts = build.run_facts(self.config, None)
        return build.episode_budget(self.config, self.env_facts)

    def group_advantage(self, rewards: Tensor, group_size: int) -> Tensor:  # pragma: no cover - abstract
        """Sequence advantages ``[B]`` from sequence rewards ``[B]`` (groups of consecutive rows)."""
        raise NotImplementedError

    def estimate(self, td: TensorDictBase) -> None:
        """Write ``("next","reward")`` (KL-shaped per token), ``advantage`` and ``value_target`` ``[B, T, 1]``.

        ``value_target`` holds the sequence reward on valid tokens (there is no critic to fit;
        kept so every agent's rollout has the same keys).
        """
        cfg = self.config
        mask = td.get(KEYS.mask)  # [B, T]
        n = cfg.n_samples_per_prompt
        if td.shape[0] % n:
            raise ValueError(
                f"{type(self).__name__} compares the {n} responses of a prompt, but the rollout has "
                f"{td.shape[0]} rows (not whole groups: did reward_nonfinite='drop' remove rows? use 'zero')"
            )
        kl = self.reference_kl(td.get(KEYS.action_log_prob), td)  # [B, T]
        beta = self.kl_ctl.value if cfg.kl_in == "reward" else 0.0
        rewards = shaped_token_rewards(token_rewards(self, td), kl, mask, beta)  # [B, T]
        sequence_reward = torch.where(mask, rewards, 0.0).sum(1)  # [B]: score - beta * sum_t KL_t
        advantage = self.group_advantage(sequence_reward, n).to(rewards.dtype)  # [B]
        zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
        td.set(KEYS.reward, rewards.unsqueeze(-1))
        td.set(KEYS.advantage, torch.where(mask, advantage.unsqueeze(1), zero).unsqueeze(-1))
        td.set(KEYS.value_target, torch.where(mask, sequence_reward.unsqueeze(1), zero).unsqueeze(-1))


@register_agent("grpo")
class GRPO(GroupPPO):
    """Group Relative Policy Optimisation: the group-normalised reward is the advantage."""

    def group_advantage(self, rewards: Tensor, group_size: int) -> Tensor:
        """``(r - mean_g) / (std_g + 1e-6)``; a constant group gives exactly 0. ``[B] -> [B]``."""
        return grpo_advantage(rewards, group_size)


@register_agent("rloo")
class RLOO(GroupPPO):
    """REINFORCE leave-one-out baseline, optimised with the clipped PPO surrogate."""

    def group_advantage(self, rewards: Tensor, group_size: int) -> Tensor:
        """``r_i - mean_{j != i} r_j`` within each group. ``[B] -> [B]``."""
        return rloo_advantage(rewards, group_size)


__all__ = ["GRPO", "RLOO", "GroupPPO"]
