"""Small named checks of a rollout TensorDict whose messages say what to fix.

Each ``check_*`` raises :class:`RolloutError` (a ``ValueError``) naming the key, what was found and
what was expected. :func:`check_rollout` runs all that apply to the keys present, so it can be
called after the environment's fast path (no log-probs yet) or on a fully processed rollout.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from textrl.keys import KEYS, NestedKey, RolloutKeys


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


def check_mask_is_prefix(td: TensorDictBase, keys: RolloutKeys = KEYS) -> None:
    """The response mask is bool, a prefix of Trues per row, with at least one valid token."""
    mask = _get(td, keys.mask)
    if mask.dtype != torch.bool:
        raise RolloutError(f"{_name(keys.mask)} has dtype {mask.dtype}, expected torch.bool")
    if mask.shape[-1] and (mask[:, 1:] & ~mask[:, :-1]).any():
        rows = torch.nonzero((mask[:, 1:] & ~mask[:, :-1]).any(1)).flatten().tolist()
        raise RolloutError(
            f"{_name(keys.mask)} is not a prefix of Trues in rows {rows[:10]}: a valid token follows "
            "padding; build it with textrl.functional.response_mask"
        )
    empty = torch.nonzero(~mask.any(1)).flatten().tolist()
    if empty:
        raise RolloutError(f"{_name(keys.mask)} has rows with no valid token: {empty[:10]}")


def check_done_once(td: TensorDictBase, keys: RolloutKeys = KEYS) -> None:
    """``("next","done")`` is True exactly once per row, at the last valid token."""
    mask = _get(td, keys.mask)
    done = _get(td, keys.done).squeeze(-1)
    counts = done.sum(1)
    bad = torch.nonzero(counts != 1).flatten().tolist()
    if bad:
        raise RolloutError(
            f"{_name(keys.done)} must be True exactly once per row; rows {bad[:10]} have "
            f"{counts[bad[:10]].tolist()} Trues"
        )
    last = mask.sum(1) - 1
    where = done.float().argmax(1)
    bad = torch.nonzero(where != last).flatten().tolist()
    if bad:
        raise RolloutError(
            f"{_name(keys.done)} is not at the last valid token (mask.sum(1) - 1) in rows {bad[:10]}"
        )
    terminated = _get(td, keys.terminated).squeeze(-1)
    truncated = _get(td, keys.truncated).squeeze(-1)
    if ((terminated | truncated) != done).any():
        raise RolloutError(
            f"{_name(keys.done)} must equal terminated | truncated at every position"
        )


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
    check_mask_is_prefix(td, keys)
    present = set(td.keys(include_nested=True))
    for key in (keys.action_log_prob, keys.ref_log_prob):
        if key in present:
            check_per_token_shape(td, key, trailing_one=False, keys=keys)
            if finite:
                check_finite(td, key, keys)
    for key in (keys.reward, keys.state_value, keys.next_state_value, keys.advantage, keys.value_target):
        if key in present:
            check_per_token_shape(td, key, trailing_one=True, keys=keys)
            if finite:
                check_finite(td, key, keys)
    for key in (keys.done, keys.terminated, keys.truncated):
        check_per_token_shape(td, key, trailing_one=True, keys=keys)
    check_done_once(td, keys)
    return td


__all__ = [
    "RolloutError",
    "check_done_once",
    "check_finite",
    "check_mask_is_prefix",
    "check_per_token_shape",
    "check_rollout",
]
