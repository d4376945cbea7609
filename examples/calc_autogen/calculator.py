"""The calculator the AutoGen agent's tool runs: + - * / on integers, parentheses, nothing else.

No ``eval``: the expression is parsed with ``ast`` and only number literals and those four
operators are evaluated. A division that is not exact gives its value to 2 decimals. Shared by the
agent's tool and the warm-start demonstrations (which show the model the tool's exact replies).
"""

from __future__ import annotations

import ast
import operator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_VALUE = 10**12


def evaluate(expression: str) -> str:
    """The value of ``expression`` as text, or ``error: ...`` saying what is wrong with it."""
    try:
        value = _value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}" if str(exc) else "error: not an arithmetic expression"
    if value == int(value):
        return str(int(value))
    return f"{value:.2f}"


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        result = _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
        if abs(result) > MAX_VALUE:
            raise ValueError("number too large")
        return result
    raise ValueError("only numbers, + - * / and parentheses")
