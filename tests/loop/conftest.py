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
def weak_calc_model(tmp_path_factory, worker_id) -> str:
    """The calculator agent's tiny model after a short warm start (the demo's own ``prepare_model``
    with 200 SFT steps of 32: its agent is right on about 0.3 of the tasks, so there is room to
    learn), made once per test run (shared by xdist's workers) for the tests that train it through
    ``spanrl demo --model`` or ``spanrl train``, each into its own output folder. (The demo's default
    warm start, 400 steps of 64, took 143 s of a CI worker at 300 steps; this one is a fifth of it.)"""
    import os

    from spanrl.demo import DemoSettings, prepare_model
    from tests.worker_cache import built_once

    settings = DemoSettings(sft_steps=200, sft_batch_size=32, device=os.environ.get("SPANRL_TEST_DEVICE", "cpu"))
    return built_once(tmp_path_factory, worker_id, "weak-calc-model", lambda out: prepare_model(settings, str(out)))
