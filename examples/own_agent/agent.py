"""Your agent: a plain OpenAI-client program that knows nothing of spanrl (replace it with yours).

It answers arithmetic questions with a calculator tool, in a text protocol a small model can
learn: the model replies ``CALC <expression>`` to use the calculator (the agent answers
``RESULT <value>``) or ``ANSWER <number>`` to finish; at most three model calls.

``spanrl run run.yaml`` calls ``solve(task)`` once per attempt, with ``OPENAI_BASE_URL`` and
``OPENAI_MODEL`` pointing at the model being trained, and records what it returns as the
variable ``output`` that ``reward.py`` scores. Run it by hand against any OpenAI-compatible
endpoint: ``python agent.py '{"question": "37+45"}'``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys

from openai import OpenAI

SYSTEM_PROMPT = "Reply CALC <expression> or ANSWER <number>."
MAX_MODEL_CALLS = 3

CALC = re.compile(r"^\s*CALC\s+(\d+)\s*([+-])\s*(\d+)\s*$")
ANSWER = re.compile(r"^\s*ANSWER\s+(-?\d+)\s*$")



@functools.cache
def client() -> OpenAI:
    """Made on first use: the runner sets OPENAI_BASE_URL after importing this module."""
    return OpenAI(api_key=os.environ.get("OPENAI_API_KEY", "unused"), max_retries=0, timeout=60.0)


def calculator(a: str, operator: str, b: str) -> int:
    return int(a) + int(b) if operator == "+" else int(a) - int(b)


def solve(task: dict) -> str:
    """Answer ``task["question"]``; returns the final answer ('' when the model gave none)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]
    for _ in range(MAX_MODEL_CALLS):
        reply = client().chat.completions.create(
            model=os.environ.get("OPENAI_MODEL", "policy"), messages=messages,  # type: ignore[arg-type]
            max_tokens=16, temperature=1.0,
        )
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        if answer := ANSWER.match(text):
            return answer.group(1)
        if not (call := CALC.match(text)):
            return ""  # the model said something this agent does not understand
        messages.append({"role": "user", "content": f"RESULT {calculator(*call.groups())}"})
    return ""


if __name__ == "__main__":
    print(solve(json.loads(sys.argv[1])))
