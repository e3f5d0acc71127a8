"""Small named checks of a rollout TensorDict whose messages say what to fix.

Each ``check_*`` raises :class:`RolloutError` (a ``ValueError``) naming the key, what was found and
what was expected. :func:`check_rollout` runs all that apply to the keys present, so it can be
called after the environment's fast path (no log-probs yet) or on a fully processed rollout.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from textrl.functional.masking import last_true_index
from textrl.keys import END_REASONS, KEYS, NestedKey, RolloutKeys


class RolloutError(ValueError):
    """A rollout TensorDict that an agent must not consume."""


def _name(key: NestedKey) -> str:
    return repr(key)


def _get(td: TensorDictBase, key: NestedKey) -> torch.Tensor:
    if key not in td.keys(include_nested=True):
        raise RolloutError(
            f"rollout has no key {_name(key)}; the keys it has are "
            f"{sorted(map(str, td.keys(include_nested=True, leaves_only=True)))}"
        )
    return td.get(key)


def check_per_token_shape(td: TensorDictBase, key: NestedKey, trailing_one: bool, keys: RolloutKeys = KEYS) -> None:
    """``key`` is ``[B, T]`` (or ``[B, T, 1]`` when ``trailing_one``) like the action."""
    action = _get(td, keys.action)
    x = _get(td, key)
    want = (*action.shape, 1) if trailing_one else tuple(action.shape)
    if tuple(x.shape) != want:
        hint = (
            " (a [B, T] tensor where [B, T, 1] is expected: add .unsqueeze(-1))"
            if trailing_one and tuple(x.shape) == tuple(action.shape)
            else " (a [B, T, 1] tensor where [B, T] is expected: use .squeeze(-1))"
            if not trailing_one and tuple(x.shape) == (*action.shape, 1)
            else ""
        )
        raise RolloutError(f"{_name(key)} has shape {tuple(x.shape)}, expected {want}{hint}")


def _rows(bad: torch.Tensor) -> list[int]:
    """Indices of the rows of a ``[B, ...]`` bool tensor with a True, the first ten."""
    return torch.nonzero(bad.reshape(bad.shape[0], -1).any(1)).flatten().tolist()[:10]


def _check_bool(td: TensorDictBase, key: NestedKey) -> torch.Tensor:
    mask = _get(td, key)
    if mask.dtype != torch.bool:
        raise RolloutError(f"{_name(key)} has dtype {mask.dtype}, expected torch.bool")
    return mask


def _check_prefix(key: NestedKey, mask: torch.Tensor, fix: str) -> None:
    if mask.shape[-1] and (mask[:, 1:] & ~mask[:, :-1]).any():
        rows = _rows(mask[:, 1:] & ~mask[:, :-1])
        raise RolloutError(f"{_name(key)} is not a prefix of Trues in rows {rows}: a valid token follows padding; {fix}")


def _check_not_empty(key: NestedKey, mask: torch.Tensor) -> None:
    empty = torch.nonzero(~mask.any(1)).flatten().tolist()
    if empty:
        raise RolloutError(f"{_name(key)} has rows with no valid token: {empty[:10]}")


def check_mask_is_prefix(td: TensorDictBase, keys: RolloutKeys = KEYS) -> None:
    """The agent mask is bool, a prefix of Trues per row, with at least one valid token (a
    single-turn rollout, without ``keys.response_mask``)."""
    mask = _check_bool(td, keys.mask)
    _check_prefix(keys.mask, mask, "build it with textrl.functional.response_mask")
    _check_not_empty(keys.mask, mask)


def check_agent_mask(td: TensorDictBase, keys: RolloutKeys = KEYS) -> None:
    """A rollout with ``keys.response_mask`` (docs/design.md, "Multi-turn episodes"): that mask is
    bool ``[B, T]`` and a prefix; the agent mask ``keys.mask`` lies inside it (gaps allowed: the
    observation tokens) and holds at least one agent token per row."""
    check_per_token_shape(td, keys.response_mask, trailing_one=False, keys=keys)
    response = _check_bool(td, keys.response_mask)
    _check_prefix(keys.response_mask, response, "it marks every token of the episode, then padding")
    mask = _check_bool(td, keys.mask)
    outside = mask & ~response
    if outside.any():
        raise RolloutError(
            f"{_name(keys.mask)} is True where {_name(keys.response_mask)} is False in rows {_rows(outside)}: "
            "an agent token must be a token of the episode (inside the response mask)"
        )
    _check_not_empty(keys.mask, mask)


def check_done_once(td: TensorDictBase, keys: RolloutKeys = KEYS) -> None:
    """``("next","done")`` is True exactly once per row, at the last valid token (the row's last
    agent token: the last True of the agent mask, gaps allowed); ``done == terminated | truncated``."""
    mask = _get(td, keys.mask)
    done = _get(td, keys.done).squeeze(-1)
    counts = done.sum(1)
    bad = torch.nonzero(counts != 1).flatten().tolist()
    if bad:
        raise RolloutError(
            f"{_name(keys.done)} must be True exactly once per row; rows {bad[:10]} have "
            f"{counts[bad[:10]].tolist()} Trues"
        )
    last = last_true_index(mask)
    where = done.float().argmax(1)
    bad = torch.nonzero(where != last).flatten().tolist()
    if bad:
        raise RolloutError(
            f"{_name(keys.done)} is not at the last valid token (the last True of {_name(keys.mask)}, "
            f"the row's last agent token) in rows {bad[:10]}"
        )
    terminated = _get(td, keys.terminated).squeeze(-1)
    truncated = _get(td, keys.truncated).squeeze(-1)
    if ((terminated | truncated) != done).any():
        raise RolloutError(
            f"{_name(keys.done)} must equal terminated | truncated at every position"
        )


def check_episode_keys(td: TensorDictBase, keys: RolloutKeys = KEYS) -> None:
    """The multi-turn keys, where present: ``keys.task_reward`` float ``[B, T, 1]`` and 0 off the
    agent mask (a reward on a token the agent did not choose would never be trained on);
    ``keys.turns`` int64 ``[B]``, at least 1; ``keys.end_reason`` int64 ``[B]``, an index into
    :data:`textrl.keys.END_REASONS`."""
    present = set(td.keys(include_nested=True))
    b = td.batch_size[0]
    if keys.task_reward in present:
        check_per_token_shape(td, keys.task_reward, trailing_one=True, keys=keys)
        task = _get(td, keys.task_reward)
        if not task.is_floating_point():
            raise RolloutError(f"{_name(keys.task_reward)} has dtype {task.dtype}, expected a float dtype")
        off = ~_get(td, keys.mask) & (task.squeeze(-1) != 0)
        if off.any():
            raise RolloutError(
                f"{_name(keys.task_reward)} is non-zero off the agent mask {_name(keys.mask)} in rows {_rows(off)}: "
                "a turn's reward goes on the turn's last agent token"
            )
    for key, low, high in ((keys.turns, 1, None), (keys.end_reason, 0, len(END_REASONS) - 1)):
        if key not in present:
            continue
        x = _get(td, key)
        if x.dtype != torch.int64 or tuple(x.shape) != (b,):
            raise RolloutError(f"{_name(key)} must be int64 [B] = ({b},), got {x.dtype} {tuple(x.shape)}")
        bad = (x < low) | (x > high) if high is not None else x < low
        if bad.any():
            rows = torch.nonzero(bad).flatten().tolist()[:10]
            allowed = f"in range({len(END_REASONS)}) (END_REASONS = {END_REASONS})" if high is not None else f">= {low}"
            raise RolloutError(f"{_name(key)} must be {allowed}; rows {rows} hold {x[rows].tolist()}")


def check_finite(td: TensorDictBase, key: NestedKey, keys: RolloutKeys = KEYS) -> None:
    """Valid positions of a float leaf are finite."""
    x = _get(td, key)
    mask = _get(td, keys.mask)
    valid = mask if x.dim() == 2 else mask.unsqueeze(-1).expand_as(x)
    bad = valid & ~torch.isfinite(x)
    if bad.any():
        rows = torch.nonzero(bad.reshape(bad.shape[0], -1).any(1)).flatten().tolist()
        raise RolloutError(f"{_name(key)} holds NaN/inf on valid tokens of rows {rows[:10]}")


def check_rollout(td: TensorDictBase, keys: RolloutKeys = KEYS, finite: bool = True) -> TensorDictBase:
    """Run every check that applies to the keys present; return the rollout unchanged.

    The agent mask ``keys.mask`` must be a prefix of Trues per row unless the rollout carries
    ``keys.response_mask`` (a multi-turn rollout): then that one is the prefix and the agent mask
    lies inside it, with gaps where the environment's observation tokens sit.

    ``finite=False`` skips the NaN/inf checks of the float leaves (log-probs, values, the
    KL-shaped reward, advantages), for a caller that handles non-finite values itself.
    """
    if td.batch_dims != 1:
        raise RolloutError(f"rollout batch_size must be [B], got {list(td.batch_size)}")
    action = _get(td, keys.action)
    if action.dim() != 2 or action.dtype != torch.int64:
        raise RolloutError(
            f"{_name(keys.action)} must be int64 [B, T], got {action.dtype} {tuple(action.shape)}"
        )
    check_per_token_shape(td, keys.mask, trailing_one=False, keys=keys)
    present = set(td.keys(include_nested=True))
    if keys.response_mask in present:
        check_agent_mask(td, keys)
    else:
        check_mask_is_prefix(td, keys)
    for key in (keys.action_log_prob, keys.ref_log_prob, keys.teacher_log_prob):
        if key in present:
            check_per_token_shape(td, key, trailing_one=False, keys=keys)
            if finite:
                check_finite(td, key, keys)
    for key in (keys.reward, keys.task_reward, keys.state_value, keys.next_state_value, keys.advantage,
                keys.value_target):
        if key in present:
            check_per_token_shape(td, key, trailing_one=True, keys=keys)
            if finite:
                check_finite(td, key, keys)
    for key in (keys.done, keys.terminated, keys.truncated):
        check_per_token_shape(td, key, trailing_one=True, keys=keys)
    check_done_once(td, keys)
    check_episode_keys(td, keys)
    return td


__all__ = [
    "RolloutError",
    "check_agent_mask",
    "check_done_once",
    "check_episode_keys",
    "check_finite",
    "check_mask_is_prefix",
    "check_per_token_shape",
    "check_rollout",
]
