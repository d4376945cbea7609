"""Fixtures for the loop tests: a real bridge API on a free port, and an in-memory tracer."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spanrl.trainer_bridge.bridge_api import BridgeAPI, PolicyInfo
from spanrl.trainer_bridge.task_dispatch import TaskDispatcher


@pytest.fixture
def bridge():
    """A dispatcher served over HTTP on a free port (stopped after the test)."""
    dispatcher = TaskDispatcher(rollout_timeout_s=2.0)
    api = BridgeAPI(dispatcher, PolicyInfo("http://127.0.0.1:9/v1", "policy"), lambda: 3,
                    port=0).start()
    try:
        yield dispatcher, api
    finally:
        dispatcher.close()
        api.stop()


@pytest.fixture
def span_exporter():
    """Spans of the global SDK provider, collected in memory for one test.

    The global provider can be set only once per process and other test areas may have set
    it already: reuse it when it is an SDK provider, else install one.
    """
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
        provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider), f"global provider is {provider!r}"
    exporter = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    try:
        yield exporter
    finally:
        processor.shutdown()  # a shut-down processor ignores later spans
