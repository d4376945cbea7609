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


def current_rollout_id(ctx: context_api.Context | None = None) -> str | None:
    """``current_identity(ctx).rollout_id`` without building the identity (every LLM call asks)."""
    identity = ctx.get(_IDENTITY_KEY) if ctx is not None else context_api.get_value(_IDENTITY_KEY)
    if isinstance(identity, RolloutIdentity):
        return identity.rollout_id
    rollout_id = baggage.get_baggage(semconv.ROLLOUT_ID, ctx)  # (no view of all the baggage built)
    if not isinstance(rollout_id, str):
        return None
    return rollout_id if isinstance(baggage.get_baggage(semconv.TASK_ID, ctx), str) else None


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
def rollout(
    task_id: str, attempt: int = 0, rollout_id: str | None = None, *,
    tracer_provider: trace_api.TracerProvider | None = None,
) -> Iterator[Rollout]:
    """Run the body as one rollout of task ``task_id``: one ``spanrl.rollout`` span, and the
    rollout identity on every span made inside it (threads via ``bind_context``, asyncio tasks
    automatically). A body that raises ends the span with status ERROR and re-raises.
    ``tracer_provider`` makes the span (default: the global provider)."""
    _check_text(task_id, "task_id")
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        raise ValueError(f"attempt must be a non-negative int, got {attempt!r}")
    if rollout_id is None:
        rollout_id = uuid.uuid4().hex
    _check_text(rollout_id, "rollout_id")
    span, rollout_context = start_rollout_span(
        RolloutIdentity(rollout_id, task_id, attempt), tracer_provider=tracer_provider)
    token = _attach(rollout_context)
    handle = Rollout(rollout_id, task_id, attempt, span)
    try:
        yield handle
    except BaseException as exc:
        end_rollout_span(span, exc)
        raise
    else:
        end_rollout_span(span, None)
    finally:
        _detach(token)


def start_rollout_span(
    identity: RolloutIdentity, *, tracer_provider: trace_api.TracerProvider | None = None,
    parent: context_api.Context | None = None,
) -> tuple[trace_api.Span, context_api.Context]:
    """Start the ``spanrl.rollout`` span of ``identity`` and return it with a context carrying
    it and the identity (as a context value and as W3C baggage). The one place a rollout's root
    span is written: ``rollout()`` and the runner's attempts call it.

    The span is a child of the span in ``parent`` (default: the current context; pass
    ``Context()`` for a new trace). Nothing is attached: the caller attaches the context in the
    thread that runs the rollout, and ends the span with ``end_rollout_span``. Never raises: on
    a tracing failure it logs and returns a non-recording span with the identity still in the
    context."""
    base = context_api.get_current() if parent is None else parent
    try:
        tracer = _tracer(tracer_provider)
        span = tracer.start_span(
            semconv.ROLLOUT_SPAN_NAME, context=base, attributes=identity.as_attributes())
    except Exception:  # noqa: BLE001 - tracing must not stop the rollout
        logger.exception("spanrl: could not start the rollout span")
        span = trace_api.INVALID_SPAN
    ctx = trace_api.set_span_in_context(span, base)
    ctx = context_api.set_value(_IDENTITY_KEY, identity, ctx)
    for key, value in identity.as_attributes().items():
        ctx = baggage.set_baggage(key, str(value), ctx)
    return span, ctx


def end_rollout_span(span: trace_api.Span, error: BaseException | str | None) -> None:
    """End a rollout span: status ERROR with ``"<ExceptionType>: <message>"`` (the exception
    recorded too) or with ``error`` as given; unset status when ``error`` is None."""
    try:
        if isinstance(error, BaseException):
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        elif error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()
    except Exception:  # noqa: BLE001
        logger.exception("spanrl: could not end the rollout span")


def _attach(ctx: context_api.Context) -> object | None:
    try:
        return context_api.attach(ctx)
    except Exception:  # noqa: BLE001
        logger.exception("spanrl: could not enter the rollout's context")
        return None


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


def emit_reward(
    value: float, name: str = semconv.DEFAULT_REWARD_NAME, response_id: str | None = None, *,
    tracer_provider: trace_api.TracerProvider | None = None,
) -> None:
    """Record a reward as a ``spanrl.reward`` event on the current span (the call or step it
    judges, by parentage), or on the LLM call with ``response_id`` (its completion ``id``).
    Outside any recording span, ``tracer_provider`` (default: the global one) makes a short
    span to carry it."""
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
        with _recording_span(semconv.REWARD_EVENT, tracer_provider) as span:
            span.add_event(semconv.REWARD_EVENT, attributes)
    except Exception:  # noqa: BLE001
        logger.exception("spanrl: could not record reward %r=%r", name, value)


def set_variable(
    name: str, value: str | int | float | bool, *,
    tracer_provider: trace_api.TracerProvider | None = None,
) -> None:
    """Record the semantic variable ``spanrl.variable.<name>`` on the current span (outside
    any recording span: on a short span of its own, made by ``tracer_provider``)."""
    _check_text(name, "variable name")
    if not isinstance(value, (str, int, float, bool)):
        raise ValueError(
            f"variable {name!r} must be a str, int, float or bool, got {type(value).__name__}"
            " (serialize structured values, e.g. with json.dumps)"
        )
    key = semconv.variable(name)
    try:
        with _recording_span(key, tracer_provider) as span:
            span.set_attribute(key, value)
    except Exception:  # noqa: BLE001
        logger.exception("spanrl: could not record variable %r", name)


def _tracer(tracer_provider: trace_api.TracerProvider | None) -> trace_api.Tracer:
    if tracer_provider is None:
        return trace_api.get_tracer(_TRACER_NAME)
    return tracer_provider.get_tracer(_TRACER_NAME)


@contextmanager
def _recording_span(
    fallback_name: str, tracer_provider: trace_api.TracerProvider | None
) -> Iterator[trace_api.Span]:
    """The current span; when none is recording, a short span named ``fallback_name`` so the
    value still reaches the receiver with the rollout identity."""
    span = trace_api.get_current_span()
    if span.is_recording():
        yield span
        return
    fallback = _tracer(tracer_provider).start_span(fallback_name)
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
