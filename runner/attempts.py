"""Runs one attempt of the user's agent inside a rollout, and says how it ended.

Two ways to run an agent: a Python callable in this process (fast: no interpreter start per
attempt; its spans come from the in-process tracer), or a command in a child process under
``opentelemetry-instrument`` (any language; identity through ``OTEL_RESOURCE_ATTRIBUTES``).
Either way the runner opens the ``spanrl.rollout`` span (``spanrl.instrumentation``'s
``start_rollout_span``, the same as ``rollout()``), records the agent's output as the semantic
variable ``output``, and a crash or a timeout ends the span with status ERROR. The span comes
from ``tracer_provider`` when given, else from the global provider.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import TracerProvider

from spanrl.bridge_protocol import ClaimedAttempt
from spanrl.instrumentation import (
    RolloutIdentity,
    end_rollout_span,
    rollout,
    set_variable,
    start_rollout_span,
)

from .agent_process import (
    AgentTimedOut,
    ChildResult,
    command_environment,
    run_child,
    task_needs_a_file,
    write_task_file,
)

logger = logging.getLogger(__name__)

OUTPUT_VARIABLE = "output"
STDERR_TAIL_CHARS = 2000


@dataclass(frozen=True)
class AttemptResult:
    status: str  # "ok" | "failed" | "timeout"
    error: str | None = None
    output: str | None = None


class AgentFailed(Exception):
    """The agent crashed or exited with an error."""


class AbandonedAgents:
    """In-process agent threads still running past their rollout timeout (a Python thread
    cannot be killed), and how many the runner tolerates (``limit``) before it stops."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def add(self, thread: threading.Thread) -> None:
        with self._lock:
            self._threads.append(thread)

    def count(self) -> int:
        """How many are still running (those that finished at last are forgotten)."""
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            return len(self._threads)

    def full(self) -> bool:
        return self.count() >= self.limit


def run_callable_attempt(
    agent: Callable[[dict], Any], claim: ClaimedAttempt, *, tracer_provider: TracerProvider | None = None,
    abandoned: AbandonedAgents | None = None,
) -> AttemptResult:
    """Call ``agent(task)`` in its own thread inside the rollout's span (a new trace).

    The span is ended here, not by the agent's thread: an agent that hangs past the timeout
    is abandoned (a thread cannot be killed; it is added to ``abandoned``) but its rollout
    still ends, with status ERROR.
    """
    identity = RolloutIdentity(claim.rollout_id, claim.task_id, claim.attempt)
    span, rollout_context = start_rollout_span(
        identity, tracer_provider=tracer_provider, parent=otel_context.Context())
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def body() -> None:
        token = otel_context.attach(rollout_context)
        try:
            result = agent(claim.task)
            if inspect.isawaitable(result):
                result = asyncio.run(_await(result))
            outcome["output"] = "" if result is None else str(result)
            if not done.is_set():
                set_variable(OUTPUT_VARIABLE, outcome["output"], tracer_provider=tracer_provider)
        except BaseException as exc:  # the agent's failure is the rollout's, never the runner's
            outcome["exception"] = exc
        finally:
            otel_context.detach(token)
            done.set()

    thread = threading.Thread(target=body, name=f"agent-{claim.rollout_id}", daemon=True)
    thread.start()
    finished = done.wait(claim.rollout_timeout_s)
    done.set()  # from here on, a late agent no longer writes to the span
    if not finished:
        error = f"agent did not finish within {claim.rollout_timeout_s:g} s (abandoned)"
        end_rollout_span(span, error)
        if abandoned is not None:
            abandoned.add(thread)
            running = abandoned.count()
        else:
            running = sum(t.name.startswith("agent-") and t.is_alive() for t in threading.enumerate())
        logger.warning("%s; %d abandoned agent thread(s) still running", error, running)
        return AttemptResult("timeout", error)
    if "exception" in outcome:
        exc = outcome["exception"]
        end_rollout_span(span, exc)
        return AttemptResult("failed", f"{type(exc).__name__}: {exc}")
    end_rollout_span(span, None)
    return AttemptResult("ok", output=outcome.get("output"))


async def _await(awaitable: Any) -> Any:
    return await awaitable


def opentelemetry_instrument_path() -> str:
    beside_python = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
    return beside_python if os.path.exists(beside_python) else "opentelemetry-instrument"


def run_command_attempt(
    command: list[str], claim: ClaimedAttempt, otlp_endpoint: str, wrap: bool = True,
    extra_env: dict | None = None, *, tracer_provider: TracerProvider | None = None,
) -> AttemptResult:
    """Run the agent command once; its last stdout line is the output. The child names its
    rollout through ``OTEL_RESOURCE_ATTRIBUTES``; the rollout span is made here. How the child
    is started and read: ``agent_process``."""
    argv = ([opentelemetry_instrument_path()] if wrap else []) + [str(c) for c in command]
    task_json = json.dumps(claim.task)
    task_file = write_task_file(claim.task) if task_needs_a_file(task_json) else None
    env = command_environment(claim, otlp_endpoint, extra_env or {}, task_json, task_file)
    try:
        with rollout(claim.task_id, attempt=claim.attempt, rollout_id=claim.rollout_id,
                     tracer_provider=tracer_provider):
            output = _agent_output(run_child(argv, env, task_json.encode(), claim.rollout_timeout_s))
            set_variable(OUTPUT_VARIABLE, output, tracer_provider=tracer_provider)
    except AgentTimedOut as exc:
        return AttemptResult("timeout", str(exc))
    except (AgentFailed, OSError) as exc:
        return AttemptResult("failed", str(exc))
    finally:
        if task_file is not None:
            os.unlink(task_file)
    return AttemptResult("ok", output=output)


def _agent_output(result: ChildResult) -> str:
    """The last line of the child's stdout; ``AgentFailed`` with the end of its stderr when it failed."""
    if result.returncode != 0:
        tail = result.stderr_tail.decode(errors="replace")[-STDERR_TAIL_CHARS:].strip()
        raise AgentFailed(f"agent exited with code {result.returncode}: {tail}")
    lines = result.stdout_tail.decode(errors="replace").strip().splitlines()
    return lines[-1].strip() if lines else ""
