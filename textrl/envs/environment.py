"""Task environments: the dynamics of a text episode, above the token MDP.

The token MDP (docs/design.md, "The token MDP") has the agent's tokens as actions. An
:class:`Environment` says what happens between the agent's turns: when the agent ends its turn
(EOS, or one of the environment's ``stop_strings``), the environment reads the turn's text and
answers with a :class:`Turn`: a reward for the turn, whether the episode is over, and otherwise
an observation (a tool result, a user or game message) whose tokens are appended to the state and
never trained on. A single-turn task (prompts plus a reward) is the environment whose first answer
always ends the episode: :class:`PromptTask`.

An environment also carries its task instances (:meth:`Environment.rows`, with a held-out split),
its final reward (``reward``: a reward spec or a callable, scoring the finished episode in a
batch), its maximum reward where known, and an optional warm-up source for the supervised format
warm-up. Environments are registered by id (:mod:`textrl.envs.registry`).

Writing one: subclass :class:`Environment`, give ``id``, ``description``, ``max_turns`` and
:meth:`~Environment.rows`, and answer turns in :meth:`~Environment.step`::

    class Echo(Environment):
        id = "echo"
        max_turns = 2

        def rows(self):
            return [{"prompt": f"Say {w}, then say it again.", "word": w} for w in ("a", "b")]

        def step(self, episode, completion):
            said = completion.strip() == episode.row["word"]
            if episode.turn == 1:
                return Turn(observation="Again.", reward=float(said))
            return Turn(reward=float(said), done=True)

Nothing here imports torch models or the agents; the batched collector that runs episodes is
:mod:`textrl.envs.collector`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

Message = dict[str, str]
"""``{"role": ..., "content": ...}``, as in a chat template."""


@dataclass
class Turn:
    """The environment's answer to one agent turn.

    ``reward`` is paid for this turn (on its last agent token); ``done`` ends the episode; otherwise
    ``observation`` (a string, sent as one ``user`` message, or a list of messages such as
    ``[{"role": "tool", "content": "42"}]``) is appended to the conversation, tokenised once as the
    chat template renders it after the history. ``info`` is kept for the episode's record.
    """

    reward: float = 0.0
    done: bool = False
    observation: str | list[Message] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def messages(self) -> list[Message]:
        """The observation as messages (``[]`` when there is none)."""
        if self.observation is None:
            return []
        if isinstance(self.observation, str):
            return [{"role": "user", "content": self.observation}]
        return [dict(m) for m in self.observation]


@dataclass
class Episode:
    """One episode's text-level state, as the environment sees it.

    ``row`` is the task instance; ``messages`` the conversation so far (the prompt's messages, then
    ``assistant`` messages holding the decoded agent turns and the environment's observations);
    ``turn`` the number of agent turns answered so far (1 inside the first :meth:`Environment.step`);
    ``state`` is the environment's own scratch space for the episode (a guessing game's secret,
    say), filled by :meth:`Environment.start`.
    """

    row: dict[str, Any]
    messages: list[Message]
    turn: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    index: int = -1
    """The row's index in the environment's rows (-1: a row given directly)."""
    prompt_messages: int = 0
    """How many of ``messages`` are the prompt's."""
    truncated: bool = False
    """Inside :meth:`Environment.step`: whether the turn being answered was cut by the per-turn
    length cap (``max_new_tokens``) before its EOS. Such a turn still reaches the environment,
    which decides what to answer (an invalid move, a nudge, or ``done``)."""

    @property
    def completions(self) -> list[Message]:
        """The messages after the prompt: every agent turn and observation so far."""
        return self.messages[self.prompt_messages :]


class EnvError(ValueError):
    """An environment raised while answering a turn; the message names the environment and row."""


def call_env(env: Any, method: Callable[..., Any], episode: Episode, what: str, *args: Any) -> Any:
    """``method(episode, *args)`` (the environment's ``start`` or ``step``); what it raises comes
    back as an :class:`EnvError` naming the environment, the method, the row and the turn."""
    try:
        return method(episode, *args)
    except Exception as error:
        turn = f" (turn {episode.turn})" if what == "step" else ""
        raise EnvError(f"environment {env_name(env)!r} raised in {what}() on row {episode.index}{turn}: "
                       f"{type(error).__name__}: {error}") from error


def answer_turn(env: Any, episode: Episode, completion: str) -> Turn:
    """``env.step(episode, completion)``, checked (:func:`check_turn`): a :class:`Turn` whose fields
    have the types they must, its reward a number float32 holds (a NaN/inf reward is the caller's
    to judge); :class:`EnvError` naming the environment, the row and the field otherwise."""
    answer = call_env(env, env.step, episode, "step", completion)
    return check_turn(env, episode, answer)


FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32: a reward beyond it would become inf in the rollout's tensors."""


def _turn_error(env: Any, episode: Episode, message: str) -> EnvError:
    return EnvError(f"environment {env_name(env)!r}: step() on row {episode.index} (turn {episode.turn}) {message}")


def check_turn(env: Any, episode: Episode, answer: Any) -> Turn:
    """``answer`` when it is a valid :class:`Turn`, its reward made a ``float``: ``reward`` a real
    number (bool refused) that float32 holds, or NaN/inf (the caller's ``reward_nonfinite``);
    ``done`` a bool (``"no"`` would end the episode silently); ``observation`` None, a str or a list
    of ``{"role": str, "content": str}`` messages, its text valid Unicode (no lone surrogate);
    ``info`` a dict. :class:`EnvError` naming the environment, the row and the field otherwise."""
    if not isinstance(answer, Turn):
        raise _turn_error(env, episode, f"returned {type(answer).__name__}; return a textrl.envs.Turn")
    reward = _tensor_reward(env, episode, answer.reward)
    if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, (int, float, np.integer, np.floating)):
        raise _turn_error(env, episode, f"gave Turn.reward={_short(reward)}: a turn reward must be a float")
    try:
        value = float(reward)
    except OverflowError:
        value = None
    if value is None or (math.isfinite(value) and abs(value) > FLOAT32_MAX):
        raise _turn_error(env, episode, f"gave Turn.reward={_short(reward)}, too large for the rollout's float32 "
                          f"rewards (|reward| <= {FLOAT32_MAX:.4g}); scale the environment's rewards")
    answer.reward = value
    if not isinstance(answer.done, (bool, np.bool_)):
        raise _turn_error(env, episode, f"gave Turn.done={_short(answer.done)}: done must be True or False")
    answer.done = bool(answer.done)
    observation = answer.observation
    if isinstance(observation, str):
        _check_text(env, episode, observation, "Turn.observation")
    elif isinstance(observation, list):
        for i, m in enumerate(observation):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise _turn_error(env, episode, f"gave Turn.observation[{i}]={_short(m)}: each message must be "
                                  "{'role': str, 'content': str}")
            _check_text(env, episode, m["content"], f"Turn.observation[{i}]['content']")
    elif observation is not None:
        raise _turn_error(env, episode, f"gave Turn.observation={_short(observation)}: an observation is None, a "
                          "str, or a list of {'role', 'content'} messages")
    if not isinstance(answer.info, dict):
        raise _turn_error(env, episode, f"gave Turn.info={_short(answer.info)}: info must be a dict")
    return answer


def _tensor_reward(env: Any, episode: Episode, reward: Any) -> Any:
    """A turn reward given as a one-number real tensor, on any device that holds values (cuda for
    a cpu run, ...), as a Python number; anything else as it is. A tensor on the 'meta' device
    (no values), of several numbers or of bools is refused naming the environment and the row."""
    if not isinstance(reward, torch.Tensor):
        return reward
    if reward.is_meta:
        raise _turn_error(env, episode, "gave Turn.reward as a tensor on device 'meta', which holds no value; "
                          "give a float (or a tensor with a value, on any real device)")
    if reward.numel() != 1 or reward.dtype == torch.bool or reward.is_complex():
        raise _turn_error(env, episode, f"gave Turn.reward as a {reward.dtype} tensor of shape {tuple(reward.shape)} "
                          f"on {reward.device}: a turn reward must be one real number")
    return reward.detach().reshape(()).item()


def _short(value: Any) -> str:
    """``repr(value)`` cut to 60 characters (an int of 400 digits, say), with its type."""
    try:
        text = repr(value)
    except Exception:  # an object whose repr raises (an int too long to print, say)
        text = f"<{type(value).__name__}>"
    return (text if len(text) <= 60 else text[:57] + "...") + f" ({type(value).__name__})"


def _check_text(env: Any, episode: Episode, text: str, name: str) -> None:
    bad = text_problem(text)
    if bad:
        raise _turn_error(env, episode, f"gave {name} with {bad}; give valid Unicode text")


def text_problem(text: str) -> str | None:
    """What makes ``text`` unfit for a tokenizer (a lone surrogate such as ``"\\ud800"``, which has
    no UTF-8 encoding), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"a lone surrogate {text[error.start]!r} at character {error.start} (not valid Unicode text)"
    return None


def env_name(env: Any) -> str:
    """How messages name an environment: its ``id``, else its class name."""
    return getattr(env, "id", "") or type(env).__name__


def check_environment(env: Any) -> Any:
    """``env`` when its attributes have the types the episodes need: ``max_turns`` an int >= 1,
    ``stop_strings`` a tuple or list of non-empty str, ``max_reward`` None or a number, ``reward``
    None, a spec str or a callable, ``answers_truncated_turns`` a bool, ``max_observation_tokens``
    (if set) an int >= 1; ``ValueError`` naming the environment and the attribute otherwise."""
    name = env_name(env)

    def refuse(attr: str, what: str) -> ValueError:
        return ValueError(f"environment {name!r}: {attr}={_short(getattr(env, attr, None))} must be {what}; "
                          f"fix the attribute of {type(env).__name__}")

    turns = getattr(env, "max_turns", None)
    if isinstance(turns, (bool, np.bool_)) or not isinstance(turns, (int, np.integer)) or turns < 1:
        raise refuse("max_turns", "an int >= 1")
    stops = getattr(env, "stop_strings", ())
    if isinstance(stops, str) or not isinstance(stops, (tuple, list)) or \
            not all(isinstance(x, str) and x for x in stops):
        raise refuse("stop_strings", "a tuple of non-empty strings (e.g. ('</tool>',))")
    best = getattr(env, "max_reward", None)
    if best is not None and (isinstance(best, bool) or not isinstance(best, (int, float))):
        raise refuse("max_reward", "None or a number")
    reward = getattr(env, "reward", None)
    if reward is not None and not isinstance(reward, str) and not callable(reward):
        raise refuse("reward", "None, a reward spec such as 'accuracy', or a callable")
    answers = getattr(env, "answers_truncated_turns", True)
    if not isinstance(answers, (bool, np.bool_)):
        raise refuse("answers_truncated_turns", "True or False")
    obs = getattr(env, "max_observation_tokens", None)
    if obs is not None and (isinstance(obs, bool) or not isinstance(obs, (int, np.integer)) or obs < 1):
        raise refuse("max_observation_tokens", "an int >= 1")
    return env


class Environment:
    """Base class of task environments; see the module docstring.

    Class attributes a subclass sets:

    - ``id``: the registry id (``textrl train --env ID``);
    - ``description``: one line for ``textrl envs``;
    - ``max_turns``: agent turns before the episode ends (truncated) if the environment has not
      ended it;
    - ``max_reward``: the best episode reward, where known (None otherwise);
    - ``stop_strings``: strings that end the agent's turn besides EOS (``"</tool>"``, say); the
      turn's tokens end with the token that completes the string.
    - ``reward``: the final reward (a reward spec such as ``"accuracy"`` or a callable in the
      reward convention of :mod:`textrl.rewards`), scored once per finished episode over the
      batch and added to the last turn's reward; None: the turns' rewards alone.
    - ``answers_truncated_turns``: whether a turn cut by ``max_new_tokens`` before its EOS reaches
      :meth:`step` (with ``episode.truncated`` True) in a multi-turn episode (default True); False
      ends such an episode by ``length``, unanswered.
    """

    id: ClassVar[str] = ""
    description: ClassVar[str] = ""
    max_turns: int = 1
    max_reward: float | None = None
    stop_strings: tuple[str, ...] = ()
    reward: str | Callable[..., Any] | None = None
    answers_truncated_turns: bool = True

    # -- task instances ------------------------------------------------------------------------

    def rows(self) -> Sequence[dict[str, Any]]:
        """The task instances: dict rows with ``"prompt"`` (a string) or ``"messages"`` (a
        conversation up to the first agent turn), plus any fields the environment or its reward
        reads (an ``"answer"``, say)."""
        raise NotImplementedError(f"{type(self).__name__} must define rows()")

    def eval_rows(self) -> Sequence[dict[str, Any]] | None:
        """A held-out split of its own, if the task has one; None: the trainer holds out
        ``eval_size`` rows of :meth:`rows` (seeded)."""
        return None

    def warmup_examples(self, rows: Sequence[dict[str, Any]], seed: int) -> list[tuple[Any, str]] | None:
        """(prompt, completion) pairs for the supervised format warm-up, or None (no warm-up).
        A prompt is a string or a list of messages; the completion is the agent's text (EOS added
        by the warm-up)."""
        return None

    # -- dynamics ------------------------------------------------------------------------------

    def start(self, episode: Episode) -> None:
        """Prepare ``episode.state`` before the first agent turn (nothing by default)."""

    def step(self, episode: Episode, completion: str) -> Turn:
        """Answer the agent's turn ``completion`` (decoded, special tokens skipped); the default
        ends the episode with no turn reward (a single-turn task scored by ``reward``)."""
        return Turn(done=True)

    def describe(self) -> str:
        """The line ``textrl envs`` prints."""
        turns = "single turn" if self.max_turns == 1 else f"up to {self.max_turns} turns"
        best = "" if self.max_reward is None else f", max reward {self.max_reward:g}"
        return f"{self.description} ({turns}{best})"


class PromptTask(Environment):
    """A single-turn task: prompt rows and a reward; the first answer ends the episode, scored by
    ``reward``. What ``textrl train`` builds from ``--dataset`` and ``--reward`` when no ``--env``
    is given (``rows``: a :class:`textrl.envs.PromptDataset` or a list of rows; None for a task
    that only scores batches it is handed)."""

    description = "prompts and a reward, one answer per episode"

    def __init__(self, rows: Sequence[dict[str, Any]] | None, reward: str | Callable[..., Any] | None,
                 *, id: str = "prompts") -> None:
        self._rows = rows
        self.reward = reward
        self.id = id  # type: ignore[misc]

    def rows(self) -> Sequence[dict[str, Any]]:
        if self._rows is None:
            raise ValueError("this PromptTask was built without rows; pass rows=[...] (or a PromptDataset)")
        return self._rows


__all__ = ["EnvError", "Environment", "Episode", "answer_turn", "call_env", "check_environment", "check_turn",
           "env_name", "Message", "PromptTask", "text_problem", "Turn"]
