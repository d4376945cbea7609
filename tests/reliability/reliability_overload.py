"""Overload: agents exporting at about twice the receiver's measured capacity, through the real
OTel Python exporters (gRPC and HTTP, BatchSpanProcessor) and the Node.js SDK (``tests/node/
flood.js``), against ``spanrl receive`` in its own process.

Used by ``test_overload.py`` (a short run) and ``bench/reliability.py`` (the figures). Every span
an agent ends is accounted for: acknowledged (its export succeeded), failed (the exporter gave up
after its retries), or dropped on the agent's side (the processor's queue was full: it never
reached the exporter; emitted - acknowledged - failed). The receiver side: spans stored (rows of
these agents' rollouts), requests refused as overload (its stats), its peak resident memory.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from spanrl.instrumentation import semconv

NODE_DIR = Path(__file__).resolve().parents[1] / "node"
EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
SPANS_PER_ROLLOUT = 10
Key = tuple[bytes, bytes]


@dataclass
class AgentCounts:
    name: str
    emitted: int = 0
    acked: set[Key] = field(default_factory=set)
    failed: set[Key] = field(default_factory=set)

    @property
    def dropped(self) -> int:
        return self.emitted - len(self.acked) - len(self.failed)


@dataclass
class OverloadReport:
    capacity_spans_per_s: float
    target_spans_per_s: float
    seconds: float
    agents: list[AgentCounts]
    stored: int  # rows of the agents' rollouts in the store
    stored_acked: int  # acknowledged spans found in the store
    stored_failed: int  # spans whose export failed on the client yet were stored (answer lost)
    rejected_late: int  # acknowledged with a partial_success rejection: their rollout was assembled already
    overloaded_requests: int
    rss_start_bytes: int
    rss_peak_bytes: int

    @property
    def sent(self) -> int:
        return sum(a.emitted for a in self.agents)

    @property
    def acked(self) -> int:
        return sum(len(a.acked) for a in self.agents)

    @property
    def failed(self) -> int:
        return sum(len(a.failed) for a in self.agents)

    @property
    def dropped_by_clients(self) -> int:
        return sum(a.dropped for a in self.agents)

    @property
    def lost(self) -> int:
        """Acknowledged spans neither stored nor rejected in the answer's partial_success: must be 0.
        (An exporter reports a partial success as a success; the rejection is in its log.)"""
        return self.acked - self.stored_acked - self.rejected_late

    def lines(self) -> list[str]:
        mib = 1024 * 1024
        return [
            f"receiver capacity (measured): {self.capacity_spans_per_s:,.0f} spans/s; agents offered"
            f" {self.sent / self.seconds:,.0f} spans/s (target {self.target_spans_per_s:,.0f})"
            f" for {self.seconds:.1f} s",
            f"spans sent {self.sent} / acked {self.acked} / stored {self.stored} / lost {self.lost}",
            f"acked but rejected in partial_success (rollout assembled before they came) {self.rejected_late}",
            f"spans failed after client retries {self.failed} (of which stored anyway {self.stored_failed});"
            f" dropped on the clients' side (queue full) {self.dropped_by_clients}",
            f"requests refused as overload (retryable) {self.overloaded_requests}; receiver RSS"
            f" {self.rss_start_bytes / mib:.0f} -> peak {self.rss_peak_bytes / mib:.0f} MiB",
        ] + [f"  {a.name}: emitted {a.emitted}, acked {len(a.acked)}, failed {len(a.failed)}, dropped {a.dropped}"
             for a in self.agents]


def _random_span(rollout_id: str) -> Span:
    identity = [KeyValue(key=semconv.ROLLOUT_ID, value=AnyValue(string_value=rollout_id)),
                KeyValue(key=semconv.TASK_ID, value=AnyValue(string_value="capacity"))]
    start = time.time_ns()
    return Span(trace_id=random.randbytes(16), span_id=random.randbytes(8), name="llm", start_time_unix_nano=start,
                end_time_unix_nano=start + 1000, attributes=identity)


def measure_capacity(grpc_port: int, stats, seconds: float = 2.0, clients: int = 4, batch: int = 100) -> float:
    """Spans new to the store per second, with ``clients`` raw gRPC loaders sending requests of
    ``batch`` fresh spans as fast as they are answered."""
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    export = channel.unary_unary(EXPORT_METHOD, request_serializer=None,
                                 response_deserializer=ExportTraceServiceResponse.FromString)
    stop = time.monotonic() + seconds

    def load(client: int) -> None:
        request = ExportTraceServiceRequest()
        scope = request.resource_spans.add().scope_spans.add()
        scope.spans.extend(_random_span(f"capacity-{client}") for _ in range(batch))
        while time.monotonic() < stop:
            for span in scope.spans:  # new span ids: a repeated span would cost the store less
                span.span_id = random.randbytes(8)
            try:
                export(request.SerializeToString(), timeout=30)
            except grpc.RpcError:
                time.sleep(0.05)

    before = stats()["new_spans"]
    started = time.monotonic()
    threads = [threading.Thread(target=load, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    channel.close()
    return (stats()["new_spans"] - before) / elapsed


class _CountingExporter(SpanExporter):
    def __init__(self, inner: SpanExporter, counts: AgentCounts) -> None:
        self.inner = inner
        self.counts = counts

    def export(self, spans) -> SpanExportResult:
        result = self.inner.export(spans)
        keys = {(s.context.trace_id.to_bytes(16, "big"), s.context.span_id.to_bytes(8, "big")) for s in spans}
        (self.counts.acked if result == SpanExportResult.SUCCESS else self.counts.failed).update(keys)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _python_agent(counts: AgentCounts, protocol: str, endpoint: str, prefix: str, rate: float,
                  seconds: float) -> None:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        inner: SpanExporter = OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=30)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        inner = HttpExporter(endpoint=endpoint, timeout=30)
    provider = TracerProvider(resource=Resource.create({"service.name": counts.name}))
    provider.add_span_processor(BatchSpanProcessor(_CountingExporter(inner, counts), schedule_delay_millis=100,
                                                   max_export_batch_size=256))
    tracer = provider.get_tracer("flood")
    started = time.monotonic()
    rollouts = 0
    while (elapsed := time.monotonic() - started) < seconds:
        while counts.emitted < rate * elapsed:
            identity = {semconv.ROLLOUT_ID: f"{prefix}-{rollouts}", semconv.TASK_ID: "flood", semconv.ATTEMPT: 0}
            rollouts += 1
            with tracer.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=identity) as root:
                for i in range(SPANS_PER_ROLLOUT - 1):
                    with tracer.start_as_current_span(f"llm-{i}", attributes={
                            **identity, semconv.LLM_PROMPT_TOKEN_IDS: [1, 2, 3, i],
                            semconv.llm_response_token_ids(0): [4, i]}):
                        pass
                root.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 1.0})
            counts.emitted += SPANS_PER_ROLLOUT
        time.sleep(0.005)
    provider.shutdown()  # flushes what is queued through the exporter (and its retries)


def _node_agent(counts: AgentCounts, protocol: str, endpoint: str, prefix: str, rate: float,
                seconds: float, node: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "counts.json"
        result = subprocess.run([node, "flood.js", protocol, endpoint, prefix, str(rate), str(seconds), str(out)],
                                cwd=NODE_DIR, capture_output=True, text=True, timeout=seconds + 120,
                                env=os.environ.copy())
        if result.returncode != 0 or not out.exists():
            raise RuntimeError(f"node flood.js failed: {result.stderr[-2000:]}")
        answer = json.loads(out.read_text())
    counts.emitted = answer["emitted"]

    def keys(items: list[str]) -> set[Key]:
        return {(bytes.fromhex(t), bytes.fromhex(s)) for t, s in (item.split(":") for item in items)}

    counts.acked, counts.failed = keys(answer["acked"]), keys(answer["failed"])


def run_overload(receiver, seconds: float, python_agents: int, node_agents: int, node: str | None,
                 overload_factor: float = 2.0, capacity_s: float = 2.0) -> OverloadReport:
    """Measure ``receiver``'s capacity, then run the agents at ``overload_factor`` times it."""
    from spanrl.otlp_receiver.store import SpanStore

    capacity = measure_capacity(receiver.grpc_port, receiver.stats, seconds=capacity_s)
    target = overload_factor * capacity
    agents_total = python_agents + (node_agents if node else 0)
    per_agent = target / max(1, agents_total)
    overloaded_before = receiver.stats()["overloaded_requests"]
    grpc_endpoint = f"http://127.0.0.1:{receiver.grpc_port}"
    http_endpoint = f"http://127.0.0.1:{receiver.http_port}/v1/traces"
    agents: list[AgentCounts] = []
    threads: list[threading.Thread] = []
    errors: list[BaseException] = []

    def guarded(function, *args) -> None:
        try:
            function(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    for i in range(python_agents):
        protocol = "grpc" if i % 2 == 0 else "http"
        counts = AgentCounts(f"python-{protocol}-{i}")
        agents.append(counts)
        endpoint = grpc_endpoint if protocol == "grpc" else http_endpoint
        threads.append(threading.Thread(target=guarded, args=(_python_agent, counts, protocol, endpoint,
                                                              f"ovl-py{i}", per_agent, seconds)))
    for i in range(node_agents if node else 0):
        protocol = "grpc" if i % 2 == 0 else "http-json"
        counts = AgentCounts(f"node-{protocol}-{i}")
        agents.append(counts)
        endpoint = grpc_endpoint if protocol == "grpc" else http_endpoint
        threads.append(threading.Thread(target=guarded, args=(_node_agent, counts, protocol, endpoint,
                                                              f"ovl-node{i}", per_agent, seconds, node)))
    rss_start = receiver.rss_bytes()
    rss_peak = rss_start
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        rss_peak = max(rss_peak, receiver.rss_bytes())
        time.sleep(0.1)
    if errors:
        raise errors[0]
    overloaded = receiver.stats()["overloaded_requests"] - overloaded_before
    acked = set().union(*(a.acked for a in agents))
    failed = set().union(*(a.failed for a in agents))
    with SpanStore(receiver.db) as store:
        stored_keys = store.span_keys()
    with sqlite3.connect(receiver.db) as db:
        stored = db.execute("SELECT count(*) FROM spans WHERE rollout_id LIKE 'ovl-%'").fetchone()[0]
        late = db.execute("SELECT coalesce(sum(late_spans), 0) FROM rollouts WHERE rollout_id LIKE 'ovl-%'"
                          ).fetchone()[0]
    return OverloadReport(capacity, target, seconds, agents, stored, len(acked & stored_keys),
                          len(failed & stored_keys), late, overloaded, rss_start, rss_peak)
