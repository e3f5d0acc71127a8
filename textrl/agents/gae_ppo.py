"""Token-level PPO with a critic and GAE (Ziegler et al. 2019; Ouyang et al. 2022; CleanRL ppo.py).

Per iteration: per-token KL to the reference (k1/k2/k3/abs) goes into the reward
(``r_t = -beta * KL_t``, the task reward on each turn's last agent token or the score spread as
``r/T``) or into the loss; GAE(gamma, lam) over the agent's tokens (the observation tokens of a
multi-turn episode skipped) gives ``advantage`` and ``value_target``; K epochs
of clipped policy loss + ``vf_coef`` x clipped value loss - ``entropy_coef`` x entropy.

VAPO's pieces (Yue et al. 2025, arXiv:2504.05118) are options here, off by default (``vapo``
turns them on): a GAE lambda of the critic's own (``lam_critic``), a length-adaptive policy
lambda (``lam_length_alpha``), critic-only warm-up iterations (``critic_warmup_iterations``) and
clip-higher (``clip_eps_high``).
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torch import Tensor

from textrl.agents import build, forwards
from textrl.agents import update as update_loop
from textrl.agents.base import (
    CRITIC_OPTIONS,
    LORA_OPTIONS,
    POLICY_OBJECTIVE_OPTIONS,
    SHARED_OPTIONS,
    PPOAgent,
    rows_normaliser,
)
from textrl.agents.teacher import TEACHER_OPTIONS, token_rewards
from textrl.agents.update import LossTerms, total_loss
from textrl.core.agent_registry import register_agent
from textrl.functional import (
    clipped_value_loss,
    gae,
    gae_row_lambda,
    length_adaptive_lambda,
    masked_whiten,
    shaped_token_rewards,
)
from textrl.keys import KEYS


@register_agent("gae_ppo")
class GAEPPO(PPOAgent):
    """Token-level PPO: KL-shaped rewards (or KL in the loss), GAE, clipped losses (docs/design.md, "Agents")."""

    needs_critic = True
    pipeline_reward = "reward_model"
    lora = "optional"
    options = SHARED_OPTIONS | POLICY_OBJECTIVE_OPTIONS | CRITIC_OPTIONS | LORA_OPTIONS | TEACHER_OPTIONS | {
        "value_clip_eps", "gamma", "lam", "whiten_advantages", "reward_placement", "critic_type",
        "lam_critic", "lam_length_alpha", "critic_warmup_iterations"}
    not_read = {
        "old_policy_refresh_every": "it keeps no old-policy snapshot: the behaviour policy is the policy at collection",
        "reward_adapter": "its reward comes from --reward / --reward-model",
    }
    default_clip_eps = 0.2
    default_lam_critic: float | None = None
    """GAE lambda of the value targets when ``lam_critic`` is unset (None: ``lam``)."""
    default_lam_length_alpha: float | None = None
    """``lam_length_alpha`` when unset (None or 0: the policy's lambda is ``lam``)."""
    default_critic_warmup_iterations = 0
    """``critic_warmup_iterations`` when unset."""

    def critic_warming_up(self) -> bool:
        """Whether this iteration only trains the critic (the first ``critic_warmup_iterations``)."""
        return self.iteration < build.option(type(self), self.config, "critic_warmup_iterations")

    def lambdas(self, mask: Tensor) -> tuple[float | Tensor, float]:
        """``(policy lambda, critic lambda)``: the policy's is ``lam``, or with ``lam_length_alpha``
        VAPO's ``1 - 1/(alpha * l)`` per row ``[B]`` (``l`` the row's agent tokens of ``mask``
        ``[B, T]``); the critic's is ``lam_critic``, else ``lam``."""
        cfg = self.config
        alpha = build.option(type(self), self.config, "lam_length_alpha")
        policy = length_adaptive_lambda(mask.sum(1), alpha) if alpha else cfg.lam
        critic = build.option(type(self), self.config, "lam_critic")
        return policy, cfg.lam if critic is None else critic

    def token_kl(self, logp: Tensor, td: TensorDictBase) -> Tensor:
        """Per-token penalty ``[B, T]`` against ``td``'s reference log-probs: ``KL_t`` of ``kl_kind``,
        or the hinge ``max(0, KL_t - kl_target)``; zeros without a reference (``kl_coef`` 0)."""
        kl = self.reference_kl(logp, td)
        if self.config.kl_hinge:
            kl = (kl - self.config.kl_target).clamp(min=0)
        return kl

    def estimate(self, td: TensorDictBase) -> None:
        """Shaped rewards, then GAE; writes ``("next","reward")``, ``advantage``, ``value_target``.

        The reward per token (:func:`textrl.agents.teacher.token_rewards`: each turn's reward on its last agent
        token, with a teacher its per-token reward) minus ``beta * KL_t`` on every agent token; GAE steps from agent token
        to agent token over the observation gaps of a multi-turn episode.
        """
        cfg = self.config
        mask = td.get(KEYS.mask)  # [B, T]
        kl = self.token_kl(td.get(KEYS.action_log_prob), td)  # [B, T]
        beta = self.kl_ctl.value if cfg.kl_in == "reward" else 0.0
        rewards = shaped_token_rewards(token_rewards(self, td), kl, mask, beta)  # [B, T]
        values = td.get(KEYS.state_value).squeeze(-1)  # [B, T]
        lam_policy, lam_critic = self.lambdas(mask)
        if isinstance(lam_policy, Tensor):
            advantages, returns = gae_row_lambda(rewards, values, mask, gamma=cfg.gamma, lam=lam_policy)
        else:
            advantages, returns = gae(rewards, values, mask, gamma=cfg.gamma, lam=lam_policy)
        if isinstance(lam_policy, Tensor) or lam_critic != lam_policy:  # VAPO's decoupled GAE
            _, returns = gae(rewards, values, mask, gamma=cfg.gamma, lam=lam_critic)
        if cfg.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
        td.set(KEYS.reward, rewards.unsqueeze(-1))
        td.set(KEYS.advantage, advantages.unsqueeze(-1))
        td.set(KEYS.value_target, returns.unsqueeze(-1))

    def loss(self, mb: TensorDictBase) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """:meth:`policy_objective`'s terms (clipped policy loss, - entropy bonus [, + beta * KL])
        and ``value``: vf_coef * clipped value loss, over the loss's tokens (not weighted by a
        rollout correction, but without the tokens it rejected, as the micro-batch weights count)."""
        cfg = self.config
        terms, stats = self.policy_objective(mb)
        mask = update_loop.loss_mask(mb)  # [B, T]
        v_loss, v_stats = clipped_value_loss(
            forwards.forward_values(self, mb),  # [B, T]
            mb.get(KEYS.state_value).squeeze(-1),
            mb.get(KEYS.value_target).squeeze(-1),
            mask,
            clip_eps=cfg.value_clip_eps,
            aggregation=self.loss_aggregation,
            normaliser=rows_normaliser(self.loss_aggregation, mask),
        )
        if self.critic_warming_up():  # VAPO's value pre-training: zero policy gradient, the policy stays
            terms = LossTerms(critic_warmup=0.0 * total_loss(terms))
            stats["critic_warmup"] = torch.ones(())
        terms["value"] = cfg.vf_coef * v_loss
        stats.update({
            "loss/value": v_loss,
            "value_clip_fraction": v_stats["value_clip_fraction"],
            "value/mean": v_stats["value_mean"],
            "value/return_mean": v_stats["return_mean"],
        })
        return terms, stats


__all__ = ["GAEPPO"]
