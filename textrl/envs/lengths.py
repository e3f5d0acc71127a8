"""The lengths a run uses: its prompts' cap and its episodes' token budget, fitted to the model.

``max_prompt_length`` left unset (None, the default) is what the environment's prompts need: the
longest prompt of its rows (training and held-out), templated and tokenized as the sampler does
(chat template included), or for a source of more than :data:`EXACT_ROWS` rows the longest of a
seeded sample of :data:`SAMPLE_ROWS` times :data:`SAMPLE_MARGIN`. It is bounded by the model's
context minus ``max_new_tokens``; the prompts over the bound are then left-truncated to their last
tokens (as TRL's ``max_prompt_length`` does), said in one line. An explicit ``max_prompt_length``
works as it always did: a prompt over it is refused, naming the row.

``max_episode_tokens`` left unset is the environment's default budget
(:func:`textrl.envs.episodes.default_episode_tokens`), bounded so that the longest prompt plus the
episode fits the model's context (said in one line when bounded). An explicit one that does not
fit is refused naming ``--max-episode-tokens``, the lever.

:func:`resolve_lengths` decides both; ``textrl train`` calls it once the models have loaded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

EXACT_ROWS = 20_000
"""Sources up to this many rows are measured exactly (every row tokenized)."""
SAMPLE_ROWS = 4096
"""Rows measured, seeded, of a larger source."""
SAMPLE_MARGIN = 1.25
"""The longest sampled prompt times this is the auto ``max_prompt_length`` of a large source."""


@dataclass
class Longest:
    """The longest prompt found: its length in tokens, where it is, and whether it was sampled."""

    tokens: int
    where: str
    sampled: bool = False
    measured: int = 0
    """Rows tokenized to find it."""


@dataclass
class Lengths:
    """What a run uses (:func:`resolve_lengths`)."""

    max_prompt_length: int
    """The prompts' cap in tokens, chat template included."""
    max_episode_tokens: int
    """The episode's budget of tokens after the prompt (agent and environment tokens)."""
    truncate: str
    """``"error"`` (an explicit ``max_prompt_length``: a longer prompt is refused) or ``"left"``
    (auto: a prompt over the bound keeps its last tokens)."""
    longest_prompt: int | None = None
    """The longest prompt measured (None: not measured)."""
    truncated_rows: int = 0
    """Measured prompts longer than ``max_prompt_length`` (left-truncated)."""
    notes: list[str] = field(default_factory=list)
    """Lines to print: a length that was bounded, prompts that are truncated."""
    source: dict[str, str] = field(default_factory=dict)
    """How each length was decided: ``"set"`` (given) or ``"auto"``."""

    def record(self) -> dict[str, Any]:
        """The JSON record of what ran (``summary.json``'s ``lengths``)."""
        return asdict(self)


def _datasets(prompt_sets: Sequence[Any]) -> list[Any]:
    from textrl.envs.prompts import load_prompts

    return [load_prompts(p) for p in prompt_sets if p is not None and len(p)]


def longest_prompt(prompt_sets: Sequence[Any], tokenizer: Any, *, seed: int = 0,
                   exact_rows: int = EXACT_ROWS, sample_rows: int = SAMPLE_ROWS) -> tuple[Longest, list[int]]:
    """The longest prompt of ``prompt_sets`` (each anything :func:`textrl.envs.load_prompts` takes)
    as the sampler tokenizes it, and the lengths measured. Every row when they hold at most
    ``exact_rows`` together, else a seeded sample of ``sample_rows`` of each set."""
    from textrl.envs.prompts.encoding import _CHUNK_ROWS, _encode_rows

    datasets = _datasets(prompt_sets)
    total = sum(len(d) for d in datasets)
    sampled = total > exact_rows
    best: Longest | None = None
    lengths: list[int] = []
    rng = np.random.default_rng([int(seed), 0x1E7])
    for dataset in datasets:
        n = len(dataset)
        rows = np.arange(n) if not sampled or n <= sample_rows else np.sort(rng.choice(n, sample_rows, replace=False))
        for start in range(0, len(rows), _CHUNK_ROWS):
            chunk = [int(i) for i in rows[start:start + _CHUNK_ROWS]]
            _, ids = _encode_rows(dataset, tokenizer, chunk)
            for i, row_ids in zip(chunk, ids):
                lengths.append(len(row_ids))
                if best is None or len(row_ids) > best.tokens:
                    best = Longest(len(row_ids), dataset.where(i), sampled)
    if best is None:
        raise ValueError("no prompts to measure: the environment gave no rows")
    best.measured = len(lengths)
    return best, lengths


def _prompt_lengths(longest: Longest, measured: Sequence[int], max_prompt_length: int | None, *,
                max_new_tokens: int, context: int | None, found: str, limit: str,
                notes: list[str]) -> tuple[int, str, int, int]:
    """``(max_prompt_length, truncate, prompt_room, truncated_rows)`` of :func:`resolve_lengths`:
    the prompts' cap, its :attr:`Lengths.truncate` mode, the prompt tokens an episode must leave
    room for, and the ``measured`` lengths over the cap. Appends the line saying a bounded cap to
    ``notes``; ``found`` and ``limit`` are the phrases naming the longest prompt and the context."""
    truncated = 0
    if max_prompt_length is not None:
        prompt_cap, truncate = int(max_prompt_length), "error"
        prompt_room = min(prompt_cap, longest.tokens) if not longest.sampled else prompt_cap
        return prompt_cap, truncate, prompt_room, truncated
    truncate = "left"
    prompt_cap = math.ceil(longest.tokens * SAMPLE_MARGIN) if longest.sampled else longest.tokens
    if context is not None and prompt_cap + max_new_tokens > context:
        bound = context - max_new_tokens
        truncated = sum(n > bound for n in measured)
        if longest.tokens > bound:
            notes.append(f"max_prompt_length: {found}, over {limit} minus max_new_tokens="
                         f"{max_new_tokens}: bounded to {bound}, and {truncated} of {len(measured)} prompts "
                         "longer than that keep their last tokens (left-truncated); give a model with a "
                         "longer context, or lower --max-new-tokens, to keep them whole")
        else:
            notes.append(f"max_prompt_length: {found}; with the sampling margin, bounded to {bound} by "
                         f"{limit} minus max_new_tokens={max_new_tokens}")
        prompt_cap = bound
    return prompt_cap, truncate, prompt_cap, truncated


def _episode_budget(env: Any, max_episode_tokens: int | None, default_budget: int, *, prompt_cap: int,
                    prompt_room: int, max_new_tokens: int, context: int | None, env_id: str, limit: str,
                    notes: list[str]) -> int:
    """The episode's token budget of :func:`resolve_lengths`: an explicit ``max_episode_tokens``
    (``ValueError`` naming ``--max-episode-tokens`` when it does not fit after ``prompt_room``
    prompt tokens), else ``default_budget`` bounded to the context (``ValueError`` when nothing
    or less than a turn is left; the line saying the bound appended to ``notes``)."""
    if max_episode_tokens is not None:
        budget = int(max_episode_tokens)
        if context is not None and prompt_room + budget > context:
            fits = context - prompt_room
            fix = (f"lower --max-episode-tokens to {fits}" if fits >= max_new_tokens else
                   f"lower --max-episode-tokens and --max-new-tokens to at most {fits}")
            raise ValueError(f"max_episode_tokens={budget}: prompts of {prompt_room} tokens plus the episode "
                             f"budget reach {prompt_room + budget} positions, more than {limit}; "
                             f"{fix}, shorten the prompts, or choose a model with a longer context")
        return budget
    budget = default_budget
    if context is not None and prompt_room + budget > context:
        budget = context - prompt_room
        if budget < 1:  # the prompts alone fill the context: max_new_tokens is no lever
            raise ValueError(f"max_prompt_length={prompt_cap}: prompts of {prompt_room} tokens alone pass "
                             f"{limit}; lower --max-prompt-length to at most {context - max_new_tokens} (or "
                             "leave it unset: it is then fitted to the context), shorten the prompts, or "
                             "choose a model with a longer context")
        if budget < max_new_tokens:  # only with an explicit max_prompt_length
            raise ValueError(f"max_prompt_length={prompt_cap}: prompts of {prompt_room} tokens leave {budget} "
                             f"of {limit} for an episode, less than max_new_tokens={max_new_tokens}; lower "
                             f"--max-prompt-length to {context - max_new_tokens} or --max-new-tokens to "
                             f"{max(1, budget)}, or choose a model with a longer context")
        turns = getattr(env, "max_turns", 1)
        notes.append(f"max_episode_tokens: the default budget of {env_id!r} ({turns} turn(s) of max_new_tokens="
                     f"{max_new_tokens} and their observations: {default_budget} tokens) is bounded to {budget} "
                     f"so that prompts of {prompt_room} tokens plus the episode fit {limit}; set "
                     "--max-episode-tokens to choose")
    return budget


def resolve_lengths(
    env: Any,
    prompt_sets: Sequence[Any],
    tokenizer: Any,
    *,
    max_new_tokens: int,
    max_prompt_length: int | None,
    max_episode_tokens: int | None,
    context: int | None,
    model: str = "the model",
    context_field: str = "max_position_embeddings",
    seed: int = 0,
) -> Lengths:
    """The run's :class:`Lengths` (module docstring). ``context`` is the smallest context of the
    models that read the policy's sequences (None: not known, nothing bounded). ``ValueError``
    names the lever when they cannot fit: ``--max-new-tokens`` when a turn alone fills the
    context, ``--max-episode-tokens`` when an explicit budget does not fit after the prompts."""
    from textrl.envs.episodes import default_episode_tokens

    env_id = getattr(env, "id", "") or type(env).__name__
    limit = f"the {context} positions of model {model!r} ({context_field} in its config)"
    if context is not None and max_new_tokens >= context:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in {limit}; lower "
                         f"--max-new-tokens below {context}, or choose a model with a longer context")
    longest, measured = longest_prompt(prompt_sets, tokenizer, seed=seed)
    counted = " (chat template included)" if getattr(tokenizer, "chat_template", None) else ""
    found = (f"the longest prompt of {env_id!r} is {longest.where}, {longest.tokens} tokens{counted}"
             + (f", of {longest.measured} sampled rows" if longest.sampled else ""))
    notes: list[str] = []
    source = {"max_prompt_length": "set" if max_prompt_length is not None else "auto",
              "max_episode_tokens": "set" if max_episode_tokens is not None else "auto"}
    prompt_cap, truncate, prompt_room, truncated = _prompt_lengths(
        longest, measured, max_prompt_length, max_new_tokens=max_new_tokens, context=context,
        found=found, limit=limit, notes=notes)
    default_budget = default_episode_tokens(env, max_new_tokens)
    budget = _episode_budget(
        env, max_episode_tokens, default_budget, prompt_cap=prompt_cap, prompt_room=prompt_room,
        max_new_tokens=max_new_tokens, context=context, env_id=env_id, limit=limit, notes=notes)
    return Lengths(max_prompt_length=prompt_cap, max_episode_tokens=budget, truncate=truncate,
                   longest_prompt=longest.tokens, truncated_rows=truncated, notes=notes, source=source)


__all__ = ["EXACT_ROWS", "Lengths", "Longest", "SAMPLE_MARGIN", "SAMPLE_ROWS", "longest_prompt", "resolve_lengths"]
