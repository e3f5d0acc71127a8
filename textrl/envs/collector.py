"""The batched collector: run a batch of episodes of an environment with a generate function.

One path for every environment (docs/design.md, "Multi-turn episodes"): per turn, one batched
``generate`` over the rows still running (each row's context is its prompt plus every token of its
episode so far), the turn cut at EOS, at a stop string or at the length cap, the environment's
answer to each finished turn, the observation tokens appended. The rows whose turn ended wait for
the others. A single-turn task is the environment whose first answer ends the episode, so its
rollout is exactly what :func:`textrl.envs.rollout_from_responses` makes of the same tokens (a
test holds them equal).

The rules of a turn and of an episode (where a turn ends, the environment's answer, the
observation, the end reasons, the final reward, the placement) are
:class:`textrl.envs.episodes.EpisodeDynamics`, the rules the token-level environments step by: the
collector feeds it each row's sampled turn token by token. The final reward (``env.reward``) is
scored once per batch by :func:`textrl.envs.fast_path.score_completions`, the one scoring path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import wait
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

from textrl.core.checks import check_rollout
from textrl.envs.background_scores import start_scores, taken_scores
from textrl.envs.environment import Environment, PromptTask, check_environment
from textrl.envs.episodes import (
    DONE,
    TURN_REWARDS,
    EpisodeDynamics,
    EpisodeState,
    default_episode_tokens,
)
from textrl.envs.fast_path import (
    NONFINITE_POLICIES,
    PLACEMENTS,
    RewardLike,
    as_reward_fn,
    flag_nonfinite,
    special_ids,
)
from textrl.envs.watchdog import NOTICE_AFTER, CallWatch
from textrl.keys import KEYS
from textrl.rewards import overlapped
from textrl.rewards.background import (
    DEFAULT_CONCURRENCY,
    RewardPool,
    background_functions,
    check_concurrency,
)

Generate = Callable[[Tensor, Tensor], "Tensor | tuple[Tensor, Tensor | None]"]
"""``generate(input_ids int64 [n, L], attention_mask bool [n, L]) -> int64 [n, T]``: one sampled
turn per row (left-padded contexts; a row without EOS runs to ``max_new_tokens``); or ``(tokens,
logp)``, with the float ``[n, T]`` log-probs the tokens were drawn with (None: not computed), which
the rollout keeps at the agent's tokens (``KEYS.generation_log_prob``)."""


def as_environment(env_or_reward: Environment | RewardLike) -> Environment:
    """An environment as it is; a reward spec or callable as the single-turn task it scores."""
    if isinstance(env_or_reward, Environment):
        return env_or_reward
    return PromptTask(None, as_reward_fn(env_or_reward))


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
            tokens together (default :func:`textrl.envs.episodes.default_episode_tokens`).
        reward_placement: ``"last"`` (each turn's reward on its last agent token, the final reward on
            the episode's) or ``"uniform"`` (the episode's score spread over its agent tokens).
        reward_nonfinite: ``"raise"``, ``"zero"`` or ``"drop"`` for a NaN/inf reward.
        env_timeout: seconds after which an environment's ``start`` / ``step`` / final reward call
            is stopped with :class:`textrl.envs.watchdog.EnvTimeout` (None: never); a call is named
            on stderr after ``env_notice_s`` seconds either way (:class:`textrl.envs.watchdog.CallWatch`);
            a call in the background (below) is named but not cut.
        generation_batch_size: the rows the agent generates in one call (its micro-batch); with a
            reward scored in the background, each turn is generated in parts of this many rows and
            the episodes a part ends are scored while the next part generates (None: one part).
        reward_concurrency: the background reward calls in flight at once (an int >= 1), for a
            reward that is ``async`` or declares ``does_io = True`` (:func:`textrl.rewards.overlapped`);
            other rewards are scored in the loop.
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
        env_timeout: float | None = None,
        env_notice_s: float = NOTICE_AFTER,
        generation_batch_size: int | None = None,
        reward_concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        if reward_placement not in PLACEMENTS:
            raise ValueError(f"reward_placement={reward_placement!r}: must be one of {PLACEMENTS}")
        if reward_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"reward_nonfinite={reward_nonfinite!r}: must be one of {NONFINITE_POLICIES}")
        self.env = check_environment(as_environment(env))  # max_turns, stop_strings, ... named if wrong
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
        if generation_batch_size is not None and (isinstance(generation_batch_size, bool)
                                                  or not isinstance(generation_batch_size, int) or generation_batch_size < 1):
            raise ValueError(f"generation_batch_size={generation_batch_size!r}: must be an int >= 1, or None")
        self.generation_batch_size = generation_batch_size
        check_concurrency(reward_concurrency)
        self.pool = RewardPool(reward_concurrency) if overlapped(self.reward_fn) else None
        """Where the final reward runs when it is scored in the background (None: in the loop)."""
        self.background = background_functions(self.reward_fn) if self.pool is not None else {}
        """The reward's functions scored in the background, by name (None: a reward that reports
        components of its own, scored whole in the background)."""
        self.turn = 0
        """The 0-based turn :meth:`run` is generating (its ``generate`` may be called several times a
        turn, one part each: a caller that draws each turn with other weights reads it)."""
        self.dynamics = EpisodeDynamics(self.env, tokenizer=tokenizer, eos_token_ids=self.eos_ids,
                                        max_new_tokens=self.max_new_tokens, max_episode_tokens=self.max_episode_tokens,
                                        reward_nonfinite=reward_nonfinite,
                                        watch=CallWatch(env_timeout, notice_after=env_notice_s))

    # -- the episodes --------------------------------------------------------------------------

    def run(self, generate: Generate, batch: Any, *, timings: dict[str, float] | None = None) -> TensorDict:
        """The rollout TensorDict (docs/design.md, "The rollout TensorDict", "Multi-turn episodes")
        of one episode per row of ``batch`` (a :class:`textrl.envs.prompts.PromptBatch`: left-padded
        ``input_ids`` / ``attention_mask`` ``[B, P]`` and its ``rows``), with ``KEYS.score`` ``[B]``.
        With ``timings``, ``generation`` and ``reward`` (the environment's answers and the final
        reward, or the wait for it) seconds are added to it, and ``reward_calls`` (the seconds the
        background reward calls ran) when the reward is scored in the background.

        A reward scored in the background (:func:`textrl.rewards.overlapped`: ``async``, or
        ``does_io = True``): each turn is generated in parts of ``generation_batch_size`` rows (the
        micro-batches the agent generates in anyway, so the same calls), and the final reward of
        the episodes a part ended starts at once on the runner's :class:`RewardPool` while the next
        part generates; the results are taken in row order when the rollout is assembled, so the
        rollout is the one scoring in the loop gives."""
        from textrl.core.timing import timed

        prompt_ids, prompt_mask = batch.input_ids, batch.attention_mask.bool()
        device = prompt_ids.device
        indices = getattr(batch, "prompt_index", None)
        states = []
        for b in range(prompt_ids.shape[0]):
            index = -1 if indices is None else int(indices[b])
            states.append(self.dynamics.start(dict(batch.rows[b]), index, index))
        prompts = [ids[m].tolist() for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        drawn: list[dict[int, float]] | None = [{} for _ in states]  # position -> the log-prob it was drawn with
        pending: list[tuple[list[int], list[Any]]] = []  # background rewards: (rows, their calls' futures)
        scoring = set()  # rows whose final reward was started
        try:
            for turn in range(self.env.max_turns):
                running = [b for b, s in enumerate(states) if s.end is None]
                if not running:
                    break
                self.turn = turn
                with timed(timings, "generation", device):
                    if turn == 0:  # the prompts as given: the first turn is today's single-turn generate
                        ids, mask = prompt_ids, prompt_mask
                    else:  # every running row's context, padded as one: a part is a slice of it
                        ids, mask = self._contexts([prompts[b] + states[b].tokens for b in running], device)
                for start in range(0, len(running), self._part_rows(len(running))):
                    part = running[start:start + self._part_rows(len(running))]
                    whole = len(part) == len(running)
                    with timed(timings, "generation", device):
                        sampled, logp = split_sampled(generate(ids if whole else ids[start:start + len(part)],
                                                               mask if whole else mask[start:start + len(part)]))
                    with timed(timings, "reward", device):
                        starts = [len(states[b].tokens) for b in part]
                        self._play_turns([states[b] for b in part], sampled)
                        if logp is None:
                            drawn = None
                        elif drawn is not None:
                            keep_drawn([states[b] for b in part], [drawn[b] for b in part], starts, logp)
                        if self.pool is not None:
                            start_scores(self, states, [b for b in part if states[b].end is not None], pending, scoring)
            with timed(timings, "reward", device):
                if self.pool is None:
                    return self._rollout(batch, states, device, drawn)
                start_scores(self, states, [b for b in range(len(states)) if b not in scoring], pending, scoring)
                final = taken_scores(self, states, pending)
                pending = []
                return self._rollout(batch, states, device, drawn, final)
        finally:
            if pending:  # an error on the way: no call is left running behind it
                for _, futures in pending:
                    for future in futures:
                        future.cancel()
                wait([f for _, futures in pending for f in futures])
            if self.pool is not None and timings is not None:
                timings["reward_calls"] = timings.get("reward_calls", 0.0) + self.pool.take_busy()

    def _part_rows(self, running: int) -> int:
        """Rows generated in one call: every running row, or ``generation_batch_size`` of them
        when the final reward is scored in the background."""
        if self.pool is None or self.generation_batch_size is None:
            return max(1, running)
        return self.generation_batch_size

    def _contexts(self, sequences: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
        """Left-padded prompt + episode tokens of each row: int64 / bool ``[n, L]``."""
        width = max(len(seq) for seq in sequences)
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.bool)
        for i, seq in enumerate(sequences):
            ids[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[i, width - len(seq):] = True
        return ids.to(device), mask.to(device)

    def _play_turns(self, states: list[EpisodeState], sampled: Tensor) -> None:
        """Feed each row its sampled turn, token by token, until the rules end the turn (the
        environment answers it, appending any observation) or the episode; tokens sampled after
        that are not taken."""
        if sampled.dim() != 2 or sampled.shape[0] != len(states):
            raise ValueError(f"generate returned {tuple(sampled.shape)} for {len(states)} rows; it must return "
                             "int64 [n, T], one turn per row")
        for s, out in zip(states, sampled.tolist()):
            start = len(s.tokens)
            for token in out:
                if self.dynamics.act(s, token) is not None or s.end is not None:
                    break
            else:
                played = len(s.tokens) - start
                raise ValueError(f"row {s.episode.index}: a turn has no EOS and fewer than max_new_tokens="
                                 f"{self.max_new_tokens} tokens ({played}): the MDP only ends a turn at EOS, a "
                                 "stop string or the cap; generate must return the full turns")

    # -- the rollout ---------------------------------------------------------------------------

    def _rollout(self, batch: Any, states: list[EpisodeState], device: torch.device,
                 drawn: list[dict[int, float]] | None = None,
                 final: tuple[Tensor, dict[str, Tensor], Tensor] | None = None) -> TensorDict:
        b = len(states)
        t = max(1, max(len(s.tokens) for s in states))
        action = torch.full((b, t), self.pad_id, dtype=torch.long)
        agent = torch.zeros((b, t), dtype=torch.bool)
        seen = torch.zeros((b, t), dtype=torch.bool)
        for i, s in enumerate(states):
            n = len(s.tokens)
            action[i, :n] = torch.tensor(s.tokens, dtype=torch.long)
            agent[i, :n] = torch.tensor(s.agent, dtype=torch.bool)
            seen[i, :n] = True
        end = torch.tensor([s.end for s in states], dtype=torch.long)
        last = torch.tensor([s.last_agent for s in states])  # [B]
        at_last = torch.arange(t).unsqueeze(0) == last.unsqueeze(1)  # [B, T]
        terminated = at_last & (end == DONE).unsqueeze(1)
        truncated = at_last & (end != DONE).unsqueeze(1)

        if final is None:
            final, components, _, nonfinite = self.dynamics.final_scores(states, self.reward_fn)
        else:  # scored in the background (:func:`textrl.envs.background_scores.taken_scores`)
            final, components, nonfinite = final
        rewards = torch.stack([self.dynamics.placed(s, final[i], t, self.reward_placement)
                               for i, s in enumerate(states)])  # [B, T]
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
                KEYS.turns: torch.tensor([s.episode.turn for s in states], dtype=torch.long),
                KEYS.end_reason: end,
                KEYS.score: rewards.sum(1),  # [B], as the agents read it: the sum over time of the task reward
            },
            batch_size=[b],
        )
        if drawn is not None:
            logp = torch.zeros((b, t), dtype=torch.float32)
            for i, positions in enumerate(drawn):
                if positions:
                    logp[i, list(positions)] = torch.tensor(list(positions.values()), dtype=torch.float32)
            td.set(KEYS.generation_log_prob, logp)
        if self.reward_nonfinite != "raise":  # NaN/inf rewards counted as 0: flagged, or dropped
            td = flag_nonfinite(td, nonfinite, self.reward_nonfinite)
        return check_rollout(td.to(device))


def split_sampled(out: Tensor | tuple[Tensor, Tensor | None]) -> tuple[Tensor, Tensor | None]:
    """``generate``'s answer as ``(tokens [n, T], logp [n, T] or None)``."""
    if isinstance(out, tuple):
        tokens, logp = out
        if logp is not None and logp.shape != tokens.shape:
            raise ValueError(f"generate returned log-probs of shape {tuple(logp.shape)} for tokens of shape "
                             f"{tuple(tokens.shape)}; return one log-prob per token, or None")
        return tokens, logp
    return out, None


def keep_drawn(states: list[EpisodeState], drawn: list[dict[int, float]], starts: list[int], logp: Tensor) -> None:
    """After a turn: each row's agent tokens from ``starts`` on (the sampled tokens the rules took, in
    order) keep the log-prob ``logp [n, T]`` they were drawn with, by their position in the episode."""
    for s, kept, start, row in zip(states, drawn, starts, logp.float().cpu().tolist()):
        taken = [i for i in range(start, len(s.tokens)) if s.agent[i]]
        kept.update(zip(taken, row))


def episode_turns(td: TensorDict, tokenizer: Any) -> list[list[dict[str, str]]]:
    """Each row's episode after the prompt as turns apart: ``[{"role": "agent" | "environment",
    "text": ...}, ...]``, one entry per stretch of the agent's tokens (``KEYS.mask``) or of the
    environment's (seen, ``KEYS.response_mask``, but not the agent's), decoded with special tokens
    skipped. The joined texts are the episode's completion; the roles are the loss mask's."""
    action = td.get(KEYS.action).cpu()
    agent = td.get(KEYS.mask).cpu().bool()
    seen = td.get(KEYS.response_mask, td.get(KEYS.mask)).cpu().bool()
    rows = []
    for ids, mine, shown in zip(action.tolist(), agent.tolist(), seen.tolist()):
        stretches: list[tuple[bool, list[int]]] = []
        for token, is_agent, is_seen in zip(ids, mine, shown):
            if not is_seen:
                continue
            if stretches and stretches[-1][0] == is_agent:
                stretches[-1][1].append(token)
            else:
                stretches.append((is_agent, [token]))
        rows.append([{"role": "agent" if is_agent else "environment",
                      "text": tokenizer.decode(tokens, skip_special_tokens=True)} for is_agent, tokens in stretches])
    return rows


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


__all__ = ["TURN_REWARDS", "EpisodeRunner", "Generate", "as_environment", "collect_episodes", "episode_turns",
           "default_episode_tokens"]
