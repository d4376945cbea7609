"""OTLP spec behaviour over both transports: partial success, errors, gzip, limits, retries."""

from __future__ import annotations

import gzip
import socket
import sqlite3
import threading

import grpc
import pytest
import requests
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from spanrl.instrumentation import semconv
from spanrl.instrumentation.packed_values import pack_logprobs, pack_token_ids
from spanrl.otlp_receiver.store import SpanStore

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def kv(key, value) -> KeyValue:
    if isinstance(value, bool):
        v = AnyValue(bool_value=value)
    elif isinstance(value, int):
        v = AnyValue(int_value=value)
    elif isinstance(value, float):
        v = AnyValue(double_value=value)
    elif isinstance(value, str):
        v = AnyValue(string_value=value)
    else:
        v = AnyValue(array_value=ArrayValue(values=[kv("x", x).value for x in value]))
    return KeyValue(key=key, value=v)


def span(n: int, rollout="r-proto", parent: int | None = None, name="s", trace=1, **attrs) -> Span:
    s = Span(
        trace_id=trace.to_bytes(16, "big"), span_id=n.to_bytes(8, "big"), name=name,
        start_time_unix_nano=1_000 + n, end_time_unix_nano=2_000 + n,
        attributes=[kv(semconv.ROLLOUT_ID, rollout), *(kv(k, v) for k, v in attrs.items())],
    )
    if parent is not None:
        s.parent_span_id = parent.to_bytes(8, "big")
    return s


def request_of(*spans: Span) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=list(spans))])]
    )


@pytest.fixture
def grpc_export(start_receiver):
    channels = []

    def make(server):
        channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
        channels.append(channel)
        return channel.unary_unary(
            EXPORT, request_serializer=None, response_deserializer=ExportTraceServiceResponse.FromString
        )

    yield make
    for channel in channels:
        channel.close()


def test_full_success_leaves_partial_success_unset(start_receiver, grpc_export):
    server = start_receiver()
    response = grpc_export(server)(request_of(span(1), span(2, parent=1)).SerializeToString())
    assert not response.HasField("partial_success")


def test_bad_spans_rejected_good_spans_kept(start_receiver, grpc_export):
    server = start_receiver()
    bad_types = span(3, **{semconv.LLM_PROMPT_TOKEN_IDS: ["1", "2"]})
    negative = span(4, **{semconv.llm_response_token_ids(0): [5, -1]})
    no_id = span(5)
    no_id.span_id = b""
    bad_attempt = span(6, **{semconv.ATTEMPT: "zero"})
    good = span(7, **{semconv.LLM_PROMPT_TOKEN_IDS: [1, 2], semconv.llm_response_token_ids(0): [3]})
    # the packed form (what spanrl's instrumentation writes): 3 bytes are no whole 4-byte id
    bad_packed = span(8, **{semconv.LLM_PROMPT_TOKEN_IDS: "AQID", semconv.llm_response_token_ids(0): [3]})
    bad_packed_logprobs = span(9, **{semconv.llm_response_logprobs(0): "not base64!"})
    good_packed = span(10, **{semconv.LLM_PROMPT_TOKEN_IDS: pack_token_ids([1, 2]),
                              semconv.llm_response_token_ids(0): pack_token_ids([3]),
                              semconv.llm_response_logprobs(0): pack_logprobs([-0.25])})
    response = grpc_export(server)(
        request_of(span(1), bad_types, negative, no_id, bad_attempt, good, bad_packed, bad_packed_logprobs,
                   good_packed).SerializeToString()
    )
    assert response.partial_success.rejected_spans == 6
    message = response.partial_success.error_message
    assert f"{semconv.LLM_PROMPT_TOKEN_IDS}: packed token ids should be whole 4-byte values, got 3 bytes" in message
    assert f"{semconv.LLM_PROMPT_TOKEN_IDS} must be an array of non-negative ints, got string_value" in message
    assert "negative id" in message and "span_id must be 8 bytes" in message
    assert f"{semconv.ATTEMPT} must be an int" in message
    with SpanStore(server.settings.db) as store:
        assert store.span_keys() == {
            ((1).to_bytes(16, "big"), n.to_bytes(8, "big")) for n in (1, 7, 10)
        }


def test_garbage_is_invalid_argument_and_server_keeps_serving(start_receiver, grpc_export):
    server = start_receiver()
    export = grpc_export(server)
    with pytest.raises(grpc.RpcError) as err:
        export(b"\xff\xff\xff not a protobuf")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ExportTraceServiceRequest" in err.value.details()
    r = requests.post(
        f"http://127.0.0.1:{server.http_port}/v1/traces", data=b"\xff\xff\xff",
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert r.status_code == 400
    assert "not a valid" in status_pb2.Status.FromString(r.content).message
    r = requests.post(
        f"http://127.0.0.1:{server.http_port}/v1/traces", data=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["message"]
    # still serving, nothing lost
    assert not export(request_of(span(9)).SerializeToString()).HasField("partial_success")
    with SpanStore(server.settings.db) as store:
        assert store.span_count() == 1


def test_duplicate_batches_are_idempotent(start_receiver, grpc_export):
    server = start_receiver()
    payload = request_of(span(1), span(2, parent=1)).SerializeToString()
    export = grpc_export(server)
    for _ in range(3):
        assert not export(payload).HasField("partial_success")
    requests.post(
        f"http://127.0.0.1:{server.http_port}/v1/traces", data=payload,
        headers={"Content-Type": "application/x-protobuf"},
    ).raise_for_status()
    with SpanStore(server.settings.db) as store:
        assert store.span_count() == 2
        (summary,) = store.rollout_summaries()
        assert summary.rollout_id == "r-proto"


def test_oversize_messages_refused_on_both_transports(start_receiver, grpc_export):
    server = start_receiver(max_message_mb=0.01)  # ~10 KiB
    big = request_of(span(1, **{semconv.variable("blob"): "x" * 20_000})).SerializeToString()
    with pytest.raises(grpc.RpcError) as err:
        grpc_export(server)(big)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    url = f"http://127.0.0.1:{server.http_port}/v1/traces"
    r = requests.post(url, data=big, headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 413
    # a gzip bomb is measured after decompression
    r = requests.post(
        url, data=gzip.compress(big),
        headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"},
    )
    assert r.status_code == 413
    small = request_of(span(2)).SerializeToString()
    assert not grpc_export(server)(small).HasField("partial_success")
    assert requests.post(url, data=small, headers={"Content-Type": "application/x-protobuf"}).status_code == 200


@pytest.mark.parametrize(
    "framing",
    ["Content-Length: -1\r\n\r\n", "Transfer-Encoding: chunked\r\n\r\n-5\r\nxxxxx\r\n"],
    ids=["negative-content-length", "negative-chunk-size"],
)
def test_negative_body_sizes_are_refused_at_once(start_receiver, framing):
    """A negative size must not make the server read until the client hangs up."""
    server = start_receiver()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=5) as conn:
        conn.sendall(
            b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            + framing.encode()
        )  # the connection stays open: the answer must come without it closing
        response = conn.makefile("rb")
        status_line = response.readline()
        assert status_line.startswith(b"HTTP/1.1 400"), status_line
        headers = {}
        while (line := response.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode().partition(":")
            headers[key.strip().lower()] = value.strip()
        assert headers["connection"] == "close"
        message = status_pb2.Status.FromString(response.read(int(headers["content-length"]))).message
        assert "Content-Length" in message or "chunk" in message
    small = request_of(span(2)).SerializeToString()
    url = f"http://127.0.0.1:{server.http_port}/v1/traces"
    assert requests.post(url, data=small, headers={"Content-Type": "application/x-protobuf"}).status_code == 200


def test_gzip_on_both_transports(start_receiver):
    server = start_receiver()
    payload = request_of(span(1, **{semconv.LLM_PROMPT_TOKEN_IDS: list(range(500))})).SerializeToString()
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", compression=grpc.Compression.Gzip) as channel:
        export = channel.unary_unary(EXPORT, response_deserializer=ExportTraceServiceResponse.FromString)
        assert not export(payload).HasField("partial_success")
    r = requests.post(
        f"http://127.0.0.1:{server.http_port}/v1/traces",
        data=gzip.compress(request_of(span(2)).SerializeToString()),
        headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"},
    )
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/x-protobuf"
    with SpanStore(server.settings.db) as store:
        assert store.span_count() == 2


def test_otlp_json_encoding(start_receiver):
    server = start_receiver()
    body = {
        "resourceSpans": [{
            "resource": {"attributes": [{"key": semconv.ROLLOUT_ID, "value": {"stringValue": "r-json"}}]},
            "scopeSpans": [{"spans": [
                {
                    "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174",
                    "name": "chat", "kind": 3, "startTimeUnixNano": "1544712660000000000",
                    "endTimeUnixNano": "1544712661000000000",
                    "attributes": [
                        {"key": semconv.LLM_PROMPT_TOKEN_IDS, "value": {"arrayValue": {"values": [
                            {"intValue": "1"}, {"intValue": "9007199254740993"}]}}},
                        {"key": semconv.ATTEMPT, "value": {"intValue": "1"}},
                    ],
                    "unknownFutureField": True,
                },
                {"traceId": "5b8efff798038103d269b633813fc60c", "spanId": "zz", "name": "bad hex"},
            ]}],
        }]
    }
    r = requests.post(f"http://127.0.0.1:{server.http_port}/v1/traces", json=body)
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    partial = r.json()["partialSuccess"]
    assert partial["rejectedSpans"] == "1" and "span_id must be 8 bytes" in partial["errorMessage"]
    with SpanStore(server.settings.db) as store:
        (stored,) = store.rollout_spans("r-json")
        assert stored.span_id == bytes.fromhex("eee19b7ec3c1b174")
        decoded = Span.FromString(stored.body)
        ids = next(a for a in decoded.attributes if a.key == semconv.LLM_PROMPT_TOKEN_IDS)
        assert [v.int_value for v in ids.value.array_value.values] == [1, 9007199254740993]


def test_unauthenticated_codes(start_receiver, grpc_export):
    server = start_receiver(token="t0ken")
    payload = request_of(span(1)).SerializeToString()
    with pytest.raises(grpc.RpcError) as err:
        grpc_export(server)(payload)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    url = f"http://127.0.0.1:{server.http_port}/v1/traces"
    assert requests.post(url, data=payload, headers={"Content-Type": "application/x-protobuf"}).status_code == 401
    ok = requests.post(
        url, data=payload, headers={"Content-Type": "application/x-protobuf", "Authorization": "Bearer t0ken"}
    )
    assert ok.status_code == 200


def test_overload_answers_unavailable_with_retry_info(start_receiver, grpc_export, tmp_path):
    """Another process holds the SQLite write lock: requests pile up; the next is refused."""
    server = start_receiver(max_pending_mb=0.000001, retry_after_s=2.5)
    blocker = sqlite3.connect(server.settings.db, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    export = grpc_export(server)
    first_result = {}
    first = threading.Thread(
        target=lambda: first_result.setdefault("response", export(request_of(span(1)).SerializeToString()))
    )
    try:
        first.start()
        import time

        deadline = time.monotonic() + 5
        while server.writer._pending_bytes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            export(request_of(span(2)).SerializeToString())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        trailers = dict(err.value.trailing_metadata())
        retry = error_details_pb2.RetryInfo.FromString(trailers["google.rpc.retryinfo-bin"])
        assert retry.retry_delay.seconds == 2 and retry.retry_delay.nanos == 500_000_000
        status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
        assert status.code == 14
        detail = error_details_pb2.RetryInfo()
        assert status.details[0].Unpack(detail) and detail.retry_delay.seconds == 2
        r = requests.post(
            f"http://127.0.0.1:{server.http_port}/v1/traces",
            data=request_of(span(3)).SerializeToString(), headers={"Content-Type": "application/x-protobuf"},
        )
        assert r.status_code == 503 and r.headers["Retry-After"] == "3"
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
        first.join(timeout=10)
    assert not first_result["response"].HasField("partial_success")
    with SpanStore(server.settings.db) as store:
        assert store.span_count() == 1  # the waiting request was committed, then acknowledged


def test_explicit_completion_over_http(start_receiver, grpc_export, kit):
    server = start_receiver()
    grpc_export(server)(request_of(span(1, rollout="r/explicit", name="llm")).SerializeToString())
    r = requests.post(f"http://127.0.0.1:{server.http_port}/spanrl/v1/rollouts/r%2Fexplicit/complete")
    assert r.status_code == 202
    with SpanStore(server.settings.db) as store:
        (rollout,) = kit.wait_for(lambda: store.completed_rollouts(0)[0])
        assert rollout.rollout_id == "r/explicit" and rollout.end_reason == "explicit"


def test_logs_and_metrics_accepted_on_http_json(start_receiver):
    server = start_receiver()
    for path in ("/v1/logs", "/v1/metrics"):
        r = requests.post(f"http://127.0.0.1:{server.http_port}{path}", json={})
        assert r.status_code == 200 and r.json() == {}
        r = requests.post(
            f"http://127.0.0.1:{server.http_port}{path}", data=b"\xff\xff",
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert r.status_code == 400
    r = requests.post(f"http://127.0.0.1:{server.http_port}/v1/traces", data=b"x",
                      headers={"Content-Type": "text/plain"})
    assert r.status_code == 415


def test_python_exporter_honours_retry_info(start_receiver, grpc_export, memory_tracer, caplog):
    """The real OTel Python exporter reads our RetryInfo trailer and succeeds once we recover."""
    import logging
    import time

    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    server = start_receiver(max_pending_mb=0.000001, retry_after_s=0.3)
    with memory_tracer.tracer.start_as_current_span("retried", attributes={semconv.ROLLOUT_ID: "r-retry"}):
        pass
    blocker = sqlite3.connect(server.settings.db, isolation_level=None, check_same_thread=False)
    blocker.execute("BEGIN IMMEDIATE")  # the disk is "busy": the first request waits for it
    export = grpc_export(server)
    first = threading.Thread(target=lambda: export(request_of(span(1)).SerializeToString()))
    first.start()
    deadline = time.monotonic() + 5
    while server.writer._pending_bytes == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    release = threading.Timer(0.8, lambda: (blocker.execute("ROLLBACK"), blocker.close()))
    release.start()
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{server.grpc_port}", insecure=True, timeout=10)
    try:
        with caplog.at_level(logging.WARNING, logger="opentelemetry.exporter.otlp.proto.grpc.exporter"):
            assert exporter.export(memory_tracer.exporter.get_finished_spans()) == SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
        release.join()
        first.join(timeout=10)
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert retries and all("retrying in 0.30s" in m for m in retries), retries
    with SpanStore(server.settings.db) as store:
        assert store.span_count() == 2
