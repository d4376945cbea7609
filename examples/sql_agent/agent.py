"""A multi-agent Text-to-SQL system written the way a LangGraph user writes one; it knows nothing of spanrl.

Three LLM agents, each a LangGraph node, over the SQLite database of ``database.py``:

- ``writer``: question -> SQL. It may first try a query with the ``run_sql`` tool (OpenAI tool
  calling, ``bind_tools``), read the rows or the error, then reply with its final query;
- ``checker``: reads the question, the query and its result, replies ``OK`` or ``WRONG``;
- ``rewriter``: when the checker objects, replies with a corrected query, which runs again.

The ``execute`` node (no LLM) runs the current query through the same ``run_sql`` tool, so a query
SQLite rejects is a tool span that ended with an error, right after the call that wrote it.

The endpoint comes from the environment, as for any OpenAI client: ``OPENAI_BASE_URL``,
``OPENAI_API_KEY`` and ``OPENAI_MODEL`` (default ``policy``); ``AGENT_TEMPERATURE`` (default 1.0,
what RL needs to explore); ``SQL_AGENT_MODEL_PER_NODE=1``: each node asks for the model named after
it (``writer``, ``checker``, ``rewriter``), one model per agent. Run it by hand::

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=x \
        python examples/sql_agent/agent.py '{"question": "How many employees work in Sales?"}'

It prints the final query. Under spanrl, ``spanrl run`` calls ``rollout:solve`` (which runs this
graph and scores the query), or runs this script under ``opentelemetry-instrument``; either way
LangGraph's node names (writer, checker, rewriter) are the agent names that training selects by.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sqlite3
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, TypedDict

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

try:  # run as a script (python examples/sql_agent/agent.py) or imported as a package module
    from .database import SCHEMA_TEXT, format_rows, run_query
except ImportError:
    from database import SCHEMA_TEXT, format_rows, run_query  # type: ignore[no-redef]

WRITER_PROMPT = f"Tables: {SCHEMA_TEXT}. Write one SQLite query that answers the question. Reply with the query."
CHECKER_PROMPT = "Does the result answer the question? Reply OK or WRONG."
REWRITER_PROMPT = f"Tables: {SCHEMA_TEXT}. The query is wrong. Reply with a corrected query."
MAX_TOKENS = 96
MAX_REWRITES = 1  # checker -> rewriter rounds per question
MAX_RESULT_CHARS = 200  # rows shown to the model

QUERY_ERRORS = (sqlite3.Error, sqlite3.Warning, ValueError)  # ValueError: e.g. a NUL character in the query
_FENCE = re.compile(r"^```(?:sql)?\s*|\s*```$", re.IGNORECASE)


@tool
def run_sql(query: str) -> str:
    """Run one SQLite query on the company database and return its rows."""
    if not query.strip():
        raise ValueError("empty query")
    return format_rows(run_query(query))


def try_query(query: str) -> str:
    """``run_sql``'s rows as text, or ``ERROR: <SQLite's message>`` when the query fails (the tool
    span then ends with status ERROR: LangChain reports the exception before it reaches here)."""
    try:
        result = run_sql.invoke({"query": query})
    except QUERY_ERRORS as exc:
        result = f"ERROR: {exc}"
    return str(result)[:MAX_RESULT_CHARS]


def result_text(query: str) -> str:
    """What ``try_query`` returns for ``query``, without the tool (no LangChain run, no span)."""
    try:
        if not query.strip():
            raise ValueError("empty query")
        result = format_rows(run_query(query))
    except QUERY_ERRORS as exc:
        result = f"ERROR: {exc}"
    return result[:MAX_RESULT_CHARS]


class SqlState(TypedDict, total=False):
    question: str
    query: str
    result: str
    verdict: str
    rewrites: int


@dataclass(frozen=True)
class ModelConfig:
    """Where the agents' model is and how it samples; ``from_env()`` reads the usual variables."""

    base_url: str | None = None
    model: str = "policy"
    temperature: float = 1.0
    api_key: str = field(default="unused", repr=False)  # a local endpoint checks none unless told to
    # each node asks for the model named after it (writer, checker, rewriter) instead of ``model``:
    # a multi-agent system with one model per agent (spanrl's ``adapters:`` serves one adapter each)
    model_per_node: bool = False

    @classmethod
    def from_env(cls) -> ModelConfig:
        return cls(base_url=os.environ.get("OPENAI_BASE_URL"), model=os.environ.get("OPENAI_MODEL", "policy"),
                   temperature=float(os.environ.get("AGENT_TEMPERATURE", "1.0")),
                   api_key=os.environ.get("OPENAI_API_KEY") or "unused",
                   model_per_node=os.environ.get("SQL_AGENT_MODEL_PER_NODE", "") == "1")


_models: dict[ModelConfig, ChatOpenAI] = {}
_models_lock = threading.Lock()


def chat_model(config: ModelConfig) -> ChatOpenAI:
    """The chat model of ``config`` (one per configuration and process)."""
    with _models_lock:
        if config not in _models:
            _models[config] = ChatOpenAI(
                model=config.model, base_url=config.base_url, temperature=config.temperature,
                api_key=config.api_key,  # type: ignore[arg-type]  # str is accepted for SecretStr
                max_tokens=MAX_TOKENS,  # type: ignore[call-arg]  # pydantic alias
                max_retries=0, timeout=120.0,
            )
        return _models[config]


def query_of(reply: BaseMessage) -> str:
    """The query a reply gives: its text (without a code fence), else its first tool call's query."""
    text = reply.content if isinstance(reply.content, str) else ""
    text = _FENCE.sub("", text.strip()).strip()
    if text:
        return text
    for call in getattr(reply, "tool_calls", None) or []:
        query = call.get("args", {}).get("query")
        if isinstance(query, str):
            return query
    return ""


def model_of(config: RunnableConfig, node: str) -> ChatOpenAI:
    """The chat model this run gave ``node`` (``configurable: {"model": ModelConfig}``)."""
    chosen: ModelConfig = config.get("configurable", {}).get("model") or ModelConfig.from_env()
    if chosen.model_per_node:
        chosen = dataclasses.replace(chosen, model=node)
    return chat_model(chosen)


def write(state: SqlState, config: RunnableConfig) -> SqlState:
    """The writer: may try one round of ``run_sql`` calls, then gives its final query."""
    model = model_of(config, "writer").bind_tools([run_sql])
    messages: list[BaseMessage] = [SystemMessage(WRITER_PROMPT), HumanMessage(state["question"])]
    reply = model.invoke(messages)
    if isinstance(reply, AIMessage) and reply.tool_calls:
        messages.append(reply)
        for call in reply.tool_calls:
            query = call.get("args", {}).get("query", "")
            messages.append(ToolMessage(try_query(str(query)), tool_call_id=call.get("id") or "call"))
        reply = model.invoke(messages)
    return {"query": query_of(reply), "rewrites": 0}


def execute(state: SqlState) -> SqlState:
    return {"result": try_query(state["query"])}  # an empty query fails too: its writer wrote nothing


def describe(state: SqlState) -> str:
    return f"Question: {state['question']}\nQuery: {state['query']}\nResult: {state['result']}"


def check(state: SqlState, config: RunnableConfig) -> SqlState:
    """The checker: ``OK`` or an objection (anything else)."""
    reply = model_of(config, "checker").invoke([SystemMessage(CHECKER_PROMPT), HumanMessage(describe(state))])
    text = reply.content if isinstance(reply.content, str) else ""
    return {"verdict": "OK" if text.strip().upper().startswith("OK") else "WRONG"}


def rewrite(state: SqlState, config: RunnableConfig) -> SqlState:
    """The rewriter: a corrected query for the one the checker objected to."""
    reply = model_of(config, "rewriter").invoke([SystemMessage(REWRITER_PROMPT), HumanMessage(describe(state))])
    return {"query": query_of(reply), "rewrites": state.get("rewrites", 0) + 1}


def after_execute(state: SqlState) -> str:
    return "checker" if state.get("rewrites", 0) < MAX_REWRITES else END


def after_check(state: SqlState) -> str:
    return END if state["verdict"] == "OK" else "rewriter"


def build_graph() -> Any:
    """The compiled graph: writer -> execute -> checker -> (rewriter -> execute) -> end."""
    graph = StateGraph(SqlState)
    graph.add_node("writer", write)
    graph.add_node("execute", execute)
    graph.add_node("checker", check)
    graph.add_node("rewriter", rewrite)
    graph.add_edge(START, "writer")
    graph.add_edge("writer", "execute")
    graph.add_conditional_edges("execute", after_execute, ["checker", END])
    graph.add_conditional_edges("checker", after_check, ["rewriter", END])
    graph.add_edge("rewriter", "execute")
    return graph.compile()


_graph: Any = None


def answer(question: str, model: ModelConfig | None = None) -> str:
    """Run the agents on one question; return the final query ('' when the model gave none).
    ``model``: where the agents' model is (default: from the environment)."""
    global _graph
    if _graph is None:
        _graph = build_graph()
    final = _graph.invoke({"question": question}, config={"configurable": {"model": model or ModelConfig.from_env()}})
    return str(final.get("query", ""))


def solve(task: dict) -> str:
    """One task ``{"question": ...}``: the final query."""
    return answer(task["question"])


def main() -> int:
    raw = sys.argv[1] if len(sys.argv) > 1 else (os.environ.get("SPANRL_TASK") or sys.stdin.read())
    print(solve(json.loads(raw)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
