"""On-policy distillation: a teacher's per-token log-probs on the student's own samples.

The student ``pi`` samples ``y ~ pi``; a teacher ``pi_T`` scores every sampled token. The
per-token reward is minus the reverse KL's single-sample estimate,
``r_t = log pi_T(y_t | y_<t) - log pi(y_t | y_<t)`` (Agarwal et al. 2024, "On-Policy Distillation
of Language Models: Learning from Self-Generated Mistakes" (GKD) with the reverse KL; Lu and
Thinking Machines Lab 2025, "On-Policy Distillation"): its expectation over ``y_t ~ pi`` is
``-KL(pi || pi_T)`` at that state, and it is 0 on every token when the teacher is the student.
All compute in float32 (float64 stays float64).
"""

from __future__ import annotations

import torch
from torch import Tensor

from textrl.functional._validate import check_2d, check_float, check_mask, check_same_shape


def _check_coef(coef: float) -> None:
    if not isinstance(coef, (int, float)) or isinstance(coef, bool) or not coef >= 0:
        raise ValueError(f"coef={coef!r}: must be a number >= 0")


def reverse_kl_reward(logp: Tensor, teacher_logp: Tensor, mask: Tensor, coef: float = 1.0) -> Tensor:
    """Per-token distillation reward ``coef * (teacher_logp - logp)`` on the agent's tokens, 0 elsewhere.

    logp: float ``[B, T]``, the student's log-prob of each sampled token; teacher_logp: float
    ``[B, T]``, the teacher's of the same tokens in the same contexts; mask: bool ``[B, T]``, the
    agent's tokens (gaps allowed); coef >= 0. Returns float32 ``[B, T]`` (float64 if an input is),
    exactly 0 at masked positions (selected: NaN/inf there does not leak). Minus the k1 estimate of
    ``KL(pi || pi_T)`` per token: ``E_{y_t ~ pi}[r_t] = -coef * KL(pi(.|s_t) || pi_T(.|s_t))``.
    """
    check_2d("logp", logp)
    check_float("logp", logp)
    check_same_shape("teacher_logp", teacher_logp, "logp", logp)
    check_float("teacher_logp", teacher_logp)
    check_mask("mask", mask, "logp", logp)
    _check_coef(coef)
    cdt = torch.promote_types(torch.promote_types(logp.dtype, teacher_logp.dtype), torch.float32)
    zero = torch.zeros((), dtype=cdt, device=logp.device)
    return torch.where(mask, coef * (teacher_logp.to(cdt) - logp.to(cdt)), zero)

