from __future__ import annotations

import doctest
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import textrl.rewards.base
import textrl.rewards.composite
import textrl.rewards.penalties
import textrl.rewards.registry
import textrl.rewards.rules
from textrl.rewards import accuracy_reward, tag_count_reward, think_format_reward

GOOD = "<think>\nsix times seven\n</think>\n<answer>\n42\n</answer>"

THINK_FORMAT_CASES = [
    # (completion, expected score)
    (GOOD, 0.5),  # the canonical layout
    (GOOD.replace("</think>\n", "</think>\n\n"), 0.5),  # one blank line between the blocks
    (GOOD.replace("</think>\n", "</think>\n\n\n"), 0.0),  # two blank lines: neither pattern
    (GOOD + "\n", 0.5),  # one trailing newline: `$` matches before a final "\n" (MiniMind)
    (GOOD + "\n\n", 0.0),  # two trailing newlines
    (GOOD + " ", 0.0),  # trailing space
    (GOOD + "\nthe end", 0.0),  # text after </answer>
    ("Sure! " + GOOD, 0.0),  # text before <think>
    ("\n" + GOOD, 0.0),  # leading newline before <think>
    (GOOD.replace("<think>\n", "<think>"), 0.0),  # missing newline after <think>
    (GOOD.replace("\n</think>", "</think>"), 0.0),  # missing newline before </think>
    (GOOD.replace("<answer>\n", "<answer>"), 0.0),  # missing newline after <answer>
    (GOOD.replace("\n</answer>", "</answer>"), 0.0),  # missing newline before </answer>
    (GOOD.replace("</think>\n", "</think>"), 0.0),  # blocks glued together
    ("<think>\n\n</think>\n<answer>\n42\n</answer>", 0.5),  # empty think content, two newlines
    ("<think>\n</think>\n<answer>\n42\n</answer>", 0.0),  # empty think, one newline: too short
    ("<think>\nr\n</think>\n<answer>\n\n</answer>", 0.5),  # empty answer content, two newlines
    ("<think>\nline 1\nline 2\n</think>\n<answer>\n4\n2\n</answer>", 0.5),  # multi-line (DOTALL)
    (GOOD.replace("\n", "\r\n"), 0.0),  # CRLF line endings
    ("<answer>\n42\n</answer>\n<think>\nr\n</think>", 0.0),  # blocks in the wrong order
    ("<answer>\n42\n</answer>", 0.0),  # no think block
    ("<think>\nr\n</think>", 0.0),  # no answer block
    ("<think>\nr\n</think>\n<answer>\n42\n", 0.0),  # truncated before </answer>
    # The lazy DOTALL `.*?` can absorb whole blocks, so MiniMind's regex accepts these;
    # tag_count_reward is the term that sees the doubled tags.
    ("<think>\na\n</think>\n<think>\nb\n</think>\n<answer>\n42\n</answer>", 0.5),  # doubled think
    (GOOD + "\n<answer>\n43\n</answer>", 0.5),  # doubled answer block
    ("<think>\n<think>\nr\n</think>\n</think>\n<answer>\n42\n</answer>", 0.5),  # nested think
    (GOOD + "\nextra\n</answer>", 0.5),  # text after </answer> that ends in another </answer>
    ("", 0.0),  # empty completion
    ("<THINK>\nr\n</THINK>\n<ANSWER>\n42\n</ANSWER>", 0.0),  # tags are case-sensitive
]


@pytest.mark.parametrize(("completion", "expected"), THINK_FORMAT_CASES)
def test_think_format_table(completion, expected):
    out = think_format_reward(["q"], [completion])
    assert out.dtype == torch.float32 and out.shape == (1,)
    assert out.item() == expected


def test_think_format_batched_order_preserved():
    completions = [c for c, _ in THINK_FORMAT_CASES]
    out = think_format_reward(["q"] * len(completions), completions)
    assert out.tolist() == [e for _, e in THINK_FORMAT_CASES]


def _minimind_think_format(text: str) -> float:
    """MiniMind's two-pattern formula, kept verbatim as the reference semantics."""
    p1 = r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$"
    p2 = r"^<think>\n.*?\n</think>\n\n<answer>\n.*?\n</answer>$"
    return 0.5 if re.match(p1, text, re.S) or re.match(p2, text, re.S) else 0.0


_FRAGMENTS = st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "\n", "x", " "])


@settings(max_examples=300, deadline=None)
@given(st.lists(_FRAGMENTS, max_size=14))
def test_think_format_equals_minimind_two_patterns(parts):
    text = "".join(parts)
    assert think_format_reward(["q"], [text]).item() == _minimind_think_format(text)


@settings(max_examples=100, deadline=None)
@given(st.lists(_FRAGMENTS, max_size=14))
def test_tag_count_in_quarter_steps(parts):
    score = tag_count_reward(["q"], ["".join(parts)]).item()
    assert 0.0 <= score <= 1.0 and (score * 4).is_integer()


TAG_COUNT_CASES = [
    (GOOD, 1.0),  # all four tags once
    (GOOD.replace("</think>\n", "</think>\n\n"), 1.0),  # blank-line variant: order/layout ignored
    ("<think>\nr\n</think>", 0.5),  # only the think block
    ("<answer>\n42\n</answer>", 0.5),  # only the answer block
    ("<think>\n<think>\nr\n</think>\n<answer>\n42\n</answer>", 0.75),  # <think> doubled
    ("<think>\na\n</think>\n<think>\nb\n</think>\n<answer>\n42\n</answer>", 0.5),  # 2 think blocks
    (GOOD + "\n<answer>\n43\n</answer>", 0.5),  # answer block doubled
    ("<answer>\n42\n</answer>\n<think>\nr\n</think>", 1.0),  # wrong order still counts
    ("<think>r</think><answer>42</answer>", 1.0),  # no newlines: tags only
    ("Sure! " + GOOD + " bye", 1.0),  # surrounding text does not matter
    ("<think>\nr\n</think>\n<answer>\n42\n", 0.75),  # truncated: </answer> missing
    ("", 0.0),  # empty
    ("<THINK></THINK>", 0.0),  # case-sensitive
]


@pytest.mark.parametrize(("completion", "expected"), TAG_COUNT_CASES)
def test_tag_count_table(completion, expected):
    assert tag_count_reward(["q"], [completion]).item() == expected


ACCURACY_CASES = [
    # (completion, reference, require_tags, expected)
    (GOOD, "42", False, 1.0),  # answer block content, stripped
    (GOOD, " 42 ", False, 1.0),  # reference is normalised too
    (GOOD, 42, False, 1.0),  # non-str reference compared via str()
    (GOOD, "43", False, 0.0),  # wrong answer
    ("<answer>x  =\n 4</answer>", "x = 4", False, 1.0),  # inner whitespace collapsed
    ("<answer>Paris</answer>", "paris", False, 0.0),  # case-sensitive
    ("<answer>1</answer><answer>2</answer>", "1", False, 1.0),  # first answer block wins
    ("<answer>1</answer><answer>2</answer>", "2", False, 0.0),  # later blocks ignored
    ("42", "42", False, 1.0),  # no tags: whole completion is the answer
    ("  42\n", "42", False, 1.0),  # no tags, whitespace stripped
    ("42", "42", True, 0.0),  # no tags and require_tags: 0
    ("<answer>\n42\n", "42", True, 0.0),  # unclosed answer block counts as no block
    ("<think>\nr\n</think>\n42", "42", False, 0.0),  # untagged reasoning text is not the answer
    ("<answer></answer>", "", False, 1.0),  # empty answer equals empty reference
]


@pytest.mark.parametrize(("completion", "reference", "require_tags", "expected"), ACCURACY_CASES)
def test_accuracy_table(completion, reference, require_tags, expected):
    out = accuracy_reward(["q"], [completion], answer=[reference], require_tags=require_tags)
    assert out.item() == expected


def test_accuracy_without_answer_names_function_and_field():
    with pytest.raises(ValueError, match=r"accuracy_reward needs the batch field 'answer'"):
        accuracy_reward(["q"], ["42"])


def test_accuracy_answer_length_mismatch():
    with pytest.raises(ValueError, match=r"accuracy_reward: answer has 1 entries for 2"):
        accuracy_reward(["q", "q"], ["1", "2"], answer=["1"])


def test_accuracy_none_reference_names_rows():
    with pytest.raises(ValueError, match=r"None in rows \[1\]"):
        accuracy_reward(["q", "q"], ["1", "2"], answer=["1", None])


def test_rules_ignore_unrelated_kwargs():
    out = tag_count_reward(["q"], [GOOD], answer=["42"], truncated=[False], completion_ids=[[1]])
    assert out.tolist() == [1.0]


def test_empty_batch():
    assert think_format_reward([], []).shape == (0,)
    assert tag_count_reward([], []).dtype == torch.float32


@pytest.mark.parametrize(
    "module",
    [textrl.rewards.rules, textrl.rewards.penalties, textrl.rewards.base, textrl.rewards.composite,
     textrl.rewards.registry, textrl.rewards],
)
def test_doctests_pass(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module.__name__} has no doctests"
    assert result.failed == 0
