"""One rollout of the retrieval QA agent under ``spanrl run``: name the SDK's agents, run the agent.

``spanrl run --agent spanrl.examples.retrieval_qa.rollout:solve`` calls ``solve(task)`` in the
runner's process, inside the rollout's span. This is the harness around the agent, not the agent
(``agent.py`` has no spanrl import): it turns on spanrl's Agents SDK instrumentor once (as
``opentelemetry-instrument`` would in a process of its own), so each model call sits under an
``invoke_agent researcher`` span and the SDK's own traces are not sent to OpenAI's servers. The
runner records the answer as the variable ``output``; the trainer scores it with ``reward.py``.
"""

from __future__ import annotations

import threading

_instrumented = False
_lock = threading.Lock()


def instrument_agents_sdk() -> None:
    """spanrl's Agents SDK instrumentor on the global tracer provider, once per process."""
    global _instrumented
    with _lock:
        if _instrumented:
            return
        from spanrl.instrumentation.agents_sdk import SpanrlAgentsSDKInstrumentor

        instrumentor = SpanrlAgentsSDKInstrumentor()
        if not instrumentor.is_instrumented_by_opentelemetry:  # e.g. under opentelemetry-instrument
            instrumentor.instrument()
        _instrumented = True


async def solve(task: dict) -> str:
    """Run the agent on ``task``; return its answer."""
    instrument_agents_sdk()
    from . import agent  # imported after the instrumentor: its post-import hook names the agents

    return await agent.solve(task)
