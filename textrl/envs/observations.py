"""Tokenising an environment's observation once, as the chat template renders it after a history.

The history is never re-rendered (docs/design.md, "Multi-turn episodes"): the agent's tokens stay
the tokens it sampled. :func:`observation_ids` renders a fixed stand-in history that ends with an
assistant turn, then the same history followed by the new messages and the generation prompt; the
tokens after the stand-in's last end-of-turn token are the observation's. With ChatML that is
``"\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n"``: the newline the template
puts after the agent's EOS, the messages, and the prompt for the next agent turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_STAND_IN = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


def _template_ids(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def observation_ids(tokenizer: Any, messages: Sequence[dict[str, str]], eos_token_ids: Sequence[int]) -> list[int]:
    """Token ids of ``messages`` appended after an agent turn that ended with one of
    ``eos_token_ids``, up to and including the next generation prompt.

    A tokenizer without a chat template gets each message's content on its own line
    (``"\\n" + content`` per message, then ``"\\n"``). ``ValueError`` when the template renders the
    history differently once messages follow (the observation could not be cut from it), or the
    messages are not ``{"role", "content"}`` dicts.
    """
    messages = [dict(m) for m in messages]
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"observation message {i} must be {{'role': str, 'content': str}}, got {m!r}")
    if not getattr(tokenizer, "chat_template", None):
        text = "".join("\n" + m["content"] for m in messages) + "\n"
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    before = _template_ids(tokenizer, _STAND_IN, False)
    after = _template_ids(tokenizer, _STAND_IN + messages, True)
    eos = set(int(e) for e in eos_token_ids)
    ends = [i for i, t in enumerate(before) if t in eos]
    if not ends:
        raise ValueError("the chat template renders an assistant turn without the tokenizer's EOS; set "
                         "eos_token_id to the template's end-of-turn token")
    cut = ends[-1] + 1
    if after[:cut] != before[:cut]:
        raise ValueError("the chat template renders the earlier turns differently once new messages follow, "
                         "so an observation cannot be appended without re-tokenising the history")
    return after[cut:]


def turn_observation(tokenizer: Any, messages: Sequence[dict[str, str]], eos_token_ids: Sequence[int],
                     last_token: int, *, env_id: str = "", row: int = -1) -> list[int]:
    """The tokens appended after an agent turn whose last token is ``last_token``:
    :func:`observation_ids`, preceded by the EOS (``eos_token_ids[0]``) the template closes an
    assistant turn with when the turn was cut by a stop string instead. ``ValueError`` naming the
    environment and row when the observation cannot be tokenised."""
    try:
        ids = observation_ids(tokenizer, messages, eos_token_ids)
    except ValueError as error:
        raise ValueError(f"environment {env_id!r}: its observation on row {row} cannot be tokenised: {error}") from error
    return ids if last_token in eos_token_ids else [int(eos_token_ids[0]), *ids]


def append_observation(record: Any, messages: list[dict[str, str]], *, tokenizer: Any, eos_token_ids: Sequence[int],
                       max_episode_tokens: int, env_id: str) -> bool:
    """Append an observation to an episode's token record (``tokens`` / ``agent`` lists and its
    ``episode``; the collector's rows and the token MDP's state alike): its tokens
    (:func:`turn_observation`, not the agent's) and its messages. False, appending nothing, when
    they would leave no room for one more agent token within ``max_episode_tokens`` (the episode
    then ends by ``context``). ``EnvError`` when the observation cannot be tokenised."""
    from textrl.envs.environment import EnvError

    try:
        obs = turn_observation(tokenizer, messages, eos_token_ids, record.tokens[-1], env_id=env_id,
                               row=record.episode.index)
    except ValueError as error:
        raise EnvError(str(error)) from error
    if len(record.tokens) + len(obs) + 1 > max_episode_tokens:
        return False
    record.tokens += obs
    record.agent += [False] * len(obs)
    record.episode.messages += messages
    return True


__all__ = ["append_observation", "observation_ids", "turn_observation"]
