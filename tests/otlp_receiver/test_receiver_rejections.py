"""Bad input never loses good data; a reused rollout id or an unknown completion never merges.

Real servers on free ports, the real SQLite store. A span the store cannot hold is rejected
alone (partial success with the reason) over gRPC and HTTP, the rest of its request stored;
retryable statuses only for conditions that can pass.
"""

from __future__ import annotations

import base64
import json

import grpc
import pytest
import requests
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.otlp_decode import SpanRow, decode_payload
from spanrl.otlp_receiver.store import SpanStore

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
BEYOND_INT64 = 2**63  # a valid fixed64, one more than SQLite's largest integer


def _ids(values) -> AnyValue:
    return AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=v) for v in values]))


def span(n: int, rollout: str = "r-bad", start: int | None = None, end: int | None = None, trace: int = 1,
         name: str = "llm") -> Span:
    return Span(
        trace_id=trace.to_bytes(16, "big"), span_id=n.to_bytes(8, "big"), name=name,
        start_time_unix_nano=1_000 + n if start is None else start,
        end_time_unix_nano=2_000 + n if end is None else end,
        attributes=[
            KeyValue(key=semconv.ROLLOUT_ID, value=AnyValue(string_value=rollout)),
            KeyValue(key=semconv.LLM_PROMPT_TOKEN_IDS, value=_ids([1, 2])),
            KeyValue(key=semconv.llm_response_token_ids(0), value=_ids([n])),
        ],
    )


def request_of(*spans: Span) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=list(spans))])])


def to_otlp_json(request: ExportTraceServiceRequest) -> bytes:
    """The OTLP/JSON encoding (hex ids, int64 as strings)."""
    data = json_format.MessageToDict(request)
    for resource_spans in data["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            for s in scope_spans["spans"]:
                for key in ("traceId", "spanId"):
                    s[key] = base64.b64decode(s[key]).hex()
    return json.dumps(data).encode()


@pytest.fixture
def grpc_export():
    channels = []

    def make(server):
        channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
        channels.append(channel)
        return channel.unary_unary(EXPORT, request_serializer=None,
                                   response_deserializer=ExportTraceServiceResponse.FromString)

    yield make
    for channel in channels:
        channel.close()


def _stored_span_ids(server) -> set[int]:
    with SpanStore(server.settings.db) as store:
        return {int.from_bytes(span_id, "big") for _, span_id in store.span_keys()}


@pytest.mark.parametrize("native", [True, False])
def test_times_beyond_int64_are_rejected_by_both_validators(native):
    decoded = decode_payload(
        request_of(span(1), span(2, start=BEYOND_INT64), span(3, end=2**64 - 1)).SerializeToString(),
        native=native,
    )
    assert [row.span_id for row in decoded.rows] == [(1).to_bytes(8, "big")]
    assert decoded.rejected == 2
    assert "start_time_unix_nano 9223372036854775808 is 2^63 ns or more" in decoded.error_message()
    assert "end_time_unix_nano 18446744073709551615" in decoded.error_message()


def test_unstorable_span_rejected_alone_over_grpc_every_time(start_receiver, grpc_export):
    server = start_receiver()
    export = grpc_export(server)
    payload = request_of(span(1), span(2, start=BEYOND_INT64, end=BEYOND_INT64 + 5)).SerializeToString()
    for _ in range(2):  # a retry gets the same definite answer, never UNAVAILABLE
        response = export(payload)
        assert response.partial_success.rejected_spans == 1
        assert "2^63 ns or more" in response.partial_success.error_message
    assert _stored_span_ids(server) == {1}


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
def test_unstorable_span_rejected_alone_over_http(start_receiver, encoding):
    server = start_receiver()
    request = request_of(span(1), span(2, start=BEYOND_INT64))
    if encoding == "json":
        body, content_type = to_otlp_json(request), "application/json"
    else:
        body, content_type = request.SerializeToString(), "application/x-protobuf"
    r = requests.post(f"http://127.0.0.1:{server.http_port}/v1/traces", data=body,
                      headers={"Content-Type": content_type}, timeout=10)
    assert r.status_code == 200
    if encoding == "json":
        partial = r.json()["partialSuccess"]
        assert partial["rejectedSpans"] == "1" and "2^63" in partial["errorMessage"]
    else:
        partial = ExportTraceServiceResponse.FromString(r.content).partial_success
        assert partial.rejected_spans == 1 and "2^63" in partial.error_message
    assert _stored_span_ids(server) == {1}


def test_store_rejects_a_row_sqlite_cannot_hold_and_keeps_the_rest(tmp_path):
    """The store's own safety net, for rows that reach it without the ingest checks."""
    good, bad, other = (decode_payload(request_of(span(n)).SerializeToString()).rows[0] for n in (1, 2, 3))
    bad = SpanRow(bad.trace_id, bad.span_id, bad.rollout_id, bad.task_id, bad.attempt, bad.name,
                  BEYOND_INT64, bad.body)
    with SpanStore(tmp_path / "s.db") as store:
        (refused,) = store.write_spans([good, bad, other], now=100.0)
        assert refused.index == 1 and "cannot hold" in refused.reason
        assert {s for _, s in store.span_keys()} == {good.span_id, other.span_id}
        (summary,) = store.rollout_summaries()
        assert summary.span_count == 2  # the bookkeeping counts only what was stored


def test_an_unexpected_write_failure_is_not_retryable(start_receiver, grpc_export, monkeypatch):
    """A bug while writing answers INTERNAL / 500 (a retry cannot pass), not UNAVAILABLE / 503."""
    server = start_receiver()

    def broken(rows, now=None):
        raise KeyError("a bug")

    monkeypatch.setattr(server.write_store, "write_spans", broken)
    with pytest.raises(grpc.RpcError) as err:
        grpc_export(server)(request_of(span(1)).SerializeToString())
    assert err.value.code() == grpc.StatusCode.INTERNAL and "KeyError" in err.value.details()
    r = requests.post(f"http://127.0.0.1:{server.http_port}/v1/traces",
                      data=request_of(span(2)).SerializeToString(),
                      headers={"Content-Type": "application/x-protobuf"}, timeout=10)
    assert r.status_code == 500 and "Retry-After" not in r.headers


def _assembled(server, kit, rollout_id: str):
    with SpanStore(server.settings.db) as store:
        return kit.wait_for(lambda: store.assembled_rollout(rollout_id), what=f"rollout {rollout_id}")


def test_a_rerun_with_a_used_rollout_id_is_refused_not_merged(start_receiver, grpc_export, kit):
    server = start_receiver()
    export = grpc_export(server)
    root = span(10, rollout="r-rerun", name=semconv.ROLLOUT_SPAN_NAME)
    first_run = [span(n, rollout="r-rerun") for n in (11, 12, 13)]
    for s in first_run:
        s.parent_span_id = root.span_id
    assert not export(request_of(*first_run, root).SerializeToString()).HasField("partial_success")
    before = _assembled(server, kit, "r-rerun")
    assert len(before.transitions) == 3
    # the same id again, in a new trace (a rerun with the same OTEL_RESOURCE_ATTRIBUTES)
    second_run = [span(n, rollout="r-rerun", trace=2) for n in (21, 22, 23)]
    response = export(request_of(*second_run).SerializeToString())
    assert response.partial_success.rejected_spans == 3
    assert "'r-rerun' was already assembled" in response.partial_success.error_message
    # a retry of spans stored before assembly is still acknowledged (idempotent)
    assert not export(request_of(first_run[0]).SerializeToString()).HasField("partial_success")
    with SpanStore(server.settings.db) as store:
        assert store.assembled_rollout("r-rerun") == before  # unchanged: 3 transitions
        (summary,) = store.rollout_summaries()
        assert (summary.span_count, summary.late_spans) == (4, 3)
        assert len(store.completed_rollouts(0)[0]) == 1  # a trainer reads it once


def test_completion_of_unknown_and_assembled_rollouts_over_http(start_receiver, grpc_export, kit):
    server = start_receiver()
    base = f"http://127.0.0.1:{server.http_port}/spanrl/v1/rollouts"
    r = requests.post(f"{base}/nobody/complete", timeout=10)
    assert r.status_code == 202 and r.json()["completion"] == "pending"
    assert "no rollout is created" in r.json()["message"]
    with SpanStore(server.settings.db) as store:
        assert store.rollout_summaries() == []  # no empty open rollout
    # its spans arrive afterwards: the earlier completion applies to them
    grpc_export(server)(request_of(span(1, rollout="nobody")).SerializeToString())
    rollout = _assembled(server, kit, "nobody")
    assert rollout.end_reason == "explicit" and len(rollout.transitions) == 1
    r = requests.post(f"{base}/nobody/complete", timeout=10)
    assert r.status_code == 200 and r.json()["completion"] == "already_assembled"
