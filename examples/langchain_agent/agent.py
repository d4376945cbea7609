"""A calculator agent written the way a LangChain user writes one; it knows nothing of spanrl.

A prompt template piped into ``ChatOpenAI``, and a LangChain tool. The model may ask for the
calculator with ``CALC <expression>``; the agent runs the tool and answers ``RESULT <value>``;
the model finishes with ``ANSWER <number>``. A reply in neither form gets a one-line reminder
of the format. At most three model calls per task.

The endpoint comes from the environment, as for any OpenAI client: ``OPENAI_BASE_URL``,
``OPENAI_API_KEY`` and ``OPENAI_MODEL`` (default ``policy``); ``AGENT_TEMPERATURE`` (default
1.0, what RL needs to explore) and ``AGENT_SEED`` (optional) set the sampling. Run it by hand::

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=x OPENAI_MODEL=policy \
        python examples/langchain_agent/agent.py '{"question": "37+45"}'

The task is a JSON object (argv, else ``$SPANRL_TASK``, else stdin); the answer is the last
line printed. ``--transcript FILE`` also writes every model reply, in order, as JSON. Under
spanrl, ``spanrl run`` runs this script wrapped in ``opentelemetry-instrument``, or calls
``agent:solve`` in its own process (see README.md next to this file).
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import re
import sys

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

SYSTEM_PROMPT = "Reply CALC <expression> or ANSWER <number>."
MAX_MODEL_CALLS = 3
MAX_TOKENS = 16

_CALC = re.compile(r"^\s*CALC\s+(.+?)\s*$")
_ANSWER = re.compile(r"^\s*ANSWER\s+(-?\d+)\s*$")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

PROMPT = ChatPromptTemplate.from_messages(
    [("system", SYSTEM_PROMPT), ("human", "{question}"), MessagesPlaceholder("turns")]
)


@tool
def calculator(expression: str) -> str:
    """Evaluate ``a+b``, ``a-b`` or ``a*b`` on integers; 'ERROR' for anything else."""
    try:
        node = ast.parse(expression, mode="eval").body
    except SyntaxError:
        return "ERROR"
    if not (
        isinstance(node, ast.BinOp)
        and type(node.op) in _OPERATORS
        and isinstance(node.left, ast.Constant)
        and isinstance(node.right, ast.Constant)
        and isinstance(node.left.value, int)
        and isinstance(node.right.value, int)
    ):
        return "ERROR"
    return str(_OPERATORS[type(node.op)](node.left.value, node.right.value))


def make_model() -> ChatOpenAI:
    """The chat model, configured from the environment like any OpenAI client."""
    seed = os.environ.get("AGENT_SEED")
    return ChatOpenAI(
        model=os.environ.get("OPENAI_MODEL", "policy"),
        base_url=os.environ.get("OPENAI_BASE_URL"),
        temperature=float(os.environ.get("AGENT_TEMPERATURE", "1.0")),
        seed=int(seed) if seed else None,
        max_tokens=MAX_TOKENS,  # type: ignore[call-arg]  # pydantic alias
        max_retries=0,
        timeout=60.0,
    )


def converse(task: dict, model: ChatOpenAI | None = None) -> tuple[str, list[str]]:
    """Run the calculator protocol on ``task``; return (answer or '', every model reply in order)."""
    chain = PROMPT | (model or make_model())
    turns: list[BaseMessage] = []
    replies: list[str] = []
    for _ in range(MAX_MODEL_CALLS):
        reply = chain.invoke({"question": task["question"], "turns": turns})
        text = reply.content if isinstance(reply.content, str) else ""
        replies.append(text)
        turns.append(AIMessage(content=text))
        answer = _ANSWER.match(text)
        if answer:
            return answer.group(1), replies
        calc = _CALC.match(text)
        if calc:
            turns.append(HumanMessage(content=f"RESULT {calculator.invoke({'expression': calc.group(1)})}"))
        else:
            turns.append(HumanMessage(content=SYSTEM_PROMPT))  # remind the model of the format
    return "", replies


def solve(task: dict) -> str:
    """Solve one task ``{"question": "37+45", ...}``; return the final answer text ('' if none)."""
    return converse(task)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="LangChain calculator agent")
    parser.add_argument("task", nargs="?", help="the task as JSON (else $SPANRL_TASK, else stdin)")
    parser.add_argument("--transcript", help="write the model's replies, in order, as JSON here")
    args = parser.parse_args(argv)
    raw = args.task or os.environ.get("SPANRL_TASK") or sys.stdin.read()
    answer, replies = converse(json.loads(raw))
    if args.transcript:
        with open(args.transcript, "w", encoding="utf-8") as out:
            json.dump(replies, out)
    print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
