"""The generate fast path of the token MDP, and the pieces both environments share with it.

The token-level MDP (:class:`textrl.envs.TokenMDPEnv`, :class:`textrl.envs.TextGenEnv`) is the specification;
batched ``model.generate`` is a faster way of executing it. :func:`rollout_from_responses` turns
generated responses into the rollout TensorDict (docs/design.md, "The rollout TensorDict"), and both environments score a
finished episode with the same :func:`score_completions` and place the score with the same
:func:`place_score`, so an environment stepped through the same tokens pays exactly the rewards
of the fast path (tests/envs prove it).

MDP semantics used everywhere here:

* an episode ends at its first EOS (``terminated``, the EOS is an action and is valid) or after
  ``max_new_tokens`` actions without EOS (``truncated``);
* a pad token emitted as an action is an ordinary token: padding only ever *follows* the end of
  an episode, so the valid length of a row is ``first EOS + 1`` or ``max_new_tokens``
  (``response_mask(..., pad_token_id=None)``), also when ``pad_token_id == eos_token_id``.

:class:`PromptTable` is the prompt side shared by the two environments: rows, chat template,
lazy tokenisation with a cache, the empty / too-long checks, and the per-row reward fields.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from textrl.rewards import RewardError, call_reward, parse_reward_spec, reward_name
from torch import Tensor

from textrl.checks import check_rollout
from textrl.functional import kl_shaped_rewards, response_mask
from textrl.keys import KEYS, RolloutKeys

PLACEMENTS = ("last", "uniform")
NONFINITE_POLICIES = ("raise", "zero", "drop")
"""What a NaN/inf task reward does: raise a RewardError, count the row with score 0, or drop it."""
TRUNCATE_MODES = ("error", "left")
DEFAULT_REWARD = "think_format,tag_count"
RESERVED_FIELDS = ("completion_ids", "truncated")
"""Batch fields :func:`score_completions` passes itself; a prompt row may not use these names."""

RewardLike = str | Callable[..., Any]


# --------------------------------------------------------------------------------------------
# tokenizer and reward helpers


@functools.cache
def default_tokenizer() -> Any:
    """The tiny offline ChatML tokenizer, built once per process (it takes ~3 s to build)."""
    from textrl.models import build_tiny_tokenizer

    return build_tiny_tokenizer()


def special_ids(
    tokenizer: Any, eos_token_id: int | Sequence[int] | None, pad_token_id: int | None
) -> tuple[tuple[int, ...], int]:
    """``(eos ids, pad id)`` from the arguments, else from the tokenizer; pad falls back to EOS."""
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    if eos is None:
        raise ValueError(
            "the tokenizer has no eos_token_id and none was given: pass eos_token_id=... "
            "(the token that ends an episode)"
        )
    eos_ids = (int(eos),) if isinstance(eos, (int, np.integer)) else tuple(int(e) for e in eos)
    if not eos_ids:
        raise ValueError("eos_token_id is an empty list: give at least one id")
    pad = tokenizer.pad_token_id if pad_token_id is None else pad_token_id
    return eos_ids, int(eos_ids[0] if pad is None else pad)


def as_reward_fn(reward: RewardLike) -> Callable[..., Any]:
    """A reward spec string (``"think_format,tag_count:0.5"``) or a callable -> reward function."""
    if isinstance(reward, str):
        return parse_reward_spec(reward)
    if callable(reward):
        return reward
    raise ValueError(
        f"reward={reward!r}: pass a spec string such as {DEFAULT_REWARD!r} or a callable "
        "fn(prompts, completions, **kwargs) -> float [B]"
    )


def reward_component_names(reward_fn: Callable[..., Any]) -> list[str]:
    """Names of the ``("reward_components", name)`` entries ``reward_fn`` produces."""
    weights = getattr(reward_fn, "weights", None)
    if callable(getattr(reward_fn, "components", None)) and isinstance(weights, Mapping):
        return list(weights)
    return [reward_name(reward_fn)]


@dataclass(frozen=True)
class Scores:
    """What :func:`score_completions` returns for a batch of ``B`` finished responses."""

    total: Tensor
    """float32 ``[B]``: the task reward (weighted sum of the components)."""
    components: dict[str, Tensor]
    """name -> float32 ``[B]`` raw score of each reward function."""
    completions: list[str]
    """the decoded completions (valid tokens, ``skip_special_tokens=True``)."""
    nonfinite: Tensor | None = None
    """bool ``[B]``: rows whose total was NaN/inf, set to 0 (``nonfinite`` 'zero' / 'drop' only)."""


def score_completions(
    reward_fn: Callable[..., Any],
    prompts: Sequence[str],
    responses: Tensor,
    mask: Tensor,
    *,
    tokenizer: Any,
    truncated: Tensor | None = None,
    fields: Mapping[str, Sequence[Any]] | None = None,
    nonfinite: str = "raise",
) -> Scores:
    """Decode and score ``B`` finished responses; the one scoring path of the envs and fast path.

    prompts: ``B`` prompt texts; responses: int ``[B, T]``; mask: bool ``[B, T]`` prefix of valid
    tokens (EOS included); truncated: bool ``[B]`` (rows that hit ``max_new_tokens``); fields:
    per-row batch fields (e.g. ``answer``) passed to the reward functions with
    ``completion_ids`` (valid ids per row) and ``truncated``. A :class:`textrl.rewards.CompositeReward`
    reports each component; any other callable reports one component under its name. A reward
    function that raises or returns NaN / a wrong shape raises :class:`textrl.rewards.RewardError`.
    Rewards must be row-wise (a row's score does not depend on the other rows of the batch) for
    an environment, which scores rows as they finish, to match the fast path exactly.

    ``nonfinite`` (one of :data:`NONFINITE_POLICIES`): with ``"zero"`` or ``"drop"`` a NaN/inf
    score does not raise; the row's total and its non-finite components become 0 and
    ``Scores.nonfinite`` marks it (the caller drops it under ``"drop"``).
    """
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"reward_nonfinite={nonfinite!r}: must be one of {NONFINITE_POLICIES}")
    if responses.dim() != 2 or mask.shape != responses.shape:
        raise ValueError(
            f"responses {tuple(responses.shape)} and mask {tuple(mask.shape)} must both be [B, T]"
        )
    b = responses.shape[0]
    if len(prompts) != b:
        raise ValueError(f"{len(prompts)} prompts for {b} responses; pass one prompt per row")
    ids = [row[m].tolist() for row, m in zip(responses.cpu(), mask.cpu())]
    completions = tokenizer.batch_decode(ids, skip_special_tokens=True)
    if truncated is None:
        truncated = torch.zeros(b, dtype=torch.bool)
    kwargs: dict[str, Any] = dict(fields or {})
    clash = sorted(set(kwargs) & set(RESERVED_FIELDS))
    if clash:
        raise ValueError(
            f"prompt fields {clash} clash with fields the environment passes to rewards itself "
            f"{list(RESERVED_FIELDS)}; rename them in the prompt rows"
        )
    kwargs["completion_ids"] = ids
    kwargs["truncated"] = truncated.to(torch.bool).cpu().reshape(b)
    prompts = list(prompts)
    allow = {"allow_nonfinite": True} if nonfinite != "raise" else {}
    components_fn = getattr(reward_fn, "components", None)
    if callable(components_fn) and isinstance(getattr(reward_fn, "weights", None), Mapping):
        total, raw = components_fn(prompts, completions, **allow, **kwargs)
    else:
        total = call_reward(reward_fn, prompts, completions, **allow, **kwargs)
        raw = {reward_name(reward_fn): total}
    total = total.detach().to(torch.float32).cpu()
    raw = {k: v.detach().to(torch.float32).cpu() for k, v in raw.items()}
    bad = ~torch.isfinite(total)
    if nonfinite == "raise":
        if bool(bad.any()):
            raise RewardError(f"reward {reward_name(reward_fn)!r} produced a non-finite weighted total")
        return Scores(total, raw, completions)
    zero = torch.zeros((), dtype=torch.float32)
    raw = {k: torch.where(torch.isfinite(v), v, zero) for k, v in raw.items()}
    return Scores(torch.where(bad, zero, total), raw, completions, nonfinite=bad)


def place_score(score: Tensor, mask: Tensor, placement: str = "last") -> Tensor:
    """Per-token rewards ``[B, T]`` from a sequence score ``[B]`` and a prefix mask ``[B, T]``.

    ``"last"``: the score on the last valid token; ``"uniform"``: ``score / T_valid`` on each
    valid token. Padding gets exactly 0. (:func:`textrl.functional.kl_shaped_rewards` with no KL.)
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"reward_placement={placement!r}: must be one of {PLACEMENTS}")
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rewards = kl_shaped_rewards(score.to(mask.device), zeros, mask, 0.0, placement=placement)
    return rewards + 0.0  # -0.0 (from -0 * kl) -> 0.0


# --------------------------------------------------------------------------------------------
# prompts


def row_messages(row: Mapping[str, Any], index: int) -> tuple[list[dict[str, str]], str]:
    """(chat messages, prompt text for the rewards) of a row with ``prompt`` or ``messages``."""
    messages = row.get("messages")
    prompt = row.get("prompt")
    if messages is None and isinstance(prompt, list):
        messages = prompt
    if messages is not None:
        user = [m.get("content", "") for m in messages if m.get("role") == "user"]
        text = prompt if isinstance(prompt, str) else (user[-1] if user else "")
        if not any(str(m.get("content", "")).strip() for m in messages):
            raise ValueError(f"prompt {index} is empty (its messages have no content)")
        return list(messages), text
    if not isinstance(prompt, str):
        raise ValueError(
            f"prompt {index} is {row!r}: a row needs a 'prompt' str (or a 'messages' list)"
        )
    if not prompt.strip():
        raise ValueError(f"prompt {index} is empty; remove it or give it text")
    return [{"role": "user", "content": prompt}], prompt


def _as_row(item: Any, index: int) -> dict[str, Any]:
    if isinstance(item, str):
        return {"prompt": item}
    if isinstance(item, Mapping):
        return dict(item)
    raise ValueError(f"prompt {index} is a {type(item).__name__}; give a str or a dict row")


def _load_prompt_source(prompts: Any) -> Any:
    """Rows from ``None`` (built-in digits task), a source spec string, or a sequence of rows."""
    if prompts is None:
        from textrl.envs.tasks import make_digits_task

        return make_digits_task()
    if isinstance(prompts, str):
        try:
            from textrl.envs.prompts import load_prompts
        except ImportError:
            load_prompts = None
        if load_prompts is not None:
            return load_prompts(prompts)
        if prompts.startswith("builtin:"):
            from textrl.envs.tasks import builtin_rows

            return builtin_rows(prompts.removeprefix("builtin:"))
        raise ValueError(f"prompts={prompts!r}: pass a list of str / dict rows or 'builtin:digits'")
    if not (hasattr(prompts, "__len__") and hasattr(prompts, "__getitem__")):
        raise ValueError(
            f"prompts is a {type(prompts).__name__}; pass a list of str, a list of dict rows "
            "with a 'prompt' field, or an indexable dataset of such rows"
        )
    return prompts


class TokenMDPSetup:
    """What both environments set up alike: tokenizer, prompts, reward, special ids, sizes."""

    def _setup_mdp(
        self,
        *,
        tokenizer: Any,
        prompts: Any,
        reward: RewardLike,
        max_new_tokens: int,
        max_prompt_length: int,
        truncate_prompt: str,
        apply_chat_template: bool | None,
        eos_token_id: int | Sequence[int] | None,
        pad_token_id: int | None,
    ) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an int >= 1")
        self.tokenizer = default_tokenizer() if tokenizer is None else tokenizer
        self.prompts = PromptTable(
            prompts,
            self.tokenizer,
            max_prompt_length=max_prompt_length,
            truncate_prompt=truncate_prompt,
            apply_chat_template=apply_chat_template,
        )
        self.reward_fn = as_reward_fn(reward)
        self.eos_token_ids, self.pad_token_id = special_ids(
            self.tokenizer, eos_token_id, pad_token_id
        )
        self.vocab_size = len(self.tokenizer)
        self.max_new_tokens = max_new_tokens
        self.max_prompt_length = max_prompt_length


class PromptTable:
    """Indexable prompts: raw text for the rewards, token ids for the policy, reward fields.

    ``prompts``: ``None`` (the built-in digits task), a source string (``"builtin:digits"``,
    a ``.jsonl`` path when :mod:`textrl.envs.prompts` is available), a list of str, a list of dict rows
    (``"prompt"`` or ``"messages"`` plus extra fields such as ``"answer"``), or any indexable
    dataset of such rows. Prompts are wrapped in the tokenizer's chat template (with the
    generation prompt) when it has one and ``apply_chat_template`` is not False, tokenised on
    first use and cached. Lists are checked for empty prompts up front.
    """

    def __init__(
        self,
        prompts: Any,
        tokenizer: Any,
        *,
        max_prompt_length: int,
        truncate_prompt: str = "error",
        apply_chat_template: bool | None = None,
    ) -> None:
        if truncate_prompt not in TRUNCATE_MODES:
            raise ValueError(
                f"truncate_prompt={truncate_prompt!r}: must be one of {TRUNCATE_MODES}"
            )
        if not isinstance(max_prompt_length, int) or max_prompt_length < 1:
            raise ValueError(f"max_prompt_length={max_prompt_length!r}: must be an int >= 1")
        self.rows = _load_prompt_source(prompts)
        if len(self.rows) == 0:
            raise ValueError("prompts is empty; give at least one prompt")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncate_prompt = truncate_prompt
        has_template = getattr(tokenizer, "chat_template", None) is not None
        self.apply_chat_template = (
            has_template if apply_chat_template is None else apply_chat_template
        )
        if self.apply_chat_template and not has_template:
            raise ValueError("apply_chat_template=True but the tokenizer has no chat_template")
        self._cache: dict[int, np.ndarray] = {}
        if isinstance(self.rows, (list, tuple)):
            for i, item in enumerate(self.rows):
                row_messages(_as_row(item, i), i)

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> dict[str, Any]:
        """The row ``index`` as a dict (a str prompt becomes ``{"prompt": str}``)."""
        if not 0 <= index < len(self):
            raise ValueError(f"prompt_index={index} is out of range for {len(self)} prompts")
        return _as_row(self.rows[index], index)

    def text(self, index: int) -> str:
        """The prompt text handed to the reward functions (the raw prompt, no template)."""
        return row_messages(self.row(index), index)[1]

    def fields(self, index: int) -> dict[str, Any]:
        """Extra per-row fields for the rewards (everything but ``prompt`` / ``messages``)."""
        return {k: v for k, v in self.row(index).items() if k not in ("prompt", "messages")}

    def ids(self, index: int) -> np.ndarray:
        """int64 token ids of prompt ``index`` (templated), at most ``max_prompt_length``."""
        if index not in self._cache:
            self._cache[index] = self.encode(self.row(index), index)
        return self._cache[index]

    def encode(self, row: Mapping[str, Any], index: int | str) -> np.ndarray:
        """Token ids of one row; raises (or left-truncates) when longer than the maximum."""
        messages, text = row_messages(row, index)  # type: ignore[arg-type]
        if self.apply_chat_template:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        ids = np.asarray(
            self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64
        )
        if ids.size == 0:
            raise ValueError(f"prompt {index} encodes to no tokens; give it text")
        if ids.size > self.max_prompt_length:
            if self.truncate_prompt == "error":
                raise ValueError(
                    f"prompt {index} has {ids.size} tokens > max_prompt_length="
                    f"{self.max_prompt_length}; raise max_prompt_length or pass "
                    "truncate_prompt='left' to keep its last tokens"
                )
            warnings.warn(
                f"prompt {index} has {ids.size} tokens > max_prompt_length="
                f"{self.max_prompt_length}; keeping its last {self.max_prompt_length}",
                stacklevel=3,
            )
            ids = ids[-self.max_prompt_length :]
        return ids


# --------------------------------------------------------------------------------------------
# the fast path


def _check_inputs(
    prompt_ids: Tensor, prompt_mask: Tensor, responses: Tensor, max_new_tokens: int
) -> None:
    if prompt_ids.dim() != 2 or prompt_ids.dtype != torch.int64:
        raise ValueError(
            f"prompt_ids must be int64 [B, P], got {prompt_ids.dtype} {tuple(prompt_ids.shape)}"
        )
    if prompt_mask.shape != prompt_ids.shape or prompt_mask.dtype != torch.bool:
        raise ValueError(
            f"prompt_mask must be bool {tuple(prompt_ids.shape)} like prompt_ids, got "
            f"{prompt_mask.dtype} {tuple(prompt_mask.shape)}"
        )
    if (
        responses.dim() != 2
        or responses.dtype != torch.int64
        or responses.shape[0] != prompt_ids.shape[0]
    ):
        raise ValueError(
            f"responses must be int64 [B, T] with B={prompt_ids.shape[0]}, got "
            f"{responses.dtype} {tuple(responses.shape)}"
        )
    if not 1 <= responses.shape[1] <= max_new_tokens:
        raise ValueError(
            f"responses have T={responses.shape[1]} tokens; need 1 <= T <= max_new_tokens="
            f"{max_new_tokens}"
        )


def rollout_from_responses(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    responses: Tensor,
    *,
    tokenizer: Any,
    reward_fn: RewardLike,
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    max_new_tokens: int,
    reward_placement: str = "last",
    fields: Mapping[str, Sequence[Any]] | None = None,
    prompt_texts: Sequence[str] | None = None,
    keys: RolloutKeys = KEYS,
    reward_nonfinite: str = "raise",
) -> TensorDict:
    """The rollout rows (docs/design.md, "The rollout TensorDict") of generated responses, as the token MDP would pay them.

    prompt_ids int64 ``[B, P]`` left-padded, prompt_mask bool ``[B, P]``; responses int64
    ``[B, T]`` (``T <= max_new_tokens``), anything after a row's first EOS is padding. A row is
    valid up to and including its first EOS (terminated there) or, without EOS, over all
    ``max_new_tokens`` tokens (truncated at the last one); a row without EOS shorter than
    ``max_new_tokens`` raises, since the MDP cannot end there. Writes prompt tokens / mask,
    ``action`` (padding set to ``pad_token_id``), ``("collector","mask")``, ``("next","reward")``
    ``[B,T,1]`` (the score placed by ``reward_placement``), ``("next","done" / "terminated" /
    "truncated")`` ``[B,T,1]`` and ``("reward_components", name)`` ``[B]``. ``prompt_texts``
    (the raw prompts, for the rewards) default to the decoded prompt tokens.

    ``reward_nonfinite`` decides what a NaN/inf task reward does (:func:`score_completions`):
    ``"raise"`` (a :class:`textrl.rewards.RewardError`), ``"zero"`` (score 0) or ``"drop"`` (the row is
    left out, so fewer than ``B`` rows come back). Under the last two, ``KEYS.reward_nonfinite``
    bool ``[B]`` marks the zeroed rows.
    """
    _check_inputs(prompt_ids, prompt_mask, responses, max_new_tokens)
    if reward_placement not in PLACEMENTS:
        raise ValueError(f"reward_placement={reward_placement!r}: must be one of {PLACEMENTS}")
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    b, t = responses.shape
    mask = response_mask(responses, eos_ids, pad_token_id=None)  # [B, T]
    lengths = mask.sum(1)  # [B]
    last = (lengths - 1).clamp(min=0)
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device))
    ended_eos = is_eos.gather(1, last.unsqueeze(1)).squeeze(1) & (lengths > 0)  # [B]
    short = torch.nonzero(~ended_eos & (lengths < max_new_tokens)).flatten().tolist()
    if short:
        raise ValueError(
            f"rows {short[:10]} have no EOS and fewer than max_new_tokens={max_new_tokens} tokens "
            f"(T={t}): the MDP only ends at EOS or after max_new_tokens; pass the full responses"
        )
    action = torch.where(mask, responses, torch.full_like(responses, pad_token_id))
    at_last = torch.arange(t, device=responses.device).unsqueeze(0) == last.unsqueeze(1)  # [B, T]
    terminated = at_last & ended_eos.unsqueeze(1)
    truncated = at_last & ~ended_eos.unsqueeze(1)

    if prompt_texts is None:
        prompt_texts = tokenizer.batch_decode(
            [row[m].tolist() for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu())],
            skip_special_tokens=True,
        )
    scores = score_completions(
        as_reward_fn(reward_fn),
        prompt_texts,
        responses,
        mask,
        tokenizer=tokenizer,
        truncated=~ended_eos,
        fields=fields,
        nonfinite=reward_nonfinite,
    )
    rewards = place_score(scores.total.to(responses.device), mask, reward_placement)  # [B, T]
    components = TensorDict(
        {k: v.to(responses.device) for k, v in scores.components.items()}, batch_size=[b]
    )
    td = TensorDict(
        {
            keys.prompt_tokens: prompt_ids,
            keys.prompt_mask: prompt_mask,
            keys.action: action,
            keys.mask: mask,
            keys.reward: rewards.unsqueeze(-1),
            keys.done: (terminated | truncated).unsqueeze(-1),
            keys.terminated: terminated.unsqueeze(-1),
            keys.truncated: truncated.unsqueeze(-1),
            keys.reward_components: components,
        },
        batch_size=[b],
        device=responses.device,
    )
    if scores.nonfinite is not None:
        bad = scores.nonfinite.to(responses.device)
        if reward_nonfinite == "drop":
            if bool(bad.all()):
                raise RewardError(
                    f"every one of the {b} rows got a NaN/inf task reward, so reward_nonfinite="
                    "'drop' leaves nothing to train on; fix the reward function"
                )
            td = td[~bad]
            bad = bad[~bad]
        td.set(keys.reward_nonfinite, bad)
    return check_rollout(td, keys)


__all__ = [
    "DEFAULT_REWARD",
    "NONFINITE_POLICIES",
    "PLACEMENTS",
    "PromptTable",
    "Scores",
    "as_reward_fn",
    "default_tokenizer",
    "place_score",
    "reward_component_names",
    "row_messages",
    "rollout_from_responses",
    "score_completions",
    "special_ids",
]
