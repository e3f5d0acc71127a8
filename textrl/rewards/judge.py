"""An LLM judge as a reward: ``judge:URL`` (``JudgeReward``), a generative model served by vLLM that
reads each row and answers a verdict, parsed into a score.

For each row, the template (``template``: a file; default :data:`DEFAULT_TEMPLATE`) is filled: ``{prompt}``
with the prompt's text (messages: their texts joined by newlines), ``{completion}`` with the completion's
(its last assistant message), ``{answer}`` with the row's reference answer (a template that names it
makes the reward read the dataset's ``answer`` column). Only those three fields are replaced, so a
template may hold other braces (JSON). The filled text is the user message of a ``/v1/chat/completions``
request (the judge model's chat template applied by the server), or, with ``chat=false``, the prompt of a
``/v1/completions`` request; greedy by default (``temperature=0``), ``max_tokens`` tokens. Rows are sent
concurrently, :data:`~textrl.rewards.served.IN_FLIGHT` x 4 at once, each retried as the served reward's
requests are (:mod:`textrl.rewards.served`).

The verdict is parsed by

- ``choices``: ``"yes=1;no=0"`` (or a dict): the choice the verdict starts with (stripped, case
  ignored, the longest first, not followed by a letter or digit: ``yes.`` is ``yes``, ``yesterday``
  is nothing) gives its score; the default, with the default template;
- ``pattern``: a regular expression; its first match's group 1 (or the whole match) read as a number.

With ``constrain=true`` the server may answer only a choice (vLLM's structured outputs), as its
lower-cased words.

A verdict that parses to nothing is *unparsable*: by default the judge does not apply to that row
(None: NaN in ``reward_components/judge``, left out of the weighted total, counted in the run's
``reward_components/judge/applies``); ``unparsable=<number>`` gives it that score instead. Either
way the first unparsable verdict is said once (a :class:`JudgeUnparsableWarning` with the verdict
and its row), and :attr:`JudgeReward.unparsable` / :attr:`JudgeReward.verdicts` count them.

On the command line the settings go in the URL's query string:
``judge:http://host:8003?template=judge.txt&choices=yes=1;no=0&max_tokens=4:0.5`` (the ``:0.5`` after
it is the entry's weight, as for any reward).
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from textrl.generation.vllm_server import RETRIES, Server, ServerDown, ServerRefused
from textrl.rewards.base import (
    Completion,
    Prompt,
    batch_field,
    check_batch,
    completion_text,
    conversation_text,
)
from textrl.rewards.served import IN_FLIGHT, gather, identify, is_url, server_failure, url_settings

JUDGE_SERVE_HINT = "start it with textrl vllm-serve JUDGE_MODEL"

DEFAULT_TEMPLATE = (
    "Read the question and the answer.\n\nQuestion:\n{prompt}\n\nAnswer:\n{completion}\n\n"
    "Is the answer correct and helpful? Reply with one word: yes or no."
)
"""The template without ``template``: a yes/no verdict (``choices`` ``yes=1;no=0``)."""

DEFAULT_CHOICES = {"yes": 1.0, "no": 0.0}

FIELDS = ("prompt", "completion", "answer")


class JudgeUnparsableWarning(UserWarning):
    """A judge's verdict that no choice or pattern reads (said once per judge, with an example)."""


def parse_choices(choices: str | Mapping[str, float]) -> dict[str, float]:
    """``"yes=1;no=0"`` (or a mapping) -> ``{"yes": 1.0, "no": 0.0}``, keys lower-cased.

    >>> parse_choices("Yes=1; no=-0.5")
    {'yes': 1.0, 'no': -0.5}
    """
    if isinstance(choices, str):
        pairs = [part.split("=", 1) for part in choices.split(";") if part.strip()]
        if not pairs or any(len(p) != 2 or not p[0].strip() for p in pairs):
            raise ValueError(f"judge choices {choices!r}: write VERDICT=SCORE;VERDICT=SCORE, e.g. yes=1;no=0")
        choices = {k: v for k, v in pairs}
    out = {}
    for key, value in choices.items():
        try:
            out[str(key).strip().lower()] = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"judge choice {key!r}={value!r}: the score is not a number") from None
    return out


def verdict_score(verdict: str, choices: Mapping[str, float] | None, pattern: re.Pattern[str] | None) -> float | None:
    """The score of one verdict text, or None where it is unparsable (see the module docstring).

    >>> verdict_score(" Yes.", {"yes": 1.0, "no": 0.0}, None), verdict_score("yesterday", {"yes": 1.0}, None)
    (1.0, None)
    >>> verdict_score("Score: 7/10", None, re.compile(r"(\\d+)/10"))
    7.0
    """
    if choices is not None:
        text = verdict.strip().lower()
        for choice in sorted(choices, key=len, reverse=True):
            if text.startswith(choice) and not text[len(choice):len(choice) + 1].isalnum():
                return choices[choice]
        return None
    assert pattern is not None
    found = pattern.search(verdict)
    if found is None:
        return None
    try:
        return float(found.group(1) if pattern.groups else found.group(0))
    except (TypeError, ValueError):
        return None


def fill(template: str, prompt: Prompt, completion: Completion, answer: Any = None) -> str:
    """The template with ``{prompt}``, ``{completion}`` (and ``{answer}``) replaced by the row's texts."""
    text = template.replace("{prompt}", conversation_text(prompt)).replace("{completion}", completion_text(completion))
    return text.replace("{answer}", "" if answer is None else str(answer))


class JudgeReward:
    """``judge:URL``: a served LLM's verdict on each row as its score; see the module docstring.

    Args:
        url: the judge server's base URL.
        template: a template file's path, or None for :data:`DEFAULT_TEMPLATE`.
        choices: verdict -> score (``"yes=1;no=0"`` or a mapping); default ``yes=1;no=0`` unless
            ``pattern`` is given.
        pattern: a regular expression reading a number from the verdict (instead of ``choices``).
        unparsable: the score of an unparsable verdict; None: the judge does not apply to the row.
        max_tokens, temperature: the verdict's sampling (greedy by default).
        chat: send the filled template as a chat message (True) or as a raw prompt.
        timeout: seconds a request is given before it is sent again.
        request: extra fields of every request body (vLLM's sampling options: ``stop``,
            ``allowed_token_ids``, ``structured_outputs``, ...).
        constrain: the verdict constrained to the choices (vLLM's structured outputs, ``choice``):
            no verdict is then unparsable, short of ``max_tokens`` cutting one.
    """

    does_io = True
    name = "judge"
    SETTINGS = {"template": "str", "choices": "str", "pattern": "str", "unparsable": "float", "max_tokens": "int",
                "temperature": "float", "chat": "bool", "timeout": "float", "constrain": "bool"}

    def __init__(
        self,
        url: str,
        *,
        template: str | Path | None = None,
        choices: str | Mapping[str, float] | None = None,
        pattern: str | None = None,
        unparsable: float | None = None,
        max_tokens: int = 8,
        temperature: float = 0.0,
        chat: bool = True,
        timeout: float = 120.0,
        request: Mapping[str, Any] | None = None,
        constrain: bool = False,
    ) -> None:
        if choices is not None and pattern is not None:
            raise ValueError("judge: give choices or pattern, not both (choices map verdict words to scores, a "
                             "pattern reads a number from the verdict)")
        if template is None:
            self.template = DEFAULT_TEMPLATE
        else:
            path = Path(template).expanduser()
            if not path.is_file():
                raise ValueError(f"judge template {str(template)!r} is not a file; give a text file with {{prompt}} "
                                 "and {completion} (and {answer}) fields")
            self.template = path.read_text()
        if "{completion}" not in self.template:
            raise ValueError(f"judge template {str(template)!r} has no {{completion}} field: the judge would not "
                             "see what it scores")
        self.pattern = re.compile(pattern) if pattern is not None else None
        self.choices = None if self.pattern is not None else parse_choices(DEFAULT_CHOICES if choices is None else choices)
        if unparsable is not None:
            unparsable = float(unparsable)
        self.unparsable_score = unparsable
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"judge: max_tokens must be a positive int, got {max_tokens!r}")
        self.max_tokens, self.temperature, self.chat = max_tokens, float(temperature), bool(chat)
        self.timeout = float(timeout)
        self.request = dict(request or {})
        if constrain:
            if self.choices is None:
                raise ValueError("judge: constrain=true needs choices (the verdicts the judge may answer), not a pattern")
            self.request.setdefault("structured_outputs", {"choice": list(self.choices)})
        if "{answer}" in self.template:
            self.needs = ("answer",)
        self.server = Server(url.rstrip("/"))
        self.server.model = str(identify(self.server.url, "judge", JUDGE_SERVE_HINT)["id"])
        self.verdicts = 0
        """Verdicts read so far."""
        self.unparsable = 0
        """Of them, unparsable."""
        self._said = False
        self._lock = threading.Lock()  # the background reward pool may call a judge from several threads

    def body(self, text: str) -> dict[str, Any]:
        """The request body asking the judge's verdict on one filled template."""
        body: dict[str, Any] = {"model": self.server.model, "max_tokens": self.max_tokens,
                                "temperature": self.temperature, **self.request}
        if self.chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        return body

    def verdict(self, text: str) -> str:
        """The judge's verdict on one filled template (a request, retried as idempotent)."""
        route = "v1/chat/completions" if self.chat else "v1/completions"
        answer = self.server.request(route, self.body(text), timeout=self.timeout, retries=RETRIES)
        choice = answer["choices"][0]
        return str(choice["message"]["content"] if self.chat else choice["text"]) or ""

    def __call__(self, prompts: list[Prompt], completions: list[Completion], *, answer: Sequence[Any] | None = None,
                 **fields: Any) -> list[float | None]:
        """The verdicts' scores, ``B`` numbers, None where a verdict is unparsable (unless ``unparsable``)."""
        n = check_batch(prompts, completions)
        answers = batch_field(answer, "answer", n, "judge") if "{answer}" in self.template else [None] * n
        texts = [fill(self.template, p, c, a) for p, c, a in zip(prompts, completions, answers)]
        try:
            verdicts = gather([lambda t=t: self.verdict(t) for t in texts], IN_FLIGHT * 4)
        except (ServerDown, ServerRefused) as err:
            raise server_failure(self.server.url, err, "judge", JUDGE_SERVE_HINT) from None
        scores = [verdict_score(v, self.choices, self.pattern) for v in verdicts]
        bad = [i for i, s in enumerate(scores) if s is None]
        with self._lock:
            self.verdicts += n
            self.unparsable += len(bad)
            say, self._said = bool(bad) and not self._said, self._said or bool(bad)
        if say:
            reads = f"choices {sorted(self.choices)}" if self.choices is not None else f"pattern {self.pattern.pattern!r}"
            fate = ("the judge does not apply to such a row (left out of the total, counted in "
                    "reward_components/judge/applies)" if self.unparsable_score is None
                    else f"such a row scores {self.unparsable_score:g}")
            warnings.warn(JudgeUnparsableWarning(
                f"judge {self.server.url}: {len(bad)} of {n} verdicts are unparsable, e.g. row {bad[0]}: "
                f"{verdicts[bad[0]][:200]!r} ({reads} read none of it); {fate}; said once"), stacklevel=2)
        if self.unparsable_score is not None:
            return [self.unparsable_score if s is None else s for s in scores]
        return scores

    def __repr__(self) -> str:
        reads = f"choices={self.choices}" if self.choices is not None else f"pattern={self.pattern.pattern!r}"
        return f"JudgeReward({self.server.url!r}, model={self.server.model!r}, {reads}, unparsable={self.unparsable_score})"


def load_judge(argument: str, **settings: Any) -> JudgeReward:
    """Loader of the ``judge:URL`` scheme: a :class:`JudgeReward` (the URL's query settings, then ``settings``)."""
    if not is_url(argument):
        raise ValueError(f"reward 'judge:{argument}' names no server; write judge:http://host:port (a vLLM server "
                         f"of the judge model: {JUDGE_SERVE_HINT})")
    url, settings = url_settings(argument, JudgeReward.SETTINGS, settings, "judge:")
    return JudgeReward(url, **settings)


__all__ = ["DEFAULT_TEMPLATE", "JudgeReward", "JudgeUnparsableWarning", "fill", "load_judge", "parse_choices",
           "verdict_score"]
