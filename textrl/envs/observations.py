"""Tokenising an environment's observation once, as the chat template renders it after a history.

The history is never re-rendered (docs/design.md, "Multi-turn episodes"): the agent's tokens stay
the tokens it sampled. That is the context the chat template renders only when the template is
append-only (each rendering of a conversation starts with the rendering of every shorter one);
:func:`check_append_only` refuses, before any model work, a template that is not (one that drops
earlier ``<think>`` blocks, as Qwen3's does). :func:`observation_ids` renders a fixed stand-in history that ends with an
assistant turn, then the same history followed by the new messages and the generation prompt; the
tokens after the stand-in's last end-of-turn token are the observation's. With ChatML that is
``"\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n"``: the newline the template
puts after the agent's EOS, the messages, and the prompt for the next agent turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_STAND_IN = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
NO_EOS = ("the chat template renders an assistant turn without the tokenizer's EOS; set eos_token_id to the "
          "template's end-of-turn token")


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
        raise ValueError(NO_EOS)
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


PROBE: tuple[dict[str, str], ...] = (
    {"role": "user", "content": "Guess my number from 1 to 8."},
    {"role": "assistant", "content": "<think>\nStart in the middle.\n</think>\n<answer>4</answer>"},
    {"role": "user", "content": "higher"},
    {"role": "assistant", "content": "<answer>6</answer>"},
    {"role": "user", "content": "lower"},
)
"""The conversation :func:`check_append_only` renders: two agent turns, the first with a
``<think>`` block, each answered by a ``user`` message."""

END_THINK = "</think>"


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def observation_text(tokenizer: Any, messages: Sequence[dict[str, str]], eos_texts: Sequence[str]) -> str:
    """The text of :func:`observation_ids`, cut as it cuts the tokens: what the template renders
    after the stand-in history's last end-of-turn text (one of ``eos_texts``). ``ValueError`` when
    the template renders that history differently once messages follow."""
    before = _render(tokenizer, _STAND_IN, False)
    after = _render(tokenizer, [*_STAND_IN, *messages], True)
    cut = max((before.rfind(e) + len(e) for e in eos_texts if e and e in before), default=-1)
    if cut < 0:
        raise ValueError(NO_EOS)
    if after[:cut] != before[:cut]:
        raise ValueError("it renders a conversation differently once new messages follow it "
                         f"({_first_difference(before, after, 'alone', 'followed by messages')})")
    return after[cut:]


def _first_difference(one: str, other: str, one_is: str, other_is: str, width: int = 24) -> str:
    """Where two renderings part: a few characters of each from just before the first difference."""
    i = next((i for i, (a, b) in enumerate(zip(one, other)) if a != b), min(len(one), len(other)))
    start = max(0, i - 8)
    return f"{one_is} {one[start : i + width]!r}, {other_is} {other[start : i + width]!r}"


def _eos_texts(tokenizer: Any, eos_token_ids: Sequence[int]) -> list[str]:
    return [tokenizer.decode([int(e)], skip_special_tokens=False) for e in eos_token_ids]


def episode_contexts(tokenizer: Any, eos_token_ids: Sequence[int],
                     conversation: Sequence[dict[str, str]] = PROBE) -> list[tuple[str, str]]:
    """Per agent turn after the first of ``conversation`` (alternating ``user`` / ``assistant``
    messages, a ``user`` one last): ``(built, rendered)``, the text of the context a multi-turn
    episode builds before that turn (the prompt's rendering, then each agent turn as sampled, its
    EOS and :func:`observation_text`) and the chat template's rendering of the conversation up to
    it with the generation prompt. Equal for every turn when the template is append-only."""
    eos_texts = _eos_texts(tokenizer, eos_token_ids)
    built = _render(tokenizer, conversation[:1], True)
    pairs = []
    for k in range(1, len(conversation) - 1, 2):
        built += conversation[k]["content"] + eos_texts[0] + observation_text(tokenizer, conversation[k + 1 : k + 2],
                                                                              eos_texts)
        pairs.append((built, _render(tokenizer, conversation[: k + 2], True)))
    return pairs




def check_append_only(tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
    """``ValueError`` (one line: what the template does, and what to do) unless the chat template
    of ``tokenizer`` is append-only on :data:`PROBE`: the context a multi-turn episode builds
    before each agent turn (:func:`episode_contexts`) is, character for character, the template's
    rendering of the conversation so far. A tokenizer without a chat template passes (its
    observations are plain lines). A few renders of a 5-message conversation: cheap enough to run
    whenever a multi-turn episode runner is built."""
    if not getattr(tokenizer, "chat_template", None):
        return
    fix = ("give the run a tokenizer whose chat template keeps earlier turns as they were sampled (--tokenizer DIR "
           "with that chat_template in its tokenizer_config.json; in Python, tokenizer.chat_template = ...)")
    try:
        renders = [_render(tokenizer, PROBE[: k + 2], True) for k in range(1, len(PROBE) - 1, 2)]
    except Exception as error:  # noqa: BLE001 - a template's own error (jinja2's TemplateError, a raise_exception)
        raise ValueError(f"the chat template cannot render a conversation of alternating user and assistant "
                         f"turns ({type(error).__name__}: {error}); {fix}") from None
    thought = PROBE[1]["content"]  # the first agent turn: a <think> block, then its answer
    if any(thought not in r and thought.split(END_THINK)[-1].strip() in r for r in renders):
        raise ValueError("the chat template is not append-only: it drops the <think> block of an earlier assistant "
                         "turn once later turns follow (as Qwen3's does), so an episode, which keeps the tokens the "
                         f"policy sampled, would train on contexts the template never renders; {fix}")
    if not any(e and e in _render(tokenizer, _STAND_IN, False) for e in _eos_texts(tokenizer, eos_token_ids)):
        raise ValueError(NO_EOS)
    try:
        pairs = episode_contexts(tokenizer, eos_token_ids)
    except ValueError as error:  # the stand-in history renders differently once messages follow
        raise ValueError(f"the chat template is not append-only: {error}; {fix}") from None
    for built, rendered in pairs:
        if built != rendered:
            raise ValueError(f"the chat template is not append-only: it renders earlier turns differently once "
                             f"later turns follow ({_first_difference(built, rendered, 'the episode holds', 'the template renders')}); "
                             f"{fix}")


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


__all__ = ["PROBE", "append_observation", "check_append_only", "episode_contexts", "observation_ids", "observation_text",
           "turn_observation"]
