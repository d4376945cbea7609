"""The policy endpoint's own LLM spans: one OTel span per generation request, sent over OTLP.

Used by the embedded policy server (``torch_backend/server/call_spans.py``) and the relay
(``relay/spans.py``: the verl gateway and ``spanrl proxy``); torch-free (the server's HTTP front
end imports it).
An agent in any language or HTTP client then trains: the span carries the engine's prompt and
response token ids, logprobs (when the request asked for them, or the gateway did), the policy
version and the response id, with the keys of ``spanrl.instrumentation.semconv`` (written by the
agent side's ``LLMSpanRecorder``, reused here), marked ``spanrl.llm.source = "endpoint"``. It is
a child of the caller's W3C ``traceparent``; its rollout identity (and agent name) comes from the
caller's W3C baggage, else from the ``x-spanrl-rollout-id`` header. The receiver keeps one
transition when the agent side reported the same call too (``otlp_receiver/endpoint_spans.py``).
A call may carry more: the text of its request and reply (``ServedCall.request`` kept, as
``spanrl proxy`` does: ``endpoint_text.py``), the prompt candidate the endpoint substituted
(``ServedCall.attributes``, set by ``endpoint_prompts.py`` through ``serving_call()``), and an
error (the upstream of a relay failed it: the span ends with status ERROR).

Where spans go (``spans_target``): the setting (``spanrl serve --spans-endpoint``, variable
``OTEL_SPANRL_SERVE_SPANS_ENDPOINT``; ``off`` turns it off), else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
/ ``OTEL_EXPORTER_OTLP_ENDPOINT``; nothing configured, or ``OTEL_SDK_DISABLED=true``: no spans.
Protocol from ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` (default
``grpc``). Serving never waits for spans: a request hands its ``ServedCall`` to a queue; one
thread builds the spans, the SDK's batch processor exports them; a failed export is logged once
(the OTLP exporters' own per-retry lines are kept back in this process).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as context_api
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from spanrl.instrumentation import semconv
from spanrl.instrumentation.llm_span_recorder import LLMSpanRecorder
from spanrl.instrumentation.rollout import current_agent_name, current_identity

logger = logging.getLogger(__name__)

SPANS_ENDPOINT_ENV = "OTEL_SPANRL_SERVE_SPANS_ENDPOINT"
OFF = "off"
DEFAULT_PROTOCOL = "grpc"
# The receiver assembles a rollout ``grace_s`` (2 s) after it ends: export well within it.
DEFAULT_SCHEDULE_DELAY_MS = 500
EXPORT_TIMEOUT_S = 5.0
MAX_QUEUED_CALLS = 10_000  # beyond this, calls are dropped (said once) rather than held in memory
SERVICE = "spanrl-policy-endpoint"
# the routes that generate (OpenAI-compatible, and Anthropic's Messages): one span per request to them
GENERATING_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})

_PROPAGATOR = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])


def spans_target(setting: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The OTLP endpoint the policy endpoint's spans go to, or None when they are off."""
    env = os.environ if environ is None else environ
    chosen = (setting or env.get(SPANS_ENDPOINT_ENV) or "").strip()
    if chosen:
        return None if chosen.lower() == OFF else chosen
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    standard = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or ""
    return standard.strip() or None


def spans_protocol(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    chosen = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    return (chosen or DEFAULT_PROTOCOL).strip()


@dataclass(frozen=True)
class CallOrigin:
    """Who made a call: the caller's context (trace parent, baggage) and the attributes it gives
    the span (rollout identity, agent name)."""

    parent: context_api.Context
    attributes: Mapping[str, str | int]


def call_origin(headers: Mapping[str, str]) -> CallOrigin:
    """The origin of a call from its HTTP headers (names in lower case)."""
    parent = _PROPAGATOR.extract(headers)
    attributes: dict[str, str | int] = {}
    identity = current_identity(parent)
    if identity is not None:
        attributes.update(identity.as_attributes())
    else:
        rollout_id = (headers.get(semconv.ROLLOUT_ID_HEADER) or "").strip()
        if rollout_id:
            attributes[semconv.ROLLOUT_ID] = rollout_id
    agent_name = current_agent_name(parent)
    if agent_name:
        attributes[semconv.AGENT_NAME] = agent_name
    return CallOrigin(parent, attributes)


@dataclass
class ServedCall:
    """One generation request as served: ``replies`` are the JSON bodies the client got (the
    whole body, or each stream event's data, in order), in the shapes ``LLMSpanRecorder`` reads."""

    origin: CallOrigin
    route: str
    start_ns: int
    streaming: bool
    replies: list[dict[str, Any]] = field(default_factory=list)
    end_ns: int = 0
    error: str | None = None
    request: dict[str, Any] | None = None  # the body sent to the model, kept when its text is recorded
    attributes: dict[str, Any] = field(default_factory=dict)  # more span attributes (the prompt candidate)
    request_model: str | None = None  # the model name the request asked for


_serving: ContextVar[ServedCall | None] = ContextVar("spanrl_serving_call", default=None)


def call_agent(headers: Mapping[str, str]) -> str | None:
    """The agent that made the current call (its baggage's ``spanrl.agent.name``; header names in
    lower case), read from the call being served when there is one; None when it names none."""
    served = serving_call()
    attributes = served.origin.attributes if served is not None else call_origin(headers).attributes
    agent = attributes.get(semconv.AGENT_NAME)
    return agent if isinstance(agent, str) and agent else None


def serving_call() -> ServedCall | None:
    """The call an endpoint's span middleware is recording in this context (None: no span)."""
    return _serving.get()


@contextlib.contextmanager
def serving(call: ServedCall) -> Iterator[ServedCall]:
    """Make ``call`` the one ``serving_call()`` returns while its request is served."""
    token = _serving.set(call)
    try:
        yield call
    finally:
        _serving.reset(token)


def served_call_for(scope: Mapping[str, Any], endpoint: str) -> ServedCall | None:
    """The call record an ASGI middleware opens for ``scope``: None for a request that is not a
    ``POST`` to a generating route, or whose trace headers cannot be read (said in ``endpoint``'s
    name; a span is never worth a request)."""
    if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in GENERATING_PATHS:
        return None
    try:
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        return ServedCall(call_origin(headers), scope["path"], time.time_ns(), streaming=False)
    except Exception:  # noqa: BLE001 - a span is never worth a request
        logger.exception("%s: could not read a call's trace headers; no span for it", endpoint)
        return None


# The OTLP exporters log every retry and failure themselves; in a serving process that is a line
# per batch while the receiver is down. Their records are kept back and the last one is quoted
# in the one warning ``_ExportFailuresLoggedOnce`` gives.
EXPORTER_LOGGERS = ("opentelemetry.exporter.otlp.proto.grpc.exporter",
                    "opentelemetry.exporter.otlp.proto.http.trace_exporter")


class _LastExporterMessage(logging.Filter):
    """Keeps back the exporter's records logged while the endpoint's own export runs on this
    thread (``exporting``); any other exporter in the process (an agent's) logs as usual."""

    def __init__(self) -> None:
        super().__init__()
        self.message: str | None = None
        self._local = threading.local()

    @contextlib.contextmanager
    def exporting(self) -> Iterator[None]:
        self._local.active = True
        try:
            yield
        finally:
            self._local.active = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(self._local, "active", False):
            return True
        self.message = record.getMessage()
        return False


_exporter_messages = _LastExporterMessage()


class _ExportFailuresLoggedOnce(SpanExporter):
    """The OTLP exporter, its failures logged once (serving goes on whatever the receiver does)."""

    def __init__(self, exporter: SpanExporter, target: str) -> None:
        self._exporter, self._target = exporter, target
        self._warned = False
        for name in EXPORTER_LOGGERS:
            exporter_logger = logging.getLogger(name)
            if _exporter_messages not in exporter_logger.filters:
                exporter_logger.addFilter(_exporter_messages)

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        try:
            with _exporter_messages.exporting():
                result = self._exporter.export(spans)
            reason = _exporter_messages.message or "the exporter reported a failure"
        except Exception as exc:  # noqa: BLE001 - never let the receiver break the endpoint
            result, reason = SpanExportResult.FAILURE, f"{type(exc).__name__}: {exc}"
        if result is not SpanExportResult.SUCCESS and not self._warned:
            self._warned = True
            logger.warning("policy endpoint: could not export its LLM spans to %s (%s); serving goes on "
                           "(said once)", self._target, reason)
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class EndpointSpans:
    """Turns ``ServedCall``s into exported LLM spans, off the serving path."""

    def __init__(self, exporter: SpanExporter, target: str = "", schedule_delay_ms: int | None = None) -> None:
        if schedule_delay_ms is None and not os.environ.get("OTEL_BSP_SCHEDULE_DELAY"):
            schedule_delay_ms = DEFAULT_SCHEDULE_DELAY_MS
        self.target = target
        self.provider = TracerProvider(resource=Resource.create({SERVICE_NAME: SERVICE}))
        self.provider.add_span_processor(BatchSpanProcessor(_ExportFailuresLoggedOnce(exporter, target),
                                                            schedule_delay_millis=schedule_delay_ms))
        self._tracer = self.provider.get_tracer(__name__)
        self._queue: queue.SimpleQueue[ServedCall | threading.Event | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()
        self._dropping_said = False
        self._queued = 0

    @classmethod
    def from_environment(cls, setting: str | None = None) -> EndpointSpans | None:
        """Spans to where ``spans_target`` says, or None when none is configured."""
        target = spans_target(setting)
        if target is None:
            return None
        from spanrl.exporter.in_process import headers_with_token, span_exporter

        protocol = spans_protocol()
        exporter = span_exporter(target, protocol, headers_with_token(None), timeout_s=EXPORT_TIMEOUT_S)
        logger.info("policy endpoint: one LLM span per generation request goes to %s over %s", target, protocol)
        return cls(exporter, target)

    def submit(self, call: ServedCall) -> None:
        """Queue one finished call (never blocks, never raises)."""
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="spanrl-endpoint-spans", daemon=True)
                self._worker.start()
            if self._queued >= MAX_QUEUED_CALLS:
                if not self._dropping_said:
                    self._dropping_said = True
                    logger.warning("policy endpoint: %d calls wait for their spans; dropping spans (said once)",
                                   self._queued)
                return
            self._queued += 1
        self._queue.put(call)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):  # a flush marker: every call before it is built
                item.set()
                continue
            with self._lock:
                self._queued -= 1
            try:
                self.record(item)
            except Exception:  # noqa: BLE001 - a span is never worth the endpoint
                logger.exception("policy endpoint: could not build the LLM span of a call")

    def record(self, call: ServedCall) -> None:
        """Build and end the span of ``call`` now (the worker thread does this for ``submit``)."""
        attributes: dict[str, Any] = {
            semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM,
            semconv.LLM_SOURCE: semconv.LLM_SOURCE_ENDPOINT,
            "http.route": call.route,
            **call.origin.attributes,
            **call.attributes,
        }
        if call.request is not None:
            from spanrl.trainer_bridge.endpoint_text import call_text_attributes

            attributes.update(call_text_attributes(call.route, call.request, call.replies))
        if call.request_model:
            attributes[semconv.GENAI_REQUEST_MODEL] = call.request_model
        span = self._tracer.start_span(f"POST {call.route}", context=call.origin.parent, kind=SpanKind.SERVER,
                                       attributes=attributes, start_time=call.start_ns)
        recorder = LLMSpanRecorder(span, streaming=call.streaming)
        for reply in call.replies:
            recorder.observe(reply)
        if call.error is not None:
            span.set_status(Status(StatusCode.ERROR, call.error))
        span.end(end_time=call.end_ns or None)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the calls queued so far are built and exported (tests, shutdown)."""
        if self._worker is not None:
            built = threading.Event()
            self._queue.put(built)
            built.wait(timeout_s)
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.flush(timeout_s)
        self._queue.put(None)
        self.provider.shutdown()


__all__ = ["CallOrigin", "EndpointSpans", "SPANS_ENDPOINT_ENV", "ServedCall", "call_agent", "call_origin", "serving",
           "serving_call",
           "spans_protocol", "spans_target"]
