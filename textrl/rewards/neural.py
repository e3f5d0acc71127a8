"""A neural reward model as a reward function: ``NeuralReward`` (registry name ``"reward_model"``).

``NeuralReward(model, tokenizer)`` wraps a scalar ``*ForSequenceClassification`` model
(``num_labels=1``) and its own tokenizer; ``NeuralReward.from_pretrained(path_or_id)`` loads both
(``"tiny"`` is the offline tiny reward model), and the registry spec
``"reward_model:/path/to/model[:weight]"`` goes through :func:`load_neural_reward`.

How a row is scored, in order:

1. **Text in, text re-encoded.** The reward function receives the policy's completions decoded
   to text, so policy and reward tokenizers may differ: the text is re-encoded with the reward
   model's own tokenizer. ``completion_ids`` in the batch fields are ignored (the text is
   authoritative); a caller holding policy token ids decodes them first, e.g. with
   :meth:`NeuralReward.decode_completions`.
2. **Rendering.** With ``use_chat_template=True`` and a reward tokenizer that has a chat
   template, the row is ``[{"role": "user", "content": prompt}, {"role": "assistant",
   "content": completion}]`` rendered by that template (``tokenize=False``) and encoded without
   extra special tokens. A prompt that is already ChatML-rendered (contains ``<|im_start|>``
   turns) is parsed back into its messages first, as MiniMind does. A conversational row
   (TRL's form: the prompt a list of messages, the completion a list of messages) is the whole
   conversation, ``prompt + completion`` messages, rendered the same way. Otherwise the text is
   ``prompt + completion`` encoded with the tokenizer's usual special tokens (messages: their
   texts joined by newlines, :func:`~textrl.rewards.base.conversation_text`).
3. **Truncation.** Sequences longer than ``max_length`` keep their *last* ``max_length`` tokens:
   the score is read at the final token, so the end of the completion must survive, and the
   tokens dropped are the start of the rendered prompt (system turn, beginning of the user
   message; the completion's start too if it alone is longer). ``max_length=None`` means the
   model's context: the smaller of ``tokenizer.model_max_length`` (when set) and
   ``config.max_position_embeddings`` / ``config.n_positions``.
4. **Batched forward.** Rows are sorted by length and scored ``batch_size`` at a time (never
   one by one), left-padded with the reward tokenizer's pad token, with ``attention_mask`` and
   explicit ``position_ids = clamp(cumsum(mask) - 1, min=0)``, so an absolute-position model
   (GPT-2) scores a left-padded row exactly as it scores the row alone. The score is the score
   head's output at the last position, which with left padding is every row's last real token
   (read from ``model.score`` per-token logits when the model has that head, which holds even
   when a row ends in the pad id; otherwise from HF's pooled logits). ``torch.no_grad``, model
   in eval mode for the call (its train/eval mode is restored afterwards). With
   ``padding_free`` (a run's ``--padding-free``, set by :meth:`NeuralReward.place`) each batch runs
   on its real tokens only: rows end to end, positions restarting per row, no attention across
   rows (:func:`textrl.models.packing.pack_last_tokens` in the layout
   :func:`textrl.models.packed_forward.scorer_layout` probes, the policy's layouts), the score
   read from the score head's per-token outputs at each row's last token; the same scores to
   float32 rounding.
5. **Post-processing** of a raw score ``r``: ``s = clip(r - baseline, *clip)`` (``clip=None``
   skips clipping). With ``answer_blend=(w_whole, w_answer)`` (MiniMind uses ``(0.4, 0.6)``)
   and a completion containing ``<answer>...</answer>``, the result is
   ``w_whole * s(whole completion) + w_answer * s(answer)`` where ``answer`` is the stripped
   content of the *first* answer block, scored as the assistant turn after the same prompt;
   without an answer block it is ``s(whole completion)``. For a message completion the answer
   block is looked for in its last assistant message, which the answer then replaces.

The result is float32 ``[B]`` on ``output_device`` (CPU by default), detached.
"""

from __future__ import annotations

import inspect
import math
import os
import re
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from textrl.models.forward import positions_from_mask
from textrl.models.packed_forward import packed_scores, scorer_layout
from textrl.models.packing import pack_last_tokens
from textrl.rewards.base import (
    Completion,
    Message,
    Prompt,
    check_batch,
    check_finite_weight,
    completion_text,
    conversation_text,
    last_assistant,
    token_lists,
)
from textrl.rewards.rules import tag_content

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_CHATML_TURN = re.compile(r"<\|im_start\|>(system|user|assistant)\s+(.*?)<\|im_end\|>", re.DOTALL)
_UNSET_MAX_LENGTH = 10**8  # HF uses a huge sentinel when model_max_length is unknown


def _vocab_slack(n_tokens: int) -> int:
    """How many unused rows an embedding table may carry beyond the tokenizer (padded vocabs)."""
    return max(256, n_tokens // 50)


def _context_length(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int | None:
    limits = []
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < _UNSET_MAX_LENGTH:
        limits.append(tok_max)
    config = model.config
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            limits.append(value)
            break
    return min(limits) if limits else None


def _messages(prompt: Prompt) -> list[dict[str, Any]]:
    """A prompt's messages: a message list copied, a ChatML-rendered prompt parsed back into its
    turns, any other text as the user turn."""
    if not isinstance(prompt, str):
        return [dict(m) for m in prompt]
    if "<|im_start|>" in prompt:
        turns = _CHATML_TURN.findall(prompt)
        if turns:
            return [{"role": role, "content": content.strip()} for role, content in turns]
    return [{"role": "user", "content": prompt}]


def _with_answer(completion: Completion, answer: str) -> Completion:
    """The completion with its (last assistant message's) text replaced by ``answer``."""
    if isinstance(completion, str):
        return answer
    messages: list[Message] = [dict(m) for m in completion]
    j = last_assistant(messages)
    messages[j] = {**messages[j], "content": answer}  # type: ignore[index]
    return messages


class NeuralReward:
    """A reward model's scalar score of ``(prompt, completion)`` text; see the module docstring.

    Args:
        model: a scalar sequence-classification model (``config.num_labels == 1``). When its
            ``config.pad_token_id`` is unset it is set to the tokenizer's pad id (HF needs it
            for batches).
        tokenizer: the reward model's *own* tokenizer; it must have a pad token.
        batch_size: rows per forward pass.
        max_length: token budget per row, truncated from the left; ``None`` = model context.
        clip: ``(low, high)`` applied after subtracting ``baseline``; ``None`` = no clipping.
        baseline: subtracted from every raw score.
        use_chat_template: render rows with the reward tokenizer's chat template when it has one.
        answer_blend: ``None`` or ``(w_whole, w_answer)``, e.g. MiniMind's ``(0.4, 0.6)``.
        policy_tokenizer: optional; only used by :meth:`decode_completions`. Its vocab may
            differ from the reward tokenizer's (scoring goes through text).
        output_device: where the returned scores live (default CPU).
        check_vocab: check at construction that ``tokenizer`` fits ``model``'s embedding table.
        autocast: a context factory every forward runs under (a run's
            :meth:`textrl.core.precision.Precision.autocast`); default none. :meth:`place` sets it
            together with the model's device and dtype.
        padding_free: score each batch on its real tokens only (step 4 of the module docstring).

    Raises ``ValueError`` at construction when the tokenizer has no pad token, the model's
    vocab does not match the tokenizer (a tokenizer of another model), or the head is not
    scalar.
    """

    name = "reward_model"

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        batch_size: int = 32,
        max_length: int | None = None,
        clip: tuple[float, float] | None = (-3.0, 3.0),
        baseline: float = 0.0,
        use_chat_template: bool = True,
        answer_blend: tuple[float, float] | None = None,
        policy_tokenizer: PreTrainedTokenizerBase | None = None,
        output_device: torch.device | str = "cpu",
        check_vocab: bool = True,
        autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
        padding_free: bool = False,
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"NeuralReward: batch_size must be a positive int, got {batch_size!r}")
        if tokenizer is None:
            raise ValueError(
                "NeuralReward: no reward tokenizer; pass the reward model's own tokenizer (the "
                "policy's may differ: scoring goes through text), or load both with "
                "NeuralReward.from_pretrained(path)"
            )
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "NeuralReward: the reward tokenizer has no pad token, so batches cannot be "
                "padded; set one, e.g. tokenizer.pad_token = tokenizer.eos_token (or load it "
                "with textrl.models.load_tokenizer, which does that)"
            )
        num_labels = getattr(model.config, "num_labels", 1)
        if num_labels != 1:
            raise ValueError(
                f"NeuralReward: the model has num_labels={num_labels}; a reward model has a "
                "scalar head (load it with num_labels=1, e.g. textrl.models.load_reward_model)"
            )
        if check_vocab:
            self._check_vocab(model, tokenizer)
        if getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = tokenizer.pad_token_id

        self.model = model.eval()
        self.max_length = self._check_max_length(max_length, model, tokenizer)
        self._keep_scoring(tokenizer, policy_tokenizer, batch_size, clip, baseline, use_chat_template, answer_blend,
                           output_device, "NeuralReward")
        self.autocast = autocast
        self.padding_free = bool(padding_free)
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        self._pass_position_ids = "position_ids" in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
        )

    def _keep_scoring(self, tokenizer: Any, policy_tokenizer: Any, batch_size: int, clip: tuple[float, float] | None,
                      baseline: float, use_chat_template: bool, answer_blend: tuple[float, float] | None,
                      output_device: torch.device | str, who: str) -> None:
        """Keep the settings a reward model scores with, the clip, baseline and blend checked (``who``
        names the class in the messages): the in-process model's and a served one's
        (:class:`textrl.rewards.served.ServedReward`)."""
        self.tokenizer = tokenizer
        self.policy_tokenizer = policy_tokenizer
        self.batch_size = batch_size
        self.clip = self._check_clip(clip)
        self.baseline = check_finite_weight(baseline, f"{who} baseline")
        self.use_chat_template = bool(use_chat_template) and bool(getattr(tokenizer, "chat_template", None))
        self.answer_blend = self._check_blend(answer_blend)
        self.output_device = torch.device(output_device)

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | os.PathLike[str],
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        tokenizer: str | os.PathLike[str] | PreTrainedTokenizerBase | None = None,
        **options: Any,
    ) -> NeuralReward:
        """Load model and tokenizer from a local path or hub id (``"tiny"``: offline tiny RM).

        ``tokenizer`` overrides where the tokenizer comes from (default: ``path_or_id``; for
        ``"tiny"``, the tiny reward model's directory). ``options`` are the constructor's
        keyword arguments.
        """
        from textrl.models import TINY_NAMES, load_reward_model, load_tokenizer, tiny_model_path

        model = load_reward_model(path_or_id, dtype=dtype, device=device)
        if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
            source = path_or_id if tokenizer is None else tokenizer
            if os.fspath(source) in TINY_NAMES:  # not the tiny causal LM's directory
                source = tiny_model_path("reward_model")
            tokenizer = load_tokenizer(source)
        return cls(model, tokenizer, **options)

    # -- construction checks ----------------------------------------------------------------

    @staticmethod
    def _check_vocab(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        embeddings = (
            model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        )
        model_vocab = getattr(embeddings, "num_embeddings", None) or getattr(
            model.config, "vocab_size", None
        )
        n_tokens = len(tokenizer)
        if model_vocab is None:
            return
        # Embedding tables are often padded past the tokenizer (Qwen: 151936 rows for 151665
        # tokens), so a little slack is allowed; fewer rows than tokens never is.
        if n_tokens > model_vocab or model_vocab - n_tokens > _vocab_slack(n_tokens):
            raise ValueError(
                f"NeuralReward: the reward model's vocab size is {model_vocab} but its tokenizer "
                f"has {n_tokens} tokens; this tokenizer belongs to another model. Pass the reward "
                "model's own tokenizer (the policy's tokenizer may differ: pass it as "
                "policy_tokenizer=, scoring goes through text)"
            )

    @staticmethod
    def _check_max_length(
        max_length: int | None, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
    ) -> int | None:
        if max_length is None:
            return _context_length(model, tokenizer)
        if not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"NeuralReward: max_length must be a positive int, got {max_length!r}")
        return max_length

    @staticmethod
    def _check_clip(clip: tuple[float, float] | None) -> tuple[float, float] | None:
        if clip is None:
            return None
        try:
            low, high = (float(c) for c in clip)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"NeuralReward: clip must be (low, high) or None, got {clip!r}"
            ) from err
        if math.isnan(low) or math.isnan(high) or low > high:
            raise ValueError(
                f"NeuralReward: clip must be (low, high) with low <= high, got {clip!r}"
            )
        return low, high

    @staticmethod
    def _check_blend(blend: tuple[float, float] | None) -> tuple[float, float] | None:
        if blend is None:
            return None
        if not isinstance(blend, (tuple, list)) or len(blend) != 2:
            raise ValueError(
                f"NeuralReward: answer_blend must be (w_whole, w_answer), e.g. (0.4, 0.6), "
                f"or None; got {blend!r}"
            )
        return (
            check_finite_weight(blend[0], "NeuralReward answer_blend[0]"),
            check_finite_weight(blend[1], "NeuralReward answer_blend[1]"),
        )

    # -- text -> ids --------------------------------------------------------------------------

    @staticmethod
    def conversation(prompt: Prompt, completion: Completion) -> list[dict[str, Any]]:
        """The row as chat messages: the prompt's messages, then the completion's (a str
        completion is one assistant message)."""
        if isinstance(completion, str):
            tail: list[dict[str, Any]] = [{"role": "assistant", "content": completion}]
        else:
            tail = [dict(m) for m in completion]
        return _messages(prompt) + tail

    def render(self, prompt: Prompt, completion: Completion) -> str:
        """The text the reward model reads for one row (step 2 of the module docstring)."""
        if not self.use_chat_template:
            return conversation_text(prompt) + conversation_text(completion)
        messages = self.conversation(prompt, completion)
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def encode(
        self, prompts: Sequence[Prompt], completions: Sequence[Completion]
    ) -> list[list[int]]:
        """Reward-tokenizer ids per row, truncated from the left to ``max_length``."""
        texts = [self.render(p, c) for p, c in zip(prompts, completions)]
        if not texts:
            return []
        ids = self.tokenizer(texts, add_special_tokens=not self.use_chat_template, verbose=False)[
            "input_ids"
        ]
        if self.max_length is not None:
            ids = [row[-self.max_length :] for row in ids]
        return [list(row) for row in ids]

    def decode_completions(self, completion_ids: Any, completion_mask: Any = None) -> list[str]:
        """Policy token ids (lists, or ``[B, T]`` + mask) -> text, with ``policy_tokenizer``."""
        if self.policy_tokenizer is None:
            raise ValueError(
                "NeuralReward.decode_completions needs the policy's tokenizer: construct with "
                "policy_tokenizer=..., or decode the completions yourself and pass text"
            )
        n = len(completion_ids)
        rows = token_lists(completion_ids, completion_mask, n, "NeuralReward.decode_completions")
        return self.policy_tokenizer.batch_decode(rows, skip_special_tokens=True)

    def place(self, precision: Any, *, padding_free: bool | None = None) -> NeuralReward:
        """Run on a training run's device in its precision (a :class:`textrl.core.precision.Precision`):
        the model moved there in the frozen models' dtype (``frozen_dtype``: bf16 on CUDA by
        default, else the weights' dtype), every forward under its autocast; ``padding_free``
        the run's (None: left as it is). Returns self."""
        self.model = precision.prepare_frozen(self.model)
        self.autocast = precision.autocast
        if padding_free is not None:
            self.padding_free = bool(padding_free)
        return self

    # -- scoring ------------------------------------------------------------------------------

    def _device(self) -> torch.device:
        try:
            return next(self.model.parameters()).device
        except StopIteration:
            return torch.device("cpu")

    def _forward(self, rows: list[list[int]]) -> Tensor:
        """Raw scores of equal-or-unequal-length id rows, one left-padded batch. -> float32 [N]."""
        device = self._device()
        n, width = len(rows), max(len(r) for r in rows)
        input_ids = torch.full((n, width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, row in enumerate(rows):
            if row:
                input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
                mask[i, width - len(row) :] = 1
        if self.padding_free:
            return self._packed_forward(input_ids.to(device), mask.to(device))
        inputs = {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}
        if self._pass_position_ids:
            inputs["position_ids"] = positions_from_mask(mask).to(device)  # [N, W]

        captured: list[Tensor] = []
        head = getattr(self.model, "score", None)
        hook = (
            head.register_forward_hook(lambda _m, _i, out: captured.append(out))
            if isinstance(head, torch.nn.Module)
            else None
        )
        try:
            with self.autocast():
                logits = self.model(**inputs).logits  # [N, 1], pooled by HF
        finally:
            if hook is not None:
                hook.remove()
        per_token = captured[-1] if captured else None  # [N, W, 1] from the score head
        if isinstance(per_token, Tensor) and tuple(per_token.shape[:2]) == (n, width):
            return per_token[:, -1, 0].float()  # left padding: the last position is real
        return logits.reshape(n, -1)[:, 0].float()

    def _packed_forward(self, input_ids: Tensor, mask: Tensor) -> Tensor:
        """Raw scores float32 ``[N]`` of a left-padded batch ``[N, W]`` on its real tokens only
        (:func:`textrl.models.packing.pack_last_tokens`, :func:`textrl.models.packed_forward.packed_scores`)."""
        with self.autocast():
            packing = pack_last_tokens(input_ids, mask, scorer_layout(self.model, input_ids.device))
            scores = packed_scores(self.model, packing)  # [n, 1]
        return packing.scatter(scores[:, 0].float())[:, 0]

    def score_raw(self, prompts: Sequence[Prompt], completions: Sequence[Completion]) -> Tensor:
        """The model's raw score per row (no baseline, clip or answer blend). -> float32 [B]."""
        ids = self.encode(prompts, completions)
        out = torch.zeros(len(ids), dtype=torch.float32)
        if not ids:
            return out
        empty = [i for i, row in enumerate(ids) if not row]
        if empty:
            raise ValueError(
                f"NeuralReward: rows {empty[:10]} encode to no tokens; give the reward model "
                "some text to read (use_chat_template=True renders at least the template)"
            )
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # less padding per batch
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for start in range(0, len(order), self.batch_size):
                    chunk = order[start : start + self.batch_size]
                    scores = self._forward([ids[i] for i in chunk]).cpu()
                    out[torch.tensor(chunk)] = scores
        finally:
            self.model.train(was_training)
        return out

    def _post(self, raw: Tensor) -> Tensor:
        s = raw - self.baseline
        if self.clip is not None:
            s = s.clamp(self.clip[0], self.clip[1])
        return s

    def __call__(
        self, prompts: list[Prompt], completions: list[Completion], **fields: Any
    ) -> Tensor:
        """Scores, float32 ``[B]`` on ``output_device``. ``fields`` (incl. ids) are ignored."""
        n = check_batch(prompts, completions)
        rows_p, rows_c = list(prompts), list(completions)
        answer_rows: list[int] = []
        if self.answer_blend is not None:
            for i, completion in enumerate(completions):
                found = tag_content(completion_text(completion), "<answer>", "</answer>")  # linear
                if found is not None:
                    answer_rows.append(i)
                    rows_p.append(prompts[i])
                    rows_c.append(_with_answer(completion, found.strip()))
        s = self._post(self.score_raw(rows_p, rows_c))  # [B + n_answers], one batched pass
        score = s[:n].clone()
        if answer_rows:
            w_whole, w_answer = self.answer_blend  # type: ignore[misc]
            idx = torch.tensor(answer_rows)
            score[idx] = w_whole * score[idx] + w_answer * s[n:]
        return score.to(self.output_device)

    def __repr__(self) -> str:
        model = getattr(self.model.config, "_name_or_path", "") or type(self.model).__name__
        return (
            f"NeuralReward({model!r}, batch_size={self.batch_size}, max_length={self.max_length}, "
            f"clip={self.clip}, baseline={self.baseline:g}, answer_blend={self.answer_blend}"
            + (", padding_free=True)" if self.padding_free else ")")
        )


def load_neural_reward(argument: str, **settings: Any) -> NeuralReward:
    """Loader of the ``reward_model:<path or hub id>`` scheme: ``NeuralReward.from_pretrained``."""
    path = argument.strip()
    if not path:
        raise ValueError(
            "reward 'reward_model:' names no model; write reward_model:/path/to/model "
            "(a local directory, a hub id, or 'tiny')"
        )
    return NeuralReward.from_pretrained(path, **settings)


__all__ = ["NeuralReward", "load_neural_reward"]
