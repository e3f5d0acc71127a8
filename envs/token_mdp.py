"""``TokenMDPEnv``: text generation as a token-level Gymnasium MDP (docs/design.md, "The token MDP").

A state is ``prompt + response tokens so far``; an action is the next token id; the episode
ends with ``terminated=True`` when the action is EOS and ``truncated=True`` after
``max_new_tokens`` actions without EOS. The task reward (a reward spec such as
``"think_format,tag_count"`` or any reward callable) is paid on the final step only.

Observation (a ``Dict`` of fixed-size arrays, so it batches under vector envs):

* ``"prompt_ids"``: int64 ``[max_prompt_length]``, the chat-templated prompt, left-padded
  with ``pad_token_id``;
* ``"prompt_mask"``: int8 ``[max_prompt_length]`` (``MultiBinary``), 1 on prompt tokens;
* ``"response_ids"``: int64 ``[max_new_tokens]``, the actions so far, right-padded with
  ``pad_token_id``;
* ``"response_length"``: ``Discrete(max_new_tokens + 1)``, how many actions were taken.

``reward_placement``: a step-by-step MDP cannot know the score before the episode ends, so the
step reward is always 0 until the final step, which pays the whole score (``"last"``, the
DESIGN default). ``"uniform"`` (score / T on every valid token) is a credit assignment that
needs the full response; it is produced by the fast path (:func:`textrl.envs.rollout_from_responses`),
and the final step's ``info["per_token_rewards"]`` (float32 ``[max_new_tokens]``, 0 after the
last valid token) holds the per-token rewards of either placement, equal to the fast path's.

Cost per step is O(1) in the prefix: the env holds token ids and appends one; it never
re-tokenises text (the response is decoded once, at the end, for the rewards and ``info``).
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
from textrl.envs.fast_path import (
    DEFAULT_REWARD,
    PLACEMENTS,
    RewardLike,
    place_score,
    score_completions,
)
from textrl.envs.prompt_table import TokenMDPSetup, row_messages

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


class TokenMDPEnv(TokenMDPSetup, gym.Env):
    """One prompt per episode, one token per step; see the module docstring for the MDP.

    All arguments are optional: ``TokenMDPEnv()`` uses the tiny offline ChatML tokenizer, the
    built-in digits prompts and the reward ``"think_format,tag_count"``.

    Args:
        tokenizer: a Hugging Face tokenizer (default: :func:`textrl.models.build_tiny_tokenizer`).
        prompts: list of str, list of dict rows (``"prompt"`` or ``"messages"`` plus fields such
            as ``"answer"`` that reach the rewards), an indexable dataset, or a source string
            such as ``"builtin:digits"`` (default: the built-in digits task).
        reward: a reward spec string for :func:`textrl.rewards.parse_reward_spec` or a callable.
        max_new_tokens: actions per episode before truncation.
        max_prompt_length: size of the prompt arrays; longer prompts raise (``truncate_prompt=
            "error"``) or keep their last tokens with a warning (``"left"``).
        reward_placement: ``"last"`` or ``"uniform"``, for ``info["per_token_rewards"]``.
        render_mode: ``None`` or ``"ansi"`` (``render()`` returns the prompt and response text).
        apply_chat_template: wrap prompts in the tokenizer's chat template (default: when it
            has one).
        eos_token_id, pad_token_id: override the tokenizer's (pad falls back to EOS).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(
        self,
        tokenizer: Any = None,
        prompts: Any = None,
        reward: RewardLike = DEFAULT_REWARD,
        max_new_tokens: int = 32,
        max_prompt_length: int = 64,
        reward_placement: str = "last",
        render_mode: str | None = None,
        truncate_prompt: str = "error",
        apply_chat_template: bool | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        if reward_placement not in PLACEMENTS:
            raise ValueError(f"reward_placement={reward_placement!r}: must be one of {PLACEMENTS}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(
                f"render_mode={render_mode!r}: must be None or one of {self.metadata['render_modes']}"
            )
        self._setup_mdp(
            tokenizer=tokenizer,
            prompts=prompts,
            reward=reward,
            max_new_tokens=max_new_tokens,
            max_prompt_length=max_prompt_length,
            truncate_prompt=truncate_prompt,
            apply_chat_template=apply_chat_template,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
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
            },
        )

        ids = spaces.Box(0, self.vocab_size - 1, shape=(max_prompt_length,), dtype=np.int64)
        self.observation_space = spaces.Dict(
            {
                "prompt_ids": ids,
                "prompt_mask": spaces.MultiBinary(max_prompt_length),
                "response_ids": spaces.Box(
                    0, self.vocab_size - 1, shape=(max_new_tokens,), dtype=np.int64
                ),
                "response_length": spaces.Discrete(max_new_tokens + 1),
            }
        )
        self.action_space = spaces.Discrete(self.vocab_size)

        self._prompt_ids = np.full(max_prompt_length, self.pad_token_id, dtype=np.int64)
        self._prompt_mask = np.zeros(max_prompt_length, dtype=np.int8)
        self._response = np.full(max_new_tokens, self.pad_token_id, dtype=np.int64)
        self._length = 0
        self._done: bool | None = None  # None: never reset
        self._prompt_text = ""
        self._fields: dict[str, Any] = {}
        self._prompt_index: int | None = None
        self._final_info: dict[str, Any] = {}

    # ---------------------------------------------------------------------------------------

    def _observation(self) -> dict[str, Any]:
        return {
            "prompt_ids": self._prompt_ids.copy(),
            "prompt_mask": self._prompt_mask.copy(),
            "response_ids": self._response.copy(),
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
            text = row_messages(row, "options['prompt']")[1]  # type: ignore[arg-type]
            fields = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
        else:
            if "prompt_index" in options:
                index = int(options["prompt_index"])
            else:
                index = int(self.np_random.integers(len(self.prompts)))
            ids = self.prompts.ids(index)
            text = self.prompts.text(index)
            fields = self.prompts.fields(index)
        p = self.max_prompt_length
        self._prompt_ids[:] = self.pad_token_id
        self._prompt_ids[p - ids.size :] = ids
        self._prompt_mask[:] = 0
        self._prompt_mask[p - ids.size :] = 1
        self._response[:] = self.pad_token_id
        self._length = 0
        self._done = False
        self._prompt_index = index
        self._prompt_text = text
        self._fields = fields
        self._final_info = {}
        return self._observation(), {"prompt_index": -1 if index is None else index, "prompt": text}

    def step(self, action: Any) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """Append the token ``action``; the final step pays the task reward and fills ``info``."""
        if self._done is None:
            raise ResetNeeded("TokenMDPEnv.step() called before reset(); call reset() first")
        if self._done:
            raise ResetNeeded(
                "TokenMDPEnv.step() called after the episode ended (EOS or max_new_tokens); "
                "call reset() to start a new episode"
            )
        token = check_action(action, self.vocab_size)
        self._response[self._length] = token
        self._length += 1
        terminated = token in self.eos_token_ids
        truncated = not terminated and self._length == self.max_new_tokens
        if not (terminated or truncated):
            return self._observation(), 0.0, False, False, {}
        self._done = True
        info = self._finish(truncated)
        return self._observation(), float(info["score"]), terminated, truncated, info

    def _finish(self, truncated: bool) -> dict[str, Any]:
        """Score the finished response exactly as the fast path does (one-row batch)."""
        responses = torch.from_numpy(self._response.copy()).unsqueeze(0)  # [1, T]
        mask = torch.arange(self.max_new_tokens).unsqueeze(0) < self._length  # [1, T]
        scores = score_completions(
            self.reward_fn,
            [self._prompt_text],
            responses,
            mask,
            tokenizer=self.tokenizer,
            truncated=torch.tensor([truncated]),
            fields={k: [v] for k, v in self._fields.items()},
        )
        per_token = place_score(scores.total, mask, self.reward_placement)[0]  # [T]
        self._final_info = {
            "prompt": self._prompt_text,
            "response": scores.completions[0],
            "response_length": self._length,
            "score": float(scores.total[0]),
            "reward_components": {k: float(v[0]) for k, v in scores.components.items()},
            "per_token_rewards": per_token.numpy().astype(np.float32),
        }
        return dict(self._final_info)

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
            lines.append(f"score: {self._final_info['score']:g} ({parts})")
        return "\n".join(lines) + "\n"


def register() -> None:
    """Register ``textrl/TokenMDP-v0`` with Gymnasium (idempotent)."""
    if ENV_ID not in gym.registry:
        gym.register(id=ENV_ID, entry_point="textrl.envs.token_mdp:TokenMDPEnv")


__all__ = ["ENV_ID", "TokenMDPEnv", "check_action", "register"]
