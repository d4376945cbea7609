"""Agent names from the OpenAI Agents SDK, with no code in the agent.

The SDK traces with its own tracer, not OTel, so nothing in an OTel trace says which SDK agent
made an LLM call. Loaded by ``opentelemetry-instrument`` (entry point ``spanrl_openai_agents``),
this instrumentor waits until the program imports ``agents`` (a post-import hook: a process that
never imports the SDK pays nothing, where importing it eagerly costs seconds of start-up) and
then registers a tracing processor with the SDK. Each SDK agent span becomes an OTel span
``invoke_agent <name>`` carrying ``gen_ai.agent.name`` (OTel GenAI conventions), current while
the agent runs, so the OpenAI SDK spans of its model calls lie under it and the receiver names
them (``otlp_receiver/agent_names.py``).

The processor takes the place of the SDK's default one, which exports the SDK's own traces to
OpenAI's servers (an agent trained against a local policy has no use for them); processors the
agent or another instrumentor (openinference's, when installed and loaded) registered stay.
``OPENAI_AGENTS_DISABLE_TRACING=1`` turns the SDK's tracing off, and with it these spans.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any, cast

from opentelemetry import context as context_api
from opentelemetry import trace as trace_api
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]
from wrapt import register_post_import_hook

from spanrl.instrumentation.package import _instruments

logger = logging.getLogger(__name__)

GENAI_AGENT_NAME = "gen_ai.agent.name"
GENAI_OPERATION_NAME = "gen_ai.operation.name"
AGENTS_MODULE = "agents"


class AgentSpanBridge:
    """An Agents SDK ``TracingProcessor``: SDK agent spans -> current OTel ``invoke_agent`` spans.

    Duck-typed against the SDK's interface (its base class would need ``agents`` imported here).
    """

    def __init__(self, tracer: trace_api.Tracer) -> None:
        self._tracer = tracer
        self._open: dict[str, tuple[trace_api.Span, object]] = {}  # SDK span id -> (span, token)

    def on_span_start(self, span: Any) -> None:
        name = _agent_name(span)
        if name is None:
            return
        otel_span = self._tracer.start_span(
            f"invoke_agent {name}", attributes={GENAI_OPERATION_NAME: "invoke_agent", GENAI_AGENT_NAME: name}
        )
        token = context_api.attach(trace_api.set_span_in_context(otel_span))
        self._open[span.span_id] = (otel_span, token)

    def on_span_end(self, span: Any) -> None:
        opened = self._open.pop(span.span_id, None)
        if opened is None:
            return
        otel_span, token = opened
        try:
            context_api.detach(token)  # type: ignore[arg-type]
        except ValueError:  # ended in another context than it started: nothing to restore there
            logger.debug("spanrl: agent span %s ended in another context", span.span_id)
        otel_span.end()

    def on_trace_start(self, trace: Any) -> None:
        pass

    def on_trace_end(self, trace: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def force_flush(self) -> None:
        pass


def _agent_name(span: Any) -> str | None:
    from agents.tracing.span_data import AgentSpanData

    data = getattr(span, "span_data", None)
    if isinstance(data, AgentSpanData) and isinstance(data.name, str) and data.name:
        return data.name
    return None


def register_bridge(tracer_provider: trace_api.TracerProvider | None = None) -> AgentSpanBridge:
    """Put the bridge in place of the SDK's default processor (``agents`` must be imported)."""
    from agents import add_trace_processor, set_trace_processors
    from agents.tracing import get_trace_provider
    from agents.tracing.processors import default_processor

    bridge = AgentSpanBridge(trace_api.get_tracer(__name__, tracer_provider=tracer_provider))
    registered = getattr(getattr(get_trace_provider(), "_multi_processor", None), "_processors", None)
    if isinstance(registered, (list, tuple)):
        default = default_processor()
        set_trace_processors([p for p in registered if p is not default] + [bridge])
    else:  # a provider whose processors cannot be read: leave them, add the bridge
        add_trace_processor(cast(Any, bridge))  # duck-typed TracingProcessor
    return bridge


class SpanrlAgentsSDKInstrumentor(BaseInstrumentor):
    """Registers the bridge once the program imports the Agents SDK."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        tracer_provider = kwargs.get("tracer_provider")

        def on_import(module: object) -> None:
            if not hasattr(module, "set_trace_processors"):  # a package of the agent's own named agents
                return
            try:
                register_bridge(tracer_provider)
            except Exception:  # noqa: BLE001 - never break the agent over names
                logger.warning("spanrl: could not name OpenAI Agents SDK agents on spans", exc_info=True)

        register_post_import_hook(on_import, AGENTS_MODULE)

    def _uninstrument(self, **kwargs: Any) -> None:
        pass  # a post-import hook cannot be removed; the bridge stays until the process ends
