"""The peers' mismatch-correction arithmetic, restated minimally (torch only) for the tests of
``textrl.functional.mismatch`` to compare against.

Each function names the repository, file, commit and function it restates. Their config plumbing
(DataProto, metrics, veto, batch normalisation, distributed means) is stripped; the tensor
arithmetic is kept op for op, in the peers' order, so that where our arithmetic is the same the
comparison is exact. Both peers are Apache-2.0. Checked once against the peers' own functions at
those commits (imported from the repositories with their other imports stubbed): equal bit for bit
on random ragged batches.
"""

from __future__ import annotations

import torch

# ------------------------------------------------------------------------------------------ verl
# https://github.com/volcengine/verl, Apache-2.0.
VERL = "volcengine/verl"
VERL_RS_COMMIT = "2f2996b7dcc037b3b3d4112665b13ab8797e3ad5"  # verl/trainer/ppo/rollout_corr_helper.py
VERL_MIS_COMMIT = "5d378b5f95085fabcde5447f53980ae842d0c165"  # verl/trainer/ppo/mismatch_helper.py
SAFETY_BOUND = 20.0  # both files


def verl_masked_sum(values, mask, axis=None):
    """verl/utils/torch_functional.py::masked_sum @ VERL_RS_COMMIT."""
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def verl_masked_mean(values, mask, axis=None):
    """verl/utils/torch_functional.py::masked_mean @ VERL_RS_COMMIT: sum / (count + 1e-8)."""
    s = verl_masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


def verl_token_tis(log_ratio, response_mask, rollout_is_threshold=2.0):
    """rollout_corr_helper.py::compute_rollout_correction_weights @ VERL_RS_COMMIT,
    ``rollout_is="token"``, ``rollout_is_batch_normalize=False``; ``log_ratio`` is
    ``old_log_prob - rollout_log_prob`` (training over rollout)."""
    log_ratio_safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    rollout_is_weights = torch.exp(log_ratio_safe)
    rollout_is_weights = rollout_is_weights * response_mask
    rollout_is_weights = rollout_is_weights.clamp(max=rollout_is_threshold)
    return rollout_is_weights.detach()


def verl_geometric_rs(log_ratio, response_mask, rollout_rs_threshold, rollout_rs_threshold_lower=None):
    """rollout_corr_helper.py::compute_rollout_rejection_mask @ VERL_RS_COMMIT,
    ``rollout_rs="geometric"``: the modified response mask (1 = kept)."""
    upper_threshold = rollout_rs_threshold
    lower_threshold = (
        rollout_rs_threshold_lower if rollout_rs_threshold_lower is not None else 1.0 / upper_threshold
    )
    log_ratio_mean = verl_masked_mean(log_ratio, response_mask, axis=-1).unsqueeze(-1)
    log_ratio_mean_safe = torch.clamp(log_ratio_mean, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    rollout_is_weights = torch.exp(log_ratio_mean_safe).expand_as(log_ratio)
    mask = (rollout_is_weights >= lower_threshold) & (rollout_is_weights <= upper_threshold)
    mask = mask.float()
    return response_mask * mask


def verl_sequence_mis(old_log_prob, rollout_log_prob, response_mask, rollout_is_threshold,
                      rollout_is_threshold_lower=None):
    """mismatch_helper.py::compute_rollout_importance_weights @ VERL_MIS_COMMIT,
    ``rollout_is_level="sequence"``, ``rollout_is_mode="mask"``, ``rollout_is_veto_threshold=None``:
    the ``rollout_is_weights`` tensor."""
    upper_threshold = rollout_is_threshold
    if rollout_is_threshold_lower is not None:
        lower_threshold = rollout_is_threshold_lower
    else:
        lower_threshold = 1.0 / upper_threshold
    log_ratio = old_log_prob - rollout_log_prob
    log_ratio_sum = verl_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
    log_ratio_sum_safe = torch.clamp(log_ratio_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    rollout_is_weights = torch.exp(log_ratio_sum_safe).expand_as(old_log_prob)
    mask = (rollout_is_weights >= lower_threshold) & (rollout_is_weights <= upper_threshold)
    mask = mask.float()
    rollout_is_weights = rollout_is_weights * mask
    veto_mask = torch.ones((old_log_prob.size(0), 1), dtype=torch.float32, device=old_log_prob.device)
    rollout_is_weights = rollout_is_weights * veto_mask
    return rollout_is_weights * response_mask


def verl_k3_kl(old_log_prob, rollout_log_prob, response_mask):
    """rollout_corr_helper.py::compute_offpolicy_metrics @ VERL_RS_COMMIT, ``k3_kl`` (as a tensor):
    the k3 estimator of KL(pi_rollout || pi_training)."""
    log_ratio = old_log_prob - rollout_log_prob
    k3_kl_matrix = torch.exp(log_ratio) - log_ratio - 1
    return verl_masked_mean(k3_kl_matrix, response_mask)


# -------------------------------------------------------------------------------------- OpenRLHF
# https://github.com/OpenRLHF/OpenRLHF, Apache-2.0.
OPENRLHF = "OpenRLHF/OpenRLHF"
OPENRLHF_COMMIT = "3c3be6234e0cb353e76bb8019947db9dfe99fca7"  # openrlhf/models/loss.py


def openrlhf_icepop(old_log_probs, rollout_log_probs, low_threshold=0.5, high_threshold=5.0):
    """openrlhf/models/loss.py::PolicyLoss.forward @ OPENRLHF_COMMIT,
    ``vllm_is_correction_type="icepop"``: the coefficient ``vllm_is`` the per-token loss is
    multiplied by (the loss is then aggregated over ``action_mask``). Defaults: the CLI's
    ``--algo.advantage.is_correction_threshold 0.5 5.0``."""
    rollout_log_ratio = old_log_probs - rollout_log_probs
    vllm_is = torch.exp(rollout_log_ratio).detach()
    mask = (vllm_is >= low_threshold) & (vllm_is <= high_threshold)
    return vllm_is * mask
