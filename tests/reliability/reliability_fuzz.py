"""The fuzzers of the reliability suite (hypothesis): OTLP protobuf and JSON payloads against the
receiver over its real server; what every fuzzer shares (``FuzzReport``, ``run_cases``, the JSON
strategies). The HTTP JSON servers (bridge, policy server, weights route, gateway, slow clients)
are fuzzed in ``reliability_fuzz_http.py``.

Loaded by path by ``test_fuzz.py`` (short runs in CI) and by ``bench/reliability.py`` (the full
run: ``--fuzz-cases``). Each ``fuzz_*`` function runs ``cases`` generated cases and returns a
``FuzzReport``: how many ran, how many were answered with a server error (HTTP 5xx, gRPC
INTERNAL/UNKNOWN), and every crash (an answer that is not the documented one for a bad case: a
5xx, a retryable status for a request that can never pass, an error without a message, an
exception other than the documented ones, a case slower than ``HANG_S``). Crashes are
collected, not raised, so a run counts them all.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import json_format
from google.rpc import status_pb2
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.export_service import TooLarge
from spanrl.otlp_receiver.otlp_decode import PayloadError

HANG_S = 10.0  # a case answered slower than this counts as a hang
EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


@dataclass
class FuzzReport:
    target: str
    cases: int = 0
    crashes: list[str] = field(default_factory=list)
    server_errors: int = 0  # cases answered 5xx (HTTP) or INTERNAL/UNKNOWN (gRPC): each is a crash too

    def crash(self, case: Any, problem: str) -> None:
        if len(self.crashes) < 50:  # enough to debug; the count is what the figures need
            self.crashes.append(f"{problem} <- {case!r:.300}")
        else:
            self.crashes.append(problem[:80])


def run_cases(cases: int, strategy: st.SearchStrategy, check: Callable[[Any], None], run_seed: int = 0) -> None:
    @seed(run_seed)  # reproducible runs
    @settings(max_examples=cases, deadline=None, database=None, derandomize=False, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(case: Any) -> None:
        check(case)

    run()


# --- OTLP payloads ---------------------------------------------------------------------------

def seed_requests() -> list:
    """Valid ExportTraceServiceRequests from the real SDK: spanrl rollouts with token ids."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("fuzz")
    requests = []
    for n in range(3):
        exporter.clear()
        identity = {semconv.ROLLOUT_ID: f"fuzz-{n}", semconv.TASK_ID: "fuzz", semconv.ATTEMPT: n}
        with tracer.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=identity) as root:
            with tracer.start_as_current_span("llm", attributes={
                    **identity, semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM,
                    semconv.LLM_PROMPT_TOKEN_IDS: [1, 2, 3], semconv.llm_response_token_ids(0): [4, 5],
                    semconv.llm_response_logprobs(0): [-0.5, -1.0], semconv.LLM_POLICY_VERSION: 2}):
                pass
            with tracer.start_as_current_span("tool") as tool:
                tool.set_status(Status(StatusCode.ERROR, "tool failed"))
            root.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 0.5})
            root.set_attribute(semconv.variable("answer"), "42")
        requests.append(encode_spans(exporter.get_finished_spans()))
    provider.shutdown()
    return requests


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _encode_fields(fields: list[tuple[int, tuple[int, Any]]]) -> bytes:
    out = bytearray()
    for number, (wire_type, value) in fields:
        out += _varint((number << 3) | wire_type)
        if wire_type == 0:
            out += _varint(value)
        elif wire_type == 2:
            out += _varint(len(value)) + value
        else:
            out += value
    return bytes(out)


_LEAF = st.one_of(
    st.tuples(st.just(0), st.one_of(st.integers(0, 300), st.integers(0, 2**64 - 1))),
    st.tuples(st.just(1), st.binary(min_size=8, max_size=8)),
    st.tuples(st.just(5), st.binary(min_size=4, max_size=4)),
    st.tuples(st.just(2), st.one_of(st.binary(min_size=16, max_size=16), st.binary(min_size=8, max_size=8),
                                    st.text(max_size=20).map(str.encode), st.binary(max_size=30))),
)
# Field numbers of the OTLP messages (1..16), so random trees often nest like real requests.
_WIRE_TREE = st.recursive(
    st.lists(st.tuples(st.integers(1, 16), _LEAF), max_size=6),
    lambda children: st.lists(st.tuples(st.integers(1, 16), st.one_of(
        _LEAF, children.map(lambda fields: (2, _encode_fields(fields))))), max_size=6),
    max_leaves=40,
).map(_encode_fields)


def _mutate_bytes(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    buffer = bytearray(data)
    for position, operation, value in edits:
        if not buffer:
            buffer.append(value)
            continue
        position %= len(buffer)
        if operation == 0:
            buffer[position] = value
        elif operation == 1:
            buffer.insert(position, value)
        elif operation == 2:
            del buffer[position]
        else:
            del buffer[position:]
    return bytes(buffer)


def protobuf_bodies(seeds: list[bytes]) -> st.SearchStrategy[bytes]:
    edits = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 3), st.integers(0, 255)), min_size=1,
                     max_size=4)
    mutated = st.tuples(st.sampled_from(seeds), edits).map(lambda pair: _mutate_bytes(*pair))
    return st.one_of(mutated, _WIRE_TREE, st.binary(max_size=200), st.integers(50, 3000).map(_deep_message))


def _deep_message(depth: int) -> bytes:
    """A message nested ``depth`` times in field 1 (OTLP's resource_spans, scope_spans, spans...)."""
    body = b""
    for _ in range(depth):
        body = _encode_fields([(1, (2, body))])
    return body


def deep_json(depth: int, document: bool) -> bytes:
    """JSON nested ``depth`` levels: bare lists, or inside an object as a field's value."""
    nested = b"[" * depth + b"]" * depth
    return b'{"resourceSpans": ' + nested + b"}" if document else nested


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
              st.text(max_size=20), st.sampled_from(["", "0", "-1", "18446744073709551616", "AAAA", "zz"])),
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.text(max_size=12), children, max_size=4)),
    max_leaves=12,
)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, prefix + (key,))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _paths(child, prefix + (index,))
    return found


@st.composite
def mutated_json(draw, seeds: list[Any]) -> Any:
    """A valid seed document with 1-3 values replaced, keys dropped or lists emptied."""
    document = json.loads(json.dumps(draw(st.sampled_from(seeds))))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(document)
        path = draw(st.sampled_from(paths))
        if not path:
            return draw(JSON_VALUES)
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(JSON_VALUES)
    return document


def json_bodies(seeds: list[Any]) -> st.SearchStrategy[bytes]:
    text_edits = st.tuples(st.sampled_from([json.dumps(s).encode() for s in seeds]),
                           st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 3), st.integers(32, 126)),
                                    min_size=1, max_size=3)).map(lambda pair: _mutate_bytes(*pair))
    deep = st.builds(deep_json, st.integers(100, 100_000), st.booleans())  # past the recursion limit, or not
    return st.one_of(mutated_json(seeds).map(lambda d: json.dumps(d).encode()), text_edits,
                     JSON_VALUES.map(lambda d: json.dumps(d).encode()), deep)


def _check_export_response(response: ExportTraceServiceResponse) -> str | None:
    partial = response.partial_success
    if partial.rejected_spans and not partial.error_message:
        return "partial_success rejected spans without an error_message"
    return None


def fuzz_otlp(receiver, cases: int, encoding: str, transport_every: int = 10) -> FuzzReport:
    """Payloads into ``receiver`` (a started ``ReceiverServer``): every case through its
    ExportService, every ``transport_every``-th also over HTTP and (protobuf) gRPC."""
    report = FuzzReport(f"otlp-{encoding}")
    requests = seed_requests()
    if encoding == "protobuf":
        strategy = protobuf_bodies([r.SerializeToString() for r in requests])
    else:
        strategy = json_bodies([json_format.MessageToDict(r) for r in requests])
    json_encoding = encoding == "json"
    channel = grpc.insecure_channel(f"127.0.0.1:{receiver.grpc_port}")
    grpc_export = channel.unary_unary(EXPORT_METHOD, request_serializer=None,
                                      response_deserializer=ExportTraceServiceResponse.FromString)

    def check(body: bytes) -> None:
        report.cases += 1
        started = time.monotonic()
        try:
            problem = _check_export_response(receiver.export.export_traces(body, json_encoding))
            if problem:
                report.crash(body, problem)
        except (PayloadError, TooLarge) as exc:
            if not str(exc):
                report.crash(body, f"{type(exc).__name__} without a message")
        except Exception as exc:  # noqa: BLE001 - the crash being looked for
            report.crash(body, f"in-process {type(exc).__name__}: {exc}")
        if report.cases % transport_every == 0:
            _check_http(receiver.http_port, body, json_encoding, report)
            if not json_encoding:
                _check_grpc(grpc_export, body, report)
        if time.monotonic() - started > HANG_S:
            report.crash(body, f"hang: {time.monotonic() - started:.1f}s")

    try:
        run_cases(cases, strategy, check)
    finally:
        channel.close()
    return report


def _check_http(port: int, body: bytes, json_encoding: bool, report: FuzzReport) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_S)
    content_type = "application/json" if json_encoding else "application/x-protobuf"
    try:
        connection.request("POST", "/v1/traces", body=body, headers={"Content-Type": content_type})
        answer = connection.getresponse()
        data = answer.read()
    except Exception as exc:  # noqa: BLE001
        report.crash(body, f"HTTP: no answer ({exc!r})")
        return
    finally:
        connection.close()
    if answer.status == 200:
        return
    if answer.status >= 500:
        report.server_errors += 1
    if answer.status != 400:
        report.crash(body, f"HTTP {answer.status} (expected 200 or 400)")
        return
    try:
        message = (json.loads(data).get("message") if json_encoding else status_pb2.Status.FromString(data).message)
    except Exception:  # noqa: BLE001
        message = None
    if not message:
        report.crash(body, "HTTP 400 without a google.rpc.Status message")


def _check_grpc(export, body: bytes, report: FuzzReport) -> None:
    try:
        problem = _check_export_response(export(body, timeout=HANG_S))
        if problem:
            report.crash(body, f"gRPC: {problem}")
    except grpc.RpcError as exc:
        if exc.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
            report.server_errors += 1
        if exc.code() != grpc.StatusCode.INVALID_ARGUMENT or not exc.details():
            report.crash(body, f"gRPC {exc.code().name}: {exc.details()}")
