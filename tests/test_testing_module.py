"""textrl.testing: its strategies draw what they promise, its references agree with
textrl.functional and with hand-computed numbers, and its checks catch deliberately wrong code."""

from __future__ import annotations

import subprocess
import sys

import hypothesis
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import textrl.testing as tt
from textrl.core.checks import check_rollout
from textrl.functional import (
    clipped_policy_loss,
    compact,
    compaction_index,
    gae,
    grpo_advantage,
    kl_k3,
    masked_mean,
    response_mask,
    rloo_advantage,
    uncompact,
)
from textrl.keys import END_REASONS, KEYS

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# For a property expected to fail: no shrinking, no example database (fast, and no state kept).
NO_SHRINK = settings(max_examples=100, deadline=None, database=None, phases=[Phase.generate])
GAMMAS = st.sampled_from([0.0, 0.5, 0.9, 1.0])
LAMS = st.sampled_from([0.0, 0.5, 0.95, 1.0])


def gae_case(**mask_kwargs):
    """``(rewards, values, mask)``: float64 ``[B, T]`` inputs over a drawn agent mask ``[B, T]``."""
    return tt.masks(**mask_kwargs).flatmap(
        lambda m: tt.float_tensors((2, *m.shape)).map(lambda x: (x[0], x[1], m))
    )


def has_gap(mask: torch.Tensor) -> bool:
    """Some row has a False between two Trues."""
    for row in mask.tolist():
        trues = [j for j, v in enumerate(row) if v]
        if trues and trues[-1] - trues[0] + 1 != len(trues):
            return True
    return False


# -- wrong GAEs the checks must catch -----------------------------------------------------------
def gae_ignoring_gaps(rewards, values, mask, gamma, lam):
    """Bootstraps from the next *position* (an observation token) instead of the next agent token."""
    adv = torch.zeros_like(rewards, dtype=torch.float64)
    b, t = rewards.shape
    for i in range(b):
        last = 0.0
        for j in reversed(range(t)):
            if not mask[i, j]:
                continue
            next_v = float(values[i, j + 1]) if j + 1 < t and mask[i, j + 1] else 0.0
            last = float(rewards[i, j]) + gamma * next_v - float(values[i, j]) + gamma * lam * last
            adv[i, j] = last
    return adv, torch.where(mask, adv + values, 0.0)


def gae_off_by_one(rewards, values, mask, gamma, lam):
    """Prefix-only GAE whose bootstrap value is V_t instead of V_{t+1}."""
    adv, ret = gae(rewards, values, mask, gamma, lam)
    shift = gamma * (torch.where(mask, values, 0.0) - torch.cat([values[:, 1:], values[:, :1] * 0], 1))
    return torch.where(mask, adv + shift, 0.0), ret


def gae_multiplying_by_mask(rewards, values, mask, gamma, lam):
    """Right numbers on clean inputs, but ``x * mask`` lets NaN padding through."""
    index = compaction_index(mask)
    t = mask.shape[1]
    m = (torch.arange(t) < mask.sum(1, keepdim=True)).to(rewards.dtype)  # the compacted mask
    r, v = compact(rewards, index), compact(values, index)
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], 1) * torch.cat([m[:, 1:], m[:, :1] * 0], 1)
    delta = (r + gamma * next_v - v) * m
    adv = torch.zeros_like(delta)
    for j in reversed(range(t)):
        adv[:, j] = delta[:, j] + (gamma * lam * adv[:, j + 1] if j + 1 < t else 0.0)
    adv = uncompact(adv * m, index)
    return adv, adv + uncompact(v * m, index)


# -- import ---------------------------------------------------------------------------------------
def test_import_pulls_in_neither_torchrl_nor_hypothesis():
    code = "import sys, textrl.testing; print(sorted(m for m in ('torchrl', 'hypothesis') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_strategies_without_hypothesis_say_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    monkeypatch.setitem(sys.modules, "hypothesis.strategies", None)
    with pytest.raises(ImportError, match="pip install hypothesis"):
        tt.masks()
    adv, _ = tt.reference_gae(torch.ones(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), 1.0, 1.0)
    assert adv.tolist() == [[2.0, 1.0]]  # references and checks work without it


# -- strategies -----------------------------------------------------------------------------------
@SETTINGS
@given(tt.rollouts(with_log_probs=True, with_values=True))
def test_drawn_rollouts_pass_check_rollout(td):
    assert check_rollout(td) is td
    mask = td.get(KEYS.mask)
    reward = td.get(KEYS.reward).squeeze(-1)
    assert (reward[~mask] == 0).all()
    torch.testing.assert_close(td.get(KEYS.score), reward.sum(1))
    end = td.get(KEYS.end_reason)
    assert torch.equal(td.get(KEYS.terminated).any(dim=(1, 2)), end == END_REASONS.index("done"))
    values = td.get(KEYS.state_value).squeeze(-1)
    next_values = td.get(KEYS.next_state_value).squeeze(-1)
    for i in range(mask.shape[0]):  # V(s_{t+1}) is the value at the next agent token
        positions = torch.nonzero(mask[i]).flatten().tolist()
        assert [float(next_values[i, j]) for j in positions] == [float(values[i, j]) for j in positions[1:]] + [0.0]


@SETTINGS
@given(tt.rollouts(multi_turn=False, eos_token_id=3))
def test_single_turn_rollouts_follow_the_eos_rule(td):
    """A single-turn row is valid up to its first EOS or all T tokens, whether pad == eos or not."""
    action, mask = td.get(KEYS.action), td.get(KEYS.mask)
    assert torch.equal(mask, response_mask(action, 3))
    assert torch.equal(td.get(KEYS.response_mask), mask)
    assert (td.get(KEYS.turns) == 1).all()


def find(strategy, condition):
    """The first drawn example with ``condition`` (no shrinking); raises ``NoSuchExample`` if none."""
    return hypothesis.find(strategy, condition, settings=settings(max_examples=200, database=None,
                                                                   phases=[Phase.generate]))


def test_strategies_draw_the_advertised_edge_cases():
    """``find`` raises if no example with the property turns up: each edge case is drawn."""
    find(tt.masks(), has_gap)
    find(tt.masks(time=(2, 48)), lambda m: (m.sum(1) == 1).any())  # a row of one token
    find(tt.masks(time=(2, 48)), lambda m: m[:, -1].any())  # a row to the last position
    find(tt.masks(leading_gap=True), lambda m: (~m[:, 0]).any())
    find(tt.masks(empty_rows=True), lambda m: (~m.any(1)).any())
    single = {"multi_turn": False, "eos_token_id": 3}
    # pad == eos: the padding after a row's first EOS is more EOS tokens
    find(tt.rollouts(pad_token_id=3, **single), lambda td: (td.get(KEYS.action)[~td.get(KEYS.mask)] == 3).any())
    # a distinct pad id is an ordinary action inside the mask; a truncated row (no EOS, all T)
    find(tt.rollouts(pad_token_id=4, **single),
         lambda td: td.get(KEYS.truncated).any() and (td.get(KEYS.action)[td.get(KEYS.mask)] == 4).any())
    find(tt.rollouts(), lambda td: (td.get(KEYS.turns) > 1).any() and has_gap(td.get(KEYS.mask)))
    find(tt.groups(group_size=(2, 8)), lambda g: (g[0].view(-1, g[1]).std(1) == 0).any())
    find(tt.float_tensors((4, 4), extreme=True), lambda x: (x.abs() == 1e30).any())


@SETTINGS
@given(tt.episode_masks())
def test_episode_masks_nest_the_agent_mask_in_a_prefix(pair):
    agent, response = pair
    assert torch.equal(response, torch.arange(response.shape[1]) < response.sum(1, keepdim=True))
    assert not (agent & ~response).any() and agent[:, 0].all()
    last = response.sum(1) - 1
    assert agent[torch.arange(agent.shape[0]), last].all()  # an episode ends on an agent token


# -- references -----------------------------------------------------------------------------------
def test_reference_gae_hand_example_with_a_gap():
    """Turn 1 = positions 0, 1; observation at 2, 3; turn 2 = 4; padding at 5 (values 50/9 are never read)."""
    mask = torch.tensor([[True, True, False, False, True, False]])
    rewards = torch.tensor([[0.0, 1.0, 50.0, 50.0, 2.0, 50.0]])
    values = torch.tensor([[0.5, 1.0, 9.0, 9.0, 0.25, 9.0]])
    adv, ret = tt.reference_gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # delta_4 = 1.75; delta_1 = 1 + 0.5 * 0.25 - 1 = 0.125; delta_0 = 0.5 * 1 - 0.5 = 0.
    assert adv.tolist() == [[0.140625, 0.5625, 0.0, 0.0, 1.75, 0.0]]
    assert ret.tolist() == [[0.640625, 1.5625, 0.0, 0.0, 2.0, 0.0]]


def test_reference_group_baselines_hand_examples():
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0])
    grpo = tt.reference_grpo_advantages(scores, 3, eps=1e-6)
    # group 1: mean 1/3, deviations (2/3, -1/3, -1/3), unbiased std sqrt((6/9) / 2) = 1/sqrt(3);
    # group 2 is constant: exactly 0.
    want = torch.tensor([2.0, -1.0, -1.0], dtype=torch.float64) / 3**0.5
    torch.testing.assert_close(grpo[:3], want, rtol=1e-5, atol=1e-5)
    assert grpo[3:].tolist() == [0.0, 0.0, 0.0]
    assert tt.reference_grpo_advantages(scores, 3, scale=False)[:3].tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    assert tt.reference_rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0, 6.0]), 3).tolist() == [1.0, -0.5, -0.5, -3.0, 0.0, 3.0]
    assert tt.reference_grpo_advantages(torch.tensor([5.0, -1.0]), 1).tolist() == [0.0, 0.0]  # k = 1: std 0


@SETTINGS
@given(gae_case(), GAMMAS, LAMS)
def test_functional_gae_agrees_with_the_reference(case, gamma, lam):
    rewards, values, mask = case
    tt.check_agrees_with_reference(gae, tt.reference_gae, rewards, values, mask, gamma, lam, mask=mask)
    tt.check_masked_positions_ignored(gae, rewards, values, mask, gamma, lam, mask=mask, zero_outside=True)


@SETTINGS
@given(gae_case(leading_gap=True, empty_rows=True), GAMMAS)
def test_reference_returns_are_gae_returns_with_lam_1_and_no_values(case, gamma):
    rewards, _, mask = case
    def returns(r, m, g):
        return gae(r, torch.zeros_like(r), m, g, 1.0)[1]

    tt.check_agrees_with_reference(returns, tt.reference_returns, rewards, mask, gamma, mask=mask)


@SETTINGS
@given(tt.groups())
def test_functional_grpo_agrees_with_the_reference(case):
    scores, k = case
    tt.check_agrees_with_reference(grpo_advantage, tt.reference_grpo_advantages, scores, k)


@SETTINGS
@given(tt.groups(group_size=(2, 8), extreme=True))
def test_functional_rloo_agrees_with_the_reference(case):
    scores, k = case
    tt.check_agrees_with_reference(rloo_advantage, tt.reference_rloo_advantages, scores, k, rtol=1e-9, atol=1e-9)


# -- the checks catch wrong code --------------------------------------------------------------------
@pytest.mark.parametrize("wrong_gae", [gae_ignoring_gaps, gae_off_by_one])
def test_a_wrong_gae_is_caught_over_drawn_cases(wrong_gae):
    @NO_SHRINK
    @given(gae_case(), GAMMAS.filter(bool), LAMS)
    def users_test(case, gamma, lam):
        rewards, values, mask = case
        tt.check_agrees_with_reference(wrong_gae, tt.reference_gae, rewards, values, mask, gamma, lam, mask=mask)

    with pytest.raises(tt.InvariantError, match=r"output\[0\].*disagrees with the reference .*row mask"):
        users_test()


def test_the_same_check_passes_the_right_gae_on_the_same_cases():
    """The counterpart of the test above: not a check that fails on everything."""
    @NO_SHRINK
    @given(gae_case(), GAMMAS.filter(bool), LAMS)
    def users_test(case, gamma, lam):
        rewards, values, mask = case
        tt.check_agrees_with_reference(gae, tt.reference_gae, rewards, values, mask, gamma, lam, mask=mask)

    users_test()


def test_multiplying_by_the_mask_is_caught():
    mask = torch.tensor([[True, True, False, True, False]])
    x = torch.tensor([[0.5, -1.0, 3.0, 2.0, 7.0]], dtype=torch.float64)
    args = (x, x.flip(1), mask, 0.9, 0.95)
    tt.check_agrees_with_reference(gae_multiplying_by_mask, tt.reference_gae, *args, mask=mask)  # right numbers
    with pytest.raises(tt.InvariantError, match=r"changed at row 0, position \d.*set to nan.*torch.where"):
        tt.check_masked_positions_ignored(gae_multiplying_by_mask, *args, mask=mask)


def test_a_nonzero_output_at_masked_positions_is_caught_when_zero_is_promised():
    mask = torch.tensor([[True, False]])
    x = torch.zeros(1, 2)
    tt.check_masked_positions_ignored(lambda a: torch.where(mask, a, 1.0), x, mask=mask)
    with pytest.raises(tt.InvariantError, match=r"is 1.0 off the mask at row 0, position 1 \(row mask 10\) as given"):
        tt.check_masked_positions_ignored(lambda a: torch.where(mask, a, 1.0), x, mask=mask, zero_outside=True)


def test_where_after_exp_is_caught_by_the_gradient_check():
    mask = torch.tensor([[True, True, False]])
    logp = torch.tensor([[-0.5, -1.0, -2.0]])

    def select_after(lp):
        return torch.where(mask, torch.exp(lp), 0.0).sum()

    def select_before(lp):
        return torch.exp(torch.where(mask, lp, 0.0)).masked_fill(~mask, 0.0).sum()

    tt.check_masked_positions_ignored(select_after, logp, mask=mask)  # the forward pass is fine
    tt.check_masked_positions_ignored(select_before, logp, mask=mask, grad=True)
    with pytest.raises(tt.InvariantError, match=r"gradient of args\[0\] is nan at row 0, position 2"):
        tt.check_masked_positions_ignored(select_after, logp, mask=mask, grad=True)


def test_masked_mean_ignores_masked_positions_with_gradients():
    mask = torch.tensor([[True, False, True], [False, True, True]])
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    tt.check_masked_positions_ignored(masked_mean, x, mask, mask=mask, grad=True)


def test_extreme_log_ratios_catch_an_unguarded_exp():
    def naive_k3(lp, old, adv, mask):
        log_r = old - lp
        return torch.where(mask, torch.exp(log_r) - 1 - log_r, 0.0)

    tt.check_finite_under_extreme_log_ratios(lambda lp, old, adv, mask: kl_k3(lp, old))
    with pytest.raises(tt.InvariantError, match=r"output is inf at row 0, position \d.*log-ratio -"):
        tt.check_finite_under_extreme_log_ratios(naive_k3)


def test_extreme_log_ratio_inputs_have_the_promised_layout():
    logp, old, adv, mask = tt.extreme_log_ratio_inputs((-100.0, 0.0, 50.0), (-1.0, 1.0))
    assert logp.shape == (2, 5) and mask.tolist() == [[True, False, True, True, False]] * 2
    assert (logp[mask] <= 0).all() and (old[mask] <= 0).all()
    assert (logp - old)[mask].tolist() == [-100.0, 0.0, 50.0] * 2
    assert adv[mask].tolist() == [-1.0] * 3 + [1.0] * 3 and logp[~mask].isnan().all()


def test_ppo_clipped_loss_is_finite_within_float32_exp_range():
    """textrl's clipped loss with the log-ratios exp() can hold in float32 (|log r| <= 50 on the
    upside; the downside underflows to 0 harmlessly). Beyond exp's range see the report."""
    def loss(lp, old, adv, mask):
        return clipped_policy_loss(lp, old, adv, mask, dual_clip=3.0)[0]

    tt.check_finite_under_extreme_log_ratios(loss, log_ratios=(-1e4, -100.0, -20.0, 0.0, 20.0, 50.0))


def test_a_nonfinite_scalar_loss_is_traced_to_its_log_ratio():
    """An unclipped surrogate overflows at the first log-ratio past float32's exp range (88.7)."""
    def unclipped(lp, old, adv, mask):
        ratio = torch.exp(torch.where(mask, lp - old, 0.0))
        return masked_mean(-torch.where(mask, adv, 0.0) * ratio, mask)

    tt.check_finite_under_extreme_log_ratios(unclipped, log_ratios=(-1e4, -20.0, 0.0, 20.0, 50.0))
    with pytest.raises(tt.InvariantError, match=r"^output is (inf|nan); with only the position of "
                                                r"log-ratio 100.0 and advantage -1.0 valid: output is inf$"):
        tt.check_finite_under_extreme_log_ratios(unclipped)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: tt.masks(time=(0, 4)), r"time=\(0, 4\)"),
        (lambda: tt.episode_masks(batch=(3, 2)), r"batch=\(3, 2\)"),
        (lambda: tt.rollouts(max_turns=0), r"max_turns=0"),
        (lambda: tt.rollouts(eos_token_id=16), r"eos_token_id=16"),
        (lambda: tt.groups(group_size=(0, 2)), r"group_size=\(0, 2\)"),
        (lambda: tt.reference_rloo_advantages(torch.zeros(4), 1), r"group_size=1"),
        (lambda: tt.reference_grpo_advantages(torch.zeros(5), 2), r"5 rows.*group_size=2"),
        (lambda: tt.check_masked_positions_ignored(torch.neg, torch.zeros(2), mask=torch.ones(2)), r"mask .*bool \[B, T\]"),
    ],
)
def test_bad_arguments_are_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_the_clipped_policy_loss_is_finite_under_extreme_log_ratios_with_and_without_dual_clip():
    """Found by this kit: exp of a log-ratio of 89 overflowed float32 (inf loss, NaN at advantage 0
    and NaN gradients with dual clip); the loss clamps the log-ratio to +-20 now."""
    from textrl.functional import clipped_policy_loss

    for dual_clip in (None, 3.0):
        tt.check_finite_under_extreme_log_ratios(
            lambda lp, old, adv, mask, d=dual_clip: clipped_policy_loss(lp, old, adv, mask, dual_clip=d)[0],
            log_ratios=(-1e4, -100.0, 50.0, 89.0, 100.0, 1e4))


def test_gamma_is_the_closed_form_and_refuses_where_there_is_no_bound():
    assert tt.unit_roundoff() == 2.0 ** -24 and tt.unit_roundoff(torch.float64) == 2.0 ** -53
    assert tt.gamma(0) == 0.0 and tt.gamma(10) == pytest.approx(10 * 2.0 ** -24 / (1 - 10 * 2.0 ** -24), rel=1e-15)
    assert tt.sum_tolerance(11, 3.0) == 2 * tt.gamma(10) * 3.0
    with pytest.raises(ValueError, match=r"n=-1"):
        tt.gamma(-1)
    with pytest.raises(ValueError, match=r"wider dtype"):
        tt.gamma(2 ** 24)
    with pytest.raises(ValueError, match=r"terms=0"):
        tt.sum_tolerance(0, 1.0)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 400), st.integers(0, 2 ** 31 - 1), st.sampled_from([1.0, 1e-6, 1e6]))
def test_two_orders_of_a_float32_sum_stay_within_sum_tolerance(n, seed, scale):
    """A sum and a permutation of it, left to right and pairwise (torch's blocked reduction), in
    float32, against the bound on the terms' magnitudes; cancelling terms (mixed signs) included."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * scale).float()
    perm = x[torch.randperm(n, generator=g)]
    left = torch.zeros((), dtype=torch.float32)
    for v in x:
        left = left + v
    bound = tt.sum_tolerance(n, float(x.double().abs().sum()))
    exact = float(x.double().sum())
    assert abs(float(left) - float(perm.sum())) <= bound
    assert abs(float(left) - exact) <= bound / 2 and abs(float(perm.sum()) - exact) <= bound / 2


def test_assert_close_normwise_passes_within_and_names_the_tensor_and_the_worst_element_beyond():
    want = torch.tensor([[1.0, -2.0], [0.0, 4.0]])
    tt.assert_close_normwise(want * (1 + 1e-7), want, rtol=1e-6)
    tt.assert_close_normwise(torch.zeros(3), torch.zeros(3), rtol=0.0)
    got = want.clone()
    got[1, 0] = 1e-3
    with pytest.raises(tt.InvariantError, match=r"grad: .*relative 2\.18\de-04.*at \(1, 0\): 1\.000000e-03 against 0"):
        tt.assert_close_normwise(got, want, rtol=1e-4, name="grad")
    with pytest.raises(tt.InvariantError, match=r"shape \(4,\) where \(2, 2\)"):
        tt.assert_close_normwise(want.reshape(4), want, rtol=1.0)  # no broadcasting, even where close
    with pytest.raises(tt.InvariantError, match=r"non-finite"):
        tt.assert_close_normwise(want * float("nan"), want, rtol=1.0)
    with pytest.raises(tt.InvariantError, match=r"relative inf"):
        tt.assert_close_normwise(torch.ones(2), torch.zeros(2), rtol=1.0)
