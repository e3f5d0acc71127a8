"""Hypothesis strategies over the ``[B, T]`` layout (docs/design.md, "The rollout TensorDict"):
agent masks with observation gaps, episode masks, whole rollouts, group scores and float tensors.
hypothesis is imported on first use (``pip install hypothesis``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from textrl.keys import END_REASONS, KEYS, RolloutKeys


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
    TensorDict" and "Multi-turn episodes" describe; :func:`textrl.core.checks.check_rollout` accepts
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
        t, rows = _draw_layout(draw, st, batch, time, multi_turn, max_turns)
        pad = pad_token_id if pad_token_id is not None else draw(
            st.sampled_from([eos_token_id, (eos_token_id + 1) % vocab_size]))
        episode = _draw_episode(draw, st, rows, t, multi_turn, vocab_size, eos_token_id, pad, reward)
        prompt, prompt_mask = _draw_prompt(draw, st, len(rows), vocab_size, pad)
        td = _rollout_td(keys, rows, t, prompt, prompt_mask, *episode)
        agent = td.get(keys.mask)
        b, nan = len(rows), torch.tensor(float("nan"))
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


def _draw_episode(draw: Any, st: Any, rows: list[Any], t: int, multi_turn: bool, vocab_size: int, eos: int,
                  pad: int, reward: Any) -> tuple[Tensor, ...]:
    """Each row's tokens, turn rewards and end (:func:`rollouts`' docstring): ``(action [B, T],
    rewards [B, T, 1], done, terminated [B, T, 1], turns [B], end reason [B])``."""
    b = len(rows)
    token = st.sampled_from([i for i in range(vocab_size) if i != eos])  # pad included when pad != eos
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
    return action, rewards, done, terminated, turns, end


def _draw_prompt(draw: Any, st: Any, b: int, vocab_size: int, pad: int) -> tuple[Tensor, Tensor]:
    """``(prompt [B, P], prompt_mask [B, P])``: left-padded prompts of 1 to ``P`` tokens, ``P <= 6``."""
    p = draw(st.integers(1, 6))
    prompt_len = torch.tensor(draw(st.lists(st.integers(1, p), min_size=b, max_size=b)), dtype=torch.long)
    prompt_mask = torch.arange(p) >= (p - prompt_len.reshape(b, 1))
    prompt = torch.where(prompt_mask, torch.randint(0, vocab_size, (b, p), generator=_gen(draw, st)), pad)
    return prompt, prompt_mask


def _rollout_td(keys: RolloutKeys, rows: list[Any], t: int, prompt: Tensor, prompt_mask: Tensor, action: Tensor,
                rewards: Tensor, done: Tensor, terminated: Tensor, turns: Tensor, end: Tensor) -> Any:
    """The rollout TensorDict of the drawn pieces (names from ``keys``)."""
    from tensordict import TensorDict  # a runtime dependency; imported only here

    b = len(rows)
    td = TensorDict(batch_size=[b])
    td.set(keys.prompt_tokens, prompt)
    td.set(keys.prompt_mask, prompt_mask)
    td.set(keys.action, action)
    td.set(keys.mask, torch.tensor([r.agent for r in rows], dtype=torch.bool).reshape(b, t))
    td.set(keys.response_mask, torch.arange(t) < torch.tensor([r.length for r in rows], dtype=torch.long).reshape(b, 1))
    td.set(keys.done, done)
    td.set(keys.terminated, terminated)
    td.set(keys.truncated, done & ~terminated)
    td.set(keys.reward, rewards)
    td.set(keys.score, rewards.sum(dim=(1, 2)))
    td.set(keys.turns, turns)
    td.set(keys.end_reason, end)
    return td


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


__all__ = ["EXTREME_VALUES", "GROUP_KINDS", "ROW_KINDS", "episode_masks", "float_tensors", "groups", "masks",
           "rollouts"]
