"""Faults: the store's disk full (a file-size limit on the receiver process), the receiver down
for a while under a running agent. (kill -9 of the receiver mid-stream:
tests/otlp_receiver/test_receiver_crash.py; the bridge down under runners:
tests/loop/test_loop_reliability.py; all are counted by bench/reliability.py.)

Disk full is made with RLIMIT_FSIZE on the receiver process, not a small filesystem (mounting a
tmpfs needs root): a write past the limit fails with EFBIG inside SQLite's own write path (the
WAL file), as ENOSPC would, and ``prlimit`` on the running process gives the space back. (SQLite's
``max_page_count`` pragma would fail earlier, in SQLite's page accounting, not in a real write.)
"""

from __future__ import annotations

import sqlite3
import time

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.store import SpanStore

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
FILE_SIZE_LIMIT = 3 * 1024 * 1024


def emit_rollout(tracer, rollout_id: str, calls: int = 3, padding: int = 0) -> None:
    identity = {semconv.ROLLOUT_ID: rollout_id, semconv.TASK_ID: "faults", semconv.ATTEMPT: 0}
    with tracer.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=identity) as root:
        for i in range(calls):
            with tracer.start_as_current_span(f"llm-{i}", attributes={
                    **identity, semconv.LLM_PROMPT_TOKEN_IDS: [i, i + 1], semconv.llm_response_token_ids(0): [7],
                    "padding": "x" * padding}):
                pass
        root.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 1.0})


def span_keys(spans) -> set[tuple[bytes, bytes]]:
    return {(s.context.trace_id.to_bytes(16, "big"), s.context.span_id.to_bytes(8, "big")) for s in spans}


def integrity(db_path) -> str:
    with sqlite3.connect(db_path) as db:
        return db.execute("PRAGMA integrity_check").fetchone()[0]


def test_disk_full_is_retryable_loses_nothing_acknowledged_and_recovers(receiver_process, tmp_path, kit):
    receiver = receiver_process(file_size_limit=FILE_SIZE_LIMIT).start()
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("agent")
    channel = grpc.insecure_channel(f"127.0.0.1:{receiver.grpc_port}")
    export = channel.unary_unary(EXPORT_METHOD, request_serializer=lambda r: r.SerializeToString(),
                                 response_deserializer=ExportTraceServiceResponse.FromString)
    acknowledged: set[tuple[bytes, bytes]] = set()
    refused_request = None
    for batch in range(400):
        memory.clear()
        emit_rollout(tracer, f"full-{batch}", calls=20, padding=2000)
        spans = memory.get_finished_spans()
        try:
            response = export(encode_spans(spans), timeout=30)
        except grpc.RpcError as exc:
            error, refused_request, refused_keys = exc, encode_spans(spans), span_keys(spans)
            break
        assert not response.HasField("partial_success")
        acknowledged |= span_keys(spans)
    assert refused_request is not None, "the file-size limit was never reached"
    assert error.code() == grpc.StatusCode.UNAVAILABLE  # retryable: space may come back
    assert "cannot write" in error.details() and "is the disk full" in error.details(), error.details()
    trailers = dict(error.trailing_metadata() or ())
    assert "google.rpc.retryinfo-bin" in trailers
    with pytest.raises(grpc.RpcError) as again:  # still full: the same retryable answer, nothing half-stored
        export(refused_request, timeout=30)
    assert again.value.code() == grpc.StatusCode.UNAVAILABLE
    assert receiver.proc.poll() is None, "the receiver died on a full disk"
    assert integrity(receiver.db) == "ok"
    with SpanStore(receiver.db) as store:
        stored = store.span_keys()
    assert acknowledged <= stored and not (refused_keys & stored)

    receiver.raise_file_size_limit()
    # the real exporter, retrying the refused rollout's spans, now gets them stored
    exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{receiver.grpc_port}", insecure=True, timeout=30)
    memory.clear()
    emit_rollout(tracer, "after-space-returns")
    assert export(refused_request, timeout=30) is not None
    assert exporter.export(memory.get_finished_spans()).name == "SUCCESS"
    with SpanStore(receiver.db) as store:
        kit.wait_for(lambda: len(store.completed_rollouts(0)[0]) == batch + 2, timeout=60,
                     what="every rollout assembled once space returned")
        assert acknowledged | refused_keys <= store.span_keys()
    assert integrity(receiver.db) == "ok"
    provider.shutdown()
    channel.close()


def test_receiver_down_for_a_while_agents_finish_and_spans_arrive(receiver_process, kit):
    port = kit.free_port()
    exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}", insecure=True, timeout=60)
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=100))
    tracer = provider.get_tracer("agent")
    started = time.monotonic()
    for i in range(3):
        emit_rollout(tracer, f"while-down-{i}")
    agent_seconds = time.monotonic() - started
    assert agent_seconds < 1.0, f"the agent was held up {agent_seconds:.1f}s by a receiver that is down"
    time.sleep(2.0)  # the exporter retries against a closed port meanwhile
    receiver = receiver_process().start(grpc_port=port)
    for i in range(2):
        emit_rollout(tracer, f"after-return-{i}")
    assert provider.force_flush(60_000)
    with SpanStore(receiver.db) as store:
        rollouts = kit.wait_for(lambda: (r := store.completed_rollouts(0)[0]) and len(r) == 5 and r,
                                timeout=30, what="all five rollouts assembled")
        assert sorted(r.rollout_id for r in rollouts) == sorted(
            [f"while-down-{i}" for i in range(3)] + [f"after-return-{i}" for i in range(2)])
        assert all(len(r.transitions) == 3 and r.total_reward == 1.0 for r in rollouts)
    provider.shutdown()
