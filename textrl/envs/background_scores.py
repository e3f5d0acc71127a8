"""The final rewards an :class:`textrl.envs.collector.EpisodeRunner` scores in the background.

A reward whose functions are ``async`` or declare ``does_io = True``
(:func:`textrl.rewards.overlapped`) is not scored after generation: :func:`start_scores` starts the
final reward of the episodes a generated part ended, on the runner's
:class:`textrl.rewards.RewardPool`, while the next part generates; :func:`taken_scores` takes the
answers in row order when the rollout is assembled and scores the rows in the loop's thread with
them (docs/rewards.md, "Asynchronous rewards"). ``runner``: the ``EpisodeRunner`` (its ``dynamics``,
``reward_fn``, ``pool`` and ``background``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from textrl.envs.episodes import EpisodeState
from textrl.rewards import RewardError
from textrl.rewards.background import answers, replayed, results
from textrl.rewards.base import AnsweredRewardError


def reward_parts(rows: list[int], groups: list[int], concurrency: int) -> list[list[int]]:
    """``rows`` (ended episodes, in order) split into at most ``concurrency`` runs, each of whole
    prompt groups (a run of consecutive rows with the same ``groups`` entry: a prompt's samples) and
    of at least ``ceil(len(rows) / concurrency)`` rows, the last one excepted: the background
    calls of one finished micro-batch.

    >>> reward_parts([0, 1, 2, 3, 4, 5], [7, 7, 8, 8, 9, 9], 2)
    [[0, 1, 2, 3], [4, 5]]
    >>> reward_parts([0, 1, 2], [5, 5, 5], 4)
    [[0, 1, 2]]
    """
    if not rows:
        return []
    least = -(-len(rows) // concurrency)
    parts: list[list[int]] = [[]]
    for i, row in enumerate(rows):
        if len(parts[-1]) >= least and groups[i] != groups[i - 1]:
            parts.append([])
        parts[-1].append(row)
    return parts


def start_scores(runner: Any, states: list[EpisodeState], rows: list[int], pending: list[tuple[list[int], list[Any]]],
                 scoring: set[int]) -> None:
    """Start the final reward of the ended episodes ``rows`` on the pool, in up to
    ``reward_concurrency`` calls split between prompt groups (:func:`reward_parts`); their
    futures go to ``pending``. Each call runs the reward's background functions
    (:func:`textrl.rewards.background.answers`; a reward that cannot be split, whole), on
    arguments built here, in the loop's thread (the tokenizer is not shared)."""
    for part in reward_parts(rows, [states[b].episode.index for b in rows], runner.pool.concurrency):
        ended = [states[b] for b in part]
        if runner.background is None:  # scored whole
            calls = [call for _, call in runner.dynamics.reward_calls(ended, runner.reward_fn)]
        else:
            calls = [functools.partial(answers, runner.background, *arguments)
                     for arguments in runner.dynamics.reward_arguments(ended)]
        pending.append((part, [runner.pool.submit(call) for call in calls]))
    scoring.update(rows)


def taken_scores(runner: Any, states: list[EpisodeState], pending: list[tuple[list[int], list[Any]]]
                 ) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """The final rewards of every row, the background calls waited for in row order: ``(total
    [B], components name -> [B], bad [B])`` as :meth:`EpisodeDynamics.final_scores` gives them
    for the whole batch, each part scored here with the background functions' answers replayed
    (:func:`textrl.rewards.background.replayed`) and the reward's other functions run. The first
    error in order is raised here, naming the batch rows of its call, the other calls cancelled."""
    n = len(states)
    total, components, bad = torch.zeros(n), {}, torch.zeros(n, dtype=torch.bool)
    for rows, futures in pending:
        try:
            got = results(futures)
            ended = [states[b] for b in rows]
            if runner.background is None:
                part_total, part_components, _, part_bad = runner.dynamics.final_scores(
                    ended, runner.reward_fn, scored=got)
            else:
                part_total, part_components, _, part_bad = runner.dynamics.final_scores(
                    ended, runner.reward_fn, fns=[replayed(runner.reward_fn, answer) for answer in got])
        except RewardError as err:
            raise AnsweredRewardError(f"{err}; the call scored the batch's rows {rows} (the rows named above are "
                                      "positions among them)") from err
        index = torch.tensor(rows)
        total[index], bad[index] = part_total, part_bad
        for name, value in part_components.items():
            components.setdefault(name, torch.zeros(n))[index] = value
    return total, components, bad


__all__ = ["reward_parts", "start_scores", "taken_scores"]
