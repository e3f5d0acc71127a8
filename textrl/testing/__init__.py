"""Property-testing kit for your own estimators and losses.

Three parts, all over the ``[B, T]`` layout of docs/design.md, "The rollout TensorDict":

- **Hypothesis strategies** (need ``pip install hypothesis``; imported on first use):
  :func:`masks` (agent masks with observation gaps, rows of one token, full-length rows),
  :func:`episode_masks` (the agent mask with the response mask around it), :func:`rollouts`
  (a whole rollout TensorDict that :func:`textrl.core.checks.check_rollout` accepts: ``pad == eos``,
  truncated rows, multi-turn episodes, placed rewards), :func:`groups` (group scores with
  constant-reward groups) and :func:`float_tensors` (optionally with extreme values).
- **Reference implementations** written as plain Python loops over rows and positions:
  :func:`reference_gae`, :func:`reference_returns`, :func:`reference_grpo_advantages`,
  :func:`reference_rloo_advantages`. They are slow and obvious on purpose.
- **Invariant checks** that raise :class:`InvariantError` (an ``AssertionError``) with a message
  naming the output, the position and the values: :func:`check_masked_positions_ignored`,
  :func:`check_agrees_with_reference`, :func:`check_finite_under_extreme_log_ratios`.
- **Tolerances from the arithmetic** (:mod:`textrl.testing.tolerance`): :func:`gamma` (the rounding
  bound of ``n`` float operations), :func:`sum_tolerance` (two orders of one sum) and
  :func:`assert_close_normwise`, for comparing two computations of the same float result (two
  kernels, two backends, two CPUs) without a tolerance read off one machine's numbers.

Example (a user's GAE against the reference, over drawn gapped masks)::

    from hypothesis import given
    from textrl import testing as tt

    cases = tt.masks().flatmap(lambda m: tt.float_tensors((2, *m.shape)).map(lambda x: (*x, m)))

    @given(cases)
    def test_my_gae(case):
        rewards, values, mask = case
        tt.check_agrees_with_reference(my_gae, tt.reference_gae, rewards, values, mask,
                                       gamma=0.9, lam=0.95, mask=mask)

Importing this module imports torch and :mod:`textrl.keys` only (no torchrl, no hypothesis).
"""

from textrl.testing.checks import (
    DEFAULT_FILLS,
    EXTREME_LOG_RATIOS,
    InvariantError,
    check_agrees_with_reference,
    check_finite_under_extreme_log_ratios,
    check_masked_positions_ignored,
    extreme_log_ratio_inputs,
)
from textrl.testing.references import (
    reference_gae,
    reference_grpo_advantages,
    reference_returns,
    reference_rloo_advantages,
)
from textrl.testing.strategies import (
    EXTREME_VALUES,
    GROUP_KINDS,
    ROW_KINDS,
    episode_masks,
    float_tensors,
    groups,
    masks,
    rollouts,
)
from textrl.testing.tolerance import assert_close_normwise, gamma, sum_tolerance, unit_roundoff

__all__ = [
    "DEFAULT_FILLS",
    "EXTREME_LOG_RATIOS",
    "EXTREME_VALUES",
    "GROUP_KINDS",
    "ROW_KINDS",
    "InvariantError",
    "assert_close_normwise",
    "check_agrees_with_reference",
    "check_finite_under_extreme_log_ratios",
    "check_masked_positions_ignored",
    "episode_masks",
    "extreme_log_ratio_inputs",
    "float_tensors",
    "gamma",
    "groups",
    "masks",
    "reference_gae",
    "reference_grpo_advantages",
    "reference_returns",
    "reference_rloo_advantages",
    "rollouts",
    "sum_tolerance",
    "unit_roundoff",
]
