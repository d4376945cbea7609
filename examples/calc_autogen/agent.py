"""A word-problem solver written with AutoGen AgentChat; it knows nothing of spanrl.

One ``AssistantAgent`` (``solver``) on autogen-ext's OpenAI model client, with one tool,
``calculator`` (``calculator.py``). It calls the tool as often as it likes (at most
``MAX_TOOL_ITERATIONS`` rounds) and replies with the final number; ``solve`` returns the last
number of that reply ('' when there is none).

The endpoint comes from the environment, as for any OpenAI client: ``OPENAI_BASE_URL``,
``OPENAI_API_KEY`` and ``OPENAI_MODEL`` (default ``policy``); ``AGENT_TEMPERATURE`` (default 1.0,
what RL needs to explore). AutoGen pins its own protobuf, so it lives in its own venv
(``.venv-autogen``, built by ``.ci/frameworks_env.sh``). Run it by hand::

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=x .venv-autogen/bin/python \
        examples/calc_autogen/agent.py '{"question": "A shop has 12 boxes with 30 pens each. ..."}'

Under spanrl, ``spanrl run`` (from ``.venv-autogen``) calls ``solve`` in its own process; each model
call is named ``solver`` by AutoGen's own ``invoke_agent`` span.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys

from autogen_agentchat.agents import AssistantAgent
from autogen_ext.models.openai import OpenAIChatCompletionClient

try:  # run as a script (python examples/calc_autogen/agent.py) or imported as a package module
    from .calculator import evaluate
except ImportError:
    from calculator import evaluate  # type: ignore[no-redef]

SYSTEM_PROMPT = "Solve the problem. Use calculator for arithmetic. Reply with the final number only."
AGENT_NAME = "solver"
MAX_TOOL_ITERATIONS = 4
MAX_TOKENS = 32
MODEL_INFO = {"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
              "structured_output": False}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / and parentheses)."""
    return evaluate(expression)


def final_number(text: str) -> str:
    """The last number in ``text`` ('' when there is none)."""
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else ""


async def answer(question: str) -> str:
    client = OpenAIChatCompletionClient(
        model=os.environ.get("OPENAI_MODEL", "policy"), base_url=os.environ.get("OPENAI_BASE_URL"),
        api_key=os.environ.get("OPENAI_API_KEY") or "unused", model_info=MODEL_INFO,
        max_tokens=MAX_TOKENS, temperature=float(os.environ.get("AGENT_TEMPERATURE", "1.0")))
    try:
        solver = AssistantAgent(AGENT_NAME, model_client=client, tools=[calculator], system_message=SYSTEM_PROMPT,
                                max_tool_iterations=MAX_TOOL_ITERATIONS, reflect_on_tool_use=False)
        result = await solver.run(task=question)
    finally:
        await client.close()
    last = result.messages[-1]
    return final_number(last.to_model_text() if hasattr(last, "to_model_text") else str(last))


async def solve(task: dict) -> str:
    """One task ``{"question": ...}``: the final number."""
    return await answer(task["question"])


def main() -> int:
    raw = sys.argv[1] if len(sys.argv) > 1 else (os.environ.get("SPANRL_TASK") or sys.stdin.read())
    print(asyncio.run(solve(json.loads(raw))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
