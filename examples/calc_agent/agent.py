"""A calculator agent written the way a user writes one: the OpenAI SDK and nothing else.

It knows nothing of spanrl. The model may ask for the calculator with ``CALC <expression>``;
the agent evaluates it and answers ``RESULT <value>``; the model finishes with
``ANSWER <number>``. At most three model calls per task.

Run it by hand against any OpenAI-compatible endpoint::

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=x OPENAI_MODEL=policy \
        python examples/calc_agent/agent.py '{"question": "37+45"}'

Under spanrl it is run by ``spanrl run`` either as the callable ``agent:solve`` or as this
script wrapped in ``opentelemetry-instrument`` (the task arrives on stdin as JSON).
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re
import sys
from typing import Any

from openai import OpenAI

SYSTEM_PROMPT = "Reply CALC <expression> or ANSWER <number>."
MAX_MODEL_CALLS = 3
MAX_TOKENS = 16

_CALC = re.compile(r"^\s*CALC\s+(.+?)\s*$")
_ANSWER = re.compile(r"^\s*ANSWER\s+(-?\d+)\s*$")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

_client: OpenAI | None = None


def calculator(expression: str) -> int:
    """Evaluate ``a+b``, ``a-b`` or ``a*b`` on integers (nothing else: no eval of code)."""
    node = ast.parse(expression, mode="eval").body
    if not (
        isinstance(node, ast.BinOp)
        and type(node.op) in _OPERATORS
        and isinstance(node.left, ast.Constant)
        and isinstance(node.right, ast.Constant)
        and isinstance(node.left.value, int)
        and isinstance(node.right.value, int)
    ):
        raise ValueError(f"not a calculator expression: {expression!r}")
    return _OPERATORS[type(node.op)](node.left.value, node.right.value)


def _openai_client() -> OpenAI:
    global _client
    if _client is None:
        _client = OpenAI(max_retries=0, timeout=60.0)
    return _client


def solve(task: dict) -> str:
    """Solve one task ``{"question": "37+45", ...}``; return the final answer text ('' if none)."""
    client = _openai_client()
    model = os.environ.get("OPENAI_MODEL", "policy")
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
    ]
    for _ in range(MAX_MODEL_CALLS):
        reply = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=1.0
        )
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        answer = _ANSWER.match(text)
        if answer:
            return answer.group(1)
        calc = _CALC.match(text)
        if not calc:
            return ""  # the model said something the agent does not understand
        try:
            result = str(calculator(calc.group(1)))
        except (ValueError, SyntaxError):
            result = "ERROR"
        messages.append({"role": "user", "content": f"RESULT {result}"})
    return ""


def main() -> int:
    raw = sys.argv[1] if len(sys.argv) > 1 else (os.environ.get("SPANRL_TASK") or sys.stdin.read())
    print(solve(json.loads(raw)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
