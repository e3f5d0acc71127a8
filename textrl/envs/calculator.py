"""A small, bounded arithmetic evaluator: the tool of the ``calculator`` environment.

:func:`evaluate` parses the expression itself (a recursive-descent parser; no ``eval``, no
``ast``, no ``exec``) and computes exactly, over Python ints and :class:`fractions.Fraction`:

    expr   := term   (("+" | "-") term)*
    term   := unary  (("*" | "/" | "//" | "%") unary)*
    unary  := ("+" | "-") unary | power
    power  := atom   ("**" unary)?             right-associative: 2**3**2 == 2**9
    atom   := NUMBER | "(" expr ")"             NUMBER: 12, 1.5, 1., .5

The precedence is Python's: ``-2**2 == -4``, ``2**-1 == 1/2``, ``7 // -2 == -4``,
``-7 % 3 == 2``. ``/`` is exact (``1/3`` is ``Fraction(1, 3)``, ``6/3`` is ``2``); ``//`` and
``%`` follow Python on ints and fractions; an exponent must be a whole number (``4**0.5`` is an
error, so every result stays exact). Decimal literals are exact (``0.1`` is ``Fraction(1, 10)``).

Everything is bounded, so a hostile expression fails fast with a :class:`CalculatorError`
whose message is one short line (the environment sends it to the model as the tool's answer):

- at most :data:`MAX_CHARS` characters and :data:`MAX_LITERAL_DIGITS` digits per number;
- at most :data:`MAX_DEPTH` nested parentheses, unary signs and exponents (no RecursionError);
- at most :data:`MAX_EXPONENT` in absolute value as an exponent, and no value (numerator or
  denominator) of more than :data:`MAX_BITS` bits, checked *before* a power is computed, so
  ``9**9**9`` and ``10**100000`` are refused instead of computed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from fractions import Fraction

MAX_CHARS = 200
"""Longest expression accepted, in characters (whitespace included)."""
MAX_LITERAL_DIGITS = 30
"""Most digits in one number literal."""
MAX_DEPTH = 32
"""Most nested parentheses, unary signs and exponents."""
MAX_EXPONENT = 1000
"""Largest absolute value of an exponent."""
MAX_BITS = 512
"""Largest size of any intermediate value: numerator and denominator, in bits (about 154 digits)."""

Number = int | Fraction
"""What :func:`evaluate` returns: an int, or a Fraction when the value is not whole."""

_TOKEN = re.compile(r"\s*(?:([0-9]+(?:\.[0-9]*)?|\.[0-9]+)|(\*\*|//|[-+*/%()]))")
"""A number (ASCII digits only: ``\\d`` would take '٣' and int() would read it as 3) or an operator."""
_OPERATORS = "+ - * / // % ** ( )"


class CalculatorError(ValueError):
    """The expression is malformed, too large, or divides by zero; the message is one line."""


def _tokens(expr: str) -> list[str]:
    """The expression's numbers and operators, in order (whitespace dropped)."""
    tokens: list[str] = []
    pos = 0
    end = len(expr.rstrip())
    while pos < end:
        match = _TOKEN.match(expr, pos)
        if match is None:
            at = pos + len(expr[pos:]) - len(expr[pos:].lstrip())
            char = expr[at]
            hint = " (use ** for powers)" if char == "^" else f" (allowed: numbers and {_OPERATORS})"
            raise CalculatorError(f"unexpected character {char!r} at position {at}{hint}")
        number, operator = match.groups()
        if number is not None:
            digits = sum(c.isdigit() for c in number)
            if digits > MAX_LITERAL_DIGITS:
                raise CalculatorError(f"number too long ({digits} digits; at most {MAX_LITERAL_DIGITS})")
        tokens.append(number if number is not None else operator)
        pos = match.end()
    return tokens


def _literal(text: str) -> Number:
    whole, _, decimals = text.partition(".")
    if not decimals.strip("0"):
        return int(whole or "0")
    return Fraction(int(whole or "0") * 10 ** len(decimals) + int(decimals), 10 ** len(decimals))


def _normal(value: Number) -> Number:
    """An int when the value is whole; refuses values larger than :data:`MAX_BITS`."""
    if isinstance(value, Fraction):
        if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
            raise CalculatorError(f"result too large (more than {MAX_BITS} bits)")
        return value.numerator if value.denominator == 1 else value
    if value.bit_length() > MAX_BITS:
        raise CalculatorError(f"result too large (more than {MAX_BITS} bits)")
    return value


def _divide(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalculatorError("division by zero")
    return Fraction(a) / Fraction(b)


def _floor_divide(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalculatorError("division by zero")
    return a // b


def _modulo(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalculatorError("modulo by zero")
    return a % b


def _power(base: Number, exponent: Number) -> Number:
    """``base ** exponent`` for a whole exponent, refused before computing when too large."""
    if isinstance(exponent, Fraction):
        raise CalculatorError("the exponent must be a whole number")
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent too large ({exponent}; at most {MAX_EXPONENT} in absolute value)")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero (0 to a negative power)")
    base = Fraction(base)
    # log2 of a part is at least bit_length - 1, so this refuses before the big number exists
    parts = (base.numerator, base.denominator)
    if any((abs(p).bit_length() - 1) * abs(exponent) > MAX_BITS for p in parts):
        raise CalculatorError(f"result too large (more than {MAX_BITS} bits)")
    return base**exponent


_BINARY: dict[str, Callable[[Number, Number], Number]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": _divide,
    "//": _floor_divide,
    "%": _modulo,
}


class _Parser:
    """Recursive descent over the token list; ``depth`` counts the open nested constructs."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    @contextmanager
    def nested(self) -> Iterator[None]:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalculatorError(f"expression nested too deeply (more than {MAX_DEPTH} levels)")
        try:
            yield
        finally:
            self.depth -= 1

    def parse(self) -> Number:
        if not self.tokens:
            raise CalculatorError("empty expression")
        value = self.expr()
        if self.peek() is not None:
            raise CalculatorError(f"unexpected {self.peek()!r} after a complete expression")
        return value

    def expr(self) -> Number:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            value = _normal(_BINARY[op](value, self.term()))
        return value

    def term(self) -> Number:
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            op = self.take()
            value = _normal(_BINARY[op](value, self.unary()))
        return value

    def unary(self) -> Number:
        if self.peek() in ("+", "-"):
            sign = self.take()
            with self.nested():
                operand = self.unary()
            return -operand if sign == "-" else operand
        return self.power()

    def power(self) -> Number:
        base = self.atom()
        if self.peek() == "**":
            self.take()
            with self.nested():
                exponent = self.unary()
            return _normal(_power(base, exponent))
        return base

    def atom(self) -> Number:
        token = self.peek()
        if token is None:
            raise CalculatorError("the expression ends where a number was expected")
        if token == "(":
            self.take()
            with self.nested():
                value = self.expr()
            if self.peek() != ")":
                raise CalculatorError("unbalanced parentheses: missing ')'")
            self.take()
            return value
        if token[0] in "0123456789.":
            return _literal(self.take())
        raise CalculatorError(f"unexpected {token!r} where a number was expected")


def evaluate(expr: str) -> Number:
    """The exact value of an arithmetic expression (see the module docstring for the grammar).

    >>> evaluate("347 * 829"), evaluate("2 ** 3 ** 2"), evaluate("-2**2"), evaluate("7 // -2")
    (287663, 512, -4, -4)
    >>> evaluate("1 / 3 + 0.5")
    Fraction(5, 6)
    >>> evaluate("1 / (2 - 2)")
    Traceback (most recent call last):
    ...
    textrl.envs.calculator.CalculatorError: division by zero
    """
    if not isinstance(expr, str):
        raise CalculatorError(f"the expression must be text, got {type(expr).__name__}")
    if len(expr) > MAX_CHARS:
        raise CalculatorError(f"expression too long ({len(expr)} characters; at most {MAX_CHARS})")
    return _normal(_Parser(_tokens(expr)).parse())


def format_number(value: Number, places: int = 6) -> str:
    """``value`` as the tool shows it: an int in full, a fraction as a decimal rounded to at most
    ``places`` decimals (trailing zeros dropped; exact when it has that few).

    >>> format_number(287663), format_number(Fraction(7, 2)), format_number(Fraction(-2, 3))
    ('287663', '3.5', '-0.666667')
    """
    if isinstance(value, int):
        return str(value)
    scaled = round(abs(value) * 10**places)
    whole, decimals = divmod(scaled, 10**places)
    text = f"{whole}.{decimals:0{places}d}".rstrip("0").rstrip(".")
    return "-" + text if value < 0 and text != "0" else text


__all__ = [
    "MAX_BITS",
    "MAX_CHARS",
    "MAX_DEPTH",
    "MAX_EXPONENT",
    "MAX_LITERAL_DIGITS",
    "CalculatorError",
    "Number",
    "evaluate",
    "format_number",
]
