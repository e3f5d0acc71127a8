"""``TokenMDPEnv``: text generation as a token-level Gymnasium MDP (docs/design.md, "The token MDP",
"Multi-turn episodes").

A state is ``prompt + response tokens so far``; an action is the next token id. Without an
environment (``env=None``) an episode is one answer to a prompt: it ends with
``terminated=True`` when the action is EOS and ``truncated=True`` after ``max_new_tokens``
actions without EOS, and the task reward (a reward spec such as ``"think_format,tag_count"`` or
any reward callable) is paid on the final step only.

With an environment (:class:`textrl.envs.Environment`, or an id for
:func:`textrl.envs.registry.make_env`) this env is the token-by-token specification of its
episodes. The agent's **turn** ends at EOS (an action), at the token that completes one of
``env.stop_strings`` (in the turn's text decoded with ``skip_special_tokens=True``), or after
``max_new_tokens`` tokens (the episode ends: ``"length"``). A turn that ended by EOS or a stop
string goes to ``env.step(episode, text)``; its :class:`~textrl.envs.Turn` reward is the step
reward of the turn's last token. Unless the turn ended the episode (``"done"``) or was the
``max_turns``-th (``"max_turns"``), the observation's tokens
(:func:`textrl.envs.observations.observation_ids`) are appended to the state in the same step
(they are not actions). An observation that would leave no room for one more agent token within
``max_episode_tokens``, or a turn cut by that budget, ends the episode (``"context"``). At the
end the environment's final ``reward`` is scored on the episode's agent tokens and added to the
last step's reward. Agent tokens are never decoded and re-encoded: the state holds the sampled
ids. A single-turn task (``env=None`` or a :class:`~textrl.envs.PromptTask`) is the case whose
first answer ends the episode, exactly as without an environment.

Observation (a ``Dict`` of fixed-size arrays, so it batches under vector envs):

* ``"prompt_ids"``: int64 ``[max_prompt_length]``, the chat-templated prompt, left-padded
  with ``pad_token_id``;
* ``"prompt_mask"``: int8 ``[max_prompt_length]`` (``MultiBinary``), 1 on prompt tokens;
* ``"response_ids"``: int64 ``[max_episode_tokens]``, every token after the prompt (the agent's
  and the observations'), right-padded with ``pad_token_id``;
* ``"agent_mask"``: int8 ``[max_episode_tokens]`` (``MultiBinary``), 1 on the agent's tokens;
* ``"response_length"``: ``Discrete(max_episode_tokens + 1)``, how many response tokens so far.

``max_episode_tokens`` defaults to ``max_new_tokens`` for a single turn.

``reward_placement``: a step-by-step MDP cannot know the score before the episode ends, so the
step rewards always follow ``"last"``: a turn's reward on its last token, the final reward on the
episode's last token. ``"uniform"`` (the score spread over the agent tokens) needs the whole
episode; the final step's ``info["per_token_rewards"]`` (float32 ``[max_episode_tokens]``, 0 off
the agent's tokens) holds the per-token rewards of either placement, equal to the fast path's
(:func:`textrl.envs.rollout_from_responses`) and the batched collector's
(:mod:`textrl.envs.collector`).

``gym.make(id, max_episode_steps=N)``: Gymnasium's ``TimeLimit`` would cut the episode without
a score; the ids registered (:mod:`textrl.envs.gym_ids`) carry :class:`~textrl.envs.gym_ids.TimeLimitCap`, which hands ``N`` to the env, so
the N-th action ends the episode as the env's own caps do (truncated, ``"length"``, scored).

Cost per step is O(1) in the prefix without stop strings (the env appends ids); with stop strings
the current turn is decoded once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces
from gymnasium.envs.registration import EnvSpec
from gymnasium.error import ResetNeeded

from textrl.envs.environment import Environment
from textrl.envs.episodes import (
    DONE,
    EpisodeDynamics,
    EpisodeState,
    default_episode_tokens,
    turn_reward_row,
)
from textrl.envs.fast_path import DEFAULT_REWARD, PLACEMENTS, RewardLike
from textrl.envs.prompts.table import TokenMDPSetup
from textrl.envs.registry import environment_and_rows
from textrl.keys import END_REASONS

ENV_ID = "textrl/TokenMDP-v0"


def check_action(action: Any, vocab_size: int) -> int:
    """``action`` as a token id in ``[0, vocab_size)``; ``ValueError`` naming both otherwise."""
    value = action
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    elif isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() <= 1:
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(
            f"action {action!r} is not an integer token id; pass an int in [0, {vocab_size}) "
            f"(vocab_size={vocab_size})"
        )
    if not 0 <= int(value) < vocab_size:
        raise ValueError(
            f"action {int(value)} is outside the vocabulary: token ids are in [0, {vocab_size}) "
            f"(vocab_size={vocab_size})"
        )
    return int(value)


# --------------------------------------------------------------------------------------------
# the Gymnasium environment


class TokenMDPEnv(TokenMDPSetup, gym.Env):
    """One episode per reset, one token per step; see the module docstring for the MDP.

    All arguments are optional: ``TokenMDPEnv()`` uses the tiny offline ChatML tokenizer, the
    built-in digits prompts and the reward ``"think_format,tag_count"``.

    Args:
        tokenizer: a Hugging Face tokenizer (default: :func:`textrl.models.build_tiny_tokenizer`).
        prompts: list of str, list of dict rows (``"prompt"`` or ``"messages"`` plus fields such
            as ``"answer"`` that reach the rewards), an indexable dataset, or a source string
            such as ``"builtin:digits"`` (default: the built-in digits task, or ``env.rows()``).
        reward: a reward spec string for :func:`textrl.rewards.parse_reward_spec` or a callable
            (default ``"think_format,tag_count"``); only without ``env``.
        max_new_tokens: actions per agent turn before the episode is truncated.
        max_prompt_length: size of the prompt arrays; longer prompts raise (``truncate_prompt=
            "error"``) or keep their last tokens with a warning (``"left"``).
        reward_placement: ``"last"`` or ``"uniform"``, for ``info["per_token_rewards"]``.
        render_mode: ``None`` or ``"ansi"`` (``render()`` returns the prompt and response text).
        apply_chat_template: wrap prompts in the tokenizer's chat template (default: when it
            has one).
        eos_token_id, pad_token_id: override the tokenizer's (pad falls back to EOS).
        env: an :class:`textrl.envs.Environment` or an id / spec for
            :func:`textrl.envs.registry.make_env`; None: the single-turn task of ``prompts`` and
            ``reward``.
        max_episode_tokens: the cap of the response side, agent and observation tokens (default:
            :func:`textrl.envs.collector.default_episode_tokens`, ``max_new_tokens`` for a single
            turn); the size of ``"response_ids"``.
        max_episode_steps: a cap on the episode's actions (ends it truncated, ``"length"``,
            scored); ``gym.make(id, max_episode_steps=N)`` sets it through :class:`TimeLimitCap`.

    ``info`` of the final step: ``"prompt"``, ``"response"`` (the agent's tokens decoded),
    ``"response_length"``, ``"score"``, ``"reward_components"``, ``"per_token_rewards"``,
    ``"turns"``, ``"end_reason"`` (a name in :data:`textrl.keys.END_REASONS`) and ``"messages"``
    (the conversation as the environment saw it). A step that ended a turn without ending the
    episode has ``info = {"turn": n, "turn_reward": r}``; other steps ``{}``.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(
        self,
        tokenizer: Any = None,
        prompts: Any = None,
        reward: RewardLike | None = None,
        max_new_tokens: int = 32,
        max_prompt_length: int = 64,
        reward_placement: str = "last",
        render_mode: str | None = None,
        truncate_prompt: str = "error",
        apply_chat_template: bool | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        env: Environment | str | None = None,
        max_episode_tokens: int | None = None,
        max_episode_steps: int | None = None,
    ) -> None:
        self._check_modes(reward_placement, render_mode)
        task, rows = environment_and_rows(env, prompts, reward)
        self._setup_mdp(
            tokenizer=tokenizer,
            prompts=rows,
            reward=DEFAULT_REWARD if task.reward is None else task.reward,
            max_new_tokens=max_new_tokens,
            max_prompt_length=max_prompt_length,
            truncate_prompt=truncate_prompt,
            apply_chat_template=apply_chat_template,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
        if task.reward is None:
            self.reward_fn = None
        self.task = task
        budget = default_episode_tokens(task, max_new_tokens) if max_episode_tokens is None else max_episode_tokens
        self.dynamics = EpisodeDynamics(task, tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids,
                                        max_new_tokens=max_new_tokens, max_episode_tokens=budget)
        self.max_episode_tokens = budget
        self.max_episode_steps = max_episode_steps
        self.reward_placement = reward_placement
        self.render_mode = render_mode
        # gym.make replaces this; a directly built env still gets a spec that re-makes it (with
        # its own arguments), which check_env needs to test the other render modes
        self.spec = EnvSpec(
            ENV_ID,
            entry_point="textrl.envs.token_mdp:TokenMDPEnv",
            kwargs={
                "tokenizer": tokenizer,
                "prompts": prompts,
                "reward": reward,
                "max_new_tokens": max_new_tokens,
                "max_prompt_length": max_prompt_length,
                "reward_placement": reward_placement,
                "truncate_prompt": truncate_prompt,
                "apply_chat_template": apply_chat_template,
                "eos_token_id": eos_token_id,
                "pad_token_id": pad_token_id,
                "env": env,
                "max_episode_tokens": max_episode_tokens,
                "max_episode_steps": max_episode_steps,
            },
        )
        self._make_spaces(max_prompt_length, budget)
        self._init_state(max_prompt_length, budget)

    @classmethod
    def _check_modes(cls, reward_placement: str, render_mode: str | None) -> None:
        if reward_placement not in PLACEMENTS:
            raise ValueError(f"reward_placement={reward_placement!r}: must be one of {PLACEMENTS}")
        if render_mode is not None and render_mode not in cls.metadata["render_modes"]:
            raise ValueError(
                f"render_mode={render_mode!r}: must be None or one of {cls.metadata['render_modes']}"
            )

    def _make_spaces(self, max_prompt_length: int, budget: int) -> None:
        """The observation space (prompt arrays ``[max_prompt_length]``, response arrays
        ``[budget]``) and the action space (a token id)."""
        ids = spaces.Box(0, self.vocab_size - 1, shape=(max_prompt_length,), dtype=np.int64)
        self.observation_space = spaces.Dict(
            {
                "prompt_ids": ids,
                "prompt_mask": spaces.MultiBinary(max_prompt_length),
                "response_ids": spaces.Box(0, self.vocab_size - 1, shape=(budget,), dtype=np.int64),
                "agent_mask": spaces.MultiBinary(budget),
                "response_length": spaces.Discrete(budget + 1),
            }
        )
        self.action_space = spaces.Discrete(self.vocab_size)

    def _init_state(self, max_prompt_length: int, budget: int) -> None:
        """The episode buffers (prompt ``[max_prompt_length]``, response ``[budget]``), before
        any reset."""
        self._prompt_ids = np.full(max_prompt_length, self.pad_token_id, dtype=np.int64)
        self._prompt_mask = np.zeros(max_prompt_length, dtype=np.int8)
        self._response = np.full(budget, self.pad_token_id, dtype=np.int64)
        self._agent = np.zeros(budget, dtype=np.int8)
        self._length = 0
        self._done: bool | None = None  # None: never reset
        self._state: EpisodeState | None = None
        self._prompt_text = ""
        self._fields: dict[str, Any] = {}
        self._prompt_index: int | None = None
        self._final_info: dict[str, Any] = {}

    @property
    def max_episode_steps(self) -> int | None:
        """The cap on an episode's actions (None: only the env's own caps)."""
        return self.dynamics.max_episode_steps

    @max_episode_steps.setter
    def max_episode_steps(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"max_episode_steps={value!r}: must be None or an int >= 1")
        self.dynamics.max_episode_steps = value

    # ---------------------------------------------------------------------------------------

    def _observation(self) -> dict[str, Any]:
        return {
            "prompt_ids": self._prompt_ids.copy(),
            "prompt_mask": self._prompt_mask.copy(),
            "response_ids": self._response.copy(),
            "agent_mask": self._agent.copy(),
            "response_length": np.int64(self._length),
        }

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Start an episode on a prompt drawn with ``self.np_random``.

        ``options`` may hold ``"prompt_index"`` (an index into the prompts) or ``"prompt"``
        (a str or a dict row, tokenised on the fly).
        """
        super().reset(seed=seed)
        options = options or {}
        if "prompt" in options:
            row = options["prompt"]
            row = {"prompt": row} if isinstance(row, str) else dict(row)
            index = None
            ids = self.prompts.encode(row, "options['prompt']")
            where: int | str = "options['prompt']"
        else:
            if "prompt_index" in options:
                index = int(options["prompt_index"])
            else:
                index = int(self.np_random.integers(len(self.prompts)))
            ids = self.prompts.ids(index)
            row, where = self.prompts.row(index), index
        state = self.dynamics.start(row, -1 if index is None else index, where)
        p = self.max_prompt_length
        self._prompt_ids[:] = self.pad_token_id
        self._prompt_ids[p - ids.size :] = ids
        self._prompt_mask[:] = 0
        self._prompt_mask[p - ids.size :] = 1
        self._response[:] = self.pad_token_id
        self._agent[:] = 0
        self._length = 0
        self._done = False
        self._state = state
        self._prompt_index = index
        self._prompt_text = state.prompt_text
        self._fields = state.fields
        self._final_info = {}
        return self._observation(), {"prompt_index": -1 if index is None else index, "prompt": state.prompt_text}

    def step(self, action: Any) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """Append the token ``action`` (and, when it ended a turn, the environment's observation);
        a turn's last token pays its reward, the final step also the final reward and fills
        ``info``."""
        if self._done is None or self._state is None:
            raise ResetNeeded("TokenMDPEnv.step() called before reset(); call reset() first")
        if self._done:
            raise ResetNeeded(
                "TokenMDPEnv.step() called after the episode ended (EOS or max_new_tokens); "
                "call reset() to start a new episode"
            )
        token = check_action(action, self.vocab_size)
        s = self._state
        before = len(s.tokens)
        turn_reward = self.dynamics.act(s, token)
        self._response[before : len(s.tokens)] = s.tokens[before:]
        self._agent[before : len(s.tokens)] = s.agent[before:]
        self._length = len(s.tokens)
        if s.end is None:
            info = {} if turn_reward is None else {"turn": s.episode.turn, "turn_reward": turn_reward}
            return self._observation(), turn_reward or 0.0, False, False, info
        self._done = True
        reward, info = self._finish(s)
        return self._observation(), reward, s.end == DONE, s.end != DONE, info

    def _finish(self, s: EpisodeState) -> tuple[float, dict[str, Any]]:
        """Score the finished episode as the fast path / collector do (a one-row batch): the
        final step's reward and ``info``."""
        final, components, completions, _ = self.dynamics.final_scores([s], self.reward_fn)
        width = self.max_episode_tokens
        per_token = self.dynamics.placed(s, final[0], width, self.reward_placement)  # [W]
        turn = turn_reward_row(s, width)
        if self.dynamics.multi_turn:
            score = float(per_token.sum())
            last = turn[s.last_agent] + final[0]  # the "last" placement's reward at the last token
        else:
            score = last = float(turn.sum() + final[0])
        self._final_info = {
            "prompt": s.prompt_text,
            "response": completions[0],
            "response_length": len(s.tokens),
            "score": score,
            "reward_components": {k: float(v[0]) for k, v in components.items()},
            "per_token_rewards": per_token.numpy().astype(np.float32),
            "turns": s.episode.turn,
            "end_reason": END_REASONS[s.end],  # type: ignore[index]
            "messages": [dict(m) for m in s.episode.messages],
        }
        return float(last), dict(self._final_info)

    def render(self) -> str | None:
        """``"ansi"``: the prompt, the response so far (decoded) and, at the end, the score."""
        if self.render_mode != "ansi":
            return None
        response = self.tokenizer.decode(
            self._response[: self._length].tolist(), skip_special_tokens=False
        )
        lines = [f"prompt: {self._prompt_text}", f"response ({self._length} tokens): {response}"]
        if self._final_info:
            parts = ", ".join(
                f"{k}={v:g}" for k, v in self._final_info["reward_components"].items()
            )
            lines.append(f"score: {self._final_info['score']:g} ({parts}); "
                         f"{self._final_info['turns']} turn(s), ended by {self._final_info['end_reason']}")
        return "\n".join(lines) + "\n"


__all__ = ["ENV_ID", "TokenMDPEnv", "check_action"]
