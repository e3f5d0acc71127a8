"""The token-level rules of an environment's episodes, shared by every way of running them.

:class:`EpisodeDynamics` takes an episode one agent token at a time (docs/design.md, "Multi-turn
episodes"): a turn ends at EOS, at the token that completes one of the environment's stop strings,
or at a cap; the environment answers it (:func:`textrl.envs.environment.answer_turn`) with a reward,
the end, or an observation appended to the state (:func:`textrl.envs.observations.append_observation`).
It also scores finished episodes with their final reward and places their rewards. The batched
collector (:mod:`textrl.envs.collector`) feeds it the turns ``generate`` sampled; the Gymnasium and
TorchRL environments feed it one action per step. So the three cannot disagree on where a turn or an
episode ends, what is paid where, or how an episode is scored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from textrl.envs.environment import (
    EnvError,
    Environment,
    Episode,
    Turn,
    answer_turn,
    call_env,
    check_environment,
    env_name,
)
from textrl.envs.fast_path import (
    NONFINITE_POLICIES,
    place_score,
    reward_component_names,
    score_completions,
)
from textrl.envs.observations import append_observation, check_append_only
from textrl.envs.prompts.rows import row_messages, split_reference
from textrl.envs.reward_inputs import reward_arguments
from textrl.envs.watchdog import CallWatch
from textrl.keys import END_REASONS

DONE, LENGTH, MAX_TURNS, CONTEXT = (END_REASONS.index(r) for r in ("done", "length", "max_turns", "context"))

TURN_REWARDS = "turn_rewards"
"""Name of the ``("reward_components", name)`` entry of a multi-turn environment: the sum of its
turns' rewards (the final ``reward``'s components sit beside it)."""


def default_episode_tokens(env: Environment, max_new_tokens: int) -> int:
    """The response-side budget of an episode when none is given: ``max_new_tokens`` per turn plus
    ``max_observation_tokens`` (the environment's attribute, else 32) per observation."""
    obs = int(getattr(env, "max_observation_tokens", 32))
    return env.max_turns * max_new_tokens + (env.max_turns - 1) * obs


def steps_env(env: Environment) -> bool:
    """Whether the environment's ``step`` is called: it overrides the base one (which answers every
    turn with done and no reward) or has stop strings."""
    return type(env).step is not Environment.step or bool(env.stop_strings)


def is_multi_turn(env: Environment) -> bool:
    """Whether an episode of ``env`` can hold more than one agent turn (and observations)."""
    return env.max_turns > 1 and steps_env(env)


def check_episode_template(env: Environment, tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
    """``ValueError`` naming ``env`` when it is multi-turn and the chat template of ``tokenizer`` is
    not append-only (:func:`textrl.envs.observations.check_append_only`): its episodes would train
    on contexts the template never renders. Nothing for a single-turn environment."""
    if not is_multi_turn(env):
        return
    try:
        check_append_only(tokenizer, eos_token_ids)
    except ValueError as error:
        raise ValueError(f"environment {env_name(env)!r} is multi-turn and {error}") from None


@dataclass
class EpisodeState:
    """One episode's token-level state (docs/design.md, "Multi-turn episodes")."""

    episode: Episode
    """The text-level state the environment sees (its messages, turn count and scratch state)."""
    prompt_text: str
    """The raw prompt the final reward reads."""
    fields: dict[str, Any]
    """The row's reward fields (everything but ``prompt`` / ``messages``)."""
    tokens: list[int] = field(default_factory=list)
    """Every token after the prompt, the agent's and the observations'."""
    agent: list[bool] = field(default_factory=list)
    """Per token of ``tokens``: True where the agent chose it."""
    turn: list[int] = field(default_factory=list)
    """The current turn's agent tokens."""
    rewards: dict[int, float] = field(default_factory=dict)
    """Position in ``tokens`` -> the turn reward paid there (a turn's last agent token)."""
    steps: int = 0
    """Actions taken."""
    end: int | None = None
    """Index into :data:`textrl.keys.END_REASONS` once the episode is over."""
    bad_reward: bool = False
    """A turn reward was NaN/inf and counted as 0 (``reward_nonfinite`` 'zero' / 'drop')."""

    @property
    def agent_tokens(self) -> list[int]:
        return [t for t, a in zip(self.tokens, self.agent) if a]

    @property
    def last_agent(self) -> int:
        """Position of the last agent token (-1 before the first action)."""
        return max((i for i, a in enumerate(self.agent) if a), default=-1)


class EpisodeDynamics:
    """The token-level rules of an environment's episodes, one action at a time (module docstring).

    Args:
        env: the environment.
        tokenizer: decodes turns and tokenises observations.
        eos_token_ids: the ids that end a turn.
        max_new_tokens: the cap of one agent turn.
        max_episode_tokens: the cap of the response side (agent and observation tokens).
        max_episode_steps: a cap on the episode's actions (``gym.make(..., max_episode_steps=)``);
            reaching it ends the episode as a length cap does.
        reward_nonfinite: what a NaN/inf turn or final reward does: ``"raise"`` (an
            :class:`EnvError` / ``RewardError``), or ``"zero"`` / ``"drop"`` (counted as 0 and
            flagged, for the caller to keep or drop the episode).
        watch: the :class:`textrl.envs.watchdog.CallWatch` around the environment's ``start``,
            ``step`` and final reward (default: named after a minute, never cut).

    A multi-turn environment's turn cut by ``max_new_tokens`` before its EOS is answered like any
    other, with ``episode.truncated`` True during that ``step()``: the environment decides (an
    invalid move, a nudge, ``done``). Set ``answers_truncated_turns = False`` on the environment
    to end such episodes by ``length`` instead, unanswered.
    """

    def __init__(self, env: Environment, *, tokenizer: Any, eos_token_ids: Sequence[int], max_new_tokens: int,
                 max_episode_tokens: int, max_episode_steps: int | None = None,
                 reward_nonfinite: str = "raise", watch: CallWatch | None = None) -> None:
        if not isinstance(max_episode_tokens, int) or max_episode_tokens < 1:
            raise ValueError(f"max_episode_tokens={max_episode_tokens!r}: must be an int >= 1")
        if reward_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"reward_nonfinite={reward_nonfinite!r}: must be one of {NONFINITE_POLICIES}")
        self.reward_nonfinite = reward_nonfinite
        self.env = check_environment(env)
        self.watch = watch or CallWatch()
        self.tokenizer = tokenizer
        self.eos_ids = tuple(int(e) for e in eos_token_ids)  # the first closes a turn cut by a stop string
        self.eos = frozenset(self.eos_ids)
        self.max_new_tokens = max_new_tokens
        self.max_episode_tokens = max_episode_tokens
        self.max_episode_steps = max_episode_steps
        # the base step answers every turn with done and no reward: it is not called (as in the collector)
        self.steps_env = steps_env(env)
        self.multi_turn = is_multi_turn(env)
        check_episode_template(env, tokenizer, self.eos_ids)  # multi-turn: only an append-only template renders its episodes
        self.answers_cut_turns = self.multi_turn and bool(getattr(env, "answers_truncated_turns", True))

    # -- an episode ----------------------------------------------------------------------------

    def start(self, row: dict[str, Any], index: int, where: int | str) -> EpisodeState:
        """A new episode on ``row`` (its index in the prompts, -1 for a row given directly);
        calls ``env.start`` (an :class:`EnvError` naming the environment and row if it raises)."""
        row = split_reference(row, where)  # a closing assistant turn: the row's reference, not the prompt
        messages, text = row_messages(row, where)  # type: ignore[arg-type]
        episode = Episode(row=dict(row), messages=list(messages), index=index, prompt_messages=len(messages))
        with self.watch(f"environment {env_name(self.env)!r} start() on row {index}"):
            call_env(self.env, self.env.start, episode, "start")
        fields = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
        return EpisodeState(episode=episode, prompt_text=text, fields=fields)

    def act(self, s: EpisodeState, token: int) -> float | None:
        """Append the agent's ``token``; end its turn where the rules say so, ask the environment
        and append its observation. Returns the turn reward paid at this token (``None`` when no
        turn was answered here); ``s.end`` is set when the episode is over."""
        s.tokens.append(token)
        s.agent.append(True)
        s.turn.append(token)
        s.steps += 1
        if token in self.eos or self._stopped(s.turn):
            return self._answer(s)
        if len(s.turn) >= self.max_new_tokens and self.answers_cut_turns and not self._out_of_steps(s):
            return self._answer(s, truncated=True)  # the environment answers the cut turn too
        if len(s.turn) >= self.max_new_tokens or self._out_of_steps(s):
            s.end = LENGTH
        elif len(s.tokens) >= self.max_episode_tokens:
            s.end = CONTEXT
        if s.end is not None:
            s.episode.turn += 1
            if self.multi_turn:  # the cut turn is the conversation's last message (not answered)
                s.episode.messages.append({"role": "assistant", "content": self._text(s.turn)})
        return None

    def _text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _stopped(self, turn: list[int]) -> bool:
        stops = self.env.stop_strings
        if not stops:
            return False
        return any(stop in self._text(turn) for stop in stops)

    def _out_of_steps(self, s: EpisodeState) -> bool:
        return self.max_episode_steps is not None and s.steps >= self.max_episode_steps

    def _answer(self, s: EpisodeState, truncated: bool = False) -> float:
        """The environment's answer to the turn that just ended by EOS or a stop string, or was
        cut by ``max_new_tokens`` (``truncated``: ``episode.truncated`` is True during its step)."""
        s.episode.turn += 1
        if not self.steps_env:
            s.end = DONE
            return 0.0
        text = self._text(s.turn)
        s.episode.messages.append({"role": "assistant", "content": text})
        s.episode.truncated = truncated
        label = f"environment {env_name(self.env)!r} step() on row {s.episode.index} (turn {s.episode.turn})"
        try:
            with self.watch(label):
                answer = answer_turn(self.env, s.episode, text)
        finally:
            s.episode.truncated = False
        reward = self._turn_reward(s, answer.reward)
        s.rewards[len(s.tokens) - 1] = s.rewards.get(len(s.tokens) - 1, 0.0) + reward
        if answer.done:
            s.end = DONE
        elif s.episode.turn >= self.env.max_turns:
            s.end = MAX_TURNS
        elif self._out_of_steps(s):
            s.end = LENGTH
        else:
            self._observe(s, answer)
        return float(np.float32(reward))

    def _turn_reward(self, s: EpisodeState, reward: float) -> float:
        if math.isfinite(reward):
            return float(reward)
        if self.reward_nonfinite == "raise":
            raise EnvError(f"environment {env_name(self.env)!r} paid a non-finite turn reward {reward} on row "
                           f"{s.episode.index}; fix the environment (or set reward_nonfinite)")
        s.bad_reward = True
        return 0.0

    def _observe(self, s: EpisodeState, answer: Turn) -> None:
        if append_observation(s, answer.messages(), tokenizer=self.tokenizer, eos_token_ids=self.eos_ids,
                              max_episode_tokens=self.max_episode_tokens, env_id=env_name(self.env)):
            s.turn = []
        else:
            s.end = CONTEXT

    # -- rewards -------------------------------------------------------------------------------

    def component_names(self, reward_fn: Callable[..., Any] | None) -> list[str]:
        """The ``reward_components`` names of a finished episode."""
        names = [] if reward_fn is None else reward_component_names(reward_fn)
        return [TURN_REWARDS, *names] if self.multi_turn else names

    def final_scores(self, states: Sequence[EpisodeState], reward_fn: Callable[..., Any] | None,
                     scored: Sequence[Any] | None = None, fns: Sequence[Callable[..., Any]] | None = None,
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[str], torch.Tensor]:
        """The final reward of finished episodes on their agent tokens, by
        :func:`textrl.envs.fast_path.score_completions`: ``(total float32 [n], components name ->
        float32 [n], decoded agent tokens, bool [n] rows with a NaN/inf turn or final reward counted
        as 0 under reward_nonfinite 'zero' / 'drop')``; zeros and no components without a reward. Rows with ``"messages"`` and multi-turn episodes are conversational
        (TRL's convention: the rewards get the prompt's messages, and a multi-turn episode's
        messages after the prompt as its completion); each kind is scored in its own call, so a
        row's score never depends on the rows beside it. Multi-turn episodes also report the sum
        of their turn rewards (``TURN_REWARDS``). ``scored``: the answers of :meth:`reward_calls`'s
        calls, in their order, where the caller ran them (in the background); else they run here,
        with ``fns`` (one reward per call, as :meth:`reward_calls` takes them) where given."""
        n = len(states)
        completions = self.tokenizer.batch_decode([s.agent_tokens for s in states], skip_special_tokens=True)
        total, components = torch.zeros(n), {}
        bad = torch.tensor([s.bad_reward for s in states], dtype=torch.bool)
        if reward_fn is not None:
            calls = self.reward_calls(states, reward_fn, completions, fns)
            answers = [call() for _, call in calls] if scored is None else list(scored)
            for (rows, _), scores in zip(calls, answers):
                index = torch.tensor(rows)
                total[index] = scores.total
                if scores.nonfinite is not None:
                    bad[index] |= scores.nonfinite
                for name, value in scores.components.items():
                    components.setdefault(name, torch.zeros(n))[index] = value
        if self.multi_turn:
            turn_sums = torch.stack([turn_reward_row(s, max(1, len(s.tokens))).sum() for s in states])
            components = {TURN_REWARDS: turn_sums, **components}
        return total, components, completions, bad

    def _kinds(self, states: Sequence[EpisodeState]) -> dict[bool, list[int]]:
        """The rows of each kind (conversational or not), each kind scored in a call of its own."""
        kinds: dict[bool, list[int]] = {}
        for i, s in enumerate(states):
            kinds.setdefault(self.multi_turn or "messages" in s.episode.row, []).append(i)
        return kinds

    def reward_calls(self, states: Sequence[EpisodeState], reward_fn: Callable[..., Any],
                     completions: Sequence[str] | None = None, fns: Sequence[Callable[..., Any]] | None = None,
                     ) -> list[tuple[list[int], Callable[[], Any]]]:
        """The final reward's calls over finished episodes, one per kind of row (plain,
        conversational): ``(the rows' indices in states, a call -> Scores)``. Everything that reads
        the tokenizer (the decoded completions) is done here, so a call may run in another thread.
        ``fns``: the reward each call scores with, in their order (default ``reward_fn``)."""
        if completions is None:
            completions = self.tokenizer.batch_decode([s.agent_tokens for s in states], skip_special_tokens=True)
        calls = []
        for k, (conversational, rows) in enumerate(self._kinds(states).items()):
            fn = reward_fn if fns is None else fns[k]
            where = sorted({states[i].episode.index for i in rows})
            shown = ", ".join(map(str, where[:8])) + (" ..." if len(where) > 8 else "")
            label = f"environment {env_name(self.env)!r} reward on row(s) {shown}"
            part, texts = [states[i] for i in rows], [completions[i] for i in rows]

            def call(label: str = label, part: list[EpisodeState] = part, texts: list[str] = texts,
                     conversational: bool = conversational, fn: Callable[..., Any] = fn) -> Any:
                with self.watch(label):
                    return self._score(part, fn, conversational, texts)

            calls.append((rows, call))
        return calls

    def _score(self, states: Sequence[EpisodeState], reward_fn: Callable[..., Any], conversational: bool,
               texts: Sequence[str] | None = None) -> Any:
        return score_completions(reward_fn, **self._score_inputs(states, conversational, texts),
                                 nonfinite=self.reward_nonfinite)

    def _score_inputs(self, states: Sequence[EpisodeState], conversational: bool,
                      texts: Sequence[str] | None = None) -> dict[str, Any]:
        """:func:`score_completions`'s arguments for finished episodes (all but the reward and the
        nonfinite policy)."""
        ids = [s.agent_tokens for s in states]
        width = max(1, max(len(t) for t in ids))
        tokens = torch.zeros((len(ids), width), dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.bool)
        for i, t in enumerate(ids):
            tokens[i, : len(t)] = torch.tensor(t, dtype=torch.long)
            mask[i, : len(t)] = True
        names = list(dict.fromkeys(k for s in states for k in s.fields))
        return dict(
            prompts=[s.prompt_text for s in states], responses=tokens, mask=mask, tokenizer=self.tokenizer,
            truncated=torch.tensor([s.end != DONE for s in states]),
            fields={k: [s.fields.get(k) for s in states] for k in names},
            conversations=[s.episode.messages[: s.episode.prompt_messages] for s in states] if conversational else None,
            completion_messages=[s.episode.completions for s in states] if self.multi_turn else None,
            texts=texts,
        )

    def reward_arguments(self, states: Sequence[EpisodeState]) -> list[tuple[list[Any], list[Any], dict[str, Any]]]:
        """What the final reward's calls over finished episodes (:meth:`reward_calls`, one per kind
        of row, in their order) call each reward function with: ``(prompts, completions, batch
        fields)``, built here (the tokenizer read in this thread)."""
        completions = self.tokenizer.batch_decode([s.agent_tokens for s in states], skip_special_tokens=True)
        out = []
        for conversational, rows in self._kinds(states).items():
            inputs = self._score_inputs([states[i] for i in rows], conversational, [completions[i] for i in rows])
            out.append(reward_arguments(**inputs)[:3])
        return out

    def placed(self, s: EpisodeState, final: torch.Tensor, width: int, placement: str) -> torch.Tensor:
        """Per-token rewards float32 ``[width]`` of a finished episode (as the collector places
        them): single turn, the score placed by :func:`textrl.envs.place_score` on the agent
        tokens; multi-turn, ``"last"`` puts each turn reward on its turn's last agent token and the
        final reward on the episode's, ``"uniform"`` spreads their sum over the agent tokens."""
        turn = turn_reward_row(s, width)
        agent = torch.zeros(width, dtype=torch.bool)
        agent[: len(s.agent)] = torch.tensor(s.agent, dtype=torch.bool)
        final = final.reshape(1).to(torch.float32)
        if not self.multi_turn:
            return place_score(turn.sum().reshape(1) + final, agent.unsqueeze(0), placement)[0]
        if placement == "uniform":
            return torch.where(agent, (turn.sum() + final) / agent.sum(), 0.0)
        return turn.scatter_add(0, torch.tensor([s.last_agent]), final)


def turn_reward_row(s: EpisodeState, width: int) -> torch.Tensor:
    """float32 ``[width]``: each turn reward of ``s`` at its position, 0 elsewhere."""
    row = torch.zeros(width, dtype=torch.float32)
    for pos, value in s.rewards.items():
        row[pos] = value
    return row


__all__ = ["CONTEXT", "DONE", "LENGTH", "MAX_TURNS", "TURN_REWARDS", "EpisodeDynamics", "EpisodeState",
           "check_episode_template", "default_episode_tokens", "is_multi_turn", "steps_env", "turn_reward_row"]
