"""On-policy distillation's teacher (``--teacher MODEL|URL``): its log-probs of the policy's own tokens.

Two kinds, one call, ``logprobs(input_ids [B, L], attention_mask [B, L], prompt_len, action [B, T]) ->
[B, T]`` (the teacher's log-prob of each response token in its context, its own distribution:
temperature 1):

- :class:`LoadedTeacher`: a causal LM loaded in the training process as the reference is (the run's
  precision, placed on the policy's device, a frozen copy in ``frozen_dtype``, eval mode), its
  forward the actor's (:class:`textrl.agents.forwards.Forwards`);
- :class:`ServedTeacher`: a vLLM server serving the teacher (``textrl vllm-serve TEACHER`` or any
  ``vllm serve``), asked for the *prompt* log-probs of each row's tokens: ``/v1/completions`` with
  the token ids as the prompt, ``prompt_logprobs: 0`` (the log-prob of each prompt token given the
  ones before it, from the raw logits) and ``max_tokens: 1``; one request a micro-batch, retried
  and failed as the ``vllm-server`` engine's completions are
  (:meth:`textrl.generation.vllm_server.Server.request`), a dead teacher raising
  :class:`~textrl.generation.base.EngineFailed` (the run saves its last finished iteration).

The teacher reads the policy's token ids, so its tokenizer must be the policy's:
:func:`check_teacher_tokenizer` compares the vocabularies (a loaded teacher) or the ids of
:data:`PROBE` (a served one) before the teacher loads (:func:`load_teacher`, when the run builds its actor, before
the first iteration), and refuses in one line naming both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from textrl.functional import masked_mean, reverse_kl_reward
from textrl.generation.base import EngineFailed
from textrl.generation.vllm_server import (
    RETRIES,
    Server,
    ServerDown,
    ServerRefused,
    completion_budget,
)
from textrl.keys import KEYS

TEACHER_OPTIONS = frozenset({"teacher", "teacher_coef"})
"""The agent options of on-policy distillation; an agent whose estimator reads :func:`token_rewards` declares them."""

PROBE = "On-policy distillation: 12 + 30 = 42, <think>why</think> Ünïcödé ✓\n"
"""The text whose token ids the policy's tokenizer and a served teacher's must agree on (digits,
tags, accents, a symbol, a newline; the tokenizer's EOS text is appended)."""

SERVE_TEACHER = "start it with textrl vllm-serve TEACHER (or vllm serve TEACHER)"


def is_served(teacher: str) -> bool:
    """Whether ``--teacher`` names a served teacher (an ``http://`` or ``https://`` URL) rather than a model."""
    return teacher.startswith(("http://", "https://"))


def probe_text(tokenizer: Any) -> str:
    """:data:`PROBE` with the tokenizer's EOS text after it (its id must agree too)."""
    return PROBE + (tokenizer.eos_token or "")


def teacher_mismatch(teacher: str, policy: str, why: str) -> ValueError:
    """The one-line refusal of a teacher whose tokenizer is not the policy's."""
    return ValueError(f"teacher {teacher!r} has another tokenizer than policy {policy!r} ({why}): distillation "
                      "scores the policy's token ids with the teacher, so they must mean the same; use a teacher "
                      "that shares the policy's tokenizer (the same family), or drop --teacher")


def tokenizer_difference(policy_tokenizer: Any, teacher_tokenizer: Any) -> str | None:
    """How two tokenizers differ, in a few words (the vocabulary's size, a token's id, the ids of
    :func:`probe_text`); None when they agree."""
    mine, theirs = policy_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if len(mine) != len(theirs):
        return f"{len(mine)} tokens against the teacher's {len(theirs)}"
    for token, index in sorted(mine.items(), key=lambda item: item[1]):
        if theirs.get(token) != index:
            return f"{token!r} is id {index} for the policy but {theirs.get(token)} for the teacher"
    text = probe_text(policy_tokenizer)
    ids, other = (t.encode(text, add_special_tokens=False) for t in (policy_tokenizer, teacher_tokenizer))
    return None if ids == other else f"{text!r} is {ids} for the policy but {other} for the teacher"


def check_teacher_tokenizer(config: Any, tokenizer: Any, policy: str) -> None:
    """Refuse ``config.teacher`` (``ValueError``, one line naming both and what to do) where its tokenizer
    is not the policy's (``tokenizer``, named ``policy``): a loaded teacher's by its vocabulary and
    :func:`probe_text`'s ids, a served one's by the ids its ``/tokenize`` gives the probe. Loads no model."""
    teacher = str(config.teacher)
    if is_served(teacher):
        ServedTeacher(teacher).check(tokenizer, policy)
        return
    from textrl.models import load_tokenizer

    try:
        theirs = load_tokenizer(teacher)
    except (OSError, ValueError) as err:
        raise ValueError(f"teacher {teacher!r}: its tokenizer cannot be loaded to compare with policy {policy!r}'s "
                         f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); fix --teacher") from None
    difference = tokenizer_difference(tokenizer, theirs)
    if difference is not None:
        raise teacher_mismatch(teacher, policy, difference)


def check_teacher_temperature(config: Any) -> None:
    """Refuse a teacher beside a sampling temperature other than 1 (``ValueError``, one line)."""
    if config.teacher is not None and config.temperature != 1.0:
        raise ValueError(f"temperature={config.temperature:g}: on-policy distillation compares the policy's log-probs with "
                         f"teacher {config.teacher!r}'s at temperature 1 (a served teacher's prompt log-probs are the raw "
                         "ones); drop --temperature (1) with --teacher")


def check_teacher(config: Any) -> None:
    """The teacher's rules before any model loads (``textrl.training.trainer.check_run``): the temperature, and the
    tokenizer rule with the policy's tokenizer loaded by name (a policy given as an object: when the
    teacher loads, :func:`load_teacher`)."""
    from textrl.models import load_tokenizer

    if config.teacher is None:
        return
    policy = config.tokenizer or config.model
    check_teacher_temperature(config)
    if isinstance(policy, str):
        check_teacher_tokenizer(config, load_tokenizer(policy), policy)


# -- the teacher in this process ----------------------------------------------------------------------------
@dataclass
class LoadedTeacher:
    """A teacher loaded in the training process: ``model`` (frozen, eval mode), its forwards the run's
    (``forwards``: the run's precision and fused / packed paths). Not an ``nn.Module``: an agent
    holding it neither saves it in a checkpoint nor trains it."""

    model: nn.Module
    forwards: Any
    name: str

    def monitors(self, td: Any) -> dict[str, float]:
        """The update's teacher metrics (:func:`teacher_monitors`)."""
        return teacher_monitors(td)

    @torch.no_grad()
    def logprobs(self, input_ids: Tensor, attention_mask: Tensor, prompt_len: int, action: Tensor) -> Tensor:
        """The teacher's log-probs ``[B, T]`` of ``action`` (temperature 1: the run's, which ``--teacher``
        requires); the teacher follows the policy's device where the agent was moved (``agent.to``)."""
        if next(self.model.parameters()).device != input_ids.device:
            self.model.to(input_ids.device)
        return self.forwards.logprobs(self.model, input_ids, attention_mask, prompt_len, action)


def load_teacher(config: Any, tokenizer: Any, forwards: Any,
                 kept: LoadedTeacher | ServedTeacher | None = None) -> LoadedTeacher | ServedTeacher | None:
    """The run's teacher: ``kept`` when one was loaded (the agent keeps it as ``agent.teacher``, loaded
    once: the actor is built from it, before the first iteration); None without ``config.teacher``.
    ``tokenizer`` is the policy's, ``forwards`` the run's (:class:`~textrl.agents.forwards.Forwards`:
    its precision and device). First the temperature (1) and the tokenizer rule (:func:`check_teacher_tokenizer`), then
    served (a URL: :class:`ServedTeacher`) or loaded here as the reference is: the run's precision
    (``dtype``, attention) on the policy's device, then a frozen copy in ``frozen_dtype``, eval mode, no
    gradients, its tokenizer checked to fit its embedding. Not a submodule: never in a checkpoint."""
    from textrl.models import load_causal_lm
    from textrl.models.checks import check_tokenizer_fits

    if kept is not None or config.teacher is None:
        return kept
    policy, teacher = str(config.tokenizer or getattr(config.model, "name_or_path", config.model)), str(config.teacher)
    check_teacher_temperature(config)
    check_teacher_tokenizer(config, tokenizer, policy)
    if is_served(teacher):
        return ServedTeacher(teacher)
    precision = forwards.precision
    model = precision.frozen_copy(load_causal_lm(teacher, device=precision.device, **precision.model_kwargs()))
    check_tokenizer_fits(tokenizer, model, tokenizer_name=policy, model_name=teacher)
    return LoadedTeacher(model, forwards, teacher)


# -- the reward and the metrics ----------------------------------------------------------------------------
def distils_alone(config: Any) -> bool:
    """Whether the run optimises the teacher's reward alone: a teacher, and no task reward named
    (``--reward`` nor ``--reward-model``)."""
    return config.teacher is not None and config.reward is None and not config.reward_model


def teacher_token_rewards(td: Any, coef: float) -> Tensor | None:
    """On-policy distillation's reward per token ``[B, T]``: ``coef * (teacher_log_prob -
    action_log_prob)`` on the agent's tokens (:func:`textrl.functional.reverse_kl_reward`, minus the
    reverse KL to the teacher), 0 elsewhere; None without a teacher's log-probs in the rollout."""
    teacher = td.get(KEYS.teacher_log_prob, None)
    if teacher is None:
        return None
    return reverse_kl_reward(td.get(KEYS.action_log_prob), teacher, td.get(KEYS.mask), coef)


def token_rewards(agent: Any, td: Any) -> Tensor:
    """The reward per token an agent's estimator shapes with the KL, ``[B, T]``: the task reward
    (``agent.task_token_rewards``) plus, with a teacher, :func:`teacher_token_rewards`; the teacher's alone
    when the run names no task reward (:func:`distils_alone`: the task's score is still logged). Placed
    per token like the KL shaping: every agent token gets its own."""
    distill = teacher_token_rewards(td, agent.config.teacher_coef)
    if distill is None:
        return agent.task_token_rewards(td)
    if distils_alone(agent.config):
        return distill
    return agent.task_token_rewards(td) + distill


def teacher_monitors(td: Any) -> dict[str, float]:
    """``teacher/reverse_kl``, the mean over the agent's tokens of ``action_log_prob - teacher_log_prob``
    (the k1 estimate of KL(policy || teacher) per token), and ``teacher/log_prob``, the teacher's mean
    log-prob of them; none without the teacher's log-probs in the rollout."""
    teacher = td.get(KEYS.teacher_log_prob, None)
    if teacher is None:
        return {}
    mask = td.get(KEYS.mask)
    gap = td.get(KEYS.action_log_prob).float() - teacher.float()
    return {"teacher/reverse_kl": masked_mean(gap, mask).item(), "teacher/log_prob": masked_mean(teacher.float(), mask).item()}


# -- the teacher on a vLLM server ---------------------------------------------------------------------------
def row_tokens(input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> list[tuple[list[int], int]]:
    """Each row's attended tokens (its real prompt tokens, then its response's) and how many of them are
    the prompt's: ``[(ids, n_prompt)]``, from ``input_ids`` / ``attention_mask`` ``[B, L]`` (a left-padded
    prompt of ``prompt_len`` columns, then the response; the response's attended tokens a prefix)."""
    rows = []
    for ids, mask in zip(input_ids.tolist(), attention_mask.bool().tolist(), strict=True):
        kept = [token for token, on in zip(ids, mask, strict=True) if on]
        rows.append((kept, sum(mask[:prompt_len])))
    return rows


def prompt_logprob_request(model: str | None, rows: list[list[int]]) -> dict[str, Any]:
    """The ``/v1/completions`` body asking for the prompt log-probs of ``rows`` (token ids, one prompt
    each): the log-prob of each token given those before it, no sampling to speak of (one greedy token)."""
    return {"model": model, "prompt": rows, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0,
            "skip_special_tokens": False}


def served_logprobs(response: dict[str, Any], rows: list[tuple[list[int], int]], width: int) -> Tensor:
    """Float32 ``[B, width]``: for each row, the log-prob the answer gives each response token (the
    prompt log-prob at its position, looked up by its id), 0 past the row's attended tokens."""
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    choices = sorted(response["choices"], key=lambda c: c["index"])
    if len(choices) != len(rows):
        raise ValueError(f"the teacher answered {len(choices)} choices for {len(rows)} prompts")
    for b, ((ids, n_prompt), choice) in enumerate(zip(rows, choices, strict=True)):
        entries = choice.get("prompt_logprobs")
        if entries is None or len(entries) < len(ids):
            raise ValueError("the teacher's answer has no prompt_logprobs for every token (a vLLM without "
                             "prompt_logprobs on /v1/completions?)")
        for j, position in enumerate(range(n_prompt, len(ids))):
            out[b, j] = float(entries[position][str(ids[position])]["logprob"])
    return out


@dataclass
class ServedTeacher:
    """A teacher on a vLLM server at ``url`` (see the module docstring): checked before any work
    (:meth:`check`), then asked for the prompt log-probs of each micro-batch (:meth:`logprobs`)."""

    url: str
    server: Server = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.server = Server(self.url)

    @property
    def name(self) -> str:
        return self.url

    def monitors(self, td: Any) -> dict[str, float]:
        """The update's teacher metrics (:func:`teacher_monitors`)."""
        return teacher_monitors(td)

    def identify(self) -> str:
        """The model id the server serves; ``ValueError`` in one line where nothing answers (after the
        engine's retries) or what answers is not a vLLM server."""
        try:
            answer = self.server.request("v1/models", retries=RETRIES)
            self.server.model = str(answer["data"][0]["id"])
        except ServerDown as err:
            raise ValueError(f"teacher {err.url} does not answer ({err.what}): {SERVE_TEACHER}, or fix --teacher") from None
        except (ServerRefused, KeyError, IndexError, TypeError) as err:
            raise ValueError(f"teacher {self.url} is not a vLLM server (GET /v1/models: {err}): point --teacher at "
                             f"one; {SERVE_TEACHER}") from None
        return self.server.model

    def check(self, tokenizer: Any, policy: str) -> None:
        """Before any work: a vLLM server answers at :attr:`url` and its ``/tokenize`` gives
        :func:`probe_text` the ids the policy's tokenizer gives it; ``ValueError`` in one line otherwise."""
        model = self.identify()
        text = probe_text(tokenizer)
        try:
            answer = self.server.request("tokenize", {"model": model, "prompt": text, "add_special_tokens": False},
                                         retries=RETRIES)
        except (ServerDown, ServerRefused) as err:
            raise ValueError(f"teacher {self.url}: its tokenizer cannot be compared with policy {policy!r}'s "
                             f"(POST /tokenize: {err}); {SERVE_TEACHER}") from None
        ids, theirs = tokenizer.encode(text, add_special_tokens=False), list(answer.get("tokens", []))
        if ids != theirs:
            raise teacher_mismatch(f"{self.url} ({model})", policy,
                                   f"{text!r} is {ids} for the policy but {theirs} for the teacher")

    def logprobs(self, input_ids: Tensor, attention_mask: Tensor, prompt_len: int, action: Tensor) -> Tensor:
        """The teacher's log-probs ``[B, T]`` of ``action`` (on its device), 0 past each row's attended
        tokens: one ``/v1/completions`` request of the micro-batch's rows, retried as the engine's
        completions are; :class:`~textrl.generation.base.EngineFailed` naming the teacher when it is down
        or refuses (the run saves its last finished iteration)."""
        if self.server.model is None:
            self.identify()
        rows = row_tokens(input_ids.cpu(), attention_mask.cpu(), prompt_len)
        body = prompt_logprob_request(self.server.model, [ids for ids, _ in rows])
        try:
            answer = self.server.request("v1/completions", body, timeout=completion_budget(sum(len(r) for r, _ in rows)),
                                         retries=RETRIES)
        except (ServerDown, ServerRefused) as err:
            raise EngineFailed(f"teacher {err}: on-policy distillation cannot score this rollout; {SERVE_TEACHER} "
                               "again, then --resume") from None
        return served_logprobs(answer, rows, action.shape[1]).to(action.device)


__all__ = ["PROBE", "TEACHER_OPTIONS", "LoadedTeacher", "ServedTeacher", "check_teacher", "check_teacher_temperature",
           "check_teacher_tokenizer", "distils_alone",
           "is_served", "load_teacher", "prompt_logprob_request", "row_tokens", "served_logprobs", "teacher_mismatch",
           "teacher_monitors", "teacher_token_rewards", "token_rewards", "tokenizer_difference"]
