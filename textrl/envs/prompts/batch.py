"""A batch of left-padded prompts (:class:`PromptBatch`) and where its rows are in the data.

A :class:`PromptBatch` scores responses to its prompts (:meth:`PromptBatch.rollout`, the fast
path) and hands out the collector's runner (:meth:`PromptBatch.episode_runner`).
:func:`batch_rows`, :class:`TrackedBatches` and :func:`placing_rows` place a batch's rows in the
data (``"0-1 = data.jsonl:5"``), so that a reward's error names the rows it failed on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict
from torch import Tensor

from textrl.envs.collector import EpisodeRunner
from textrl.envs.fast_path import rollout_from_responses
from textrl.envs.prompts.rows import batch_fields, raw_prompts
from textrl.keys import KEYS
from textrl.rewards import RewardError

if TYPE_CHECKING:
    from textrl.envs.prompts.dataset import PromptDataset


@dataclass
class PromptBatch:
    """One batch of left-padded prompts; rows ``i*n .. i*n+n-1`` share a prompt (a group)."""

    input_ids: Tensor
    """int64 ``[B, P]``, left-padded with the tokenizer's pad id."""
    attention_mask: Tensor
    """bool ``[B, P]``, True on prompt tokens (a suffix of each row)."""
    prompt_texts: list[str]
    """The templated prompt of each row, as tokenized."""
    rows: list[dict[str, Any]]
    """The dataset fields of each row (``answer``, ``reference``, ...), one copy per sample."""
    prompt_index: list[int]
    """Index of each row's prompt in the sampler's dataset."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> PromptBatch:
        """The same batch with its tensors on ``device``."""
        return PromptBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.prompt_texts,
            self.rows,
            self.prompt_index,
        )

    def select(self, rows: slice) -> PromptBatch:
        """The rows ``rows`` of this batch (e.g. one process's share of a global batch)."""
        return PromptBatch(
            self.input_ids[rows],
            self.attention_mask[rows],
            self.prompt_texts[rows],
            self.rows[rows],
            self.prompt_index[rows],
        )

    def episode_runner(self, env: Any, **settings: Any) -> Any:
        """An :class:`textrl.envs.collector.EpisodeRunner` of ``env`` (an environment, or a reward
        spec / callable: the single-turn task it scores) for batches like this one; ``settings``
        are its keyword arguments (``tokenizer``, ``max_new_tokens``, ...)."""
        return EpisodeRunner(env, **settings)

    def rollout(
        self,
        responses: Tensor,
        *,
        tokenizer: Any,
        reward_fn: Any,
        eos_token_id: int | Sequence[int],
        pad_token_id: int,
        max_new_tokens: int,
        reward_placement: str = "last",
        reward_nonfinite: str = "raise",
    ) -> TensorDict:
        """The token MDP's rollout rows (docs/design.md, "The rollout TensorDict") of ``responses`` to these prompts.

        ``responses`` int64 ``[B, T]`` from the policy's batched ``generate`` (the fast path);
        :func:`textrl.envs.fast_path.rollout_from_responses` pays them as the MDP would, with the raw
        prompts and the rows' fields (``answer``, ...) passed to ``reward_fn`` (a callable or a
        spec string). Adds ``KEYS.score`` float ``[B]``: the task score of each row, the sum
        over time of the task reward (read before any agent shapes the reward with a KL term).
        Tensors live on ``responses.device``.
        """
        if len(self.rows) != len(self):
            raise ValueError(
                f"PromptBatch has {len(self)} prompts but {len(self.rows)} rows of fields; build it "
                "with PromptSampler / encode_prompts"
            )
        device = responses.device
        td = rollout_from_responses(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            responses,
            tokenizer=tokenizer,
            reward_fn=reward_fn,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            max_new_tokens=max_new_tokens,
            reward_placement=reward_placement,
            fields=batch_fields(self.rows),
            prompt_texts=raw_prompts(self.rows),
            reward_nonfinite=reward_nonfinite,
        )
        td.set(KEYS.score, td.get(KEYS.reward).squeeze(-1).sum(1))
        return td


def batch_rows(batch: PromptBatch, dataset: PromptDataset, most: int = 8) -> str:
    """Where the rows of ``batch`` (drawn from ``dataset``) come from, by their positions in it:
    ``"0-1 = data.jsonl:5, 2-3 = data.jsonl:9"``, the first ``most`` prompts named."""
    spans: list[list[int]] = []  # [first, last, dataset row] of each run of one prompt
    for b, i in enumerate(batch.prompt_index):
        if spans and spans[-1][2] == i and spans[-1][1] == b - 1:
            spans[-1][1] = b
        else:
            spans.append([b, b, i])
    named = [f"{a} = {dataset.where(i)}" if a == z else f"{a}-{z} = {dataset.where(i)}" for a, z, i in spans[:most]]
    return ", ".join(named) + (f" and {len(spans) - most} more prompts" if len(spans) > most else "")


class TrackedBatches:
    """Prompt batches of ``dataset``, iterated any number of times, the one handed out last kept
    (``current``) so that a fault in it can be placed in the data (:meth:`rows`)."""

    def __init__(self, batches: Any, dataset: PromptDataset | None) -> None:
        self.batches, self.dataset = batches, dataset
        self.current: PromptBatch | None = None

    def __iter__(self) -> Iterator[PromptBatch]:
        for batch in self.batches:
            self.current = batch
            yield batch

    def __len__(self) -> int:
        return len(self.batches)

    def rows(self) -> str:
        """:func:`batch_rows` of the batch handed out last ('unknown' before any, or without a dataset)."""
        if self.current is None or self.dataset is None:
            return "unknown"
        return batch_rows(self.current, self.dataset)


@contextmanager
def placing_rows(what: str, rows: Callable[[], str]) -> Iterator[None]:
    """A :class:`textrl.rewards.RewardError` raised inside is raised again (one line), its message
    followed by what ran (``"iteration 14"``) and where its batch's rows are in the data
    (``rows()``, e.g. :func:`batch_rows`): the rows a reward's error names are positions in that
    batch. ``...; in iteration 14, batch rows 0-1 = data.jsonl:12, 2-3 = data.jsonl:5``."""
    try:
        yield
    except RewardError as err:
        raise RewardError(f"{err}; in {what}, batch rows {rows()}") from err


__all__ = ["PromptBatch", "TrackedBatches", "batch_rows", "placing_rows"]
