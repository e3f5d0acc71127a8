"""The seeded, resumable prompt sampler (:class:`PromptSampler`).

Its state is ``(seed, epoch, position)`` plus the rows' count, fingerprint and per-row digests,
so that a resume draws the same batches and names the rows edited since (:mod:`textrl.envs.prompts.edits`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from textrl.envs.prompts.batch import PromptBatch, batch_rows
from textrl.envs.prompts.dataset import PromptDataset, load_prompts
from textrl.envs.prompts.edits import edited_rows
from textrl.envs.prompts.encoding import TruncateMode, _Encoder, _truncated_message, encode_prompts


class PromptSampler:
    """Endless seeded batches of prompts, each repeated ``n_samples_per_prompt`` times in a row.

    Every epoch visits every prompt once, in an order drawn from ``numpy.random.default_rng(
    [seed, epoch])`` (private: the global RNGs are untouched); batches run on across epoch
    boundaries, so no prompt is dropped. Because the order of epoch ``e`` depends only on
    ``(seed, e)``, ``state_dict()`` is just ``(seed, epoch, position)`` and a sampler restored
    from it yields exactly the batches the uninterrupted one would have.

    Prompts are templated and tokenized when first drawn (the last ``_CACHE_ROWS`` kept), so
    building a sampler costs no tokenization; a prompt over ``max_prompt_length`` (with
    ``truncate="error"``) or one that tokenizes to nothing is refused by the ``next_batch`` that
    first draws it, the stream left where it was. Run :func:`check_prompts_fit` first to refuse
    such prompts before training (``textrl train`` does).

    Args:
        dataset: a :class:`PromptDataset` or anything :func:`load_prompts` accepts.
        tokenizer: a Hugging Face tokenizer with a pad token; its chat template is applied
            (``add_generation_prompt=True``) when it has one, else the raw prompt is used.
        prompts_per_batch: distinct prompt draws per batch (B = this x n_samples_per_prompt).
        n_samples_per_prompt: consecutive copies of each prompt (a group, for GRPO / RLOO).
        seed: seed of the shuffling.
        max_prompt_length: longest prompt in tokens after templating (None = no limit).
        truncate: ``"error"`` (raise, naming the prompt) or ``"left"`` (keep the last tokens,
            with a warning) for prompts over ``max_prompt_length``.
        shuffle: False visits the prompts in dataset order every epoch.
        held_out: the rows the run evaluates on (a :class:`PromptDataset`), or None; its rows'
            digests go into the state with the sampler's own, so a resume names an edit of them too.

    A resume on a prompt file whose rows' contents were edited since the checkpoint (a bad row
    fixed), with as many rows in the same places, continues with the same batches; the state's
    per-row digests tell which rows changed (:attr:`edited`, :func:`edited_rows`). Rows added,
    removed or reordered are refused.
    """

    def __init__(
        self,
        dataset: PromptDataset | Sequence[Any] | str,
        tokenizer: Any,
        *,
        prompts_per_batch: int,
        n_samples_per_prompt: int = 1,
        seed: int = 0,
        max_prompt_length: int | None = None,
        truncate: TruncateMode = "error",
        shuffle: bool = True,
        held_out: PromptDataset | None = None,
    ) -> None:
        if prompts_per_batch < 1:
            raise ValueError(f"prompts_per_batch must be >= 1, got {prompts_per_batch}")
        if n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        self.dataset = load_prompts(dataset)
        self.tokenizer = tokenizer
        self.prompts_per_batch = prompts_per_batch
        self.n_samples_per_prompt = n_samples_per_prompt
        self.seed = int(seed)
        self.max_prompt_length = max_prompt_length
        self.truncate = truncate
        self.shuffle = shuffle
        self.held_out = held_out
        self.edited: list[dict[str, Any]] = []
        """The rows whose contents the last :meth:`load_state_dict` found changed (:func:`edited_rows`)."""
        self._encoder = _Encoder(self.dataset, tokenizer, max_prompt_length, truncate)
        self._warned_truncation = False
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    @property
    def batch_size(self) -> int:
        """Rows per batch: prompts_per_batch x n_samples_per_prompt."""
        return self.prompts_per_batch * self.n_samples_per_prompt

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def _next_indices(self) -> list[int]:
        picked: list[int] = []
        while len(picked) < self.prompts_per_batch:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.prompts_per_batch - len(picked), len(self._order) - self.position)
            picked += self._order[self.position : self.position + take].tolist()
            self.position += take
        return picked

    def next_batch(self) -> PromptBatch:
        """The next ``prompts_per_batch`` prompts, each repeated ``n_samples_per_prompt`` times.

        A prompt it refuses (too long, tokenizes to nothing) raises ``ValueError`` naming it
        (``FILE:LINE``) and leaves the stream unmoved. The first batch that left-truncates
        prompts (``truncate="left"``) warns, naming them; later ones truncate silently."""
        where = (self.epoch, self.position, self._order)
        indices = self._next_indices()
        n = self.n_samples_per_prompt
        try:
            batch, truncated = self._encoder.batch([i for i in indices for _ in range(n)])
        except Exception:
            self.epoch, self.position, self._order = where
            raise
        if truncated and not self._warned_truncation:
            self._warned_truncation = True
            scope = " in this batch"
            warnings.warn(_truncated_message(self.dataset, truncated, self.max_prompt_length, scope)
                          + "; later batches truncate without a warning", stacklevel=2)
        return batch

    def __iter__(self) -> Iterator[PromptBatch]:
        while True:
            yield self.next_batch()

    def batch_rows(self, batch: PromptBatch) -> str:
        """Where the rows of ``batch`` (one of this sampler's) come from: :func:`batch_rows`."""
        return batch_rows(batch, self.dataset)

    def encode_eval(
        self, dataset: PromptDataset | Sequence[Any], batch_size: int | None = None
    ) -> list[PromptBatch]:
        """A fixed eval set with this sampler's tokenizer and length rules, in order, n = 1."""
        return encode_prompts(
            dataset,
            self.tokenizer,
            max_prompt_length=self.max_prompt_length,
            truncate=self.truncate,
            batch_size=batch_size,
        )

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream; enough to resume it exactly (JSON-serialisable). With each
        row's digest (``row_digests``: :meth:`PromptDataset.row_digests`; ``held_out``: the
        held-out rows' count and digests) so that a resume can accept edited rows, naming them."""
        state = {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "shuffle": self.shuffle,
            "num_prompts": len(self.dataset),
            "fingerprint": self.dataset.fingerprint(),
            "row_digests": self.dataset.row_digests(),
        }
        if self.held_out is not None:
            state["held_out"] = {"num_prompts": len(self.held_out), "row_digests": self.held_out.row_digests()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: the dataset must be the one the state was taken on, or that
        dataset with some rows' contents edited (as many rows, in the same order: the batches
        are drawn as before), which :attr:`edited` then names. A state without per-row digests
        (an older checkpoint) needs the very same rows. ``ValueError`` says what changed; the
        sampler is left as it was."""
        edited = self._edited_since(state)
        self.edited = edited
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)

    def _edited_since(self, state: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The rows (training, then held-out) edited since ``state`` was taken (:func:`edited_rows`)."""
        if "row_digests" not in state:  # saved before per-row digests: the same rows or nothing
            same = state["num_prompts"] == len(self.dataset)
            if not (same and self.dataset._has_fingerprint(state["fingerprint"])):
                raise ValueError(
                    f"sampler state was saved on a different prompt dataset ({state['num_prompts']} "
                    f"prompts, fingerprint {state['fingerprint']}) than this one ({len(self.dataset)} "
                    f"prompts, fingerprint {self.dataset.fingerprint()}); resume with the same dataset "
                    "and split"
                )
            return []
        sets = [(state["num_prompts"], state["row_digests"], self.dataset, "training prompts")]
        held = state.get("held_out")
        if held is not None and self.held_out is not None:
            sets.append((held["num_prompts"], held["row_digests"], self.held_out, "held-out prompts"))
        return edited_rows(*sets)


__all__ = ["PromptSampler"]
