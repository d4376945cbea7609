"""Fixtures of the instrumentation tests: a real OTLP/gRPC TraceService collecting what agents
export, a real HTTP server replaying answers recorded from vLLM (``vllm_recording*``: a
recording, not a live engine; tests/verl_backend/test_vllm_live.py runs an agent of ``agents/``
against a running vLLM), private tracer providers, and a runner for agent scripts under
``opentelemetry-instrument``. Every server binds 127.0.0.1 on
a free port and is stopped in teardown; every subprocess is killed in ``finally``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from spanrl.child_processes import free_port
from spanrl.instrumentation.packed_values import unpacked_attributes

HERE = Path(__file__).resolve().parent
AGENTS = HERE / "agents"
BIN = Path(sys.executable).parent


def _load_replay_server_module():
    spec = importlib.util.spec_from_file_location("spanrl_test_vllm_replay_server", HERE / "vllm_replay_server.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


vllm_replay_server = _load_replay_server_module()
POLICY_VERSION = 7  # the x-spanrl-policy-version header the replay adds, as spanrl's endpoint does


def decode_any_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return tuple(decode_any_value(v) for v in value.array_value.values)
    if kind == "kvlist_value":
        return {kv.key: decode_any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


def decode_attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: decode_any_value(kv.value) for kv in key_values}


class TraceCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """A real TraceService: keeps every ExportTraceServiceRequest and its gRPC metadata."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metadata: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self.endpoint = ""

    def Export(self, request, context):  # noqa: N802 - gRPC's naming
        with self._lock:
            self.requests.append(request)
            self.metadata.append({k: v for k, v in context.invocation_metadata()})
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[dict[str, Any]]:
        """Every span received, flattened: name, ids, attributes, resource, events, status."""
        with self._lock:
            requests = list(self.requests)
        result = []
        for request in requests:
            for resource_spans in request.resource_spans:
                resource = decode_attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        result.append({
                            "name": span.name,
                            "scope": scope_spans.scope.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(),
                            "attributes": unpacked_attributes(decode_attributes(span.attributes)),
                            "resource": resource,
                            "events": [(e.name, decode_attributes(e.attributes)) for e in span.events],
                            "status_code": span.status.code,
                            "status_message": span.status.message,
                        })
        return result

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()
            self.metadata.clear()


class SignalCounter(metrics_service_pb2_grpc.MetricsServiceServicer, logs_service_pb2_grpc.LogsServiceServicer):
    """Counts OTLP metrics and logs export requests (to check which exporters are on)."""

    def __init__(self) -> None:
        self.metrics_requests = 0
        self.logs_requests = 0

    def Export(self, request, context):  # noqa: N802
        if isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest):
            self.metrics_requests += 1
            return metrics_service_pb2.ExportMetricsServiceResponse()
        self.logs_requests += 1
        return logs_service_pb2.ExportLogsServiceResponse()


@pytest.fixture()
def trace_collector():
    """The TraceService; its ``signals`` counts metrics/logs exports on the same port."""
    collector = TraceCollector()
    collector.signals = SignalCounter()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(collector.signals, server)
    logs_service_pb2_grpc.add_LogsServiceServicer_to_server(collector.signals, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    collector.endpoint = f"http://127.0.0.1:{port}"
    try:
        yield collector
    finally:
        server.stop(grace=None).wait(5)


def _server_fixture(**options: Any):
    server = vllm_replay_server.VLLMReplayServer(policy_version_header=POLICY_VERSION, **options)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture()
def vllm_recording():
    """vLLM's recorded answers: token ids when the request asks for them."""
    yield from _server_fixture()


@pytest.fixture()
def vllm_recording_without_ids():
    """vLLM's answers to requests without ``return_token_ids``, whatever the request asks:
    an OpenAI-compatible endpoint that ignores the field."""
    yield from _server_fixture(ignores_token_ids=True)


def agent_environment(endpoint: str, base_url: str, **extra: str) -> dict[str, str]:
    """A clean environment for an agent subprocess (no inherited OTEL_* settings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_SERVICE_NAME="spanrl-test-agent",
        OTEL_EXPORTER_OTLP_TIMEOUT="2",
        OPENAI_BASE_URL=base_url,
        OPENAI_API_KEY="test-key",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def run_process(command: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``command`` to completion (killing it on timeout) and return its result."""
    process = subprocess.Popen(command, env=env, cwd=str(HERE), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.fixture()
def run_agent() -> Callable[..., subprocess.CompletedProcess]:
    """Run ``agents/<script>`` under ``opentelemetry-instrument`` (``instrument=False``: plain
    python) with ``env``; ``flags`` go to opentelemetry-instrument."""

    def run(script: str, env: dict[str, str], *args: str, flags: tuple[str, ...] = (),
            instrument: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        command = [sys.executable, str(AGENTS / script), *args]
        if instrument:
            command = [str(BIN / "opentelemetry-instrument"), *flags, *command]
        return run_process(command, env, timeout)

    return run


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture()
def harness():
    """The plain helpers above, for test files (they cannot import conftest)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        agent_environment=agent_environment,
        run_process=run_process,
        wait_for=wait_for,
        free_port=free_port,
        agents=AGENTS,
        bin=BIN,
    )


@pytest.fixture()
def vllm_recording_malformed():
    """vLLM's answers with ``choices[0].token_ids`` that are not a list of ints."""
    yield from _server_fixture(malformed_token_ids=True)


@pytest.fixture()
def rollout_tracing():
    """A private SDK TracerProvider with spanrl's identity processor, exporting to memory: pass
    ``rollout_tracing.provider`` as ``tracer_provider=`` to rollout() and friends."""
    from types import SimpleNamespace

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from spanrl.exporter.span_processor import install_identity_processor

    provider = TracerProvider()
    install_identity_processor(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        yield SimpleNamespace(provider=provider, exporter=exporter)
    finally:
        provider.shutdown()


@pytest.fixture()
def otlp_http_collector():
    """A real OTLP/HTTP endpoint (POST /v1/traces, protobuf) keeping requests and headers."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    received = SimpleNamespace(requests=[], headers=[], endpoint="")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format, *args):  # quiet
            return

        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path != "/v1/traces":
                self.send_response(404)
                self.end_headers()
                return
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            received.requests.append(request)
            received.headers.append({k.lower(): v for k, v in self.headers.items()})
            payload = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    received.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield received
    finally:
        server.shutdown()
        server.server_close()
