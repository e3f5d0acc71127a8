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

The prompt side the two environments share (rows, chat template, lazy tokenisation) is
:mod:`textrl.envs.prompts.table`; this module imports no prompt source, so the prompt datasets
(:mod:`textrl.envs.prompts`) can build on it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor

from textrl.core.checks import check_rollout
from textrl.envs.reward_inputs import reward_arguments
from textrl.functional import kl_shaped_rewards, response_mask
from textrl.keys import KEYS, RolloutKeys
from textrl.rewards import (
    CompositeReward,
    RewardError,
    combine_scores,
    evaluate_reward,
    parse_reward_spec,
    reward_name,
)

PLACEMENTS = ("last", "uniform")
NONFINITE_POLICIES = ("raise", "zero", "drop")
"""What a NaN/inf task reward does: raise a RewardError, count the row with score 0, or drop it."""
TRUNCATE_MODES = ("error", "left")
DEFAULT_REWARD = "think_format,tag_count"

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
    """float32 ``[B]``: the task reward (weighted sum of the components that apply to the row;
    0 where none applies)."""
    components: dict[str, Tensor]
    """name -> float32 ``[B]`` raw score of each reward function; NaN exactly where the function
    returned None ("does not apply"), never for a faulty score."""
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
    conversations: Sequence[Sequence[Mapping[str, Any]]] | None = None,
    completion_messages: Sequence[Sequence[Mapping[str, Any]]] | None = None,
    texts: Sequence[str] | None = None,
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

    Conversational rows (TRL's convention): ``conversations`` gives each row's prompt messages
    (the whole conversation up to the answered turn); the reward functions then get those
    message lists as ``prompts`` and ``[{"role": "assistant", "content": text}]`` as
    ``completions``. ``completion_messages`` (``B`` message lists, e.g. the several turns of a
    multi-turn episode) replaces those completions; given alone, each prompt text becomes one
    user message. Without either, prompts and completions are strings.

    A reward function may return None for a row ("does not apply"): the total sums the
    components that apply (0 with a warning where none does), and the row's component is NaN.
    ``nonfinite`` (one of :data:`NONFINITE_POLICIES`): with ``"zero"`` or ``"drop"`` a NaN/inf
    score does not raise; the row's total and its non-finite components become 0 and
    ``Scores.nonfinite`` marks it (the caller drops it under ``"drop"``). A None is never
    counted as a non-finite score. ``texts``: the ``B`` completions decoded already (as this
    function decodes them), where the caller decoded them in its own thread (a fast tokenizer is
    not to be shared between threads): the tokenizer is then not used.
    """
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"reward_nonfinite={nonfinite!r}: must be one of {NONFINITE_POLICIES}")
    reward_prompts, reward_completions, kwargs, completions = reward_arguments(
        prompts, responses, mask, tokenizer=tokenizer, truncated=truncated, fields=fields,
        conversations=conversations, completion_messages=completion_messages, texts=texts)
    allow = {"allow_nonfinite": True} if nonfinite != "raise" else {}
    total, raw, applies = _evaluate(reward_fn, reward_prompts, reward_completions, allow, kwargs)
    total = total.detach().to(torch.float32).cpu()
    raw = {k: v.detach().to(torch.float32).cpu() for k, v in raw.items()}
    bad = ~torch.isfinite(total)
    if nonfinite == "raise":
        if bool(bad.any()):
            raise RewardError(f"reward {reward_name(reward_fn)!r} produced a non-finite weighted total")
        return Scores(total, raw, completions)
    zero = torch.zeros((), dtype=torch.float32)
    raw = {k: torch.where(applies[k].cpu() & ~torch.isfinite(v), zero, v) for k, v in raw.items()}
    return Scores(torch.where(bad, zero, total), raw, completions, nonfinite=bad)


def _evaluate(
    reward_fn: Callable[..., Any],
    prompts: list[Any],
    completions: list[Any],
    allow: dict[str, bool],
    kwargs: dict[str, Any],
) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """``(total [B], raw scores {name: [B]}, applies {name: bool [B]})`` of ``reward_fn``.

    A :class:`CompositeReward` reports its breakdown; another object with ``components`` and
    ``weights`` reports raw scores that all apply; a plain function is one component whose None
    rows count 0 in the total (:func:`combine_scores`).
    """
    if isinstance(reward_fn, CompositeReward):
        out = reward_fn.evaluate(prompts, completions, **allow, **kwargs)
        return out.total, out.components, out.applies
    components_fn = getattr(reward_fn, "components", None)
    if callable(components_fn) and isinstance(getattr(reward_fn, "weights", None), Mapping):
        total, raw = components_fn(prompts, completions, **allow, **kwargs)
        return total, raw, {k: torch.ones(v.shape, dtype=torch.bool) for k, v in raw.items()}
    name = reward_name(reward_fn)
    score, applies = evaluate_reward(reward_fn, prompts, completions, **allow, **kwargs)
    total = combine_scores({name: score}, {name: applies}, {name: 1.0})
    return total, {name: score}, {name: applies}


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


def _episode_ends(
    responses: Tensor, eos_ids: list[int], max_new_tokens: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(mask, ended_eos, terminated, truncated)`` of responses int64 ``[B, T]`` under the MDP.

    mask: bool ``[B, T]``, each row valid up to and including its first EOS, else over all its
    tokens; ended_eos: bool ``[B]``, rows that end at an EOS; terminated / truncated: bool
    ``[B, T]``, True on the last valid token of a row that ended at EOS / without one. A row
    without EOS shorter than ``max_new_tokens`` raises: the MDP cannot end there.
    """
    t = responses.shape[1]
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
    at_last = torch.arange(t, device=responses.device).unsqueeze(0) == last.unsqueeze(1)  # [B, T]
    terminated = at_last & ended_eos.unsqueeze(1)
    truncated = at_last & ~ended_eos.unsqueeze(1)
    return mask, ended_eos, terminated, truncated


def _decode_prompts(tokenizer: Any, prompt_ids: Tensor, prompt_mask: Tensor) -> list[str]:
    """The ``B`` prompt texts of prompt_ids int64 ``[B, P]`` over prompt_mask bool ``[B, P]``
    (special tokens skipped): what the rewards get when no raw prompts are given."""
    return tokenizer.batch_decode(
        [row[m].tolist() for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu())],
        skip_special_tokens=True,
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
    b = responses.shape[0]
    mask, ended_eos, terminated, truncated = _episode_ends(responses, eos_ids, max_new_tokens)
    action = torch.where(mask, responses, torch.full_like(responses, pad_token_id))
    if prompt_texts is None:
        prompt_texts = _decode_prompts(tokenizer, prompt_ids, prompt_mask)
    scores = score_completions(
        as_reward_fn(reward_fn), prompt_texts, responses, mask, tokenizer=tokenizer,
        truncated=~ended_eos, fields=fields, nonfinite=reward_nonfinite,
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
        td = flag_nonfinite(td, scores.nonfinite.to(responses.device), reward_nonfinite, keys)
    return check_rollout(td, keys)


def flag_nonfinite(td: TensorDict, bad: Tensor, policy: str, keys: RolloutKeys = KEYS) -> TensorDict:
    """The rollout rows under a ``'zero'`` or ``'drop'`` NaN/inf reward policy, ``bad`` bool
    ``[B]`` marking the rows whose reward was NaN/inf (and set to 0): ``'zero'`` keeps them,
    ``'drop'`` leaves them out (a :class:`textrl.rewards.RewardError` when no row is left); either
    way ``keys.reward_nonfinite`` marks the zeroed rows that remain."""
    if policy == "drop":
        if bool(bad.all()):
            raise RewardError(
                f"every one of the {bad.numel()} rows got a NaN/inf task reward, so reward_nonfinite="
                "'drop' leaves nothing to train on; fix the reward function"
            )
        td, bad = td[~bad], bad[~bad]
    td.set(keys.reward_nonfinite, bad)
    return td


__all__ = [
    "DEFAULT_REWARD",
    "NONFINITE_POLICIES",
    "PLACEMENTS",
    "Scores",
    "as_reward_fn",
    "default_tokenizer",
    "flag_nonfinite",
    "place_score",
    "reward_component_names",
    "rollout_from_responses",
    "score_completions",
    "special_ids",
]
