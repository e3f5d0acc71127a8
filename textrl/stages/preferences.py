"""Preference data: three common formats read into one :class:`Preference` type.

A row is recognised by its fields (or forced with ``format=``):

- ``generic``: ``prompt`` (or ``question``), ``chosen`` (or ``response_chosen``), ``rejected``
  (or ``response_rejected``). ``prompt`` is a string or a list of chat messages.
- ``hh`` (Anthropic hh-rlhf): ``chosen`` and ``rejected`` are whole transcripts
  ``"\\n\\nHuman: ...\\n\\nAssistant: ..."``; the prompt is the conversation before the final
  Assistant turn (it must be the same in both) and the responses are the two final turns.
- ``pku`` (PKU-SafeRLHF): ``prompt``, ``response_0``, ``response_1``, ``is_response_0_safe``,
  ``is_response_1_safe``, ``better_response_id`` (``safer_response_id`` optional). Safety
  first: a safe response beats an unsafe one; when both or neither are safe,
  ``better_response_id`` decides.

A malformed row raises ``ValueError`` naming the source, the row number (0-based, over non-blank
lines for a ``.jsonl`` file, with the line number) and the missing or bad field.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from textrl.stages.common import StageConfig

FORMATS = ("auto", "generic", "hh", "pku")
_PKU_FIELDS = ("prompt", "response_0", "response_1", "is_response_0_safe", "is_response_1_safe",
               "better_response_id")
_HH_TURN = re.compile(r"\n\n(Human|Assistant): ")


@dataclass(frozen=True)
class Preference:
    """One comparison: ``messages`` (the conversation up to the response, ending with a user
    turn) and the preferred and the dispreferred response."""

    messages: tuple[tuple[str, str], ...]
    chosen: str
    rejected: str

    @property
    def prompt(self) -> list[dict[str, str]]:
        """The conversation as chat messages ``[{"role", "content"}, ...]``."""
        return [{"role": role, "content": content} for role, content in self.messages]


def _text(row: Mapping[str, Any], names: Sequence[str], where: str) -> str:
    """The first present field of ``names``, which must be a non-empty string."""
    name = next((n for n in names if n in row), None)
    if name is None:
        raise ValueError(f"{where}: missing field {names[0]!r}")
    value = row[name]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: field {name!r} must be a non-empty string, got {value!r}")
    return value


def _messages(prompt: Any, where: str) -> tuple[tuple[str, str], ...]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: field 'prompt' is empty")
        return (("user", prompt),)
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{where}: field 'prompt' must be a string or a list of messages")
    turns = []
    for j, turn in enumerate(prompt):
        role = turn.get("role") if isinstance(turn, Mapping) else None
        content = turn.get("content") if isinstance(turn, Mapping) else None
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f"{where}: field 'prompt'[{j}] needs string 'role' and 'content'")
        turns.append((role, content))
    if turns[-1][0] != "user":
        raise ValueError(f"{where}: field 'prompt' must end with a 'user' turn, got {turns[-1][0]!r}")
    return tuple(turns)


def parse_hh_transcript(text: str, where: str, field: str) -> tuple[tuple[tuple[str, str], ...], str]:
    """(conversation before the final Assistant turn, that turn's text) of an hh-rlhf transcript.

    >>> parse_hh_transcript("\\n\\nHuman: Hi\\n\\nAssistant: Hello!", "row 0", "chosen")
    ((('user', 'Hi'),), 'Hello!')
    """
    parts = _HH_TURN.split(text)
    # parts = [preamble, role, content, role, content, ...]
    if len(parts) < 5 or parts[0].strip():
        raise ValueError(
            f"{where}: field {field!r} is not an hh-rlhf transcript "
            "('\\n\\nHuman: ...\\n\\nAssistant: ...')"
        )
    turns = [("user" if role == "Human" else "assistant", content.strip())
             for role, content in zip(parts[1::2], parts[2::2])]
    if turns[-1][0] != "assistant" or turns[-2][0] != "user":
        raise ValueError(f"{where}: field {field!r} must end with a Human turn then an Assistant turn")
    if not turns[-1][1]:
        raise ValueError(f"{where}: field {field!r} has an empty final Assistant turn")
    return tuple(turns[:-1]), turns[-1][1]


def _flag(row: Mapping[str, Any], name: str, where: str, allowed: tuple) -> Any:
    """``row[name]`` if it is one of ``allowed`` (bools and ints are told apart: True is not 1)."""
    value = row[name]
    if isinstance(value, bool) != isinstance(allowed[0], bool) or value not in allowed:
        raise ValueError(f"{where}: field {name!r} must be one of {allowed}, got {value!r}")
    return value


def _pku(row: Mapping[str, Any], where: str) -> Preference:
    for name in _PKU_FIELDS:
        if name not in row:
            raise ValueError(f"{where}: missing field {name!r} (PKU-SafeRLHF format)")
    messages = _messages(row["prompt"], where)
    responses = (_text(row, ["response_0"], where), _text(row, ["response_1"], where))
    safe = (_flag(row, "is_response_0_safe", where, (True, False)),
            _flag(row, "is_response_1_safe", where, (True, False)))
    better = _flag(row, "better_response_id", where, (0, 1))
    if row.get("safer_response_id") is not None:
        _flag(row, "safer_response_id", where, (0, 1))
    best = (0 if safe[0] else 1) if safe[0] != safe[1] else better
    return Preference(messages, responses[best], responses[1 - best])


def _hh(row: Mapping[str, Any], where: str) -> Preference:
    chosen_msgs, chosen = parse_hh_transcript(_text(row, ["chosen"], where), where, "chosen")
    rejected_msgs, rejected = parse_hh_transcript(_text(row, ["rejected"], where), where, "rejected")
    if chosen_msgs != rejected_msgs:
        raise ValueError(
            f"{where}: fields 'chosen' and 'rejected' hold different conversations before their "
            "final Assistant turns; an hh-rlhf pair must share its prompt"
        )
    return Preference(chosen_msgs, chosen, rejected)


def _generic(row: Mapping[str, Any], where: str) -> Preference:
    if "prompt" not in row and "question" not in row:
        raise ValueError(f"{where}: missing field 'prompt'")
    messages = _messages(row["prompt"] if "prompt" in row else row["question"], where)
    chosen = _text(row, ["chosen", "response_chosen"], where)
    rejected = _text(row, ["rejected", "response_rejected"], where)
    return Preference(messages, chosen, rejected)


def detect_format(row: Mapping[str, Any]) -> str:
    """``pku`` with ``response_0``/``response_1``; ``generic`` with a prompt; else ``hh``."""
    if "response_0" in row or "response_1" in row:
        return "pku"
    if "prompt" in row or "question" in row:
        return "generic"
    return "hh"


_PARSERS = {"generic": _generic, "hh": _hh, "pku": _pku}


def parse_preference(row: Any, where: str, format: str = "auto") -> Preference:
    """One row of any supported format -> :class:`Preference`; ``where`` names it in errors."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: a preference row must be an object, got {type(row).__name__}")
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: must be one of {', '.join(FORMATS)}")
    kind = detect_format(row) if format == "auto" else format
    if kind == "hh" and "chosen" not in row and "rejected" not in row:
        raise ValueError(
            f"{where}: no preference fields (got {sorted(row)}); expected prompt/chosen/rejected, "
            "hh-rlhf chosen/rejected transcripts, or PKU-SafeRLHF prompt/response_0/response_1/..."
        )
    return _PARSERS[kind](row, where)


def load_preferences(
    source: str | os.PathLike[str] | Iterable[Mapping[str, Any]], format: str = "auto"
) -> list[Preference]:
    """Preferences from ``builtin:NAME``, a ``.jsonl`` / ``.json`` file, or rows (a list of dicts,
    a ``datasets.Dataset``).

    >>> prefs = load_preferences([{"prompt": "2+2?", "chosen": "4", "rejected": "5"}])
    >>> prefs[0].prompt, prefs[0].chosen
    ([{'role': 'user', 'content': '2+2?'}], '4')
    """
    from textrl.envs.synthetic import BUILTIN_PREFERENCES
    from textrl.stages.common import source_rows

    parsed = [(where, parse_preference(row, where, format))
              for where, row in source_rows(source, BUILTIN_PREFERENCES, "preference data")]
    return _without_ties(parsed)


_TIES_NAMED = 5


def _without_ties(parsed: list[tuple[str, Preference]]) -> list[Preference]:
    """The pairs whose chosen and rejected answers differ; the others (same text, whitespace
    aside: their loss has no gradient, they only dilute the mean) are left out with one warning
    naming them, and a file of nothing but such pairs is refused."""
    ties = [where for where, p in parsed if " ".join(p.chosen.split()) == " ".join(p.rejected.split())]
    if not ties:
        return [p for _, p in parsed]
    named = ", ".join(ties[:_TIES_NAMED]) + (f" and {len(ties) - _TIES_NAMED} more" if len(ties) > _TIES_NAMED else "")
    if len(ties) == len(parsed):
        raise ValueError(f"every preference pair has chosen == rejected ({named}): nothing to learn from; "
                         "give each pair two different answers")
    warnings.warn(f"{len(ties)} of {len(parsed)} preference pairs have chosen == rejected ({named}): they "
                  "teach nothing and are left out; fix or drop them", stacklevel=3)
    tied = set(ties)
    return [p for where, p in parsed if where not in tied]


@dataclass
class PreferenceStageConfig(StageConfig):
    """Fields of the stages that learn from preference pairs (``textrl rm``, ``textrl dpo``)."""

    data: str = "builtin:case"
    """Preference data: 'builtin:case', or a .jsonl / .json of generic, hh-rlhf or PKU-SafeRLHF rows."""
    format: str = "auto"
    """Preference format: auto (per row, from its fields) | generic | hh | pku."""
    steps: int = 100
    """Optimiser steps."""
    eval_size: int = 64
    """Held-out preference pairs (pairwise accuracy and margin are measured on them)."""

    def validate(self) -> PreferenceStageConfig:
        super().validate()
        if self.format not in FORMATS:
            raise ValueError(f"format={self.format!r}: must be one of {', '.join(FORMATS)}")
        return self


__all__ = ["FORMATS", "Preference", "PreferenceStageConfig", "detect_format", "load_preferences", "parse_hh_transcript",
           "parse_preference"]
