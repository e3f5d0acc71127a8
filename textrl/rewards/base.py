"""The reward-function interface, its error type and the safety wrapper :func:`call_reward`.

A reward function is any callable

    fn(prompts: list[Prompt], completions: list[Completion], **kwargs) -> scores  # [B]

where a row comes in one of TRL's two forms:

- **standard** (a plain-prompt dataset): ``prompts[i]`` and ``completions[i]`` are ``str``;
- **conversational** (rows with ``"messages"``): ``prompts[i]`` is the conversation up to the
  answered turn, a list of ``{"role", "content"}`` messages, and ``completions[i]`` the list of
  messages the policy produced (one ``{"role": "assistant", "content": text}`` for a single
  turn), so TRL's ``completion[0]["content"]`` works. :func:`completion_text` reads either form.

``scores`` is a float tensor ``[B]``, or a list / tuple / array of ``B`` numbers in which
``None`` means *this reward does not apply to this row* (TRL's convention): the row's score
becomes NaN, its ``applies`` flag False (:func:`evaluate_reward`), and weighted sums leave it out
(:func:`textrl.rewards.composite.combine_scores`). A NaN or inf *returned* as a score is a fault,
not "does not apply".

``kwargs`` carry optional per-row batch fields; a function reads the ones it needs and ignores
the rest, so every reward function must accept ``**kwargs``. As TRL does, a function with a
parameter named ``completions`` gets ``prompts`` and ``completions`` by keyword, so TRL's
``def reward(completions, **kwargs)`` works as it is (:func:`invoke`); others get them by
position. The fields the built-in rewards read are

- ``completion_ids``: per-row token id lists, or an int64 ``[B, T]`` tensor (then with
  ``completion_mask`` bool ``[B, T]``, True on valid tokens);
- ``answer``: one reference answer per row (the prompt dataset's ``answer`` field);
- ``truncated``: bool ``[B]``, the completion hit the length cap without EOS.

A reward function has a ``name`` attribute (set with :func:`named`); :func:`reward_name` falls
back to ``__name__`` for user callables. A function that reads dataset columns declares them with
:func:`needs` (``fn.needs``, e.g. ``("answer",)`` for ``accuracy``): a run checks every row for
them before any model loads (:func:`required_columns`). Rewards are scores, not losses: they are
detached. A reward that calls ``sys.exit`` raises a :class:`RewardError` naming it instead of
ending the process.

A reward function may be ``async def`` (or an object whose ``__call__`` is), or declare that it
waits on I/O (a sandbox, an API, a served judge) with ``does_io = True`` (:func:`does_io`); either
is called with the same arguments and read by the same rules. The episode runner scores such a
reward in the background, a few calls at a time (:func:`overlapped`,
:class:`textrl.rewards.background.RewardPool`; docs/rewards.md, "Asynchronous rewards"); called
here directly, an ``async`` reward is awaited to its end (:func:`invoke`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from torch import Tensor

from textrl.generation.base import EngineFailed

_MAX_ROWS_SHOWN = 10
_MAX_ROWS_RETRIED = 64

Message = Mapping[str, Any]
"""One chat message: ``{"role": str, "content": str}`` (content may also be a list of parts)."""
Prompt = str | list[Message]
"""A row's prompt: text (standard form) or the conversation up to the answered turn."""
Completion = str | list[Message]
"""A row's completion: text (standard form) or the messages the policy produced."""


class RewardFn(Protocol):
    """``fn(prompts, completions, **kwargs) -> scores [B]`` (a tensor, or numbers and None)."""

    def __call__(self, prompts: list[Prompt], completions: list[Completion], **kwargs: Any) -> Any: ...


class RewardError(ValueError):
    """A reward function that raised or returned something other than finite float ``[B]``."""


class AnsweredRewardError(RewardError):
    """A :class:`RewardError` already named where the reward ran (a background call's, raised again
    where the loop needs the scores): :func:`evaluate_reward` lets it through as it is."""


F = TypeVar("F", bound=Callable[..., Any])


def named(name: str) -> Callable[[F], F]:
    """Decorator: set ``fn.name``, the name the registry and the reward logs use."""

    def set_name(fn: F) -> F:
        fn.name = name  # type: ignore[attr-defined]
        return fn

    return set_name


def needs(*columns: str) -> Callable[[F], F]:
    """Decorator: set ``fn.needs``, the dataset columns the reward reads from every row (a run
    refuses, naming file and line, a row that lacks one or holds None there)."""

    def set_needs(fn: F) -> F:
        fn.needs = tuple(columns)  # type: ignore[attr-defined]
        return fn

    return set_needs


def does_io(fn: F) -> F:
    """Decorator: set ``fn.does_io = True``, the declaration that ``fn`` waits on I/O (a sandbox,
    an API, a served model) rather than computing: the episode runner then scores it in the
    background while generation goes on (:func:`overlapped`). A plain CPU function so declared
    still scores the same."""
    fn.does_io = True  # type: ignore[attr-defined]
    return fn


def is_async_reward(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is ``async def``, or a callable object whose ``__call__`` is (through
    ``functools.partial``).

    >>> async def judge(prompts, completions, **kwargs): ...
    >>> is_async_reward(judge), is_async_reward(lambda p, c, **kw: [1.0])
    (True, False)
    """
    inner = getattr(fn, "func", None)  # functools.partial
    if inner is not None and inner is not fn and is_async_reward(inner):
        return True
    if inspect.iscoroutinefunction(fn):
        return True
    call = next((vars(klass)["__call__"] for klass in type(fn).__mro__ if "__call__" in vars(klass)), None)
    return not inspect.isfunction(fn) and call is not None and inspect.iscoroutinefunction(call)


def overlapped(fn: Callable[..., Any] | None) -> bool:
    """Whether the episode runner scores ``fn`` in the background: ``fn`` (or, for a composite,
    one of its ``functions``) is ``async`` (:func:`is_async_reward`) or declares ``does_io = True``
    (:func:`does_io`), on itself or on the function a ``functools.partial`` wraps. Other rewards
    (CPU-bound rules) are scored in the loop, as they always were."""
    if fn is None:
        return False
    functions = getattr(fn, "functions", None)
    if isinstance(functions, Mapping) and not callable(functions) and any(overlapped(f) for f in functions.values()):
        return True
    inner = getattr(fn, "func", None)
    declared = getattr(fn, "does_io", False) is True or (inner is not None and getattr(inner, "does_io", False) is True)
    return declared or is_async_reward(fn)


def resolve(out: Any) -> Any:
    """``out`` awaited to its end when it is awaitable (an ``async`` reward's coroutine), else as it
    is: on a fresh event loop in this thread, or in a thread of its own when this thread already
    runs a loop (a notebook's)."""
    if not inspect.isawaitable(out):
        return out

    async def wait() -> Any:
        return await out

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="textrl-reward-await") as pool:
        return pool.submit(asyncio.run, wait()).result()


def required_columns(fn: Callable[..., Any] | None) -> dict[str, list[str]]:
    """Column -> the names of the rewards of ``fn`` that read it: ``fn.needs`` of a function
    (through ``functools.partial``), of each component of a composite (``fn.functions``).

    >>> @needs("answer")
    ... def exact(prompts, completions, *, answer=None, **kwargs): ...
    >>> required_columns(exact)
    {'answer': ['exact']}
    """
    if fn is None:
        return {}
    functions = getattr(fn, "functions", None)
    if isinstance(functions, Mapping) and not callable(functions):
        out: dict[str, list[str]] = {}
        for name, part in functions.items():
            for column in required_columns(part):
                out.setdefault(column, []).append(name)
        return out
    columns = getattr(fn, "needs", None)
    inner = getattr(fn, "func", None)  # functools.partial
    if columns is None and inner is not None and inner is not fn:
        columns = getattr(inner, "needs", None)
    if isinstance(columns, str):
        columns = (columns,)
    return {column: [reward_name(fn)] for column in columns or ()}


def reward_name(fn: Callable[..., Any]) -> str:
    """``fn.name``, else ``fn.__name__``, else the class name (for callable objects)."""
    name = getattr(fn, "name", None)
    if isinstance(name, str) and name:
        return name
    inner = getattr(fn, "func", None)  # functools.partial
    if inner is not None and inner is not fn:
        return reward_name(inner)
    return getattr(fn, "__name__", None) or type(fn).__name__


def _rows(indices: Sequence[int]) -> str:
    shown = list(indices[:_MAX_ROWS_SHOWN])
    more = f" and {len(indices) - len(shown)} more" if len(indices) > len(shown) else ""
    return f"{shown}{more}"


def message_text(message: Message) -> str:
    """The text of one message: its ``content`` str, or the ``"text"`` of its content parts.

    >>> message_text({"role": "assistant", "content": [{"type": "text", "text": "hi"}]})
    'hi'
    """
    content = message.get("content") if isinstance(message, Mapping) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        )
    raise ValueError(
        f"message {message!r} has no text content: a message is {{'role': ..., 'content': str}}"
    )


def last_assistant(messages: Sequence[Message]) -> int | None:
    """Index of the last ``"assistant"`` message in ``messages``, None without one."""
    for j in range(len(messages) - 1, -1, -1):
        message = messages[j]
        if isinstance(message, Mapping) and message.get("role") == "assistant":
            return j
    return None


def completion_text(completion: Completion) -> str:
    """The text a rule reward reads: a str as it is; for messages, the last assistant message.

    >>> completion_text("42")
    '42'
    >>> completion_text([{"role": "assistant", "content": "4"}, {"role": "tool", "content": "ok"},
    ...                  {"role": "assistant", "content": "42"}])
    '42'
    """
    if isinstance(completion, str):
        return completion
    if not isinstance(completion, (list, tuple)):
        raise ValueError(
            f"a completion is a str or a list of messages, got {type(completion).__name__}"
        )
    j = last_assistant(completion)
    if j is None:
        roles = [m.get("role") if isinstance(m, Mapping) else type(m).__name__ for m in completion]
        raise ValueError(
            f"completion messages with roles {roles} have no 'assistant' message to score; "
            "give each row's completion the policy's turn(s) as role 'assistant'"
        )
    return message_text(completion[j])


def completion_texts(completions: Sequence[Completion]) -> list[str]:
    """:func:`completion_text` of every row: ``B`` texts from strings or message lists."""
    return [completion_text(c) for c in completions]


def conversation_text(messages: Prompt | Completion) -> str:
    """Plain text of a prompt or completion: a str as it is, messages' texts joined by newlines.

    >>> conversation_text([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    's\\nu'
    """
    if isinstance(messages, str):
        return messages
    return "\n".join(message_text(m) for m in messages)


def check_batch(prompts: Sequence[Prompt], completions: Sequence[Completion]) -> int:
    """Batch size ``B``; raises when prompts and completions are not equally long lists."""
    for what, x in (("prompts", prompts), ("completions", completions)):
        if isinstance(x, str):
            raise ValueError(f"{what} is a single str; pass a list of str (one per row)")
    if len(prompts) != len(completions):
        raise ValueError(
            f"len(prompts)={len(prompts)} != len(completions)={len(completions)}: "
            "pass one prompt per completion (repeat a prompt for each of its samples)"
        )
    return len(completions)


def batch_field(value: Any, field: str, n: int, fn_name: str) -> Sequence[Any]:
    """A required per-row kwarg: raises when it is missing or not ``n`` long."""
    if value is None:
        raise ValueError(
            f"{fn_name} needs the batch field {field!r}: pass {field}=[...] (one entry per "
            f"completion), i.e. give the prompt dataset a {field!r} column"
        )
    if len(value) != n:
        raise ValueError(f"{fn_name}: {field} has {len(value)} entries for {n} completions")
    return value


def token_lists(completion_ids: Any, completion_mask: Any, n: int, fn_name: str) -> list[list[int]]:
    """Per-row token id lists from ``completion_ids`` (lists, or a ``[B, T]`` tensor + mask)."""
    ids = batch_field(completion_ids, "completion_ids", n, fn_name)
    if not isinstance(ids, Tensor):
        return [list(map(int, row)) for row in ids]
    if ids.dim() != 2:
        raise ValueError(f"{fn_name}: completion_ids has shape {tuple(ids.shape)}, expected [B, T]")
    if completion_mask is None:
        raise ValueError(
            f"{fn_name}: completion_ids is a padded [B, T] tensor, so the row lengths are unknown; "
            "pass completion_mask (bool [B, T], True on valid tokens) or a list of per-row id lists"
        )
    mask = torch.as_tensor(completion_mask, dtype=torch.bool)
    if mask.shape != ids.shape:
        raise ValueError(
            f"{fn_name}: completion_mask has shape {tuple(mask.shape)}, "
            f"completion_ids has {tuple(ids.shape)}"
        )
    return [row[m].tolist() for row, m in zip(ids, mask)]


def bool_rows(value: Any, field: str, n: int, fn_name: str) -> Tensor:
    """A required per-row bool kwarg (list, ``[B]`` or ``[B, 1]`` tensor) as bool ``[B]``."""
    x = torch.as_tensor(batch_field(value, field, n, fn_name)).to(torch.bool)
    if x.dim() == 2 and x.shape[1] == 1:
        x = x.squeeze(1)
    if tuple(x.shape) != (n,):
        raise ValueError(f"{fn_name}: {field} has shape {tuple(x.shape)}, expected [{n}]")
    return x


def _slice_kwargs(kwargs: dict[str, Any], i: int, n: int) -> dict[str, Any]:
    out = {}
    for k, v in kwargs.items():
        sized = isinstance(v, (list, tuple)) or getattr(v, "ndim", 0) > 0  # tensors, arrays
        out[k] = v[i : i + 1] if sized and len(v) == n else v
    return out


def invoke(fn: RewardFn, prompts: list[Any], completions: list[Any], kwargs: dict[str, Any]) -> Any:
    """``fn`` called as TRL calls a reward function (``prompts=``, ``completions=`` and the batch
    fields by keyword) when it names a ``completions`` parameter, else ``fn(prompts, completions,
    **kwargs)``; an ``async`` reward's answer awaited (:func:`resolve`)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        params = {}
    completions_param = params.get("completions")
    if completions_param is not None and completions_param.kind is not inspect.Parameter.POSITIONAL_ONLY:
        return resolve(fn(prompts=prompts, completions=completions, **kwargs))
    return resolve(fn(prompts, completions, **kwargs))


def _rows_that_raise(fn: RewardFn, prompts, completions, kwargs) -> list[int] | None:
    """Rows whose one-row call raises, or None when the batch is too large to retry."""
    n = len(completions)
    if n > _MAX_ROWS_RETRIED:
        return None
    bad = []
    for i in range(n):
        try:
            invoke(fn, prompts[i : i + 1], completions[i : i + 1], _slice_kwargs(kwargs, i, n))
        except (Exception, SystemExit):
            bad.append(i)
    return bad


def _raised(fn: RewardFn, name: str, err: BaseException, prompts, completions, kwargs) -> RewardError:
    hint = "fix the function or the batch field it needs"
    if isinstance(err, SystemExit):
        hint = ("a reward function must return scores, not end the process: remove the sys.exit / exit() "
                "call (raise an exception, or return None for a row it does not apply to)")
        err = SystemExit(f"sys.exit({err.code!r}) was called")
    elif isinstance(err, TypeError) and "unexpected keyword argument" in str(err):
        hint = "reward functions must accept **kwargs (the trainer passes every batch field)"
    rows = _rows_that_raise(fn, prompts, completions, kwargs)
    if rows is None:
        where = f"rows: not searched (batch of {len(completions)} is too large to retry row by row)"
    elif rows and len(rows) == len(completions):
        where = "rows: every row raises on its own"
    elif rows:
        where = f"rows that raise on their own: {_rows(rows)}"
    else:
        where = "rows: no single row raises on its own (the failure needs the whole batch)"
    return RewardError(f"reward {name!r} raised {type(err).__name__}: {err}; {where}; {hint}")


def _none_free(out: Any) -> tuple[Any, list[bool] | None]:
    """``(out with None -> NaN, per-entry "is None" flags)`` for a list / tuple / object array;
    ``(out, None)`` for anything else (tensors, numeric arrays, scalars)."""
    if not isinstance(out, (list, tuple, Tensor)) and hasattr(out, "__array__"):
        array = np.asarray(out)
        if array.dtype == object:
            out = array.tolist()
    if not isinstance(out, (list, tuple)):
        return out, None
    flags = [x is None for x in out]
    return [math.nan if x is None else x for x in out], flags


def _as_scores(out: Any, name: str, n: int) -> tuple[Tensor, Tensor]:
    """A reward function's output as ``(float32 [n] scores, bool [n] applies)``; raises
    :class:`RewardError` for anything that is not ``n`` numbers (None allowed in lists)."""
    out, none_flags = _none_free(out)
    if not isinstance(out, Tensor):
        if isinstance(out, (list, tuple)) or hasattr(out, "__array__"):
            try:
                out = torch.as_tensor(out, dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError) as err:
                raise RewardError(
                    f"reward {name!r} returned a {type(out).__name__} that is not {n} numbers "
                    f"({err}); return a float tensor of shape [{n}] (or a list of floats, None "
                    "where the reward does not apply)"
                ) from err
        else:
            raise RewardError(
                f"reward {name!r} returned {type(out).__name__}, expected a float tensor of shape "
                f"[{n}] (one score per completion)"
            )
    if out.is_complex() or not (out.is_floating_point() or out.dtype in _REAL_DTYPES):
        raise RewardError(f"reward {name!r} returned dtype {out.dtype}; return float scores")
    if out.is_meta:  # scores on a real device (cuda for a cpu run, ...) are moved by the callers
        raise RewardError(f"reward {name!r} returned a tensor on device 'meta', which holds no values; "
                          "return real scores (a tensor on cpu or the run's device, or a list of floats)")
    if tuple(out.shape) != (n,):
        hint = (
            " (a [B, 1] tensor: use .squeeze(-1))"
            if tuple(out.shape) == (n, 1)
            else f" ({out.shape[0]} scores for {n} completions: return exactly one per row)"
            if out.dim() == 1
            else ""
        )
        raise RewardError(
            f"reward {name!r} returned shape {tuple(out.shape)}, expected [{n}]{hint}"
        )
    out = out.detach().to(torch.float32)
    applies = torch.ones(n, dtype=torch.bool, device=out.device)
    if none_flags is not None:
        applies = ~torch.tensor(none_flags, dtype=torch.bool, device=out.device)
    return out, applies


def evaluate_reward(
    fn: RewardFn,
    prompts: Sequence[Prompt],
    completions: Sequence[Completion],
    *,
    allow_nonfinite: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """Call ``fn`` once on the batch: ``(scores, applies)``, float32 ``[B]`` and bool ``[B]``.

    ``applies[i]`` is False where ``fn`` returned None for row ``i`` ("does not apply", TRL's
    convention); ``scores[i]`` is NaN there. Every applying score is finite, else a
    :class:`RewardError` names the function, the rows and what to do; the same when ``fn``
    raises, returns the wrong shape, or something that is not a tensor, list or array of ``B``
    numbers. ``allow_nonfinite=True`` lets NaN/inf scores of applying rows through (the caller
    applies a ``reward_nonfinite`` policy to them).

    >>> scores, applies = evaluate_reward(lambda p, c, **kw: [1, None], ["p", "p"], ["a", "b"])
    >>> scores.tolist(), applies.tolist()
    ([1.0, nan], [True, False])
    """
    n = check_batch(prompts, completions)
    name = reward_name(fn)
    try:
        out = invoke(fn, list(prompts), list(completions), kwargs)
    except (EngineFailed, AnsweredRewardError):  # a served reward's server is gone: the run saves its last
        raise  # finished iteration; an error named in the background: as it was
    except (Exception, SystemExit) as err:  # a reward's sys.exit must not end the run half written
        raise _raised(fn, name, err, list(prompts), list(completions), kwargs) from err
    scores, applies = _as_scores(out, name, n)
    if not allow_nonfinite:
        bad = torch.nonzero(applies & ~torch.isfinite(scores)).flatten().tolist()
        if bad:
            values = [scores[i].item() for i in bad[:_MAX_ROWS_SHOWN]]
            raise RewardError(
                f"reward {name!r} returned non-finite scores {values} in rows {_rows(bad)}; "
                "return a finite score for every row (e.g. 0.0 for a completion it cannot "
                "parse), or None where the reward does not apply"
            )
    return scores, applies


def call_reward(
    fn: RewardFn,
    prompts: Sequence[Prompt],
    completions: Sequence[Completion],
    *,
    allow_nonfinite: bool = False,
    **kwargs: Any,
) -> Tensor:
    """``fn``'s scores as a detached float32 ``[B]`` tensor, checked by :func:`evaluate_reward`.

    Rows where ``fn`` returned None ("does not apply") are NaN; every other score is finite
    unless ``allow_nonfinite=True``. Lists and arrays of shape ``[B]`` are converted.

    >>> call_reward(lambda p, c, **kw: [1, 2], ["p", "p"], ["a", "b"]).tolist()
    [1.0, 2.0]
    """
    return evaluate_reward(fn, prompts, completions, allow_nonfinite=allow_nonfinite, **kwargs)[0]


_REAL_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def check_finite_weight(weight: float, what: str) -> float:
    """``weight`` as a finite float; raises naming ``what`` otherwise."""
    try:
        w = float(weight)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what}: weight {weight!r} is not a number") from err
    if not math.isfinite(w):
        raise ValueError(f"{what}: weight {weight!r} is not finite")
    return w


__all__ = [
    "Completion",
    "Message",
    "Prompt",
    "AnsweredRewardError",
    "RewardError",
    "RewardFn",
    "batch_field",
    "bool_rows",
    "call_reward",
    "check_batch",
    "check_finite_weight",
    "completion_text",
    "completion_texts",
    "conversation_text",
    "does_io",
    "evaluate_reward",
    "is_async_reward",
    "last_assistant",
    "message_text",
    "named",
    "needs",
    "overlapped",
    "required_columns",
    "resolve",
    "reward_name",
    "token_lists",
]
