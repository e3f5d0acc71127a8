"""The built-in task environments: ``digits``, ``arithmetic``, ``calculator``, ``guess_number``
and ``reward_model`` (``textrl envs`` lists them; ``textrl train --env ID`` trains on one).

Each is an :class:`~textrl.envs.environment.Environment` registered by id; its constructor takes
keyword settings with defaults (``make_env("guess_number", max_n=16)``). Rows are generated
deterministically from a ``seed`` with private NumPy generators (the global RNGs are untouched),
and where a task has a natural held-out split, :meth:`eval_rows` returns rows disjoint from
:meth:`rows`. The class docstrings say what a row holds, the reward, the maximum reward and the
turn protocol.

The warm-up (``warmup_examples(rows, seed, *, answer_accuracy=None)``) teaches each task's
*format*, not its solution, for the reason :mod:`textrl.envs.tasks` gives: a warm-up that solves
the task leaves RL nothing to show. ``answer_accuracy`` (None: the environment's own setting)
is the share of warm-up answers that are right (for ``guess_number``: the share of guesses
that are consistent with the feedback so far). Multi-turn warm-ups give later turns as a
conversation so far (a list of messages) with the agent's next turn as the completion.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from textrl.envs.calculator import CalculatorError, evaluate, format_number
from textrl.envs.environment import Environment, Episode, Message, Turn
from textrl.envs.registry import register_env
from textrl.envs.tasks import (
    DIGITS_ROWS,
    DIGITS_SEED,
    WARMUP_THINK,
    format_completion,
    make_digits_task,
)
from textrl.envs.tasks import warmup_examples as digits_warmup_examples
from textrl.rewards.rules import extract_answer, tag_content

FORMAT_REWARD = "think_format,tag_count,accuracy"
"""The reasoning-format reward of the single-turn built-ins (as the embedded default's)."""
FORMAT_MAX_REWARD = 0.5 + 1.0 + 1.0
"""Its maximum: think_format 0.5, tag_count 4 x 0.25, accuracy 1 (:mod:`textrl.rewards.rules`)."""
WARMUP_ACCURACY = 0.3
"""Default share of right answers in a warm-up (the embedded default's ``warmup_answer_accuracy``)."""

_INTEGER = re.compile(r"[-+]?[0-9]{1,18}")
"""An integer as the tasks write answers: ASCII digits only (``\\d`` also takes '٣'), no separators."""


# -- shared helpers ----------------------------------------------------------------------------


def _rng(seed: int, stream: int) -> np.random.Generator:
    """A private generator for one purpose (``stream``) of one ``seed``."""
    return np.random.default_rng([int(seed), stream])


def _check_int(name: str, value: Any, low: int, env: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{env}: {name}={value!r} must be an int >= {low}")
    return int(value)


def _check_share(name: str, value: Any, env: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{env}: {name}={value!r} must be a number in [0, 1]")
    return float(value)


def _distinct_indices(total: int, n_eval: int, n_rows: int, seed: int, env: str) -> tuple[list[int], list[int]]:
    """Disjoint (train, eval) samples of ``range(total)``: ``n_rows`` and ``n_eval`` indices."""
    if n_rows < 1 or n_rows + n_eval > total:
        raise ValueError(f"{env}: n_rows={n_rows} and n_eval={n_eval} do not fit its {total} distinct "
                         f"instances (need n_rows >= 1 and n_rows + n_eval <= {total}); ask for fewer "
                         "rows or widen the task")
    picked = _rng(seed, 0xA217).choice(total, size=n_rows + n_eval, replace=False)
    return [int(i) for i in picked[n_eval:]], [int(i) for i in picked[:n_eval]]


def parse_integer(text: str | None) -> int | None:
    """An integer written alone (an optional sign and ASCII digits), else None: thousands
    separators and other scripts' digits are not the answer's format.

    >>> parse_integer(" 287663 "), parse_integer("-4"), parse_integer("4 apples")
    (287663, -4, None)
    >>> parse_integer("287,663"), parse_integer("\u0663")  # a comma; ARABIC-INDIC DIGIT THREE
    (None, None)
    """
    if text is None:
        return None
    text = text.strip()
    return int(text) if _INTEGER.fullmatch(text) else None


def _format_warmup(
    rows: Sequence[dict[str, Any]], seed: int, answer_accuracy: float, choices: Sequence[str], stream: int
) -> list[tuple[str, str]]:
    """(prompt, format completion) per row: the row's answer with probability
    ``answer_accuracy``, else an answer drawn uniformly from ``choices`` (independent of the
    prompt), in the think/answer format of :func:`textrl.envs.tasks.format_completion`."""
    rng = _rng(seed, stream)
    pairs = []
    for row in rows:
        right = rng.random() < answer_accuracy
        guess = choices[int(rng.integers(len(choices)))]
        pairs.append((row["prompt"], format_completion(WARMUP_THINK, str(row["answer"]) if right else guess)))
    return pairs


# -- digits ------------------------------------------------------------------------------------


@register_env("digits")
class DigitsEnv(Environment):
    """The embedded default's task (:mod:`textrl.envs.tasks`): repeat the last digit of a list.

    - Row: ``{"prompt": "Repeat the last digit: 4 8 1", "answer": "1"}``; the default rows are
      ``builtin:digits`` (``make_digits_task(512, seed=0)``, the shipped file).
    - Turns: one; the answer ends the episode.
    - Reward: ``"think_format,tag_count,accuracy"``; max reward 2.5 (0.5 + 1 + 1).
    - Held-out split: none of its own (:meth:`eval_rows` is None), so ``--env digits`` holds out
      ``eval_size`` rows as ``--dataset builtin:digits`` does and reproduces that run.
    - Warm-up: :func:`textrl.envs.tasks.warmup_examples` (random digits, ``answer_accuracy`` right).
    """

    id = "digits"
    description = "repeat the last digit of a list (the embedded default's task)"
    max_turns = 1
    max_reward = FORMAT_MAX_REWARD
    reward = FORMAT_REWARD

    def __init__(self, *, n_rows: int = DIGITS_ROWS, seed: int = DIGITS_SEED,
                 answer_accuracy: float = WARMUP_ACCURACY) -> None:
        self.n_rows = _check_int("n_rows", n_rows, 1, self.id)
        self.seed = int(seed)
        self.answer_accuracy = _check_share("answer_accuracy", answer_accuracy, self.id)
        self._rows = make_digits_task(self.n_rows, seed=self.seed)

    def rows(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._rows]

    def warmup_examples(self, rows: Sequence[dict[str, Any]], seed: int, *,
                        answer_accuracy: float | None = None) -> list[tuple[Any, str]]:
        accuracy = self.answer_accuracy if answer_accuracy is None else answer_accuracy
        return digits_warmup_examples(rows, seed, answer_accuracy=accuracy)


# -- arithmetic --------------------------------------------------------------------------------


@register_env("arithmetic")
class ArithmeticEnv(Environment):
    """Single-turn arithmetic with small operands: "What is 3 + 4?" -> ``7``.

    - Row: ``{"prompt": "What is 3 + 4?", "answer": "7", "a": 3, "op": "+", "b": 4}``. Instances
      are the distinct ``(a, op, b)`` with operands in ``[0, max_operand]`` and ``op`` in
      ``ops`` (any of ``+ - *``); ``n_eval`` of them (seeded) are held out
      (:meth:`eval_rows`), and :meth:`rows` holds ``n_rows`` others (None: all the rest).
    - Turns: one; the answer ends the episode.
    - Reward: ``"think_format,tag_count,accuracy"``; max reward 2.5.
    - Warm-up: the think/answer format with an answer drawn uniformly from the task's possible
      answers, right in ``answer_accuracy`` of the rows (as for ``digits``).
    """

    id = "arithmetic"
    description = "small-number arithmetic, 'What is 3 + 4?'"
    max_turns = 1
    max_reward = FORMAT_MAX_REWARD
    reward = FORMAT_REWARD

    def __init__(self, *, n_rows: int | None = None, n_eval: int = 40, max_operand: int = 9,
                 ops: str = "+-", seed: int = 0, answer_accuracy: float = WARMUP_ACCURACY) -> None:
        self.max_operand = _check_int("max_operand", max_operand, 1, self.id)
        if not isinstance(ops, str) or not ops or set(ops) - set("+-*") or len(set(ops)) != len(ops):
            raise ValueError(f"{self.id}: ops={ops!r} must be distinct characters from '+-*', e.g. '+-'")
        self.ops = ops
        self.seed = int(seed)
        self.answer_accuracy = _check_share("answer_accuracy", answer_accuracy, self.id)
        self.n_eval = _check_int("n_eval", n_eval, 0, self.id)
        width = self.max_operand + 1
        total = width * width * len(ops)
        self.n_rows = total - self.n_eval if n_rows is None else _check_int("n_rows", n_rows, 1, self.id)
        train, held_out = _distinct_indices(total, self.n_eval, self.n_rows, self.seed, self.id)
        self._rows = [self._instance(i) for i in train]
        self._eval = [self._instance(i) for i in held_out]

    def _instance(self, index: int) -> dict[str, Any]:
        width = self.max_operand + 1
        op_index, rest = divmod(index, width * width)
        a, b = divmod(rest, width)
        op = self.ops[op_index]
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return {"prompt": f"What is {a} {op} {b}?", "answer": str(value), "a": a, "op": op, "b": b}

    def rows(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._rows]

    def eval_rows(self) -> list[dict[str, Any]] | None:
        return [dict(r) for r in self._eval] if self._eval else None

    def answers(self) -> list[str]:
        """Every possible answer of the task's settings, sorted by value."""
        m = self.max_operand
        values: set[int] = set()
        if "+" in self.ops:
            values.update(range(0, 2 * m + 1))
        if "-" in self.ops:
            values.update(range(-m, m + 1))
        if "*" in self.ops:
            values.update(a * b for a in range(m + 1) for b in range(m + 1))
        return [str(v) for v in sorted(values)]

    def warmup_examples(self, rows: Sequence[dict[str, Any]], seed: int, *,
                        answer_accuracy: float | None = None) -> list[tuple[Any, str]]:
        accuracy = self.answer_accuracy if answer_accuracy is None else answer_accuracy
        return _format_warmup(rows, seed, _check_share("answer_accuracy", accuracy, self.id),
                              self.answers(), stream=0xA41)


# -- calculator (tool use) ---------------------------------------------------------------------

_TOOL_OPEN, _TOOL_CLOSE = "<tool>", "</tool>"


def parse_tool_call(completion: str) -> tuple[str | None, str | None]:
    """``(expression, None)`` for a turn holding ``<tool>EXPR</tool>``, ``(None, error)`` for a
    malformed call, ``(None, None)`` for a turn without a call.

    >>> parse_tool_call("<tool>3*4</tool>"), parse_tool_call("<tool>3*4"), parse_tool_call("12")
    (('3*4', None), (None, 'error: unclosed <tool> (write <tool>EXPR</tool>)'), (None, None))
    """
    found = tag_content(completion, _TOOL_OPEN, _TOOL_CLOSE)  # linear in the completion's length
    if found is not None:
        expression = found.strip()
        return (expression, None) if expression else (None, "error: empty <tool></tool> call")
    if _TOOL_OPEN in completion:
        return None, "error: unclosed <tool> (write <tool>EXPR</tool>)"
    if _TOOL_CLOSE in completion:
        return None, "error: </tool> without <tool> (write <tool>EXPR</tool>)"
    return None, None


def run_tool(expression: str) -> str:
    """The calculator's answer to an expression: its value, or ``"error: ..."``.

    >>> run_tool("347*829"), run_tool("7/2"), run_tool("1/0")
    ('287663', '3.5', 'error: division by zero')
    """
    try:
        return format_number(evaluate(expression))
    except CalculatorError as error:
        return f"error: {error}"


@register_env("calculator")
class CalculatorEnv(Environment):
    """Tool use: multiply two ``digits``-digit numbers with a calculator the model may call.

    - Row: ``{"prompt": "What is 347 * 829? ...", "answer": "287663", "expression": "347 * 829"}``;
      instances are distinct ordered pairs, ``n_eval`` of them held out (:meth:`eval_rows`).
    - Turns (``max_turns``, default 3; a turn also ends at ``</tool>``, the stop string): a turn holding
      ``<answer>N</answer>`` ends the episode. Otherwise a turn holding ``<tool>EXPR</tool>`` is
      answered with one ``observation_role`` ("tool") message: the value of ``EXPR``
      (:func:`textrl.envs.calculator.evaluate`, shown by :func:`format_number`) or
      ``"error: ..."`` for a malformed call (unclosed, empty, not arithmetic, too large). A turn
      with neither gets a ``user`` message saying how to call the tool or answer. The last turn
      without an answer ends the episode unanswered.
    - Reward: 1.0 on the answering turn when its answer (:func:`parse_integer`) is the product,
      else 0; no bonus or penalty for calling the tool, so the tool is used exactly when it
      makes the answer right. Max reward 1. ``reward`` (the final reward) is None.
    - Warm-up: per row, a tool call (the row's expression with probability ``answer_accuracy``,
      else a random one of the same shape) and, after the tool's result, an answer (a copy of
      the result with probability ``answer_accuracy``, else a random number as long).
    """

    id = "calculator"
    description = "multiply big numbers with a calculator tool, <tool>EXPR</tool>"
    max_turns = 3
    max_reward = 1.0
    stop_strings = (_TOOL_CLOSE,)
    reward = None

    INSTRUCTION = "Use <tool>EXPR</tool>, then <answer>N</answer>."

    def __init__(self, *, n_rows: int = 512, n_eval: int = 64, digits: int = 3, max_turns: int = 3,
                 seed: int = 0, observation_role: str = "tool",
                 answer_accuracy: float = WARMUP_ACCURACY) -> None:
        self.digits = _check_int("digits", digits, 1, self.id)
        self.max_turns = _check_int("max_turns", max_turns, 1, self.id)
        if self.digits > 9:
            raise ValueError(f"{self.id}: digits={digits} must be at most 9")
        self.n_rows = _check_int("n_rows", n_rows, 1, self.id)
        self.n_eval = _check_int("n_eval", n_eval, 0, self.id)
        self.seed = int(seed)
        if not isinstance(observation_role, str) or not observation_role:
            raise ValueError(f"{self.id}: observation_role={observation_role!r} must be a role name such as 'tool'")
        self.observation_role = observation_role
        self.answer_accuracy = _check_share("answer_accuracy", answer_accuracy, self.id)
        low, high = 10 ** (self.digits - 1), 10**self.digits
        self._low, self._span = low, high - low
        train, held_out = _distinct_indices(self._span**2, self.n_eval, self.n_rows, self.seed, self.id)
        self._rows = [self._instance(i) for i in train]
        self._eval = [self._instance(i) for i in held_out]

    def _instance(self, index: int) -> dict[str, Any]:
        a, b = (self._low + i for i in divmod(index, self._span))
        expression = f"{a} * {b}"
        return {"prompt": f"What is {expression}? {self.INSTRUCTION}", "answer": str(a * b),
                "expression": expression}

    def rows(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._rows]

    def eval_rows(self) -> list[dict[str, Any]] | None:
        return [dict(r) for r in self._eval] if self._eval else None

    def step(self, episode: Episode, completion: str) -> Turn:
        answer = extract_answer(completion)
        if answer is not None:
            got = parse_integer(answer)
            correct = got is not None and str(got) == str(episode.row["answer"])
            return Turn(reward=float(correct), done=True, info={"correct": correct, "answer": answer})
        if episode.turn >= self.max_turns:
            return Turn(done=True, info={"correct": False, "answer": None})
        expression, error = parse_tool_call(completion)
        if expression is None and error is None:
            return Turn(observation=f"No tool call or answer. {self.INSTRUCTION}", info={"tool": None})
        result = run_tool(expression) if expression is not None else error
        return Turn(observation=[{"role": self.observation_role, "content": result}],
                    info={"tool": expression, "result": result})

    def warmup_examples(self, rows: Sequence[dict[str, Any]], seed: int, *,
                        answer_accuracy: float | None = None) -> list[tuple[Any, str]]:
        accuracy = _check_share("answer_accuracy",
                                self.answer_accuracy if answer_accuracy is None else answer_accuracy, self.id)
        rng = _rng(seed, 0xCA1C)
        pairs: list[tuple[Any, str]] = []
        for row in rows:
            if rng.random() < accuracy:
                expression = compact(row["expression"])
            else:
                a, b = (int(x) for x in self._low + rng.integers(self._span, size=2))
                expression = f"{a}*{b}"
            call = f"{_TOOL_OPEN}{expression}{_TOOL_CLOSE}"
            result = run_tool(expression)
            if rng.random() < accuracy:
                final = result
            else:
                final = str(int(rng.integers(10 ** (len(result) - 1), 10 ** len(result))))
            conversation: list[Message] = [
                {"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": call},
                {"role": self.observation_role, "content": result},
            ]
            pairs.append((row["prompt"], call))
            pairs.append((conversation, f"<answer>{final}</answer>"))
        return pairs


def compact(expression: str) -> str:
    """``expression`` without whitespace: ``"347 * 829"`` -> ``"347*829"``."""
    return "".join(expression.split())


# -- guess the number --------------------------------------------------------------------------

HIGHER, LOWER, INVALID = "higher", "lower", "invalid guess"
"""The game's observations: the secret is higher / lower than the guess; no guess was read."""


def parse_guess(completion: str) -> int | None:
    """The integer in the turn's first ``<answer>...</answer>`` block, or the whole turn when it
    is a bare integer; None otherwise.

    >>> parse_guess("<answer>5</answer>"), parse_guess(" 3 "), parse_guess("<answer>five</answer>")
    (5, 3, None)
    """
    answer = extract_answer(completion)
    return parse_integer(answer if answer is not None else completion)


def guess_completion(guess: int) -> str:
    """A guess as the warm-up writes it: ``<answer>5</answer>`` (3 tokens of the tiny tokenizer)."""
    return f"<answer>{guess}</answer>"


def feedback(secret: int, guess: int | None) -> str | None:
    """The game's answer to a guess: None when it is right, else ``higher`` / ``lower`` (where
    the secret lies) or ``invalid guess``."""
    if guess is None:
        return INVALID
    if guess == secret:
        return None
    return HIGHER if secret > guess else LOWER


@register_env("guess_number")
class GuessNumberEnv(Environment):
    """Guess a secret integer in ``[1, max_n]`` from "higher" / "lower" feedback.

    - Row: ``{"prompt": "Guess my number from 1 to 8.", "secret": 5, "instance": 17}``. The
      prompt is the same in every row (the secret is never shown); rows carry the secret, so an
      episode is reproducible from its row. :meth:`rows` holds ``n_rows`` instances and
      :meth:`eval_rows` ``n_eval`` others (``instance`` ids are disjoint); both are balanced over
      the secrets (each secret ``n // max_n`` or one more times), so a constant guess wins
      ``1 / max_n`` of the first turns and no more.
    - Turns (``max_turns``, default 4: enough for binary search over 8): each agent turn is a
      guess, ``<answer>K</answer>`` or a bare integer (:func:`parse_guess`). A right guess ends
      the episode; a wrong one is answered with a ``user`` message ``higher`` or ``lower``
      (where the secret lies; a guess outside the range too), and an unreadable one with
      ``invalid guess`` (it uses up the turn). The ``max_turns``-th wrong guess ends the episode.
    - Reward: on the winning turn ``t``, ``1 - turn_cost * (t - 1)`` (default ``turn_cost=0``:
      1.0 for a win on any turn), else 0; max reward 1. With the default the episode's reward
      *is* its success, so the mean reward is the success rate. ``Turn.info`` holds
      ``solved`` (bool), ``guess`` and ``feedback``. ``reward`` (the final reward) is None.
    - Warm-up: random play of every row's game to its end: each guess is uniform over the
      guesses still consistent with the feedback with probability ``answer_accuracy``, else
      uniform over ``[1, max_n]``. Each agent turn is a pair (the first with the prompt, later
      ones with the conversation so far), so the warm-up teaches the format of a guess and of
      going on after feedback, but not the strategy (binary search wins every game; uniform
      guessing wins about 41% with the defaults).
    """

    id = "guess_number"
    description = "guess a secret number from higher/lower feedback"
    max_turns = 4
    max_reward = 1.0
    reward = None

    def __init__(self, *, max_n: int = 8, max_turns: int = 4, n_rows: int = 256, n_eval: int = 64,
                 seed: int = 0, turn_cost: float = 0.0, answer_accuracy: float = WARMUP_ACCURACY) -> None:
        self.max_n = _check_int("max_n", max_n, 2, self.id)
        self.max_turns = _check_int("max_turns", max_turns, 1, self.id)
        self.n_rows = _check_int("n_rows", n_rows, 1, self.id)
        self.n_eval = _check_int("n_eval", n_eval, 0, self.id)
        self.seed = int(seed)
        if isinstance(turn_cost, bool) or not isinstance(turn_cost, (int, float)) or not 0 <= turn_cost * (self.max_turns - 1) < 1:
            raise ValueError(f"{self.id}: turn_cost={turn_cost!r} must be >= 0 and leave a win on the last "
                             f"turn worth more than 0 (turn_cost * (max_turns - 1) < 1)")
        self.turn_cost = float(turn_cost)
        self.answer_accuracy = _check_share("answer_accuracy", answer_accuracy, self.id)
        self.prompt = f"Guess my number from 1 to {self.max_n}."
        self._rows = self._instances(self.n_rows, first=0, stream=0x6E55)
        self._eval = self._instances(self.n_eval, first=self.n_rows, stream=0xE7A1)

    def _instances(self, n: int, first: int, stream: int) -> list[dict[str, Any]]:
        """``n`` rows with balanced secrets in a seeded order, ids ``first .. first + n - 1``."""
        secrets = _rng(self.seed, stream).permutation(np.arange(n) % self.max_n) + 1
        return [{"prompt": self.prompt, "secret": int(s), "instance": first + i} for i, s in enumerate(secrets)]

    def rows(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._rows]

    def eval_rows(self) -> list[dict[str, Any]] | None:
        return [dict(r) for r in self._eval] if self._eval else None

    def start(self, episode: Episode) -> None:
        secret = episode.row.get("secret")
        if isinstance(secret, bool) or not isinstance(secret, (int, np.integer)) or not 1 <= secret <= self.max_n:
            raise ValueError(f"{self.id}: row {episode.index} has secret={secret!r}; a row needs an int "
                             f"'secret' in [1, {self.max_n}] (use the environment's rows())")
        episode.state["secret"] = int(secret)

    def win_reward(self, turn: int) -> float:
        """The reward of a right guess on agent turn ``turn`` (1-based)."""
        return 1.0 - self.turn_cost * (turn - 1)

    def step(self, episode: Episode, completion: str) -> Turn:
        guess = parse_guess(completion)
        said = feedback(episode.state["secret"], guess)
        info = {"guess": guess, "feedback": said, "solved": said is None}
        if said is None:
            return Turn(reward=self.win_reward(episode.turn), done=True, info=info)
        if episode.turn >= self.max_turns:
            return Turn(done=True, info=info)
        return Turn(observation=said, info=info)

    def warmup_examples(self, rows: Sequence[dict[str, Any]], seed: int, *,
                        answer_accuracy: float | None = None) -> list[tuple[Any, str]]:
        consistent = _check_share("answer_accuracy",
                                  self.answer_accuracy if answer_accuracy is None else answer_accuracy, self.id)
        rng = _rng(seed, 0x6E5)
        pairs: list[tuple[Any, str]] = []
        for row in rows:
            secret, low, high = int(row["secret"]), 1, self.max_n
            conversation: list[Message] = [{"role": "user", "content": row["prompt"]}]
            for turn in range(1, self.max_turns + 1):
                if rng.random() < consistent:
                    guess = int(rng.integers(low, high + 1))
                else:
                    guess = int(rng.integers(1, self.max_n + 1))
                completion = guess_completion(guess)
                pairs.append((row["prompt"] if turn == 1 else [dict(m) for m in conversation], completion))
                said = feedback(secret, guess)
                if said is None:
                    break
                if said == HIGHER:
                    low = max(low, guess + 1)
                else:
                    high = min(high, guess - 1)
                conversation += [{"role": "assistant", "content": completion}, {"role": "user", "content": said}]
        return pairs


# -- the pipeline's reward-model task ----------------------------------------------------------

CASE_PROMPTS = "builtin:case"


@register_env("reward_model")
class RewardModelEnv(Environment):
    """The pipeline's PPO task (:mod:`textrl.stages.pipeline`): prompts scored by a reward model.

    - Row: ``{"prompt": "Describe the moon. Use capital letters.", "style": "capital",
      "topic": "moon"}`` for ``prompts="builtin:case"`` (the 128 held-out ``case`` prompts that
      the pipeline's SFT and reward model never see, :mod:`textrl.envs.synthetic`), or the rows
      of any source :func:`textrl.envs.load_prompts` reads.
    - Turns: one; the answer ends the episode.
    - Reward: ``"reward_model:<path>"`` (a folder, hub id, or ``tiny``, the untrained offline tiny
      reward model: give the pipeline's ``OUT/rm/model`` for a trained one). With the ``case``
      prompts and ``monitor=True`` the rule :func:`~textrl.envs.synthetic.case_follow_reward`
      rides along with weight 0, so the share of responses that follow the constraint is logged
      next to the score, as in the pipeline. Max reward: None (a reward model's scale is open).
    - Held-out split: none of its own; the trainer holds out ``eval_size`` rows.
    - Warm-up: for the ``case`` prompts, ``n_warmup`` of the pipeline's SFT pairs
      (``case_sft_pairs``: the requested case half of the time, on the SFT prompts), whatever
      ``answer_accuracy`` says (the task has no reference answer; a follow rate other than 0.5
      would bias the start for or against the constraint); None for other prompts.
    """

    id = "reward_model"
    description = "the pipeline's case prompts scored by a reward model (reward_model:<path>)"
    max_turns = 1
    max_reward = None

    def __init__(self, *, path: str = "tiny", prompts: Any = CASE_PROMPTS, monitor: bool = True,
                 n_warmup: int = 1024) -> None:
        if not isinstance(path, str) or not path.strip() or "," in path:
            raise ValueError(f"{self.id}: path={path!r} must be a reward model folder, hub id or 'tiny' "
                             "(without ',', which separates reward spec entries)")
        self.path = path.strip()
        self.prompts = prompts
        self.is_case = isinstance(prompts, str) and prompts == CASE_PROMPTS
        self.n_warmup = _check_int("n_warmup", n_warmup, 1, self.id)
        self.reward = f"reward_model:{self.path}"
        if monitor and self.is_case:
            from textrl.envs import synthetic

            self.reward += f",{synthetic.__file__}:case_follow_reward:0"
        self._rows: list[dict[str, Any]] | None = None

    def rows(self) -> list[dict[str, Any]]:
        if self._rows is None:
            if self.is_case:
                from textrl.envs.synthetic import BUILTIN_PROMPTS

                self._rows = BUILTIN_PROMPTS["case"]()
            else:
                from textrl.envs.prompts import load_prompts

                self._rows = [dict(r) for r in load_prompts(self.prompts)]
        return [dict(r) for r in self._rows]

    def warmup_examples(self, rows: Sequence[dict[str, Any]], seed: int, *,
                        answer_accuracy: float | None = None) -> list[tuple[Any, str]] | None:
        if not self.is_case:
            return None
        from textrl.envs.synthetic import case_sft_pairs

        pairs = case_sft_pairs(self.n_warmup, follow_rate=0.5, seed=seed)
        return [(r["prompt"], r["response"]) for r in pairs]


__all__ = [
    "FORMAT_MAX_REWARD",
    "FORMAT_REWARD",
    "HIGHER",
    "INVALID",
    "LOWER",
    "ArithmeticEnv",
    "CalculatorEnv",
    "DigitsEnv",
    "GuessNumberEnv",
    "RewardModelEnv",
    "compact",
    "feedback",
    "guess_completion",
    "parse_guess",
    "parse_integer",
    "parse_tool_call",
    "run_tool",
]
