"""Property-testing kit for your own estimators and losses (issue 17, "textrl.testing").

Three parts, all over the ``[B, T]`` layout of docs/design.md, "The rollout TensorDict":

- **Hypothesis strategies** (need ``pip install hypothesis``; imported on first use):
  :func:`masks` (agent masks with observation gaps, rows of one token, full-length rows),
  :func:`episode_masks` (the agent mask with the response mask around it), :func:`rollouts`
  (a whole rollout TensorDict that :func:`textrl.checks.check_rollout` accepts: ``pad == eos``,
  truncated rows, multi-turn episodes, placed rewards), :func:`groups` (group scores with
  constant-reward groups) and :func:`float_tensors` (optionally with extreme values).
- **Reference implementations** written as plain Python loops over rows and positions:
  :func:`reference_gae`, :func:`reference_returns`, :func:`reference_grpo_advantages`,
  :func:`reference_rloo_advantages`. They are slow and obvious on purpose.
- **Invariant checks** that raise :class:`InvariantError` (an ``AssertionError``) with a message
  naming the output, the position and the values: :func:`check_masked_positions_ignored`,
  :func:`check_agrees_with_reference`, :func:`check_finite_under_extreme_log_ratios`.

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

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from textrl.keys import END_REASONS, KEYS, RolloutKeys


class InvariantError(AssertionError):
    """An invariant of an estimator or loss does not hold; the message says where and how."""


def _strategies() -> Any:
    """``hypothesis.strategies``, or an ImportError that says how to get it."""
    try:
        from hypothesis import strategies
    except ImportError as e:  # hypothesis is a dev dependency, not a runtime one
        raise ImportError(
            "textrl.testing's strategies need hypothesis, which is not installed: "
            "pip install hypothesis (or pip install 'textrl[dev]')"
        ) from e
    return strategies


# -- strategies -----------------------------------------------------------------------------------

ROW_KINDS = ("one_token", "full", "any")
"""Row shapes the strategies draw: a single agent token; a row filling all ``T`` positions (the
rows :func:`rollouts` may make truncated: no EOS, ``max_new_tokens`` or the context reached);
anything that fits."""

EXTREME_VALUES = (0.0, -0.0, 1e-30, -1e-30, 1e4, -1e4, 88.0, -88.0, 1e30, -1e30)
"""Finite values :func:`float_tensors` plants with ``extreme=True``."""


@dataclass(frozen=True)
class _Row:
    """One episode's layout: ``agent[t]`` is True on the agent's tokens; ``length`` tokens of the
    episode (agent and observation), then padding; ``turn_ends`` the last agent token of each turn."""

    agent: tuple[bool, ...]
    length: int
    turn_ends: tuple[int, ...]


def _draw_row(draw: Any, st: Any, t: int, multi_turn: bool, max_turns: int) -> _Row:
    """An episode layout in ``t`` positions: turns of agent tokens separated by observations
    (``multi_turn``), starting and ending with an agent token, then padding."""
    kind = draw(st.sampled_from(ROW_KINDS))
    if kind == "one_token" or t == 1:
        return _Row((True,) + (False,) * (t - 1), 1, (0,))
    layout: list[bool] = []
    turn_ends: list[int] = []
    turns = draw(st.integers(1, max_turns)) if multi_turn else 1
    for i in range(turns):
        room = t - len(layout)
        run = draw(st.integers(1, room))
        layout += [True] * run
        turn_ends.append(len(layout) - 1)
        room = t - len(layout)
        if i == turns - 1 or room < 2:  # an observation needs room for one more agent token
            break
        layout += [False] * draw(st.integers(1, room - 1))
    if kind == "full" and len(layout) < t:  # the last turn runs to the end of the time axis
        layout += [True] * (t - len(layout))
        turn_ends[-1] = t - 1
    n = len(layout)
    return _Row(tuple(layout + [False] * (t - n)), n, tuple(turn_ends))


def _draw_layout(draw: Any, st: Any, batch: tuple[int, int], time: tuple[int, int], multi_turn: bool,
                 max_turns: int) -> tuple[int, list[_Row]]:
    b = draw(st.integers(*batch))
    t = draw(st.integers(*time))
    return t, [_draw_row(draw, st, t, multi_turn, max_turns) for _ in range(b)]


def _check_range(name: str, r: tuple[int, int], low: int) -> None:
    if len(r) != 2 or not low <= r[0] <= r[1]:
        raise ValueError(f"{name}={r!r}: must be (min, max) with {low} <= min <= max")


def _check_layout_args(batch: tuple[int, int], time: tuple[int, int], max_turns: int) -> None:
    _check_range("batch", batch, 0)
    _check_range("time", time, 1)
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns={max_turns!r}: must be an int >= 1")


def episode_masks(
    batch: tuple[int, int] = (1, 6),
    time: tuple[int, int] = (1, 48),
    multi_turn: bool = True,
    max_turns: int = 4,
) -> Any:
    """Strategy of ``(agent_mask, response_mask)``, each bool ``[B, T]``.

    ``response_mask`` is a prefix of Trues (every token of the episode); ``agent_mask`` lies inside
    it, starts at position 0 and ends on the episode's last token, with gaps where observation
    tokens sit (``multi_turn``; up to ``max_turns`` agent turns). Rows of one token and rows
    filling all ``T`` positions are drawn often. ``B`` and ``T`` are drawn from the inclusive
    ranges ``batch`` and ``time`` (``T > 32`` crosses the blocks of textrl's GAE scan).
    """
    _check_layout_args(batch, time, max_turns)
    st = _strategies()

    @st.composite
    def draw_masks(draw: Any) -> tuple[Tensor, Tensor]:
        t, rows = _draw_layout(draw, st, batch, time, multi_turn, max_turns)
        agent = torch.tensor([r.agent for r in rows], dtype=torch.bool).reshape(len(rows), t)
        response = torch.arange(t) < torch.tensor([r.length for r in rows], dtype=torch.long)[:, None]
        return agent, response.reshape(len(rows), t)

    return draw_masks()


def masks(
    batch: tuple[int, int] = (1, 6),
    time: tuple[int, int] = (1, 48),
    multi_turn: bool = True,
    max_turns: int = 4,
    leading_gap: bool = False,
    empty_rows: bool = False,
) -> Any:
    """Strategy of agent masks: bool ``[B, T]``, the decisions an estimator sees.

    As the agent mask of :func:`episode_masks` (gaps at observations when ``multi_turn``, rows of
    one token, full rows). For functions whose contract is "any pattern of Trues",
    ``leading_gap=True`` lets a row open with Falses and ``empty_rows=True`` lets rows be all False.
    """
    pairs = episode_masks(batch, time, multi_turn, max_turns)  # checks the arguments now
    st = _strategies()

    @st.composite
    def draw_mask(draw: Any) -> Tensor:
        agent, _ = draw(pairs)
        rows = []
        for row in agent.tolist():
            if empty_rows and draw(st.booleans()):
                row = [False] * len(row)
            elif leading_gap and len(row) > 1:
                shift = draw(st.integers(0, len(row) - 1))
                row = [False] * shift + row[: len(row) - shift]
                if not any(row):
                    row[-1] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool).reshape(agent.shape)

    return draw_mask()


def float_tensors(
    shape: Sequence[int], extreme: bool = False, dtype: torch.dtype = torch.float64, scale: float = 1.0
) -> Any:
    """Strategy of float tensors of ``shape``: standard normal times ``scale``; with ``extreme``,
    some entries are replaced by values of :data:`EXTREME_VALUES` (signed zeros, 1e-30, 1e4, 88,
    1e30), finite in float64 and float32."""
    st = _strategies()
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)

    @st.composite
    def draw_tensor(draw: Any) -> Tensor:
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        x = (torch.randn(numel, generator=g, dtype=torch.float64) * scale)
        if extreme and numel:
            planted = draw(st.lists(st.tuples(st.integers(0, numel - 1), st.sampled_from(EXTREME_VALUES)),
                                    max_size=numel))
            for i, v in planted:
                x[i] = v
        return x.to(dtype).reshape(shape)

    return draw_tensor()


GROUP_KINDS = ("constant", "binary", "continuous", "outlier")
"""Group reward patterns :func:`groups` draws: every row the same score (GRPO's zero-advantage
group); 0/1 verifier rewards; normal scores; all equal but one."""


def groups(
    group_size: tuple[int, int] = (1, 8),
    n_groups: tuple[int, int] = (1, 4),
    dtype: torch.dtype = torch.float64,
    extreme: bool = False,
) -> Any:
    """Strategy of ``(scores, group_size)``: float ``[G * k]`` with each group's ``k`` rows
    consecutive (the layout of ``textrl.functional.grpo_advantage``), ``k`` drawn from
    ``group_size`` (pass ``(2, 8)`` for RLOO). Constant groups are drawn often. ``extreme``
    scales a group's scores by 1e-6 or 1e6."""
    _check_range("group_size", group_size, 1)
    _check_range("n_groups", n_groups, 0)
    st = _strategies()
    score = st.one_of(st.sampled_from([0.0, 1.0, -1.0, 0.5]), st.floats(-10, 10, width=32))

    @st.composite
    def draw_groups(draw: Any) -> tuple[Tensor, int]:
        k = draw(st.integers(*group_size))
        out: list[float] = []
        for _ in range(draw(st.integers(*n_groups))):
            kind = draw(st.sampled_from(GROUP_KINDS))
            if kind == "constant":
                g = [draw(score)] * k
            elif kind == "binary":
                g = [float(v) for v in draw(st.lists(st.integers(0, 1), min_size=k, max_size=k))]
            elif kind == "continuous":
                g = draw(st.lists(score, min_size=k, max_size=k))
            else:
                g = [draw(score)] * k
                g[draw(st.integers(0, k - 1))] = draw(score)
            if extreme:
                s = draw(st.sampled_from([1e-6, 1.0, 1e6]))
                g = [v * s for v in g]
            out += g
        return torch.tensor(out, dtype=dtype), k

    return draw_groups()


def rollouts(
    batch: tuple[int, int] = (1, 6),
    time: tuple[int, int] = (1, 32),
    multi_turn: bool = True,
    max_turns: int = 4,
    vocab_size: int = 16,
    eos_token_id: int = 2,
    pad_token_id: int | None = None,
    with_log_probs: bool = False,
    with_values: bool = False,
    keys: RolloutKeys = KEYS,
) -> Any:
    """Strategy of rollout TensorDicts (``batch_size=[B]``) as docs/design.md, "The rollout
    TensorDict" and "Multi-turn episodes" describe; :func:`textrl.checks.check_rollout` accepts
    every one.

    Keys (names from ``keys``): ``prompt_tokens`` int64 / ``prompt_mask`` bool ``[B, P]``
    (left-padded); ``action`` int64 ``[B, T]`` (agent and observation tokens, right-padded with
    the pad id); ``mask`` bool ``[B, T]`` (agent tokens, gaps at observations);
    ``response_mask`` bool ``[B, T]`` (a prefix); ``done`` / ``terminated`` / ``truncated`` bool
    ``[B, T, 1]`` at each row's last agent token; ``reward`` float32 ``[B, T, 1]`` (each turn's
    reward on its last agent token, the final reward added on the last one, 0 elsewhere);
    ``score`` float32 ``[B]`` (the reward's sum); ``turns``, ``end_reason`` int64 ``[B]``. With
    ``with_log_probs``: ``action_log_prob``, ``ref_log_prob`` float32 ``[B, T]`` (<= 0 on agent
    tokens, NaN elsewhere); with ``with_values``: ``state_value`` float32 ``[B, T, 1]`` (NaN off
    the agent mask) and ``next_state_value`` (V at the next agent token, 0 after the last and
    off the mask).

    Tokens: a single-turn row (``multi_turn=False``) ends at its first EOS (``terminated``) or runs
    all ``T`` positions without EOS (``truncated``), so its mask is
    ``textrl.functional.response_mask(action, eos_token_id)``; ``pad_token_id=None`` draws
    ``pad == eos`` or a distinct pad id, which then also appears as an ordinary action.
    """
    _check_layout_args(batch, time, max_turns)
    if vocab_size < 4 or not 0 <= eos_token_id < vocab_size:
        raise ValueError(f"vocab_size={vocab_size}, eos_token_id={eos_token_id}: need vocab_size >= 4 "
                         "and 0 <= eos_token_id < vocab_size")
    st = _strategies()
    reward = st.one_of(st.sampled_from([0.0, 1.0, -1.0]), st.floats(-5, 5, width=32))

    @st.composite
    def draw_rollout(draw: Any) -> Any:
        from tensordict import TensorDict  # a runtime dependency; imported only here

        t, rows = _draw_layout(draw, st, batch, time, multi_turn, max_turns)
        b = len(rows)
        eos = eos_token_id
        pad = pad_token_id if pad_token_id is not None else draw(
            st.sampled_from([eos, (eos + 1) % vocab_size]))
        ordinary = [i for i in range(vocab_size) if i != eos]  # pad included when pad != eos
        token = st.sampled_from(ordinary)
        action = torch.full((b, t), pad, dtype=torch.long)
        rewards = torch.zeros(b, t, 1)
        done = torch.zeros(b, t, 1, dtype=torch.bool)
        terminated = torch.zeros(b, t, 1, dtype=torch.bool)
        turns = torch.zeros(b, dtype=torch.long)
        end = torch.zeros(b, dtype=torch.long)
        for i, row in enumerate(rows):
            last = row.turn_ends[-1]
            if multi_turn:
                reasons = list(END_REASONS) if row.length == t else [r for r in END_REASONS if r != "context"]
            else:  # one turn: EOS ends it, or it fills max_new_tokens = T
                reasons = ["done", "length"] if row.length == t else ["done"]
            reason = draw(st.sampled_from(reasons))
            for j in range(row.length):
                if not row.agent[j]:
                    action[i, j] = draw(st.integers(0, vocab_size - 1))  # observation: any id
                elif j in row.turn_ends:  # a turn ends at EOS, or (multi-turn) at a stop string
                    eos_here = reason == "done" if not multi_turn else (
                        reason == "done" or j != last) and draw(st.booleans())
                    action[i, j] = eos if eos_here else draw(token)
                else:
                    action[i, j] = draw(token)
            for j in row.turn_ends:
                rewards[i, j, 0] = draw(reward)
            rewards[i, last, 0] += draw(reward)  # the environment's final reward
            done[i, last, 0] = True
            terminated[i, last, 0] = reason == "done"
            turns[i] = len(row.turn_ends)
            end[i] = END_REASONS.index(reason)
        agent = torch.tensor([r.agent for r in rows], dtype=torch.bool).reshape(b, t)
        response = torch.arange(t) < torch.tensor([r.length for r in rows], dtype=torch.long).reshape(b, 1)
        p = draw(st.integers(1, 6))
        prompt_len = torch.tensor(draw(st.lists(st.integers(1, p), min_size=b, max_size=b)), dtype=torch.long)
        prompt_mask = torch.arange(p) >= (p - prompt_len.reshape(b, 1))
        prompt = torch.where(prompt_mask, torch.randint(0, vocab_size, (b, p), generator=_gen(draw, st)), pad)

        td = TensorDict(batch_size=[b])
        td.set(keys.prompt_tokens, prompt)
        td.set(keys.prompt_mask, prompt_mask)
        td.set(keys.action, action)
        td.set(keys.mask, agent)
        td.set(keys.response_mask, response)
        td.set(keys.done, done)
        td.set(keys.terminated, terminated)
        td.set(keys.truncated, done & ~terminated)
        td.set(keys.reward, rewards)
        td.set(keys.score, rewards.sum(dim=(1, 2)))
        td.set(keys.turns, turns)
        td.set(keys.end_reason, end)
        nan = torch.tensor(float("nan"))
        if with_log_probs:
            g = _gen(draw, st)
            td.set(keys.action_log_prob, torch.where(agent, -torch.rand(b, t, generator=g) * 5, nan))
            td.set(keys.ref_log_prob, torch.where(agent, -torch.rand(b, t, generator=g) * 5, nan))
        if with_values:
            v = torch.where(agent, torch.randn(b, t, generator=_gen(draw, st)), nan)
            td.set(keys.state_value, v.unsqueeze(-1))
            td.set(keys.next_state_value, _next_agent_value(v, agent).unsqueeze(-1))
        return td

    return draw_rollout()


def _gen(draw: Any, st: Any) -> torch.Generator:
    return torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))


def _next_agent_value(values: Tensor, mask: Tensor) -> Tensor:
    """Loop: at each True position, ``values`` at the row's next True position, else 0. ``[B, T]``."""
    out = torch.zeros_like(values)
    for i in range(values.shape[0]):
        positions = [j for j in range(values.shape[1]) if mask[i, j]]
        for here, after in zip(positions, positions[1:]):
            out[i, here] = values[i, after]
    return out


# -- reference implementations ----------------------------------------------------------------------


def _rows_of(x: Tensor) -> list[list[float]]:
    return x.detach().to(torch.float64).tolist()


def reference_gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016) as a loop over rows and, backwards, over positions.

    rewards, values: float ``[B, T]``; mask: bool ``[B, T]`` (gaps allowed). Only True positions
    are decisions: for a True ``t`` with next True ``t'`` in its row,
    ``delta_t = r_t + gamma * V_{t'} - V_t`` (``V_{t'} = 0`` after the row's last True) and
    ``A_t = delta_t + gamma * lam * A_{t'}``. False positions are never read.

    Returns ``(advantages, returns)``, float64 ``[B, T]``, ``returns = advantages + values``, both
    0 at False positions.
    """
    r, v, m = _rows_of(rewards), _rows_of(values), mask.tolist()
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    ret = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(len(m)):
        next_value, next_adv = 0.0, 0.0
        for j in reversed(range(len(m[i]))):
            if not m[i][j]:
                continue
            delta = r[i][j] + gamma * next_value - v[i][j]
            next_adv = delta + gamma * lam * next_adv
            next_value = v[i][j]
            adv[i, j] = next_adv
            ret[i, j] = next_adv + v[i][j]
    return adv, ret


def reference_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Discounted reward-to-go over the True positions: ``G_t = r_t + gamma * G_{t'}`` with ``t'``
    the row's next True position (``G = 0`` after the last). rewards: float ``[B, T]``; mask: bool
    ``[B, T]`` -> float64 ``[B, T]``, 0 at False positions. Equals GAE's returns with
    ``lam = 1`` and ``V = 0``."""
    r, m = _rows_of(rewards), mask.tolist()
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(len(m)):
        g = 0.0
        for j in reversed(range(len(m[i]))):
            if m[i][j]:
                g = r[i][j] + gamma * g
                out[i, j] = g
    return out


def _groups_of(scores: Tensor, group_size: int) -> list[list[float]]:
    s = scores.detach().to(torch.float64).tolist()
    if group_size < 1 or len(s) % group_size:
        raise ValueError(f"scores has {len(s)} rows, not a multiple of group_size={group_size}")
    return [s[g : g + group_size] for g in range(0, len(s), group_size)]


def reference_grpo_advantages(
    scores: Tensor, group_size: int, eps: float = 1e-6, scale: bool = True
) -> Tensor:
    """GRPO outcome advantage (Shao et al. 2024) per group of ``group_size`` consecutive rows:
    ``(s_i - mean) / (std + eps)`` with the unbiased std (divide by ``k - 1``; 0 for ``k = 1``),
    as ``textrl.functional.grpo_advantage``. ``scale=False`` gives ``s_i - mean`` (Dr. GRPO,
    Liu et al. 2025). scores: float ``[G * k]`` -> float64 ``[G * k]``."""
    out: list[float] = []
    for g in _groups_of(scores, group_size):
        k = len(g)
        mean = sum(g) / k
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / (k - 1)) if k > 1 else 0.0
        out += [(x - mean) / (std + eps) if scale else x - mean for x in g]
    return torch.tensor(out, dtype=torch.float64)


def reference_rloo_advantages(scores: Tensor, group_size: int) -> Tensor:
    """RLOO (Ahmadian et al. 2024): ``s_i - mean_{j != i} s_j`` within each group of
    ``group_size >= 2`` consecutive rows. scores: float ``[G * k]`` -> float64 ``[G * k]``."""
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: RLOO needs at least 2 rows per group")
    out: list[float] = []
    for g in _groups_of(scores, group_size):
        out += [x - sum(g[:i] + g[i + 1 :]) / (len(g) - 1) for i, x in enumerate(g)]
    return torch.tensor(out, dtype=torch.float64)


# -- invariant checks -------------------------------------------------------------------------------


def _flatten(out: Any, name: str = "output") -> list[tuple[str, Tensor]]:
    """Named tensors of a function's output: a tensor, or (nested) tuples, lists and dicts of them."""
    if isinstance(out, Tensor):
        return [(name, out)]
    if isinstance(out, (tuple, list)):
        return [p for i, o in enumerate(out) for p in _flatten(o, f"{name}[{i}]")]
    if isinstance(out, dict):
        return [p for k, o in out.items() for p in _flatten(o, f"{name}[{k!r}]")]
    return []


def _per_token(x: Tensor, mask: Tensor) -> bool:
    return tuple(x.shape) in (tuple(mask.shape), (*mask.shape, 1))


def _where_valid(x: Tensor, mask: Tensor) -> Tensor:
    """``mask`` shaped like ``x`` (``[B, T]`` or ``[B, T, 1]``)."""
    return mask if x.dim() == mask.dim() else mask.unsqueeze(-1)


def _row_mask(mask: Tensor, row: int) -> str:
    return "".join("1" if v else "0" for v in mask[row].tolist())


def _where(index: tuple[int, ...], mask: Tensor | None) -> str:
    """`` at row r, position t (row mask 1101)``, `` at index [i]``, or nothing for a scalar."""
    if not index:
        return ""
    if mask is None or len(index) < 2:
        return f" at index {list(index)}"
    return f" at row {index[0]}, position {index[1]} (row mask {_row_mask(mask, index[0])})"


def _compare(name: str, got: Tensor, want: Tensor, mask: Tensor | None, rtol: float, atol: float,
             what: str) -> None:
    """Raise InvariantError where ``got`` and ``want`` differ (at ``mask`` for per-token tensors)."""
    if tuple(got.shape) != tuple(want.shape):
        raise InvariantError(f"{name}: shape {tuple(got.shape)} but {what} has {tuple(want.shape)}")
    g, w = got.detach().to(torch.float64), want.detach().to(torch.float64)
    both_nan = g.isnan() & w.isnan()
    same_inf = torch.isinf(g) & (g == w)
    bad = ~((g - w).abs() <= atol + rtol * w.abs()) & ~both_nan & ~same_inf
    if mask is not None and _per_token(g, mask):
        bad &= _where_valid(g, mask)
    if bad.any():
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise InvariantError(
            f"{name} disagrees with {what} at {int(bad.sum())} of {bad.numel()} entries; first"
            f"{_where(idx, mask)}: got {g[idx].item()!r}, {what} {w[idx].item()!r} "
            f"(rtol={rtol}, atol={atol})"
        )


def check_agrees_with_reference(
    fn: Callable[..., Any],
    ref: Callable[..., Any],
    *args: Any,
    mask: Tensor | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **kwargs: Any,
) -> None:
    """``fn(*args, **kwargs)`` equals ``ref(*args, **kwargs)`` up to ``rtol`` / ``atol`` (in float64).

    Outputs may be a tensor or tuples / lists / dicts of tensors, matched in order. With ``mask``
    (bool ``[B, T]``), per-token outputs (``[B, T]`` or ``[B, T, 1]``) are compared only at its
    True positions; other outputs everywhere. NaN matches NaN, inf matches the same inf.

    Raises :class:`InvariantError` naming the output, the first differing row and position, that
    row's mask as 0/1 and both values.
    """
    got, want = _flatten(fn(*args, **kwargs)), _flatten(ref(*args, **kwargs))
    if len(got) != len(want):
        raise InvariantError(f"fn returned {len(got)} tensors, the reference {len(want)}")
    shown = {k: v for k, v in kwargs.items() if not isinstance(v, Tensor)}
    call = f" (called with {shown})" if shown else ""
    for (name, g), (_, w) in zip(got, want):
        _compare(name + call, g, w, mask, rtol, atol, "the reference")


DEFAULT_FILLS = (float("nan"), float("inf"), -float("inf"), 1e30, -12345.0)
"""What :func:`check_masked_positions_ignored` writes into masked positions, one pass each."""


def check_masked_positions_ignored(
    fn: Callable[..., Any],
    *args: Any,
    mask: Tensor,
    zero_outside: bool = False,
    fills: Sequence[float] = DEFAULT_FILLS,
    grad: bool = False,
) -> None:
    """Values at masked positions never change an output at a valid position.

    ``fn(*args)`` is called once as given, then once per value of ``fills`` with the False
    positions of ``mask`` (bool ``[B, T]``) overwritten in every float argument of shape
    ``[B, T]`` or ``[B, T, 1]`` (other arguments, the mask included, pass unchanged). Per-token
    outputs must keep their bits at True positions and other outputs (losses, ``[B]`` scores)
    everywhere. ``zero_outside=True``: per-token outputs must also be exactly 0 at False
    positions (the function promises it). ``grad=True``: the float arguments require grad, the
    outputs' valid entries are summed and back-propagated, and every gradient must be finite and
    0 at False positions (catches ``torch.where`` applied after ``exp`` of garbage).

    Raises :class:`InvariantError` naming the output, the position, the fill and both values.
    """
    if mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(f"mask must be a bool [B, T] tensor, got {mask.dtype} {list(mask.shape)}")
    clean = _flatten(fn(*args))
    if zero_outside:
        _check_zero_outside(clean, mask, "as given")
    for fill in fills:
        dirty_args = [
            torch.where(_where_valid(a, mask), a, torch.tensor(fill, dtype=a.dtype))
            if isinstance(a, Tensor) and a.is_floating_point() and _per_token(a, mask) else a
            for a in args
        ]
        if grad:
            dirty_args = [a.detach().requires_grad_(True) if isinstance(a, Tensor) and a.is_floating_point()
                          else a for a in dirty_args]
        dirty = _flatten(fn(*dirty_args))
        for (name, c), (_, d) in zip(clean, dirty):
            c64, d64 = c.detach().to(torch.float64), d.detach().to(torch.float64)
            same = (c64 == d64) | (c64.isnan() & d64.isnan())
            if _per_token(c, mask):
                same |= ~_where_valid(c, mask)
            if not same.all():
                idx = tuple(int(i) for i in torch.nonzero(~same)[0])
                raise InvariantError(
                    f"{name} changed{_where(idx, mask)} when the masked positions of the inputs "
                    f"were set to {fill}: {c64[idx].item()!r} before, {d64[idx].item()!r} after; the "
                    "function reads masked positions (select with torch.where(mask, x, 0) before any "
                    "arithmetic instead of multiplying by the mask)"
                )
        if zero_outside:
            _check_zero_outside(dirty, mask, f"with masked inputs set to {fill}")
        if grad:
            _check_grad(dirty, dirty_args, mask, fill)


def _check_zero_outside(outputs: list[tuple[str, Tensor]], mask: Tensor, when: str) -> None:
    for name, x in outputs:
        if _per_token(x, mask) and x.is_floating_point():
            bad = ~_where_valid(x, mask) & (x.detach() != 0)
            if bad.any():
                idx = tuple(int(i) for i in torch.nonzero(bad)[0])
                raise InvariantError(
                    f"{name} is {x[idx].item()!r} off the mask{_where(idx, mask)} {when}; "
                    "it must be exactly 0 at masked positions"
                )


def _check_grad(outputs: list[tuple[str, Tensor]], args: list[Any], mask: Tensor, fill: float) -> None:
    total = None
    for _, x in outputs:
        if x.requires_grad:
            part = torch.where(_where_valid(x, mask), x, 0.0).sum() if _per_token(x, mask) else x.sum()
            total = part if total is None else total + part
    if total is None:
        raise ValueError("grad=True but no output of fn requires grad: pass grad=False")
    leaves = [(i, a) for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad]
    grads = torch.autograd.grad(total, [a for _, a in leaves], allow_unused=True)
    for (i, a), g in zip(leaves, grads):
        if g is None:
            continue
        bad = ~torch.isfinite(g) | (~_where_valid(a, mask) & (g != 0)) if _per_token(a, mask) else ~torch.isfinite(g)
        if bad.any():
            idx = tuple(int(k) for k in torch.nonzero(bad)[0])
            raise InvariantError(
                f"the gradient of args[{i}] is {g[idx].item()!r}{_where(idx, mask)} with masked "
                f"inputs set to {fill}; it must be finite, and 0 at masked positions (select before "
                "exp/log: torch.where after them still back-propagates NaN)"
            )


EXTREME_LOG_RATIOS = (-1e4, -1000.0, -100.0, -50.0, -20.0, -1e-6, 0.0, 1e-6, 20.0, 50.0, 100.0, 1000.0, 1e4)
"""``logp - old_logp`` values :func:`check_finite_under_extreme_log_ratios` tries (exp overflows
float32 beyond 88.7 and float64 beyond 709.8)."""


def extreme_log_ratio_inputs(
    log_ratios: Sequence[float] = EXTREME_LOG_RATIOS,
    advantages: Sequence[float] = (-1.0, 0.0, 1.0),
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(logp, old_logp, advantages, mask)`` ``[A, R + 2]``: row ``a`` holds advantage
    ``advantages[a]``, column ``r < R`` log-ratio ``logp - old_logp = log_ratios[r]`` (both
    log-probs <= 0); a masked column in the middle and one at the end hold NaN."""
    a, r = len(advantages), len(log_ratios)
    d = torch.tensor(log_ratios, dtype=torch.float64)
    logp = torch.where(d < 0, -0.5 + d, torch.full_like(d, -0.5))
    old = torch.where(d < 0, torch.full_like(d, -0.5), -0.5 - d)
    half = r // 2
    nan = torch.full((1,), float("nan"), dtype=torch.float64)

    def layout(x: Tensor) -> Tensor:
        return torch.cat([x[:half], nan, x[half:], nan]).expand(a, r + 2).to(dtype).clone()

    mask = torch.ones(a, r + 2, dtype=torch.bool)
    mask[:, half] = False
    mask[:, -1] = False
    adv = torch.tensor(advantages, dtype=dtype).reshape(a, 1).expand(a, r + 2)
    adv = torch.where(mask, adv, torch.tensor(float("nan"), dtype=dtype))
    return layout(logp), layout(old), adv, mask


def check_finite_under_extreme_log_ratios(
    fn: Callable[[Tensor, Tensor, Tensor, Tensor], Any],
    log_ratios: Sequence[float] = EXTREME_LOG_RATIOS,
    advantages: Sequence[float] = (-1.0, 0.0, 1.0),
    dtype: torch.dtype = torch.float32,
    grad: bool = True,
) -> None:
    """``fn(logp, old_logp, advantages, mask)`` stays finite for every log-ratio in ``log_ratios``
    and advantage in ``advantages`` (inputs from :func:`extreme_log_ratio_inputs`, ``[A, R + 2]``
    with NaN at masked positions; a function that needs no advantages ignores them).

    Per-token outputs must be finite at valid positions, other outputs everywhere; with ``grad``
    (``logp`` requires grad), the gradient of the outputs' valid entries with respect to ``logp``
    must be finite everywhere. On failure the check reruns ``fn`` with one valid position at a time
    and names the first (log-ratio, advantage) that breaks it.
    """
    logp, old, adv, mask = extreme_log_ratio_inputs(log_ratios, advantages, dtype)
    problem = _nonfinite(fn, logp, old, adv, mask, grad)
    if problem is None:
        return
    culprit = ""
    for i, j in torch.nonzero(mask).tolist():
        one = torch.zeros_like(mask)
        one[i, j] = True
        alone = _nonfinite(fn, logp, old, adv, one, grad)
        if alone is not None:
            culprit = (f"; with only the position of log-ratio {float(logp[i, j] - old[i, j])!r} and advantage "
                       f"{float(adv[i, j])!r} valid: {alone}")
            break
    raise InvariantError(f"{problem}{culprit}")


def _nonfinite(fn: Callable[..., Any], logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor,
               grad: bool) -> str | None:
    """What is non-finite in ``fn``'s outputs (or the gradient wrt ``logp``), or None."""
    lp = logp.detach().clone().requires_grad_(grad)
    outputs = _flatten(fn(lp, old, adv, mask))
    total = None
    for name, x in outputs:
        if not x.is_floating_point():
            continue
        valid = _where_valid(x, mask) if _per_token(x, mask) else torch.ones_like(x, dtype=torch.bool)
        bad = valid & ~torch.isfinite(x.detach())
        if bad.any():
            idx = tuple(int(i) for i in torch.nonzero(bad)[0])
            return f"{name} is {x.detach()[idx].item()!r}{_where(idx, mask)}"
        if grad and x.requires_grad:
            part = torch.where(valid, x, 0.0).sum()
            total = part if total is None else total + part
    if grad and total is not None:
        (g,) = torch.autograd.grad(total, [lp], allow_unused=True)
        if g is not None and not torch.isfinite(g).all():
            idx = tuple(int(i) for i in torch.nonzero(~torch.isfinite(g))[0])
            return f"the gradient wrt logp is {g[idx].item()!r}{_where(idx, mask)}"
    return None


__all__ = [
    "DEFAULT_FILLS",
    "EXTREME_LOG_RATIOS",
    "EXTREME_VALUES",
    "GROUP_KINDS",
    "ROW_KINDS",
    "InvariantError",
    "check_agrees_with_reference",
    "check_finite_under_extreme_log_ratios",
    "check_masked_positions_ignored",
    "episode_masks",
    "extreme_log_ratio_inputs",
    "float_tensors",
    "groups",
    "masks",
    "reference_gae",
    "reference_grpo_advantages",
    "reference_returns",
    "reference_rloo_advantages",
    "rollouts",
]
