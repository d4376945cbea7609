"""Fixtures for the loop tests: a real bridge API on a free port, and a private tracer provider
exporting to memory (passed to the runner as ``tracer_provider=``)."""

from __future__ import annotations

import pytest
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
def tracer_provider():
    """A private SDK tracer provider for one test; the global provider is left alone."""
    provider = TracerProvider()
    try:
        yield provider
    finally:
        provider.shutdown()


@pytest.fixture
def span_exporter(tracer_provider):
    """Spans of ``tracer_provider``, collected in memory."""
    exporter = InMemorySpanExporter()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture(scope="session")
def demo_warm_model(tmp_path_factory, worker_id) -> str:
    """The demo's warm-started calculator model (its own ``prepare_model``: a tiny model, 300 SFT
    steps, ~40 s on an idle 2-core machine), made once per test run (shared by xdist's workers)
    for the tests that run ``spanrl demo``: each trains it through ``--model`` into its own
    output folder."""
    import os

    from spanrl.demo import DemoSettings, prepare_model
    from tests.worker_cache import built_once

    settings = DemoSettings(sft_steps=300, device=os.environ.get("SPANRL_TEST_DEVICE", "cpu"))
    return built_once(tmp_path_factory, worker_id, "demo-model", lambda out: prepare_model(settings, str(out)))
