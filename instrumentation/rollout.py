"""Rollout helpers for agent code and the runner: mark rollouts, rewards, variables, agent names.

``rollout()`` opens the ``spanrl.rollout`` span and puts the rollout identity in the OTel
context (and W3C baggage, so it also crosses process boundaries when propagated). The
identity span processor (``spanrl.exporter.span_processor``) copies it onto every span started
inside, including spans of instrumentors spanrl did not write.

Inheritance of the identity follows the OTel context (a ``contextvars`` variable):

- asyncio tasks created inside ``with rollout(...)`` inherit it (asyncio copies the context);
  ``asyncio.to_thread`` does too;
- raw ``threading.Thread`` and ``concurrent.futures`` executors do not: submit
  ``bind_context(fn)`` (or ``contextvars.copy_context().run``) instead of ``fn``.

Nothing here raises into the agent because of tracing; programmer errors (a non-numeric
reward, an empty task id) raise ``ValueError`` naming the bad argument.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import math
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from opentelemetry import baggage
from opentelemetry import context as context_api
from opentelemetry import trace as trace_api
from opentelemetry.trace import Status, StatusCode

from spanrl.instrumentation import semconv

logger = logging.getLogger(__name__)

_TRACER_NAME = "spanrl.instrumentation"
_IDENTITY_KEY = context_api.create_key("spanrl.rollout_identity")
_AGENT_NAME_KEY = context_api.create_key("spanrl.agent_name")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class RolloutIdentity:
    """Which rollout a span belongs to: the three keys stamped on every span of it."""

    rollout_id: str
    task_id: str
    attempt: int

    def as_attributes(self) -> dict[str, str | int]:
        return {
            semconv.ROLLOUT_ID: self.rollout_id,
            semconv.TASK_ID: self.task_id,
            semconv.ATTEMPT: self.attempt,
        }


@dataclass(frozen=True)
class Rollout:
    """What ``with rollout(...) as r`` yields."""

    rollout_id: str
    task_id: str
    attempt: int
    span: trace_api.Span


def current_identity(ctx: context_api.Context | None = None) -> RolloutIdentity | None:
    """The rollout identity in ``ctx`` (default: the current context), from ``rollout()`` or
    from W3C baggage propagated by another process; None outside a rollout."""
    identity = context_api.get_value(_IDENTITY_KEY, ctx)
    if isinstance(identity, RolloutIdentity):
        return identity
    rollout_id = baggage.get_baggage(semconv.ROLLOUT_ID, ctx)
    task_id = baggage.get_baggage(semconv.TASK_ID, ctx)
    if not isinstance(rollout_id, str) or not isinstance(task_id, str):
        return None
    try:
        attempt = int(str(baggage.get_baggage(semconv.ATTEMPT, ctx) or 0))
    except ValueError:
        attempt = 0
    return RolloutIdentity(rollout_id, task_id, attempt)


def current_agent_name(ctx: context_api.Context | None = None) -> str | None:
    """The name given by the innermost ``agent(name)`` around the current code, or None."""
    name = context_api.get_value(_AGENT_NAME_KEY, ctx)
    if isinstance(name, str):
        return name
    name = baggage.get_baggage(semconv.AGENT_NAME, ctx)
    return name if isinstance(name, str) else None


def _check_text(value: Any, argument: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{argument} must be a non-empty string, got {value!r}")
    return value


@contextmanager
def rollout(task_id: str, attempt: int = 0, rollout_id: str | None = None) -> Iterator[Rollout]:
    """Run the body as one rollout of task ``task_id``: one ``spanrl.rollout`` span, and the
    rollout identity on every span made inside it (threads via ``bind_context``, asyncio tasks
    automatically). A body that raises ends the span with status ERROR and re-raises."""
    _check_text(task_id, "task_id")
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        raise ValueError(f"attempt must be a non-negative int, got {attempt!r}")
    if rollout_id is None:
        rollout_id = uuid.uuid4().hex
    _check_text(rollout_id, "rollout_id")
    identity = RolloutIdentity(rollout_id, task_id, attempt)
    span, token = _start_rollout_span(identity)
    handle = Rollout(rollout_id, task_id, attempt, span)
    try:
        yield handle
    except BaseException as exc:
        _end_span(span, exc)
        raise
    else:
        _end_span(span, None)
    finally:
        _detach(token)


def _start_rollout_span(identity: RolloutIdentity) -> tuple[trace_api.Span, object | None]:
    try:
        tracer = trace_api.get_tracer(_TRACER_NAME)
        span = tracer.start_span(semconv.ROLLOUT_SPAN_NAME, attributes=identity.as_attributes())
        ctx = trace_api.set_span_in_context(span)
        ctx = context_api.set_value(_IDENTITY_KEY, identity, ctx)
        for key, value in identity.as_attributes().items():
            ctx = baggage.set_baggage(key, str(value), ctx)
        return span, context_api.attach(ctx)
    except Exception:  # noqa: BLE001 - tracing must not stop the rollout
        logger.exception("spanrl: could not start the rollout span")
        return trace_api.INVALID_SPAN, None


def _end_span(span: trace_api.Span, exc: BaseException | None) -> None:
    try:
        if exc is not None:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        span.end()
    except Exception:  # noqa: BLE001
        logger.exception("spanrl: could not end the rollout span")


def _detach(token: object | None) -> None:
    if token is None:
        return
    try:
        context_api.detach(token)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - e.g. detached in another context
        logger.exception("spanrl: could not restore the context after a rollout")


@contextmanager
def agent(name: str) -> Iterator[str]:
    """Name the agent of a multi-agent system that makes the calls inside: every span started
    in the body carries ``spanrl.agent.name`` (selective optimization trains named agents)."""
    _check_text(name, "agent name")
    token = None
    try:
        ctx = context_api.set_value(_AGENT_NAME_KEY, name)
        ctx = baggage.set_baggage(semconv.AGENT_NAME, name, ctx)
        token = context_api.attach(ctx)
    except Exception:  # noqa: BLE001
        logger.exception("spanrl: could not set the agent name")
    try:
        yield name
    finally:
        _detach(token)


def emit_reward(value: float, name: str = semconv.DEFAULT_REWARD_NAME, response_id: str | None = None) -> None:
    """Record a reward as a ``spanrl.reward`` event on the current span (the call or step it
    judges, by parentage), or on the LLM call with ``response_id`` (its completion ``id``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"reward value must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"reward value must be finite, got {value!r}")
    _check_text(name, "reward name")
    if response_id is not None:
        _check_text(response_id, "response_id")
    attributes: dict[str, Any] = {semconv.REWARD_VALUE: float(value), semconv.REWARD_NAME: name}
    if response_id is not None:
        attributes[semconv.REWARD_RESPONSE_ID] = response_id
    try:
        with _recording_span(semconv.REWARD_EVENT) as span:
            span.add_event(semconv.REWARD_EVENT, attributes)
    except Exception:  # noqa: BLE001
        logger.exception("spanrl: could not record reward %r=%r", name, value)


def set_variable(name: str, value: str | int | float | bool) -> None:
    """Record the semantic variable ``spanrl.variable.<name>`` on the current span."""
    _check_text(name, "variable name")
    if not isinstance(value, (str, int, float, bool)):
        raise ValueError(
            f"variable {name!r} must be a str, int, float or bool, got {type(value).__name__}"
            " (serialize structured values, e.g. with json.dumps)"
        )
    key = semconv.variable(name)
    try:
        with _recording_span(key) as span:
            span.set_attribute(key, value)
    except Exception:  # noqa: BLE001
        logger.exception("spanrl: could not record variable %r", name)


@contextmanager
def _recording_span(fallback_name: str) -> Iterator[trace_api.Span]:
    """The current span; when none is recording, a short span named ``fallback_name`` so the
    value still reaches the receiver with the rollout identity."""
    span = trace_api.get_current_span()
    if span.is_recording():
        yield span
        return
    fallback = trace_api.get_tracer(_TRACER_NAME).start_span(fallback_name)
    try:
        yield fallback
    finally:
        fallback.end()


def bind_context(fn: F) -> F:
    """``fn`` bound to a copy of the current context (rollout identity, agent name, parent
    span), for ``threading.Thread(target=...)`` and ``executor.submit(...)``."""
    ctx = contextvars.copy_context()

    @functools.wraps(fn)
    def run_in_context(*args: Any, **kwargs: Any) -> Any:
        return ctx.copy().run(fn, *args, **kwargs)

    return run_in_context  # type: ignore[return-value]
