"""TorchRL data of a :class:`~textrl.envs.torchrl_env.TextGenEnv` -> textrl's rollout TensorDict:
:func:`to_rollout` (``textrl.envs.to_rollout``), for ``env.rollout(...)`` or a TorchRL collector's batch."""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase

from textrl.core.checks import check_rollout
from textrl.envs.fast_path import PLACEMENTS, place_score
from textrl.envs.torchrl_env import EPISODE_END, EPISODE_ID, EPISODE_TURNS, TextGenEnv
from textrl.keys import KEYS, RolloutKeys


def _episodes(data: TensorDictBase) -> list[tuple[int, list[int]]]:
    """``(row, steps)`` of every episode that both starts and ends inside ``data`` ``[B, S]``:
    the steps of one ``("episode","id")`` up to its first ``("next","done")``."""
    ids = data.get(EPISODE_ID)
    done = data.get(("next", "done")).reshape(ids.shape)
    start = data.get("response_length").reshape(ids.shape) == 0
    out = []
    for row in range(ids.shape[0]):
        steps: dict[int, list[int]] = {}
        ended: set[int] = set()
        for s, (episode, d) in enumerate(zip(ids[row].tolist(), done[row].tolist())):
            if episode in ended:
                continue  # TorchRL repeats a finished row's last transition (break_when_all_done)
            steps.setdefault(episode, []).append(s)
            if d:
                ended.add(episode)
        out += [(row, st) for episode, st in steps.items() if episode in ended and bool(start[row, st[0]])]
    return out


def to_rollout(data: TensorDictBase, env: TextGenEnv, *, reward_placement: str = "last",
               keys: RolloutKeys = KEYS) -> TensorDict:
    """textrl's rollout TensorDict (docs/design.md, "The rollout TensorDict", "Multi-turn
    episodes") of the episodes in TorchRL data collected from ``env``: ``env.rollout(...)`` or a
    TorchRL collector's batch, ``[B, S]`` with one entry per step.

    One row per episode that starts and ends inside ``data`` (an episode cut by the data's start
    or end is left out; collect more steps to keep it), ordered by ``env`` row, then time. Writes
    the prompt tokens / mask ``[N, P]``, ``action`` ``[N, T]`` (every token after the prompt, agent
    and observation, right-padded; ``T`` the longest episode), ``("collector","mask")`` (the
    agent's tokens), ``("masks","response")`` (every token), ``("next","done" / "terminated" /
    "truncated")`` ``[N, T, 1]`` at the last agent token, ``("next","reward")`` ``[N, T, 1]`` (the
    task reward the env paid, placed by ``reward_placement``: ``"last"`` as paid, or
    ``"uniform"``), ``("reward_components", name)`` and ``score`` ``[N]``, and
    ``("episode","turns")`` / ``("episode","end")`` ``[N]``; for a single turn it equals
    :func:`textrl.envs.rollout_from_responses` of the same tokens. Checked by
    :func:`textrl.core.checks.check_rollout`.
    """
    if reward_placement not in PLACEMENTS:
        raise ValueError(f"reward_placement={reward_placement!r}: must be one of {PLACEMENTS}")
    if data.batch_dims != 2:
        raise ValueError(f"data has batch_size {list(data.batch_size)}: pass TorchRL data of a TextGenEnv, "
                         "[B, steps] (env.rollout(...) or a collector's batch)")
    if EPISODE_ID not in data.keys(include_nested=True):
        raise ValueError("data has no ('episode', 'id'): collect it from a textrl.envs.TextGenEnv")
    episodes = _episodes(data)
    if not episodes:
        raise ValueError(f"no episode both starts and ends in data of {data.batch_size[1]} steps; collect more "
                         "steps (an episode takes up to max_episode_tokens of them)")
    data = data.cpu()
    nxt = data.get("next")
    finals = [(row, steps[-1]) for row, steps in episodes]
    lengths = [int(nxt.get("response_length")[r, s]) for r, s in finals]
    n, t = len(episodes), max(1, max(lengths))
    action = torch.stack([nxt.get("response_ids")[r, s, :t] for r, s in finals])  # [N, T]
    agent = torch.stack([nxt.get("agent_mask")[r, s, :t] for r, s in finals])  # [N, T]
    seen = torch.arange(t).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # [N, T]
    paid = torch.zeros((n, t), dtype=torch.float32)  # each step's reward at its action's position
    for i, (row, steps) in enumerate(episodes):
        pos = data.get("response_length")[row, steps].reshape(-1)
        paid[i].index_put_((pos,), nxt.get("reward")[row, steps].reshape(-1), accumulate=True)
    terminated_row = torch.stack([nxt.get("terminated")[r, s].reshape(()) for r, s in finals])  # [N]
    last = torch.tensor([int(torch.nonzero(a).max()) for a in agent])  # [N]
    at_last = torch.arange(t).unsqueeze(0) == last.unsqueeze(1)  # [N, T]
    rewards = _placed(paid, agent, env.dynamics.multi_turn, reward_placement)
    components = {name: torch.stack([nxt.get(("reward_components", name))[r, s] for r, s in finals])
                  for name in env.component_names}
    td = TensorDict(
        {
            keys.prompt_tokens: torch.stack([data.get("prompt_ids")[r, s] for r, s in finals]),
            keys.prompt_mask: torch.stack([data.get("prompt_mask")[r, s] for r, s in finals]).bool(),
            keys.action: action,
            keys.mask: agent,
            keys.response_mask: seen,
            keys.reward: rewards.unsqueeze(-1),
            keys.done: at_last.unsqueeze(-1),
            keys.terminated: (at_last & terminated_row.unsqueeze(1)).unsqueeze(-1),
            keys.truncated: (at_last & ~terminated_row.unsqueeze(1)).unsqueeze(-1),
            keys.reward_components: TensorDict(components, batch_size=[n]),
            keys.turns: torch.stack([nxt.get(EPISODE_TURNS)[r, s] for r, s in finals]),
            keys.end_reason: torch.stack([nxt.get(EPISODE_END)[r, s] for r, s in finals]),
            keys.score: rewards.sum(1),
        },
        batch_size=[n],
    )
    return check_rollout(td, keys)


def _placed(paid: torch.Tensor, agent: torch.Tensor, multi_turn: bool, placement: str) -> torch.Tensor:
    """Per-token task rewards ``[N, T]`` from the rewards the env paid at each action ``[N, T]``
    (``"last"``: as paid; ``"uniform"``: their sum spread over the agent tokens, as the collector
    places it)."""
    if placement == "last":
        return paid
    if not multi_turn:
        return place_score(paid.sum(1), agent, placement)
    return torch.where(agent, (paid.sum(1) / agent.sum(1)).unsqueeze(1), 0.0)


__all__ = ["to_rollout"]
