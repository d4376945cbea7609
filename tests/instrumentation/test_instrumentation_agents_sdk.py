"""The OpenAI Agents SDK bridge (instrumentation/agents_sdk.py) with the real SDK and OTel SDK:
SDK agent spans become current ``invoke_agent`` OTel spans naming the agent, in place of the
SDK's default export; and a process that never imports the SDK does not import it at start-up.
(End to end with real agents: tests/integration/test_integration_responses.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spanrl.instrumentation.agents_sdk import GENAI_AGENT_NAME, register_bridge

INSTRUMENT = Path(sys.executable).parent / "opentelemetry-instrument"


def test_sdk_agent_spans_become_current_otel_spans_naming_the_agent():
    from agents import set_trace_processors
    from agents.tracing import agent_span, get_trace_provider, trace
    from agents.tracing.processors import default_processor

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    before = list(get_trace_provider()._multi_processor._processors)
    try:
        bridge = register_bridge(provider)
        registered = list(get_trace_provider()._multi_processor._processors)
        assert bridge in registered and default_processor() not in registered
        tracer = provider.get_tracer("test")
        with trace("workflow"):
            with agent_span(name="triage"):
                tracer.start_span("call-1").end()
                with agent_span(name="billing"):  # an agent run as a tool of another
                    tracer.start_span("call-2").end()
            tracer.start_span("call-3").end()
    finally:
        set_trace_processors(before)
        provider.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["invoke_agent triage"].attributes[GENAI_AGENT_NAME] == "triage"
    assert spans["call-1"].parent.span_id == spans["invoke_agent triage"].context.span_id
    assert spans["invoke_agent billing"].parent.span_id == spans["invoke_agent triage"].context.span_id
    assert spans["call-2"].parent.span_id == spans["invoke_agent billing"].context.span_id
    assert spans["call-3"].parent is None  # the agents' context was restored


def test_a_process_that_never_imports_the_sdk_does_not_load_it():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none")
    code = "import sys; print('agents' in sys.modules)"
    result = subprocess.run([str(INSTRUMENT), sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
    # ... while a program importing it gets the bridge in place of the SDK's default export
    code = ("import agents; from agents.tracing import get_trace_provider;"
            " print([type(p).__name__ for p in get_trace_provider()._multi_processor._processors])")
    result = subprocess.run([str(INSTRUMENT), sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "['AgentSpanBridge']"
