"""One rollout of the Text-to-SQL agent under ``spanrl run``: run the graph, score it, say the score.

``spanrl run --agent spanrl.examples.sql_agent.rollout:solve`` calls ``solve(task)`` in the
runner's process, inside the rollout's span. This is the harness around the agent, not the agent
(``agent.py`` has no spanrl import): it turns on openinference's LangChain instrumentation once
(as ``opentelemetry-instrument`` would in a process of its own), so each LLM call sits under its
LangGraph node's span and the receiver names the call's agent ``writer``, ``checker`` or
``rewriter``; then it runs the graph and records the execution match with the gold answer as the
rollout's ``spanrl.reward`` event. The receiver attaches that reward to the last call, and adds
the AIR rewards of its rules (``air_rules.yaml``: a failing ``run_sql``) to the calls that wrote
the failing queries; ``credit: discounted`` then gives each call the rewards from it onwards.
"""

from __future__ import annotations

import threading

from spanrl.instrumentation import emit_reward

from . import agent
from .reward import execution_match

REWARD_NAME = "execution_match"

_instrumented = False
_lock = threading.Lock()


def instrument_langchain() -> None:
    """openinference's LangChain instrumentor on the global tracer provider, once per process."""
    global _instrumented
    with _lock:
        if _instrumented:
            return
        from openinference.instrumentation.langchain import LangChainInstrumentor

        instrumentor = LangChainInstrumentor()
        if not instrumentor.is_instrumented_by_opentelemetry:  # e.g. under opentelemetry-instrument
            instrumentor.instrument()
        _instrumented = True


def solve(task: dict) -> str:
    """Run the agents on ``task``, emit the execution-match reward; return the final query."""
    instrument_langchain()
    query = agent.solve(task)
    emit_reward(execution_match(query, task["answer"]), name=REWARD_NAME)
    return query
