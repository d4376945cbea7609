"""The agent of the dashboard's tests: a planner and a writer, each one call to the policy.

Written as a user writes one (the OpenAI SDK; spanrl only for ``agent()`` names and reward
events). Each call is judged by its own reward event (``response_id``: the call's completion
id), so rewards vary with what the tiny random model says and land on the calls they judge.
On tasks that say ``"tool": "broken"`` a tool span ends with ERROR after the writer's call,
which the receiver's default AIR rule turns into a ``tool_error`` reward on that call.

For the live test: with ``DASHBOARD_TEST_GATE`` set, training rollouts of step
``DASHBOARD_TEST_GATE_STEP`` and later wait until that file exists before calling the model.
Imports no test code.
"""

from __future__ import annotations

import os
import time

from openai import OpenAI
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from spanrl.instrumentation import agent, current_identity, emit_reward

_client: OpenAI | None = None


def _wait_for_gate() -> None:
    gate = os.environ.get("DASHBOARD_TEST_GATE")
    identity = current_identity()
    if not gate or identity is None or not identity.rollout_id.startswith("s"):
        return
    step = int(identity.rollout_id[1:].split("-", 1)[0]) + 1
    if step < int(os.environ.get("DASHBOARD_TEST_GATE_STEP", "1")):
        return
    while not os.path.exists(gate):
        time.sleep(0.05)


def score(text: str) -> float:
    """A reward the tiny model's text moves: the share of its characters that are letters."""
    return round(sum(c.isalpha() for c in text) / len(text), 3) if text else 0.0


def _ask(client: OpenAI, name: str, prompt: str) -> str:
    with agent(name):
        reply = client.chat.completions.create(
            model=os.environ.get("OPENAI_MODEL", "policy"), max_tokens=8, temperature=1.0, logprobs=True,
            messages=[{"role": "system", "content": f"You are the {name}."}, {"role": "user", "content": prompt}],
        )
        text = reply.choices[0].message.content or ""
        emit_reward(score(text), name=f"{name}_letters", response_id=reply.id)
    return text


def solve(task: dict) -> str:
    global _client
    _wait_for_gate()
    if _client is None:
        _client = OpenAI(max_retries=0, timeout=60.0)
    plan = _ask(_client, "planner", f"Plan: {task['question']}")
    answer = _ask(_client, "writer", f"Answer {task['question']} using {plan!r}")
    if task.get("tool") == "broken":
        tracer = trace.get_tracer("dashboard-test-agent")
        with tracer.start_as_current_span("lookup tool", attributes={"openinference.span.kind": "TOOL"}) as span:
            span.set_status(Status(StatusCode.ERROR, "lookup failed"))
    return answer
