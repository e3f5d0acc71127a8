"""Pure tensor math of RLHF-PPO over ``[B, T]`` tensors: no TensorDict, no nn.Module, no config.

Every function checks its inputs and raises ``ValueError`` naming the argument and the expected
shape or dtype; masks are bool and masked positions may hold NaN/inf (select, don't multiply).
A mask of the agent's tokens may have gaps (the observation tokens of a multi-turn episode,
docs/design.md, "Multi-turn episodes"); only ``response_mask`` builds a prefix.
"""

from __future__ import annotations

from textrl.functional.advantages import (
    gae,
    grpo_advantage,
    last_valid,
    next_valid,
    one_step_advantage,
    rloo_advantage,
)
from textrl.functional.distill import reverse_kl_reward
from textrl.functional.kl import (
    KL_KINDS,
    kl_abs,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
    kl_shaped_rewards,
    shaped_token_rewards,
)
from textrl.functional.logprobs import (
    ENTROPY_MODES,
    entropy_from_logits,
    logprobs_from_hidden,
    logprobs_from_logits,
    sampling_filter,
)
from textrl.functional.masking import (
    compact,
    compaction_index,
    last_true_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    response_mask,
    uncompact,
)
from textrl.functional.mismatch import (
    MISMATCH_KINDS,
    geo_mean_weights,
    icepop_weights,
    mis_weights,
    mismatch_bounds,
    mismatch_stats,
    mismatch_weights,
    none_weights,
    tis_weights,
)
from textrl.functional.ppo import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    clipped_policy_loss,
    clipped_value_loss,
    explained_variance,
    kept_mask,
)
from textrl.functional.vapo import gae_row_lambda, length_adaptive_lambda
from textrl.functional.zoo import (
    LOG_RATIO_CLAMP,
    cispo_loss,
    dr_grpo_advantage,
    dr_grpo_aggregate,
    dynamic_sampling_keep,
    gspo_loss,
    overlong_penalty,
    reinforce_pp_advantages,
    token_level_aggregate,
)

__all__ = [
    "MISMATCH_KINDS",
    "geo_mean_weights",
    "icepop_weights",
    "mis_weights",
    "mismatch_bounds",
    "mismatch_stats",
    "mismatch_weights",
    "none_weights",
    "tis_weights",
    "gae_row_lambda",
    "length_adaptive_lambda",
    "LOG_RATIO_CLAMP",
    "cispo_loss",
    "dr_grpo_advantage",
    "dr_grpo_aggregate",
    "dynamic_sampling_keep",
    "gspo_loss",
    "overlong_penalty",
    "reinforce_pp_advantages",
    "token_level_aggregate",
    "ENTROPY_MODES",
    "KL_KINDS",
    "LOSS_AGGREGATIONS",
    "aggregate_loss",
    "clipped_policy_loss",
    "clipped_value_loss",
    "compact",
    "compaction_index",
    "entropy_from_logits",
    "explained_variance",
    "kept_mask",
    "gae",
    "grpo_advantage",
    "kl_abs",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
    "kl_shaped_rewards",
    "last_true_index",
    "last_valid",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "sampling_filter",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "next_valid",
    "one_step_advantage",
    "response_mask",
    "reverse_kl_reward",
    "rloo_advantage",
    "shaped_token_rewards",
    "uncompact",
]
