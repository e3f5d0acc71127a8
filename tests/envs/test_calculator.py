"""The calculator tool's evaluator: known values, random trees against Python, hostile inputs."""

from __future__ import annotations

import ast
import doctest
import re
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import textrl.envs.calculator as calculator
from textrl.envs.calculator import MAX_BITS, CalculatorError, evaluate, format_number

# -- known values ------------------------------------------------------------------------------

KNOWN = [
    ("347 * 829", 287663),
    ("1 + 2 * 3", 7),
    ("(1 + 2) * 3", 9),
    ("10 - 4 - 3", 3),  # left-associative
    ("2 ** 3 ** 2", 512),  # right-associative
    ("-2 ** 2", -4),  # unary minus binds looser than **
    ("(-2) ** 2", 4),
    ("2 ** -1", Fraction(1, 2)),
    ("-2 ** -2", Fraction(-1, 4)),
    ("--3", 3),
    ("+-+3", -3),
    ("7 / 2", Fraction(7, 2)),
    ("6 / 3", 2),
    ("7 // 2", 3),
    ("7 // -2", -4),  # floor, as Python
    ("-7 % 3", 2),
    ("7 % -3", -2),
    ("7.5 // 2", 3),
    ("7.5 % 2", Fraction(3, 2)),
    ("0.1 + 0.2", Fraction(3, 10)),  # exact decimals
    ("1. + .5", Fraction(3, 2)),
    ("2.50", Fraction(5, 2)),
    ("3.0", 3),
    ("1 / 3 + 1 / 6", Fraction(1, 2)),
    ("0 ** 0", 1),
    ("(((7)))", 7),
    ("  12\t*\n3 ", 36),
    ("100 - 2 * (3 + 4) ** 2 / 7", 86),
    ("999 * 999 - 998001", 0),
    ("2 ** 511", 2**511),
]


@pytest.mark.parametrize(("expr", "value"), KNOWN)
def test_known_values(expr, value):
    got = evaluate(expr)
    assert got == value
    assert type(got) is type(value), f"{expr!r}: a whole value is an int, else a Fraction"


ERRORS = [
    ("", "empty expression"),
    ("   ", "empty expression"),
    ("1 +", "ends where a number was expected"),
    ("(1 + 2", "missing ')'"),
    ("1 + 2)", "unexpected ')'"),
    ("3 4", "unexpected '4'"),
    ("2 ^ 3", "use ** for powers"),
    ("x + 1", "unexpected character 'x'"),
    ("1 / 0", "division by zero"),
    ("1 // (2 - 2)", "division by zero"),
    ("5 % 0", "modulo by zero"),
    ("0 ** -1", "division by zero"),
    ("4 ** 0.5", "whole number"),
    ("1..2", "unexpected"),
    ("*3", "unexpected '*'"),
    ("()", "unexpected ')'"),
    ("2 ** 512", "result too large"),
    ("2 ** 1001", "exponent too large"),
]


@pytest.mark.parametrize(("expr", "message"), ERRORS)
def test_errors_name_the_problem(expr, message):
    with pytest.raises(CalculatorError, match=re.escape(message)):
        evaluate(expr)


def test_errors_are_value_errors_with_one_short_line():
    with pytest.raises(ValueError) as info:
        evaluate("1 +* 2")
    message = str(info.value)
    assert "\n" not in message and len(message) < 100


def test_format_number():
    assert format_number(287663) == "287663"
    assert format_number(-5) == "-5"
    assert format_number(Fraction(7, 2)) == "3.5"
    assert format_number(Fraction(1, 3)) == "0.333333"
    assert format_number(Fraction(-2, 3)) == "-0.666667"
    assert format_number(Fraction(1, 8)) == "0.125"
    assert format_number(Fraction(-1, 10**9)) == "0"  # rounds to zero: no "-0"
    assert format_number(Fraction(1, 3), places=2) == "0.33"


def test_doctests_pass():
    result = doctest.testmod(calculator)
    assert result.attempted > 0 and result.failed == 0


# -- random trees against Python's arithmetic --------------------------------------------------


class TooLarge(Exception):
    """The reference's stand-in for the evaluator's size bound."""


def _check_size(value):
    value = Fraction(value)
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise TooLarge
    return value


def reference(node):
    """The value of a tree of ``ast`` nodes by Python's operators on Fractions (no eval)."""
    if isinstance(node, ast.Constant):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp):
        operand = reference(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    a, b = reference(node.left), reference(node.right)
    op = type(node.op)
    if op in (ast.Div, ast.FloorDiv, ast.Mod, ast.Pow) and b == 0 and op is not ast.Pow:
        raise ZeroDivisionError
    if op is ast.Pow:
        if a == 0 and b < 0:
            raise ZeroDivisionError
        return _check_size(a ** int(b))
    result = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b,
              ast.Div: lambda: a / b, ast.FloorDiv: lambda: a // b, ast.Mod: lambda: a % b}[op]()
    return _check_size(result)


leaves = st.one_of(
    st.integers(0, 30).map(ast.Constant),
    st.tuples(st.integers(0, 9), st.integers(0, 9)).map(lambda p: ast.Constant(float(f"{p[0]}.{p[1]}"))),
)
exponents = st.one_of(
    st.integers(0, 3).map(ast.Constant),
    st.integers(1, 3).map(lambda k: ast.UnaryOp(ast.USub(), ast.Constant(k))),
)
BINARY = (ast.Add(), ast.Sub(), ast.Mult(), ast.Div(), ast.FloorDiv(), ast.Mod())


def _extend(children):
    return st.one_of(
        st.tuples(children, st.sampled_from(BINARY), children).map(lambda t: ast.BinOp(t[0], t[1], t[2])),
        st.tuples(children, exponents).map(lambda t: ast.BinOp(t[0], ast.Pow(), t[1])),
        st.tuples(st.sampled_from((ast.USub(), ast.UAdd())), children).map(lambda t: ast.UnaryOp(t[0], t[1])),
    )


trees = st.recursive(leaves, _extend, max_leaves=12)


def _expected(tree):
    try:
        value = reference(tree)
    except (ZeroDivisionError, TooLarge):
        return None
    return value


@settings(max_examples=250, deadline=None)
@given(trees)
def test_random_trees_match_python(tree):
    """Python's own precedence writes the tree (``ast.unparse``, minimal parentheses); the
    evaluator must read it back to the value Python's operators give on the same tree."""
    text = ast.unparse(tree)
    expected = _expected(tree)
    if len(text) > calculator.MAX_CHARS:
        return
    if expected is None:
        with pytest.raises(CalculatorError):
            evaluate(text)
    else:
        assert evaluate(text) == expected, text


def _parenthesised(node) -> str:
    """Every operation in its own parentheses: a rendering that needs no precedence at all."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.UnaryOp):
        return f"({'-' if isinstance(node.op, ast.USub) else '+'}{_parenthesised(node.operand)})"
    symbol = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
              ast.Mod: "%", ast.Pow: "**"}[type(node.op)]
    return f"({_parenthesised(node.left)}{symbol}{_parenthesised(node.right)})"


@settings(max_examples=150, deadline=None)
@given(trees)
def test_fully_parenthesised_trees_match_python(tree):
    text = _parenthesised(tree)
    expected = _expected(tree)
    if len(text) > calculator.MAX_CHARS or text.count("(") > calculator.MAX_DEPTH:
        return
    if expected is None:
        with pytest.raises(CalculatorError):
            evaluate(text)
    else:
        assert evaluate(text) == expected, text


# -- hostile inputs ----------------------------------------------------------------------------

HOSTILE = [
    "9**9**9",
    "9**9**9**9",
    "(9**9)**(9**9)",
    "10**100000",
    "2**-100000",
    "10**1000 * 10**1000",
    "7**999",
    "(1/3)**999",
    "1" * 10_000,
    "1" * 31,
    "0." + "1" * 40,
    "(" * 5_000 + "1" + ")" * 5_000,
    "(" * 99 + "1" + ")" * 99,
    "-" * 10_000 + "1",
    "-" * 150 + "1",
    "2" + "**2" * 60,
    "((((((((((",
    "1/" * 90 + "0",
    "\x00" * 50,
    "1e9999",
    "__import__('os')",
]


@pytest.mark.parametrize("expr", HOSTILE, ids=lambda e: repr(e[:24]) + f"..{len(e)}")
def test_hostile_inputs_fail_fast(expr):
    start = time.perf_counter()
    with pytest.raises(CalculatorError) as info:
        evaluate(expr)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.1, f"{expr[:30]!r}: {elapsed:.3f} s"
    assert "\n" not in str(info.value) and len(str(info.value)) < 100


def test_limits_are_the_documented_ones():
    """Just inside every bound works; just outside fails."""
    ok = "1" * calculator.MAX_LITERAL_DIGITS
    assert evaluate(ok) == int(ok)
    with pytest.raises(CalculatorError, match="number too long"):
        evaluate(ok + "1")
    depth = calculator.MAX_DEPTH
    assert evaluate("(" * depth + "5" + ")" * depth) == 5
    with pytest.raises(CalculatorError, match="nested too deeply"):
        evaluate("(" * (depth + 1) + "5" + ")" * (depth + 1))
    assert evaluate("1 ** 1000") == 1 and evaluate("(-1) ** -1000") == 1
    with pytest.raises(CalculatorError, match="exponent too large"):
        evaluate("1 ** 1001")
    assert evaluate("1" + " " * (calculator.MAX_CHARS - 1)) == 1
    with pytest.raises(CalculatorError, match="too long"):
        evaluate("1" + " " * calculator.MAX_CHARS)


def test_non_text_is_refused():
    with pytest.raises(CalculatorError, match="must be text"):
        evaluate(12)  # type: ignore[arg-type]


# -- the calculator environment's answer and tool-call parsing ---------------------------------


def _calculator_turn(completion: str, turn: int = 1):
    from textrl.envs.environment import Episode
    from textrl.envs.registry import make_env

    env = make_env("calculator", n_rows=4, n_eval=0)
    row = env.rows()[0]
    episode = Episode(row=row, messages=[{"role": "user", "content": row["prompt"]}], prompt_messages=1, turn=turn)
    env.start(episode)
    return row, env.step(episode, completion)


_ARABIC_INDIC = str.maketrans("0123456789", "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669")
_FULLWIDTH = str.maketrans("0123456789", "\uff10\uff11\uff12\uff13\uff14\uff15\uff16\uff17\uff18\uff19")


@pytest.mark.parametrize("written", [
    lambda n: f"{n:,}",                          # thousands commas: 287,663
    lambda n: str(n).translate(_ARABIC_INDIC),  # another script's digits, which int() reads
    lambda n: str(n).translate(_FULLWIDTH),
], ids=["commas", "arabic-indic", "fullwidth"])
def test_only_ascii_digits_without_separators_answer(written):
    from textrl.envs.builtin import parse_integer

    row, _ = _calculator_turn("")
    answer = int(row["answer"])
    text = written(answer)
    assert int(text.replace(",", "")) == answer  # what the old parser accepted as right
    assert parse_integer(text) is None
    _, turn = _calculator_turn(f"<answer>{text}</answer>")
    assert turn.reward == 0.0 and turn.done
    _, right = _calculator_turn(f"<answer>{answer}</answer>")
    assert right.reward == 1.0


def test_the_tool_takes_only_ascii_digits():
    with pytest.raises(CalculatorError, match="unexpected character"):
        evaluate("\u0663 * 2")
    assert evaluate("3 * 2") == 6


def test_adversarial_long_completions_parse_correctly():
    """120k characters of unclosed tags: what the lazy regexes scanned quadratically (11-16 s);
    the answer and the tool call are found by str.find (rewards.rules.tag_content)."""
    from textrl.envs.builtin import parse_tool_call
    from textrl.rewards.rules import extract_answer, tag_content

    n = 120_000
    assert extract_answer("<answer>" * (n // 8)) is None
    assert parse_tool_call("<tool>" * (n // 6)) == (None, "error: unclosed <tool> (write <tool>EXPR</tool>)")
    assert extract_answer("<answer>" * (n // 8) + "</answer>") == "<answer>" * (n // 8 - 1)
    assert tag_content("x" * n + "<tool>1+1</tool>", "<tool>", "</tool>") == "1+1"
    row, turn = _calculator_turn("<tool>" * (n // 6))
    assert not turn.done and "unclosed <tool>" in turn.observation[0]["content"]
