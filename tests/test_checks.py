from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from textrl.core.checks import RolloutError, check_rollout
from textrl.keys import KEYS


def _rollout(lengths=(3, 1, 4), T=4, P=2) -> TensorDict:
    B = len(lengths)
    mask = torch.arange(T).expand(B, T) < torch.tensor(lengths)[:, None]
    done = torch.zeros(B, T, 1, dtype=torch.bool)
    done[torch.arange(B), torch.tensor(lengths) - 1, 0] = True
    truncated = done & torch.tensor([n == T for n in lengths])[:, None, None]
    td = TensorDict(batch_size=[B])
    td.set(KEYS.prompt_tokens, torch.ones(B, P, dtype=torch.long))
    td.set(KEYS.prompt_mask, torch.ones(B, P, dtype=torch.bool))
    td.set(KEYS.action, torch.randint(0, 10, (B, T)))
    td.set(KEYS.mask, mask)
    td.set(KEYS.action_log_prob, torch.where(mask, -1.0, float("nan")))
    td.set(KEYS.reward, torch.zeros(B, T, 1))
    td.set(KEYS.done, done)
    td.set(KEYS.terminated, done & ~truncated)
    td.set(KEYS.truncated, truncated)
    return td


def test_valid_rollout_passes_even_with_nan_padding():
    td = _rollout()
    assert check_rollout(td) is td


def _break(td, key, value):
    td.set(key, value)
    return td


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda td: _break(td, KEYS.reward, torch.zeros(3, 4)), r"unsqueeze\(-1\)"),
        (lambda td: _break(td, KEYS.action_log_prob, torch.zeros(3, 4, 1)), r"squeeze\(-1\)"),
        (lambda td: _break(td, KEYS.mask, td.get(KEYS.mask).long()), "dtype"),
        (lambda td: _break(td, KEYS.mask, torch.tensor([[True, False, True, False]] * 3)), "prefix"),
        (lambda td: _break(td, KEYS.done, torch.zeros(3, 4, 1, dtype=torch.bool)), "exactly once"),
        (lambda td: _break(td, KEYS.reward, torch.full((3, 4, 1), float("nan"))), "NaN/inf"),
        (lambda td: td.exclude(KEYS.done), "no key"),
    ],
)
def test_broken_rollouts_are_named(mutate, message):
    with pytest.raises(RolloutError, match=message):
        check_rollout(mutate(_rollout()))


def test_done_at_wrong_position_is_reported():
    td = _rollout()
    done = torch.zeros(3, 4, 1, dtype=torch.bool)
    done[:, 0] = True
    td.set(KEYS.done, done)
    with pytest.raises(RolloutError, match="last valid token"):
        check_rollout(td)
