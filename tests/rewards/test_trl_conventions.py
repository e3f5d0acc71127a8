"""Reward functions behave as TRL's ``GRPOTrainer`` calls its ``reward_funcs``.

* conversational rows: ``prompts`` are the rows' message lists, ``completions`` lists of
  messages (``[{"role": "assistant", "content": text}]``); plain rows keep strings;
* ``None`` in a function's output means "does not apply to this row": the total is the
  weighted sum over the functions that apply (TRL's ``nansum``), 0 with a warning where none
  does, and it is never mistaken for a faulty NaN by the ``reward_nonfinite`` policy.

The TRL functions below are written out from the shapes TRL's documentation gives its examples.
"""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.arithmetic import assert_within
from tests.rewards.test_neural import score_tolerance
from textrl.core.checks import check_rollout
from textrl.envs.fast_path import rollout_from_responses, score_completions
from textrl.keys import KEYS
from textrl.models import build_tiny_reward_model, build_tiny_tokenizer
from textrl.rewards import (
    CompositeReward,
    NeuralReward,
    NoApplicableRewardWarning,
    RewardError,
    accuracy_reward,
    call_reward,
    combine_scores,
    completion_text,
    evaluate_reward,
    length_penalty,
    missing_eos_penalty,
    parse_reward_spec,
    repetition_penalty,
    tag_count_reward,
    think_format_reward,
)
from textrl.testing import sum_tolerance, unit_roundoff

NAN = math.nan
EOS = 3

# -- TRL's documented example reward functions (keyword style: they name `completions`) --------


def format_reward(completions, **kwargs):
    """TRL's conversational format reward: reads ``completion[0]["content"]``."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, c) else 0.0 for c in contents]


def length_reward(completions, **kwargs):
    """The brief's conversational length reward."""
    return [len(c[0]["content"]) for c in completions]


def reward_len(completions, **kwargs):
    """TRL's standard-format length reward: completions are strings."""
    return [-abs(20 - len(completion)) for completion in completions]


def solution_reward(completions, solution, **kwargs):
    """A reward reading the dataset's ``solution`` column, as TRL's ``accuracy_reward`` does."""
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if c.strip() == s else 0.0 for c, s in zip(contents, solution)]


def math_reward(prompts, completions, task, **kwargs):
    """A multi-task reward: None for rows of another task."""
    return [
        (1.0 if c[0]["content"].strip().isdigit() else 0.0) if t == "math" else None
        for c, t in zip(completions, task)
    ]


def code_reward(prompts, completions, task, **kwargs):
    """The other task's reward: None for the math rows."""
    return [
        (0.5 if "def " in c[0]["content"] else -0.5) if t == "code" else None
        for c, t in zip(completions, task)
    ]


# -- helpers ---------------------------------------------------------------------------------------


class CharTokenizer:
    """Decodes ids as characters (``chr``), dropping EOS: a fast stand-in for a tokenizer."""

    eos_token_id = EOS
    pad_token_id = 0

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join(chr(i) for i in row if i not in (EOS, 0)) for row in rows]


def encode(texts: list[str], t: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(responses [B, T], mask [B, T])``: each text's characters then EOS, right-padded."""
    t = t or max(len(x) for x in texts) + 1
    responses = torch.zeros((len(texts), t), dtype=torch.int64)
    mask = torch.zeros((len(texts), t), dtype=torch.bool)
    for i, text in enumerate(texts):
        ids = [ord(c) for c in text] + [EOS]
        responses[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = True
    return responses, mask


CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Write add."},
        {"role": "assistant", "content": "Which language?"},
        {"role": "user", "content": "Python."},
    ],
    [{"role": "user", "content": "3*3?"}],
]
TEXTS = ["4", "def add(a, b): return a + b", "<think>x</think><answer>9</answer>"]
TASKS = ["math", "code", "math"]


def score(reward, texts=TEXTS, **kw):
    responses, mask = encode(texts)
    prompts = kw.pop("prompts", [f"prompt {i}" for i in range(len(texts))])
    return score_completions(reward, prompts, responses, mask, tokenizer=CharTokenizer(), **kw)


def column(rows: list[list[float | None]], j: int):
    """A reward function returning column ``j`` of ``rows`` (None where the row has None)."""

    def fn(prompts, completions, **kwargs):
        return [row[j] for row in rows]

    return fn


def reference_total(rows: list[list[float | None]], weights: list[float]) -> list[float]:
    """Python reference of TRL's sum: weighted sum over the non-None scores; 0 when all None."""
    return [
        sum((w * s for w, s in zip(weights, row) if s is not None), 0.0) for row in rows
    ]


# -- conversational rows get message lists ---------------------------------------------------------


def test_conversational_rows_get_the_conversation_and_assistant_messages():
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [0.0] * len(completions)

    score(spy, conversations=CONVERSATIONS)
    assert seen["prompts"] == CONVERSATIONS  # every message, not the last user turn
    assert seen["completions"] == [[{"role": "assistant", "content": t}] for t in TEXTS]


def test_plain_rows_keep_strings():
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [0.0] * len(completions)

    score(spy, prompts=["a", "b", "c"])
    assert seen == {"prompts": ["a", "b", "c"], "completions": TEXTS}


def test_trl_documented_functions_work_unchanged_on_conversational_rows():
    scores = score(
        CompositeReward({"format": format_reward, "length": length_reward, "sol": solution_reward}),
        conversations=CONVERSATIONS,
        fields={"solution": ["4", "x", "9"]},
    )
    assert scores.components["format"].tolist() == [0.0, 0.0, 1.0]
    assert scores.components["length"].tolist() == [float(len(t)) for t in TEXTS]
    assert scores.components["sol"].tolist() == [1.0, 0.0, 0.0]
    expected = [f + n + s for f, n, s in zip([0, 0, 1], map(len, TEXTS), [1, 0, 0])]
    assert scores.total.tolist() == expected


def test_trl_standard_format_function_gets_strings_on_plain_rows():
    scores = score(reward_len)
    assert scores.total.tolist() == [-abs(20 - len(t)) for t in TEXTS]


def test_a_reward_may_not_mutate_the_conversation_of_another_row():
    shared = [{"role": "user", "content": "q"}]

    def vandal(prompts, completions, **kwargs):
        prompts[0][0]["content"] = "changed"
        prompts[0].append({"role": "user", "content": "extra"})
        return [float(len(p)) for p in prompts]

    scores = score(vandal, texts=["a", "b"], prompts=["q", "q"], conversations=[shared, shared])
    assert scores.total.tolist() == [2.0, 1.0]
    assert shared == [{"role": "user", "content": "q"}]


def test_completion_messages_replace_the_single_assistant_turn():
    episode = [
        {"role": "assistant", "content": "<tool>calc 2+2</tool>"},
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "<think>\nok\n</think>\n<answer>\n4\n</answer>"},
    ]
    seen = {}

    def spy(completions, **kwargs):
        seen.update(kwargs, completions=completions)
        return [len(c) for c in completions]

    scores = score(
        CompositeReward({"spy": spy, "think_format": think_format_reward}),
        texts=["x"],
        conversations=CONVERSATIONS[:1],
        completion_messages=[episode],
    )
    assert seen["completions"] == [episode] and seen["prompts"] == CONVERSATIONS[:1]
    assert scores.components["spy"].tolist() == [3.0]
    assert scores.components["think_format"].tolist() == [0.5]  # the last assistant message
    assert scores.completions == ["x"]  # the decoded tokens, as before


def test_completion_messages_alone_make_each_prompt_one_user_message():
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen["prompts"] = prompts
        return [0.0]

    score(spy, texts=["x"], prompts=["hello"],
          completion_messages=[[{"role": "assistant", "content": "x"}]])
    assert seen["prompts"] == [[{"role": "user", "content": "hello"}]]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"conversations": CONVERSATIONS[:2]}, r"conversations has 2 rows for 3 responses"),
        ({"conversations": [[], *CONVERSATIONS[1:]]}, r"conversations\[0\] is \[\]: each row"),
        ({"conversations": ["q", *CONVERSATIONS[1:]]}, r"conversations\[0\] is 'q'"),
        ({"completion_messages": [[{"content": "x"}]] * 3}, r"completion_messages\[0\] is"),
        ({"completion_messages": "abc"}, r"completion_messages has a str for 3 responses"),
    ],
)
def test_bad_message_rows_name_the_argument_and_row(kw, match):
    with pytest.raises(ValueError, match=match):
        score(tag_count_reward, **kw)


# -- built-in rewards accept both forms ------------------------------------------------------------

PIECES = [*"ab \n<>/", "<think>", "</think>", "<answer>", "</answer>", "42"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=12).map("".join)


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(TEXT, min_size=1, max_size=5), data=st.data())
def test_builtins_score_messages_as_the_text_of_the_last_assistant_message(texts, data):
    b = len(texts)
    answers = data.draw(st.lists(st.sampled_from(["42", "a", "b"]), min_size=b, max_size=b))
    truncated = data.draw(st.lists(st.booleans(), min_size=b, max_size=b))
    ids = [[1] * len(t) for t in texts]
    prompts = [[{"role": "user", "content": "q"}]] * b
    as_messages = [
        [{"role": "assistant", "content": "ignored <think>"}, {"role": "user", "content": "go"},
         {"role": "assistant", "content": t}]
        for t in texts
    ]
    fields = {"answer": answers, "truncated": truncated, "completion_ids": ids}
    for fn in (think_format_reward, tag_count_reward, accuracy_reward, repetition_penalty,
               length_penalty, missing_eos_penalty):
        want = call_reward(fn, ["q"] * b, texts, **fields)
        got = call_reward(fn, prompts, as_messages, **fields)
        torch.testing.assert_close(got, want, msg=fn.__name__)


def test_message_content_parts_are_read_as_text():
    parts = [[{"role": "assistant", "content": [{"type": "text", "text": "<answer>4"},
                                                {"type": "text", "text": "2</answer>"}]}]]
    assert accuracy_reward(["q"], parts, answer=["42"]).tolist() == [1.0]


def test_a_completion_without_an_assistant_message_names_the_roles():
    with pytest.raises(RewardError, match=r"roles \['tool'\] have no 'assistant' message"):
        call_reward(tag_count_reward, ["q"], [[{"role": "tool", "content": "x"}]])
    assert completion_text([{"role": "assistant", "content": "a"}]) == "a"


# -- None means "does not apply" -------------------------------------------------------------------


@pytest.mark.parametrize(
    "output",
    [[1.0, None, 3.0], (1, None, 3), np.array([1.0, None, 3.0], dtype=object)],
)
def test_none_rows_are_nan_and_do_not_apply(output):
    scores, applies = evaluate_reward(lambda p, c, **kw: output, ["p"] * 3, ["a", "b", "c"])
    assert applies.tolist() == [True, False, True]
    assert scores[0].item() == 1.0 and math.isnan(scores[1].item()) and scores[2].item() == 3.0
    assert math.isnan(call_reward(lambda p, c, **kw: output, ["p"] * 3, ["a"] * 3)[1].item())


def test_a_returned_nan_is_still_a_fault_and_the_message_mentions_none():
    with pytest.raises(RewardError, match=r"non-finite scores \[nan\] in rows \[1\].*or None where"):
        evaluate_reward(lambda p, c, **kw: [1.0, NAN, None], ["p"] * 3, ["a"] * 3)
    with pytest.raises(RewardError, match=r"in rows \[0\]"):  # a tensor cannot say None
        evaluate_reward(lambda p, c, **kw: torch.tensor([NAN, 1.0]), ["p"] * 2, ["a"] * 2)


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    k=st.integers(1, 4),
    b=st.integers(1, 6),
)
def test_combined_total_is_trls_nansum_over_applying_functions(data, k, b):
    score = st.one_of(st.none(), st.floats(-10, 10, allow_nan=False, width=32))
    rows = data.draw(st.lists(st.lists(score, min_size=k, max_size=k), min_size=b, max_size=b))
    weights = data.draw(st.lists(st.floats(-3, 3, width=32), min_size=k, max_size=k))
    fns = {f"f{j}": (column(rows, j), weights[j]) for j in range(k)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        total, raw = CompositeReward(fns).components(["p"] * b, ["c"] * b)
    # float32 products and a sum of up to k of them, which cancels (10 x 3 - 10 x 3): within
    # 2 gamma(2k) of the terms' magnitudes, not of the total (tests/arithmetic.py)
    magnitude = torch.tensor([sum(abs(w * s) for w, s in zip(weights, row) if s is not None) for row in rows],
                             dtype=torch.float64)
    tol = sum_tolerance(2 * k + 1, 1.0) * magnitude
    assert_within(total, torch.tensor(reference_total(rows, weights)), tol, "total")
    # TRL's formula: (rewards_per_func * weights).nansum(dim=1), None -> NaN
    per_func = torch.tensor([[NAN if s is None else s for s in row] for row in rows])
    assert_within(total, (per_func * torch.tensor(weights)).nansum(dim=1), tol, "TRL's total")
    for j in range(k):
        torch.testing.assert_close(raw[f"f{j}"], per_func[:, j], equal_nan=True)
    none_rows = [i for i, row in enumerate(rows) if all(s is None for s in row)]
    warned = [w for w in caught if issubclass(w.category, NoApplicableRewardWarning)]
    assert bool(warned) == bool(none_rows)
    if none_rows:
        assert f"rows {none_rows[:10]}" in str(warned[0].message)


def test_multi_task_rewards_sum_over_the_applying_one_and_metrics_use_applying_rows():
    reward = CompositeReward({"math": (math_reward, 2.0), "code": code_reward})
    scores = score(reward, conversations=CONVERSATIONS, fields={"task": TASKS})
    assert scores.total.tolist() == [2.0, 0.5, 0.0]
    math_scores = scores.components["math"]
    assert math_scores[0].item() == 1.0 and math.isnan(math_scores[1].item())
    assert torch.nanmean(math_scores).item() == 0.5  # mean over the rows it applies to
    assert scores.nonfinite is None


def test_a_row_no_reward_applies_to_scores_zero_with_a_warning():
    with pytest.warns(NoApplicableRewardWarning, match=r"rows \[1\] \(each of \['math_reward'\] returned"):
        scores = score(math_reward, conversations=CONVERSATIONS, fields={"task": TASKS})
    assert scores.total.tolist() == [1.0, 0.0, 0.0]
    assert math.isnan(scores.components["math_reward"][1].item())


@pytest.mark.parametrize("policy", ["raise", "zero", "drop"])
def test_none_is_not_a_nonfinite_score_under_any_policy(policy):
    reward = CompositeReward({"math": math_reward, "code": code_reward})
    scores = score(reward, conversations=CONVERSATIONS, fields={"task": TASKS}, nonfinite=policy)
    assert scores.total.tolist() == [1.0, 0.5, 0.0]
    if policy != "raise":
        assert scores.nonfinite.tolist() == [False, False, False]
    assert torch.isnan(scores.components["code"]).tolist() == [True, False, True]


@pytest.mark.parametrize("policy", ["zero", "drop"])
def test_a_faulty_nan_next_to_a_none_is_zeroed_and_the_none_stays_nan(policy):
    def faulty(prompts, completions, **kwargs):
        return [NAN, None, 1.0]

    reward = CompositeReward({"faulty": faulty, "tags": tag_count_reward})
    scores = score(reward, nonfinite=policy)
    assert scores.nonfinite.tolist() == [True, False, False]
    assert scores.total.tolist() == [0.0, 0.0, 1.0 + 1.0]  # row 2 has all four tags
    raw = scores.components["faulty"]
    assert raw[0].item() == 0.0 and math.isnan(raw[1].item()) and raw[2].item() == 1.0
    with pytest.raises(RewardError, match=r"reward 'faulty' returned non-finite scores \[nan\] "
                                          r"in rows \[0\]"):
        score(reward, nonfinite="raise")


def test_fast_path_drops_no_row_for_none_and_the_rollout_checks_pass():
    def half(prompts, completions, **kwargs):
        return [None if i % 2 else 1.0 for i in range(len(completions))]

    texts = ["ab", "cd", "ef", "gh"]
    responses, mask = encode(texts)
    prompt_ids = torch.full((4, 2), 65, dtype=torch.int64)
    with pytest.warns(NoApplicableRewardWarning):
        td = rollout_from_responses(
            prompt_ids, torch.ones(4, 2, dtype=torch.bool), responses, tokenizer=CharTokenizer(),
            reward_fn=half, eos_token_id=EOS, pad_token_id=0, max_new_tokens=responses.shape[1],
            prompt_texts=["p"] * 4, reward_nonfinite="drop",
        )
    check_rollout(td)
    assert td.batch_size == (4,) and td.get(KEYS.reward_nonfinite).tolist() == [False] * 4
    assert td.get(KEYS.reward).sum((1, 2)).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert torch.isnan(td.get(KEYS.reward_component("half"))).tolist() == [False, True, False, True]


def test_combine_scores_keeps_a_faulty_inf_of_an_applying_row():
    with pytest.warns(NoApplicableRewardWarning, match=r"rows \[1\]"):
        total = combine_scores(
            {"a": torch.tensor([math.inf, NAN])},
            {"a": torch.tensor([True, False])},
            {"a": 1.0},
        )
    assert total.tolist() == [math.inf, 0.0]  # the inf is a fault, left for reward_nonfinite


def test_spec_rewards_and_trl_functions_mix():
    reward = parse_reward_spec("tag_count:0.5")
    mixed = CompositeReward({**{k: (f, 0.5) for k, f in reward.functions.items()},
                             "format": format_reward})
    scores = score(mixed, conversations=CONVERSATIONS)
    assert scores.components["format"].tolist() == [0.0, 0.0, 1.0]
    assert scores.components["tag_count"].tolist() == [0.0, 0.0, 1.0]  # raw, unweighted
    assert scores.total.tolist() == [0.0, 0.0, 0.5 * 1.0 + 1.0]


# -- the neural reward model reads the whole conversation ------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def reward_model(tokenizer):
    return NeuralReward(build_tiny_reward_model(tokenizer, seed=5), tokenizer, clip=None)


def test_neural_reward_renders_the_whole_conversation_with_the_chat_template(
    reward_model, tokenizer
):
    completions = [[{"role": "assistant", "content": t}] for t in TEXTS]
    ids = reward_model.encode(CONVERSATIONS, completions)
    for row, conv, comp in zip(ids, CONVERSATIONS, completions):
        text = tokenizer.apply_chat_template(conv + comp, tokenize=False)
        assert row == tokenizer(text, add_special_tokens=False)["input_ids"]
    # peer path: the same conversation given as a ChatML-rendered prompt string
    rendered = [tokenizer.apply_chat_template(c, tokenize=False) for c in CONVERSATIONS]
    torch.testing.assert_close(reward_model(CONVERSATIONS, completions),
                               reward_model(rendered, TEXTS))
    last_user = [c[-1]["content"] for c in CONVERSATIONS]
    assert not torch.equal(reward_model(CONVERSATIONS[1:2], completions[1:2]),
                           reward_model(last_user[1:2], TEXTS[1:2]))


def test_neural_answer_blend_reads_the_last_assistant_message(tokenizer, reward_model):
    blend = NeuralReward(reward_model.model, tokenizer, clip=None, answer_blend=(0.4, 0.6))
    text = "<think>\nhm\n</think>\n<answer>\n9\n</answer>"
    conv = CONVERSATIONS[2]
    got = blend([conv], [[{"role": "assistant", "content": text}]])
    whole = reward_model([conv], [text])
    answer = reward_model([conv], ["9"])
    # the blend scores the whole and the answer in one padded batch, these two alone: each score
    # within score_tolerance (tests/rewards/test_neural.py), the blend's weights on them
    expected = 0.4 * whole + 0.6 * answer
    tol = 0.4 * score_tolerance(reward_model, [conv], [text]) + 0.6 * score_tolerance(reward_model, [conv], ["9"])
    assert_within(got, expected, tol + 4 * unit_roundoff() * expected.abs(), "blended score")


def test_neural_reward_without_template_joins_the_message_texts(tokenizer, reward_model):
    plain = NeuralReward(reward_model.model, tokenizer, use_chat_template=False)
    assert plain.render(CONVERSATIONS[0], [{"role": "assistant", "content": "4"}]) == (
        "Be brief.\n2+2?4"
    )
    assert plain.render("2+2?", "4") == "2+2?4"  # plain rows: unchanged
