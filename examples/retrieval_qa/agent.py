"""A multi-hop question-answering agent written with the OpenAI Agents SDK; it knows nothing of spanrl.

One SDK ``Agent`` (``researcher``) with the SDK's default model (the Responses API) and one
function tool, ``search``, which looks words up in a small encyclopedia (BM25, ``search.py``). The
agent searches as often as it likes (at most ``MAX_TURNS`` model calls) and replies with the
answer alone. A run that ends without an answer (too many turns, a reply the SDK rejects) answers
"" rather than crash: the agent gave no answer.

The endpoint comes from the environment, as for any OpenAI client: ``OPENAI_BASE_URL``,
``OPENAI_API_KEY`` and ``OPENAI_MODEL`` (default ``policy``); ``AGENT_TEMPERATURE`` (default 1.0,
what RL needs to explore). Run it by hand::

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=x \
        python examples/retrieval_qa/agent.py '{"question": "Where was the founder of Zuran Works born?"}'

Under spanrl, ``spanrl run`` calls ``rollout:solve`` (the harness: it names the SDK's agents in
the spans), or runs this script under ``opentelemetry-instrument``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass, field

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool
from agents.exceptions import AgentsException
from openai import AsyncOpenAI

try:  # run as a script (python examples/retrieval_qa/agent.py) or imported as a package module
    from .search import search as search_documents
except ImportError:
    from search import search as search_documents  # type: ignore[no-redef]

INSTRUCTIONS = "Answer the question. Look facts up with search. Reply with the answer only."
AGENT_NAME = "researcher"
MAX_TURNS = 5  # model calls per question: up to four searches and the answer
MAX_TOKENS = 48


@function_tool
def search(query: str) -> str:
    """Search the encyclopedia."""
    return search_documents(query)


@dataclass(frozen=True)
class ModelConfig:
    """Where the agent's model is and how it samples; ``from_env()`` reads the usual variables."""

    base_url: str | None = None
    model: str = "policy"
    temperature: float = 1.0
    api_key: str = field(default="unused", repr=False)

    @classmethod
    def from_env(cls) -> ModelConfig:
        return cls(base_url=os.environ.get("OPENAI_BASE_URL"), model=os.environ.get("OPENAI_MODEL", "policy"),
                   temperature=float(os.environ.get("AGENT_TEMPERATURE", "1.0")),
                   api_key=os.environ.get("OPENAI_API_KEY") or "unused")


def build_agent(config: ModelConfig, client: AsyncOpenAI) -> Agent:
    """The SDK agent, on a Responses model of ``client`` (made for the endpoint of ``config``)."""
    return Agent(name=AGENT_NAME, instructions=INSTRUCTIONS, tools=[search],
                 model=OpenAIResponsesModel(model=config.model, openai_client=client),
                 model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=config.temperature))


async def answer(question: str, config: ModelConfig | None = None) -> str:
    """The agent's answer to ``question`` ('' when it gave none)."""
    config = config or ModelConfig.from_env()
    # closed here, in the loop that used it: left to the garbage collector, its connections would be
    # closed from whatever loop runs then (each rollout has its own) and fail, logging each time
    async with AsyncOpenAI(base_url=config.base_url, api_key=config.api_key, max_retries=0, timeout=120.0) as client:
        try:
            result = await Runner.run(build_agent(config, client), question, max_turns=MAX_TURNS)
        except AgentsException:  # too many turns, or a reply the SDK cannot use: no answer
            return ""
    return str(result.final_output or "").strip()


async def solve(task: dict) -> str:
    """One task ``{"question": ...}``: the answer."""
    return await answer(task["question"])


def main() -> int:
    raw = sys.argv[1] if len(sys.argv) > 1 else (os.environ.get("SPANRL_TASK") or sys.stdin.read())
    print(asyncio.run(solve(json.loads(raw))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
