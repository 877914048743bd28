"""Arithmetic on numbers, evaluated from the expression's syntax tree (never ``eval``)."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from fractions import Fraction

BINARY: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
#: results (and exponents) beyond this many digits are refused, so a call cannot hang the tool
MAX_DIGITS = 100


class CalculatorError(ValueError):
    """The expression is not arithmetic the calculator does, or its value is undefined."""


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner = _value(node.operand)
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exponent = _value(node.left), _value(node.right)
        if exponent.denominator != 1 or abs(exponent) > MAX_DIGITS * 4:
            raise CalculatorError("exponents must be whole numbers of moderate size")
        if base == 0 and exponent < 0:
            raise CalculatorError("division by zero")
        return base**exponent
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise CalculatorError("division by zero")
        result = BINARY[type(node.op)](left, right)
        return Fraction(result)
    raise CalculatorError(f"unsupported: {ast.unparse(node)[:40]!r} (numbers, + - * / // % ** and parentheses)")


def calculate(expression: str) -> str:
    """The value of ``expression`` as text: an integer exactly, anything else as a decimal rounded to
    6 places (trailing zeros dropped). :class:`CalculatorError` for anything else."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an expression: {expression.strip()[:40]!r}") from None
    value = _value(tree.body)
    if len(str(abs(value.numerator))) > MAX_DIGITS:
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")
