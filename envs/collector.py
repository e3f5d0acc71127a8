"""The batched collector: run a batch of episodes of an environment with a generate function.

One path for every environment (docs/design.md, "Multi-turn episodes"): per turn, one batched
``generate`` over the rows still running (each row's context is its prompt plus every token of its
episode so far), the turn cut at EOS, at a stop string or at the length cap, the environment's
answer to each finished turn, the observation tokens appended. The rows whose turn ended wait for
the others. A single-turn task is the environment whose first answer ends the episode, so its
rollout is exactly what :func:`textrl.envs.rollout_from_responses` makes of the same tokens (a
test holds them equal).

The episode's final reward (``env.reward``) is scored once, over the whole batch, by
:func:`textrl.envs.fast_path.score_completions`, the one scoring path of the environments.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict
from textrl.envs.environment import (
    EnvError,
    Environment,
    Episode,
    PromptTask,
    Turn,
    answer_turn,
    call_env,
)
from textrl.envs.fast_path import (
    NONFINITE_POLICIES,
    PLACEMENTS,
    RewardLike,
    as_reward_fn,
    place_score,
    score_completions,
    special_ids,
)
from textrl.envs.observations import append_observation
from textrl.envs.rows import batch_fields, raw_prompts, row_messages
from torch import Tensor

from textrl.checks import check_rollout
from textrl.keys import END_REASONS, KEYS

Generate = Callable[[Tensor, Tensor], Tensor]
"""``generate(input_ids int64 [n, L], attention_mask bool [n, L]) -> int64 [n, T]``: one sampled
turn per row (left-padded contexts; a row without EOS runs to ``max_new_tokens``)."""

TURN_REWARDS = "turn_rewards"
"""Name of the ``("reward_components", name)`` entry of a multi-turn environment: the sum of its
turns' rewards (the final ``reward``'s components sit beside it)."""

DONE, LENGTH, MAX_TURNS, CONTEXT = (END_REASONS.index(r) for r in ("done", "length", "max_turns", "context"))


def as_environment(env_or_reward: Environment | RewardLike) -> Environment:
    """An environment as it is; a reward spec or callable as the single-turn task it scores."""
    if isinstance(env_or_reward, Environment):
        return env_or_reward
    return PromptTask(None, as_reward_fn(env_or_reward))


def default_episode_tokens(env: Environment, max_new_tokens: int) -> int:
    """The response-side budget of an episode when none is given: ``max_new_tokens`` per turn plus
    ``max_observation_tokens`` (the environment's attribute, else 32) per observation."""
    obs = int(getattr(env, "max_observation_tokens", 32))
    return env.max_turns * max_new_tokens + (env.max_turns - 1) * obs


@dataclass
class _Row:
    """One episode's token-level record while the batch runs."""

    prompt: list[int]
    episode: Episode
    tokens: list[int] = field(default_factory=list)
    agent: list[bool] = field(default_factory=list)
    rewards: dict[int, float] = field(default_factory=dict)
    """position -> turn reward (on the turn's last agent token)."""
    end: int | None = None
    bad_reward: bool = False


class EpisodeRunner:
    """Runs batches of episodes of ``env`` (see the module docstring).

    Args:
        env: an :class:`~textrl.envs.environment.Environment`, or a reward spec / callable (the
            single-turn task it scores).
        tokenizer: decodes the agent's turns and tokenises observations.
        eos_token_id, pad_token_id: as for :func:`textrl.envs.rollout_from_responses` (default:
            the tokenizer's).
        max_new_tokens: the length cap of one agent turn (what ``generate`` samples at most).
        max_episode_tokens: the cap of the response side of an episode, agent and observation
            tokens together (default :func:`default_episode_tokens`).
        reward_placement: ``"last"`` (each turn's reward on its last agent token, the final reward on
            the episode's) or ``"uniform"`` (the episode's score spread over its agent tokens).
        reward_nonfinite: ``"raise"``, ``"zero"`` or ``"drop"`` for a NaN/inf reward.
    """

    def __init__(
        self,
        env: Environment | RewardLike,
        *,
        tokenizer: Any,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        max_episode_tokens: int | None = None,
        reward_placement: str = "last",
        reward_nonfinite: str = "raise",
    ) -> None:
        if reward_placement not in PLACEMENTS:
            raise ValueError(f"reward_placement={reward_placement!r}: must be one of {PLACEMENTS}")
        if reward_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"reward_nonfinite={reward_nonfinite!r}: must be one of {NONFINITE_POLICIES}")
        self.env = as_environment(env)
        if not isinstance(self.env.max_turns, int) or self.env.max_turns < 1:
            raise ValueError(f"environment {self.env.id!r}: max_turns={self.env.max_turns!r} must be an int >= 1")
        self.tokenizer = tokenizer
        self.eos_ids, self.pad_id = special_ids(tokenizer, eos_token_id, pad_token_id)
        self.max_new_tokens = int(max_new_tokens)
        budget = default_episode_tokens(self.env, self.max_new_tokens) if max_episode_tokens is None else max_episode_tokens
        if budget < 1:
            raise ValueError(f"max_episode_tokens={budget} must be >= 1")
        self.max_episode_tokens = int(budget)
        self.reward_placement = reward_placement
        self.reward_nonfinite = reward_nonfinite
        self.reward_fn = None if self.env.reward is None else as_reward_fn(self.env.reward)
        self._steps = type(self.env).step is not Environment.step or bool(self.env.stop_strings)
        self.multi_turn = self.env.max_turns > 1 and self._steps

    # -- the episodes --------------------------------------------------------------------------

    def run(self, generate: Generate, batch: Any, *, timings: dict[str, float] | None = None) -> TensorDict:
        """The rollout TensorDict (docs/design.md, "The rollout TensorDict", "Multi-turn episodes")
        of one episode per row of ``batch`` (a :class:`textrl.envs.prompts.PromptBatch`: left-padded
        ``input_ids`` / ``attention_mask`` ``[B, P]`` and its ``rows``), with ``KEYS.score`` ``[B]``.
        With ``timings``, ``generation`` and ``reward`` (the environment's answers and the final
        reward) seconds are added to it."""
        from textrl.timing import timed

        prompt_ids, prompt_mask = batch.input_ids, batch.attention_mask.bool()
        device = prompt_ids.device
        rows = [self._start(batch, b) for b in range(prompt_ids.shape[0])]
        for turn in range(self.env.max_turns):
            running = [b for b, row in enumerate(rows) if row.end is None]
            if not running:
                break
            with timed(timings, "generation", device):
                if turn == 0:  # the prompts as given: the first turn is today's single-turn generate
                    ids, mask = prompt_ids, prompt_mask
                else:
                    ids, mask = self._contexts([rows[b] for b in running], device)
                sampled = generate(ids, mask)  # [n, T]
            with timed(timings, "reward", device):
                finished = self._cut_turns([rows[b] for b in running], sampled)
                self._answer(finished)
        with timed(timings, "reward", device):
            return self._rollout(batch, rows, device)

    def _start(self, batch: Any, b: int) -> _Row:
        row = dict(batch.rows[b])
        index = int(batch.prompt_index[b]) if getattr(batch, "prompt_index", None) is not None else -1
        messages, _ = row_messages(row, index)
        episode = Episode(row=row, messages=list(messages), index=index, prompt_messages=len(messages))
        call_env(self.env, self.env.start, episode, "start")
        valid = batch.attention_mask[b].bool()
        return _Row(prompt=batch.input_ids[b][valid].tolist(), episode=episode)

    def _contexts(self, rows: list[_Row], device: torch.device) -> tuple[Tensor, Tensor]:
        """Left-padded prompt + episode tokens of each row: int64 / bool ``[n, L]``."""
        width = max(len(r.prompt) + len(r.tokens) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, r in enumerate(rows):
            seq = r.prompt + r.tokens
            ids[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[i, width - len(seq):] = True
        return ids.to(device), mask.to(device)

    def _cut_turns(self, rows: list[_Row], sampled: Tensor) -> list[tuple[_Row, list[int]]]:
        """Append each row's turn (to its first EOS, stop string or cap); the rows whose turn
        ended by EOS or a stop string, with the turn's tokens, wait for the environment."""
        if sampled.dim() != 2 or sampled.shape[0] != len(rows):
            raise ValueError(f"generate returned {tuple(sampled.shape)} for {len(rows)} rows; it must return "
                             "int64 [n, T], one turn per row")
        waiting = []
        for r, out in zip(rows, sampled.tolist()):
            cap = min(self.max_new_tokens, self.max_episode_tokens - len(r.tokens))
            turn, ended = self._turn_tokens(out[:cap])
            if not ended and len(turn) < cap:
                raise ValueError(f"row {r.episode.index}: a turn has no EOS and fewer than max_new_tokens="
                                 f"{self.max_new_tokens} tokens ({len(turn)}, cap {cap}): the MDP only ends a "
                                 "turn at EOS, a stop string or the cap; generate must return the full turns")
            r.tokens += turn
            r.agent += [True] * len(turn)
            if ended:
                waiting.append((r, turn))
            else:
                r.end = LENGTH if cap == self.max_new_tokens else CONTEXT
                r.episode.turn += 1
                if self.multi_turn:  # the cut turn is the conversation's last message
                    text = self.tokenizer.decode(turn, skip_special_tokens=True)
                    r.episode.messages.append({"role": "assistant", "content": text})
        return waiting

    def _turn_tokens(self, out: list[int]) -> tuple[list[int], bool]:
        """The turn's tokens and whether it ended (EOS or a stop string) rather than hit the cap."""
        for i, token in enumerate(out):
            if token in self.eos_ids:
                out, ended = out[: i + 1], True
                break
        else:
            ended = False
        stops = self.env.stop_strings
        if stops:
            text = self.tokenizer.decode(out, skip_special_tokens=True)
            if any(s in text for s in stops):
                for i in range(1, len(out) + 1):
                    if any(s in self.tokenizer.decode(out[:i], skip_special_tokens=True) for s in stops):
                        return out[:i], True
        return out, ended

    def _answer(self, finished: list[tuple[_Row, list[int]]]) -> None:
        """The environment's :class:`Turn` for each finished turn: its reward, the end, or the
        observation appended (unless it would leave no room for another agent token)."""
        if not finished:
            return
        if not self._steps:  # the base step: the first answer ends the episode, no turn reward
            for r, _ in finished:
                r.episode.turn += 1
                r.end = DONE
            return
        texts = self.tokenizer.batch_decode([t for _, t in finished], skip_special_tokens=True)
        for (r, _), text in zip(finished, texts):
            r.episode.turn += 1
            r.episode.messages.append({"role": "assistant", "content": text})
            answer = answer_turn(self.env, r.episode, text)
            self._pay(r, answer.reward)
            if answer.done:
                r.end = DONE
            elif r.episode.turn >= self.env.max_turns:
                r.end = MAX_TURNS
            else:
                self._observe(r, answer)

    def _pay(self, r: _Row, reward: float) -> None:
        reward = float(reward)
        if not math.isfinite(reward):
            if self.reward_nonfinite == "raise":
                raise EnvError(f"environment {self.env.id!r} paid a non-finite turn reward {reward} on row "
                               f"{r.episode.index}; fix the environment (or set reward_nonfinite)")
            r.bad_reward, reward = True, 0.0
        last = len(r.tokens) - 1
        r.rewards[last] = r.rewards.get(last, 0.0) + reward

    def _observe(self, r: _Row, answer: Turn) -> None:
        if not append_observation(r, answer.messages(), tokenizer=self.tokenizer, eos_token_ids=self.eos_ids,
                                  max_episode_tokens=self.max_episode_tokens, env_id=self.env.id):
            r.end = CONTEXT

    # -- the rollout ---------------------------------------------------------------------------

    def _rollout(self, batch: Any, rows: list[_Row], device: torch.device) -> TensorDict:
        b = len(rows)
        t = max(1, max(len(r.tokens) for r in rows))
        action = torch.full((b, t), self.pad_id, dtype=torch.long)
        agent = torch.zeros((b, t), dtype=torch.bool)
        seen = torch.zeros((b, t), dtype=torch.bool)
        turn_rewards = torch.zeros((b, t), dtype=torch.float32)
        for i, r in enumerate(rows):
            n = len(r.tokens)
            action[i, :n] = torch.tensor(r.tokens, dtype=torch.long)
            agent[i, :n] = torch.tensor(r.agent, dtype=torch.bool)
            seen[i, :n] = True
            for pos, value in r.rewards.items():
                turn_rewards[i, pos] = value
        end = torch.tensor([r.end for r in rows], dtype=torch.long)
        last = torch.tensor([max(j for j, a in enumerate(r.agent) if a) for r in rows])  # [B]
        at_last = torch.arange(t).unsqueeze(0) == last.unsqueeze(1)  # [B, T]
        terminated = at_last & (end == DONE).unsqueeze(1)
        truncated = at_last & (end != DONE).unsqueeze(1)

        final, components, nonfinite = self._final_scores(batch, rows, action, agent, end)
        turn_sum = turn_rewards.sum(1)  # [B]
        if self.multi_turn:
            components = {TURN_REWARDS: turn_sum, **components}
        if not self.multi_turn:  # the fast path's placement, bit for bit
            rewards = place_score(turn_sum + final, agent, self.reward_placement)
        elif self.reward_placement == "uniform":
            rewards = torch.where(agent, ((turn_sum + final) / agent.sum(1)).unsqueeze(1), 0.0)
        else:
            rewards = turn_rewards.scatter_add(1, last.unsqueeze(1), final.unsqueeze(1))
        score = rewards.sum(1)  # [B], as the agents read it: the sum over time of the task reward
        nonfinite = nonfinite | torch.tensor([r.bad_reward for r in rows], dtype=torch.bool)

        td = TensorDict(
            {
                KEYS.prompt_tokens: batch.input_ids.cpu(),
                KEYS.prompt_mask: batch.attention_mask.bool().cpu(),
                KEYS.action: action,
                KEYS.mask: agent,
                KEYS.response_mask: seen,
                KEYS.reward: rewards.unsqueeze(-1),
                KEYS.done: (terminated | truncated).unsqueeze(-1),
                KEYS.terminated: terminated.unsqueeze(-1),
                KEYS.truncated: truncated.unsqueeze(-1),
                KEYS.reward_components: TensorDict(components, batch_size=[b]),
                KEYS.turns: torch.tensor([r.episode.turn for r in rows], dtype=torch.long),
                KEYS.end_reason: end,
                KEYS.score: score,
            },
            batch_size=[b],
        )
        if self.reward_nonfinite != "raise":
            if self.reward_nonfinite == "drop":
                if bool(nonfinite.all()):
                    from textrl.rewards import RewardError

                    raise RewardError(f"every one of the {b} rows got a NaN/inf reward, so reward_nonfinite="
                                      "'drop' leaves nothing to train on; fix the reward function")
                td, nonfinite = td[~nonfinite], nonfinite[~nonfinite]
            td.set(KEYS.reward_nonfinite, nonfinite)
        return check_rollout(td.to(device))

    def _final_scores(self, batch: Any, rows: list[_Row], action: Tensor, agent: Tensor,
                      end: Tensor) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """The final ``reward`` of every episode over its agent tokens: ``(total [B], components,
        nonfinite [B])``; zeros and no components without a final reward."""
        b = len(rows)
        if self.reward_fn is None:
            return torch.zeros(b), {}, torch.zeros(b, dtype=torch.bool)
        width = max(1, int(agent.sum(1).max()))
        tokens = torch.full((b, width), self.pad_id, dtype=torch.long)  # the agent's tokens, compacted
        mask = torch.zeros((b, width), dtype=torch.bool)
        for i in range(b):
            own = action[i][agent[i]]
            tokens[i, : own.numel()] = own
            mask[i, : own.numel()] = True
        # TRL's convention: conversational rows (and multi-turn episodes) give the rewards message
        # lists, the prompt's messages and what followed them
        conversational = self.multi_turn or any("messages" in row for row in batch.rows)
        scores = score_completions(
            self.reward_fn, raw_prompts(batch.rows), tokens, mask, tokenizer=self.tokenizer,
            truncated=end != DONE, fields=batch_fields(batch.rows), nonfinite=self.reward_nonfinite,
            conversations=[r.episode.messages[: r.episode.prompt_messages] for r in rows] if conversational else None,
            completion_messages=[r.episode.completions for r in rows] if self.multi_turn else None,
        )
        nonfinite = scores.nonfinite if scores.nonfinite is not None else torch.zeros(b, dtype=torch.bool)
        return scores.total, scores.components, nonfinite


def collect_episodes(
    env: Environment | RewardLike,
    generate: Generate,
    batch: Any,
    *,
    tokenizer: Any,
    max_new_tokens: int,
    timings: dict[str, float] | None = None,
    **settings: Any,
) -> TensorDict:
    """``EpisodeRunner(env, ...).run(generate, batch)``: one batch of episodes, in one call."""
    runner = EpisodeRunner(env, tokenizer=tokenizer, max_new_tokens=max_new_tokens, **settings)
    return runner.run(generate, batch, timings=timings)


__all__ = ["TURN_REWARDS", "EpisodeRunner", "Generate", "as_environment", "collect_episodes",
           "default_episode_tokens"]
