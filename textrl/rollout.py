"""Collecting rollouts with an agent: generate, score, hand to the agent, check.

:func:`collect` is phase 1-2 of the training loop (rollout and rewards) for one
:class:`envs.prompts.PromptBatch`: the agent samples responses with batched ``model.generate``
(its fast path), :func:`envs.rollout_from_responses` turns them into the DESIGN.md §3 rows the
token MDP would pay, and the agent fills in log-probs, values and advantages.
:func:`evaluate_prompts` scores held-out prompts without touching the agent's state.

The agent is duck-typed; these functions use only ``agent.act(input_ids, attention_mask,
greedy=...) -> int64 [B, T]``, optionally ``agent.process_rollout(td) -> td``, and the attributes
``config`` (``max_new_tokens``), ``tokenizer``, ``eos_token_id``, ``pad_token_id`` and ``device``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from envs.fast_path import RewardLike, as_reward_fn, rollout_from_responses, row_messages
from envs.prompts import PromptBatch
from textrl.checks import check_rollout
from textrl.keys import KEYS

SCORE_KEY = "score"
"""float ``[B]``: each row's task score (the weighted reward before any KL shaping)."""

_PROMPT_FIELDS = ("prompt", "messages")


def batch_fields(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """The rows' reward fields as a dict of lists (``prompt`` / ``messages`` left out).

    A field missing from some rows is ``None`` there, so every list has one entry per row.

    >>> batch_fields([{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    {'answer': ['1', None]}
    """
    names: dict[str, None] = {}
    for row in rows:
        names.update((k, None) for k in row if k not in _PROMPT_FIELDS)
    return {name: [row.get(name) for row in rows] for name in names}


def raw_prompts(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The text the reward functions see for each row: the raw prompt, no chat template
    (for a conversation, its last user turn)."""
    return [row_messages(row, i)[1] for i, row in enumerate(rows)]


def _max_new_tokens(agent: Any, max_new_tokens: int | None) -> int:
    if max_new_tokens is not None:
        return int(max_new_tokens)
    value = getattr(getattr(agent, "config", None), "max_new_tokens", None)
    if value is None:
        raise ValueError(
            "max_new_tokens is None and the agent has no config.max_new_tokens; pass "
            "max_new_tokens= (the generation limit the agent's act() uses)"
        )
    return int(value)


def _score_rows(
    agent: Any,
    batch: PromptBatch,
    responses: torch.Tensor,
    reward_fn: Callable[..., Any],
    reward_placement: str,
    max_new_tokens: int | None,
) -> TensorDictBase:
    """The fast-path rollout rows of ``responses`` ``[B, T]`` plus ``"score"`` ``[B]``."""
    if len(batch.rows) != len(batch):
        raise ValueError(
            f"PromptBatch has {len(batch)} prompts but {len(batch.rows)} rows of fields; build it "
            "with PromptSampler / encode_prompts"
        )
    device = torch.device(agent.device)
    td = rollout_from_responses(
        batch.input_ids.to(device),
        batch.attention_mask.to(device),
        responses.to(device),
        tokenizer=agent.tokenizer,
        reward_fn=reward_fn,
        eos_token_id=agent.eos_token_id,
        pad_token_id=agent.pad_token_id,
        max_new_tokens=_max_new_tokens(agent, max_new_tokens),
        reward_placement=reward_placement,
        fields=batch_fields(batch.rows),
        prompt_texts=raw_prompts(batch.rows),
    )
    # Read before the agent shapes ("next","reward") with a KL penalty: the task score alone.
    td.set(SCORE_KEY, td.get(KEYS.reward).squeeze(-1).sum(1))
    return td


def collect(
    agent: Any,
    batch: PromptBatch,
    reward_fn: RewardLike,
    *,
    reward_placement: str = "last",
    max_new_tokens: int | None = None,
) -> TensorDictBase:
    """One rollout TensorDict (DESIGN.md §3, ``batch_size=[B]``) for a batch of prompts.

    1. ``agent.act`` samples a response per row (micro-batched generation inside the agent);
    2. :func:`envs.rollout_from_responses` scores them with ``reward_fn`` (a callable or a spec
       string such as ``"think_format,tag_count"``) and writes the tokens, masks, done flags,
       ``("next","reward")`` (placed by ``reward_placement``) and ``("reward_components", name)``;
       ``"score"`` float ``[B]`` is each row's task score, the sum over time of the task reward
       (equal to the weighted reward total; exact for ``"last"``, up to float rounding for
       ``"uniform"``), kept so it survives the KL shaping of the next step;
    3. ``agent.process_rollout(td)`` (when the agent has it) adds log-probs, values, KL shaping,
       ``advantage`` and ``value_target``;
    4. :func:`textrl.checks.check_rollout` validates the result.

    Every tensor is on ``agent.device``. ``max_new_tokens`` defaults to
    ``agent.config.max_new_tokens``; it must be the limit ``act`` generated with, since a row
    without EOS is only valid at full length.
    """
    reward_fn = as_reward_fn(reward_fn)
    device = torch.device(agent.device)
    # 1. rollout
    responses = agent.act(
        batch.input_ids.to(device), batch.attention_mask.to(device), greedy=False
    )  # [B, T]
    # 2. rewards
    td = _score_rows(agent, batch, responses, reward_fn, reward_placement, max_new_tokens)
    # 3. log-probs, values, advantages
    process = getattr(agent, "process_rollout", None)
    if callable(process):
        td = process(td)
    # 4. checks
    return check_rollout(td)


def evaluate_prompts(
    agent: Any,
    prompt_batches: Iterable[PromptBatch],
    reward_fn: RewardLike,
    greedy: bool = True,
    *,
    max_new_tokens: int | None = None,
) -> dict[str, float]:
    """Held-out evaluation: generate for every prompt once and average the task rewards.

    Returns flat float metrics over all rows: ``reward/mean`` (the weighted task score, no KL),
    ``reward_components/NAME`` (each reward function's raw mean), ``response_length/mean``
    (valid tokens, EOS included), ``truncated/rate`` (rows that hit ``max_new_tokens``),
    ``format_rate`` (fraction with ``think_format > 0``, only when that component exists) and
    ``accuracy`` (mean of the ``accuracy`` component, only when it exists). ``n`` is the row
    count. The agent's state is untouched (no ``process_rollout``).
    """
    reward_fn = as_reward_fn(reward_fn)
    device = torch.device(agent.device)
    scores, lengths, truncated = [], [], []
    components: dict[str, list[torch.Tensor]] = {}
    for batch in prompt_batches:
        responses = agent.act(
            batch.input_ids.to(device), batch.attention_mask.to(device), greedy=greedy
        )
        td = _score_rows(agent, batch, responses, reward_fn, "last", max_new_tokens)
        scores.append(td.get(SCORE_KEY).float().cpu())
        lengths.append(td.get(KEYS.mask).sum(1).float().cpu())
        truncated.append(td.get(KEYS.truncated).squeeze(-1).any(1).float().cpu())
        for name, value in td.get(KEYS.reward_components).items():
            components.setdefault(name, []).append(value.float().cpu())
    if not scores:
        raise ValueError("evaluate_prompts: no prompt batches given; pass at least one batch")
    comp = {name: torch.cat(values) for name, values in components.items()}
    metrics = {
        "reward/mean": torch.cat(scores).mean().item(),
        "response_length/mean": torch.cat(lengths).mean().item(),
        "truncated/rate": torch.cat(truncated).mean().item(),
        "n": float(sum(s.numel() for s in scores)),
    }
    metrics.update({f"reward_components/{name}": v.mean().item() for name, v in comp.items()})
    if "think_format" in comp:
        metrics["format_rate"] = (comp["think_format"] > 0).float().mean().item()
    if "accuracy" in comp:
        metrics["accuracy"] = comp["accuracy"].mean().item()
    return metrics


__all__ = [
    "SCORE_KEY",
    "batch_fields",
    "collect",
    "evaluate_prompts",
    "raw_prompts",
]
