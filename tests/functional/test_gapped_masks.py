"""Masks with gaps: the agent's tokens of a multi-turn episode, interrupted by observation tokens.

docs/design.md, "Multi-turn episodes": only True positions are decisions. GAE steps from one True
position to the next (``V(s_{t+1})`` is the value at the next True, 0 after the last), so GAE on a
gapped mask equals GAE on the compacted Trues; the score goes on the row's last True; a prefix
mask (a single turn) gives exactly what it gave before gaps were allowed.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrl.objectives.value.functional import generalized_advantage_estimate

from tests.arithmetic import assert_within, gae_tolerance
from textrl.functional import (
    compact,
    compaction_index,
    gae,
    kl_shaped_rewards,
    last_true_index,
    last_valid,
    next_valid,
    shaped_token_rewards,
    uncompact,
)
from textrl.functional.advantages import _discounted_reverse_cumsum
from textrl.testing import reference_gae  # the loop that skips the gaps

SETTINGS = settings(max_examples=40, deadline=None)
GAMMAS = [0.0, 0.5, 0.9, 0.99, 1.0]
LAMS = [0.0, 0.5, 0.95, 1.0]


@st.composite
def gapped_masks(draw, min_true: int = 1, prefix: bool = False):
    """bool ``[B, T]``: per row, turns of agent tokens separated by observation gaps, then padding.

    Every row has at least ``min_true`` Trues (``min_true=0`` allows empty rows). ``prefix``
    draws single-turn rows (Trues then Falses).
    """
    b = draw(st.integers(1, 5))
    t = draw(st.one_of(st.integers(1, 12), st.integers(13, 70)))  # > 32: several scan blocks
    rows = []
    for _ in range(b):
        if prefix:
            n = draw(st.integers(min_true, t))
            rows.append([True] * n + [False] * (t - n))
            continue
        row: list[bool] = []
        agent = draw(st.booleans()) or min_true > 0  # a row may open with an observation
        while len(row) < t:
            run = draw(st.integers(1, max(1, t // 3)))
            row += [agent] * run
            agent = not agent
        row = row[:t]
        padding = draw(st.integers(0, t))
        row = row[: t - padding] + [False] * padding
        if sum(row) < min_true:
            row[draw(st.integers(0, t - 1))] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).reshape(b, t)


def randn(shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def compacted_by_loop(x, mask):
    """Each row's True positions moved left, in order; zeros after them (a loop, not the code under test)."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        kept = [x[i, j] for j in range(x.shape[1]) if mask[i, j]]
        if kept:
            out[i, : len(kept)] = torch.stack(kept)
    return out


def gae_before_gaps(rewards, values, mask, gamma, lam):
    """``textrl.functional.gae`` as it was when it required a prefix mask (the same float ops)."""
    dtype = torch.promote_types(
        torch.promote_types(rewards.dtype, torch.float32), torch.promote_types(values.dtype, torch.float32)
    )
    zero = torch.zeros((), dtype=dtype)
    r = torch.where(mask, rewards.to(dtype), zero)
    v = torch.where(mask, values.to(dtype), zero)
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    delta = torch.where(mask, r + gamma * next_v - v, zero)
    advantages = torch.where(mask, _discounted_reverse_cumsum(delta, gamma * lam), zero)
    return advantages, torch.where(mask, advantages + v, zero)


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor (so -0.0 != 0.0 and NaN payloads count)."""
    return x.view({torch.float64: torch.int64, torch.float32: torch.int32}[x.dtype])


# -- compaction --------------------------------------------------------------------------------
@SETTINGS
@given(gapped_masks(min_true=0), st.integers(0, 2**31 - 1))
def test_compaction_moves_trues_left_in_order_and_back(mask, seed):
    x = randn(mask.shape, seed)
    index = compaction_index(mask)
    assert torch.equal(index.sort(dim=1).values, torch.arange(mask.shape[1]).expand_as(index))
    packed = compact(x, index)
    n = mask.sum(1, keepdim=True)
    valid = torch.arange(mask.shape[1]) < n
    assert torch.equal(torch.where(valid, packed, 0.0), compacted_by_loop(x, mask))
    assert torch.equal(uncompact(packed, index), x)


@SETTINGS
@given(gapped_masks(min_true=0, prefix=True))
def test_compaction_of_a_prefix_mask_is_the_identity(mask):
    assert torch.equal(compaction_index(mask), torch.arange(mask.shape[1]).expand(mask.shape))


@SETTINGS
@given(gapped_masks(min_true=0))
def test_last_true_index_matches_loop(mask):
    want = [max((j for j in range(mask.shape[1]) if mask[i, j]), default=-1) for i in range(mask.shape[0])]
    assert last_true_index(mask).tolist() == want


# -- GAE ---------------------------------------------------------------------------------------
@SETTINGS
@given(gapped_masks(min_true=0), st.integers(0, 2**31 - 1), st.sampled_from(GAMMAS), st.sampled_from(LAMS))
def test_gapped_gae_matches_a_loop_that_skips_the_gaps(mask, seed, gamma, lam):
    rewards, values = randn(mask.shape, seed), randn(mask.shape, seed + 1)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


@SETTINGS
@given(gapped_masks(), st.integers(0, 2**31 - 1), st.sampled_from(GAMMAS), st.sampled_from(LAMS))
def test_gapped_gae_equals_torchrl_on_the_compacted_agent_tokens(mask, seed, gamma, lam):
    # float32: TorchRL forms gamma * (~done).int() in the default dtype even for float64 inputs.
    rewards, values = randn(mask.shape, seed, torch.float32), randn(mask.shape, seed + 1, torch.float32)
    b, t = mask.shape
    n = mask.sum(1)
    valid = torch.arange(t) < n[:, None]  # the compacted mask
    v = compacted_by_loop(values, mask)
    next_v = torch.where(valid, torch.cat([v[:, 1:], torch.zeros(b, 1)], dim=1), 0.0)
    next_v = torch.where(torch.arange(t) == (n - 1)[:, None], 0.0, next_v)
    done = torch.zeros(b, t, dtype=torch.bool)
    done[torch.arange(b), n - 1] = True  # at the last agent token
    ref_adv, ref_ret = generalized_advantage_estimate(
        gamma, lam, v.unsqueeze(-1), next_v.unsqueeze(-1), compacted_by_loop(rewards, mask).unsqueeze(-1),
        done.unsqueeze(-1), done.unsqueeze(-1), time_dim=-2,
    )
    adv, ret = gae(rewards, values, mask, gamma, lam)
    # a blocked scan against TorchRL's loop, in float32: within the sums' bound (tests/arithmetic.py)
    adv_tol, ret_tol = gae_tolerance(rewards, values, mask, gamma, lam)
    assert_within(adv[mask], ref_adv.squeeze(-1)[valid], adv_tol[mask], "advantages")  # both row-major, in order
    assert_within(ret[mask], ref_ret.squeeze(-1)[valid], ret_tol[mask], "returns")


@SETTINGS
@given(
    gapped_masks(min_true=0, prefix=True), st.integers(0, 2**31 - 1), st.sampled_from(GAMMAS),
    st.sampled_from(LAMS), st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_prefix_masks_give_bit_for_bit_the_result_from_before_gaps(mask, seed, gamma, lam, dtype):
    rewards, values = randn(mask.shape, seed).to(dtype), randn(mask.shape, seed + 1).to(dtype)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    old_adv, old_ret = gae_before_gaps(rewards, values, mask, gamma, lam)
    assert adv.dtype == old_adv.dtype
    assert torch.equal(bits(adv), bits(old_adv)) and torch.equal(bits(ret), bits(old_ret))


@SETTINGS
@given(
    gapped_masks(prefix=True), st.integers(0, 2**31 - 1), st.sampled_from(GAMMAS), st.sampled_from(LAMS),
    st.sampled_from([float("nan"), float("inf"), 1e30]),
)
def test_inserting_observation_gaps_changes_nothing_at_the_agent_tokens(mask, seed, gamma, lam, garbage):
    """A single-turn batch, then the same agent tokens with observation columns (garbage) between them."""
    b, t = mask.shape
    rewards, values = randn(mask.shape, seed), randn(mask.shape, seed + 1)
    g = torch.Generator().manual_seed(seed)
    agent_cols = torch.randperm(2 * t, generator=g)[:t].sort().values  # the rest are observation columns
    width = int(agent_cols.max()) + 1
    wide_mask = torch.zeros(b, width, dtype=torch.bool)
    wide_r = torch.full((b, width), garbage, dtype=torch.float64)
    wide_v = torch.full((b, width), -garbage, dtype=torch.float64)
    wide_mask[:, agent_cols], wide_r[:, agent_cols], wide_v[:, agent_cols] = mask, rewards, values
    adv, ret = gae(rewards, values, mask, gamma, lam)
    wide_adv, wide_ret = gae(wide_r, wide_v, wide_mask, gamma, lam)
    # close, not bitwise: the blocked scan groups its sums by the width T
    torch.testing.assert_close(wide_adv[:, agent_cols], adv)
    torch.testing.assert_close(wide_ret[:, agent_cols], ret)
    assert (wide_adv[~wide_mask] == 0).all() and (wide_ret[~wide_mask] == 0).all()


def test_gapped_gae_hand_example():
    """Turn 1 = positions 0, 1; an observation at 2, 3; turn 2 = position 4; padding at 5."""
    mask = torch.tensor([[True, True, False, False, True, False]])
    rewards = torch.tensor([[0.0, 1.0, 50.0, 50.0, 2.0, 50.0]])
    values = torch.tensor([[0.5, 1.0, 9.0, 9.0, 0.25, 9.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # delta_4 = 2 - 0.25 = 1.75; delta_1 = 1 + 0.5 * 0.25 - 1 = 0.125 (V at the next agent token);
    # delta_0 = 0 + 0.5 * 1 - 0.5 = 0. A_4 = 1.75, A_1 = 0.125 + 0.25 * 1.75 = 0.5625,
    # A_0 = 0 + 0.25 * 0.5625 = 0.140625.
    torch.testing.assert_close(adv, torch.tensor([[0.140625, 0.5625, 0.0, 0.0, 1.75, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.640625, 1.5625, 0.0, 0.0, 2.0, 0.0]]))


# -- next_valid / last_valid -------------------------------------------------------------------
@SETTINGS
@given(gapped_masks(min_true=0), st.integers(0, 2**31 - 1))
def test_next_valid_is_the_value_at_the_next_true_position(mask, seed):
    x = torch.where(mask, randn(mask.shape, seed), float("nan"))
    out = next_valid(x, mask)
    want = torch.zeros_like(x)
    for i in range(x.shape[0]):
        positions = [j for j in range(x.shape[1]) if mask[i, j]]
        for here, after in zip(positions, positions[1:]):
            want[i, here] = x[i, after]
    assert torch.equal(out, want)


@SETTINGS
@given(gapped_masks(prefix=True), st.integers(0, 2**31 - 1))
def test_next_valid_on_a_prefix_mask_is_the_old_shift(mask, seed):
    values = torch.where(mask, randn(mask.shape, seed, torch.float32), 0.0)
    next_mask = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)
    old = torch.where(next_mask, values.roll(-1, dims=1), 0.0)  # textrl/agents/base.py before gaps
    assert torch.equal(bits(next_valid(values, mask)), bits(old))


@SETTINGS
@given(gapped_masks(), st.integers(0, 2**31 - 1))
def test_last_valid_reads_the_last_true_position(mask, seed):
    x = torch.where(mask, randn(mask.shape, seed), float("nan"))
    want = torch.stack([x[i, max(j for j in range(x.shape[1]) if mask[i, j])] for i in range(x.shape[0])])
    assert torch.equal(last_valid(x, mask), want)


def test_last_valid_of_an_empty_row_is_an_error():
    with pytest.raises(ValueError, match=r"empty rows \[1\]"):
        last_valid(torch.zeros(2, 3), torch.tensor([[False, True, False], [False] * 3]))


# -- rewards -----------------------------------------------------------------------------------
def reference_shaped(score, kl, mask, coef, placement):
    out = torch.zeros(kl.shape, dtype=torch.float64)
    for i in range(kl.shape[0]):
        positions = [j for j in range(kl.shape[1]) if mask[i, j]]
        for j in positions:
            out[i, j] = -coef * float(kl[i, j])
            out[i, j] += float(score[i]) / len(positions) if placement == "uniform" else 0.0
        if placement == "last":
            out[i, positions[-1]] += float(score[i])
    return out


@SETTINGS
@given(gapped_masks(), st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.05, 1.0]), st.sampled_from(["last", "uniform"]))
def test_kl_shaped_rewards_with_gaps_match_a_loop(mask, seed, coef, placement):
    kl = torch.where(mask, randn(mask.shape, seed), float("nan"))
    score = randn((mask.shape[0],), seed + 1)
    out = kl_shaped_rewards(score, kl, mask, coef, placement)
    torch.testing.assert_close(out, reference_shaped(score, kl, mask, coef, placement))
    assert (out[~mask] == 0).all()


@SETTINGS
@given(
    gapped_masks(), st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    st.sampled_from(["last", "uniform"]), st.booleans(),
)
def test_shaped_token_rewards_equal_kl_shaped_rewards_of_the_placed_score(mask, seed, coef, placement, prefix):
    """Single turn: the task reward is the score placed (as the fast path places it); the shaping
    must give the numbers kl_shaped_rewards gives, bit for bit when no zero's sign is at stake."""
    if prefix:
        mask = torch.arange(mask.shape[1]) < mask.sum(1, keepdim=True)
    kl = torch.where(mask, randn(mask.shape, seed, torch.float32), float("nan"))
    score = randn((mask.shape[0],), seed + 1, torch.float32)
    task = kl_shaped_rewards(score, torch.zeros_like(kl), mask, 0.0, placement) + 0.0  # fast_path.place_score
    shaped = shaped_token_rewards(task, kl, mask, coef)
    want = kl_shaped_rewards(score, kl, mask, coef, placement)
    assert torch.equal(shaped, want)
    if coef > 0:  # no -0.0 from -coef * kl: equal bits
        assert torch.equal(bits(shaped), bits(want))


def test_shaped_token_rewards_keep_each_turns_reward_on_its_token():
    mask = torch.tensor([[True, True, False, True, True, False]])
    task = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.5, 0.0]])  # turn 1 ends at 1, turn 2 at 4
    kl = torch.tensor([[0.1, 0.2, float("nan"), 0.3, 0.4, float("inf")]])
    out = shaped_token_rewards(task, kl, mask, 0.5)
    torch.testing.assert_close(out, torch.tensor([[-0.05, 0.9, 0.0, -0.15, 2.3, 0.0]]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"task_rewards": torch.zeros(2, 3, 1)}, r"task_rewards .*squeeze"),
        ({"kl": torch.zeros(2, 3, 1)}, r"kl .*squeeze"),
        ({"kl": torch.zeros(2, 4)}, r"kl must have the shape of task_rewards"),
        ({"task_rewards": torch.zeros(2, 3, dtype=torch.long)}, r"task_rewards .*float"),
        ({"mask": torch.ones(2, 3)}, r"mask .*bool"),
        ({"kl_coef": -1.0}, r"kl_coef"),
    ],
)
def test_shaped_token_rewards_reject_bad_input(kwargs, match):
    args = {"task_rewards": torch.zeros(2, 3), "kl": torch.zeros(2, 3), "mask": torch.ones(2, 3, dtype=torch.bool),
            "kl_coef": 0.1} | kwargs
    with pytest.raises(ValueError, match=match):
        shaped_token_rewards(**args)
