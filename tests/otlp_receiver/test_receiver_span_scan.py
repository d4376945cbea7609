"""The C span scanner agrees with the exact Python validator.

``_span_scan.scan_span`` may only accept a span that the Python path (``span_problem``) accepts,
and must read the same columns from it; on anything else it must answer None. Checked on
hand-made edge cases and on thousands of byte-level mutations of real spans.
"""

from __future__ import annotations

import random

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from spanrl.instrumentation import semconv
from spanrl.instrumentation.packed_values import pack_logprobs, pack_token_ids
from spanrl.otlp_receiver import otlp_decode
from spanrl.otlp_receiver.otlp_decode import decode_payload
from spanrl.otlp_receiver.otlp_shadow import ShadowExportRequest


def test_native_scanner_is_built():
    # CI installs with a C compiler; a missing scanner there is a packaging bug, not a skip.
    assert otlp_decode.NATIVE_SCANNER, "spanrl.otlp_receiver._span_scan was not built (pip install -e . with gcc)"


def _kv(key, value) -> KeyValue:
    kv = KeyValue(key=key)
    if isinstance(value, AnyValue):
        kv.value.CopyFrom(value)
    elif isinstance(value, bool):
        kv.value.bool_value = value
    elif isinstance(value, int):
        kv.value.int_value = value
    elif isinstance(value, float):
        kv.value.double_value = value
    elif isinstance(value, str):
        kv.value.string_value = value
    elif isinstance(value, bytes):
        kv.value.bytes_value = value
    elif isinstance(value, dict):
        kv.value.kvlist_value.SetInParent()
        kv.value.kvlist_value.values.extend(_kv(k, v) for k, v in value.items())
    elif isinstance(value, list):
        kv.value.array_value.SetInParent()
        kv.value.array_value.values.extend(_kv("", v).value for v in value)
    return kv


def _span(n: int, attributes: dict, **fields) -> Span:
    span = Span(trace_id=b"\x07" * 16, span_id=n.to_bytes(8, "big"), parent_span_id=b"\x01" * 8,
                name=f"span {n} ✓", start_time_unix_nano=1_700_000_000_000_000_000 + n,
                end_time_unix_nano=1_700_000_000_000_000_500 + n, **fields)
    span.attributes.extend(_kv(k, v) for k, v in attributes.items())
    return span


def _identity(rollout="r-1", task="t-1", attempt=0) -> dict:
    return {semconv.ROLLOUT_ID: rollout, semconv.TASK_ID: task, semconv.ATTEMPT: attempt}


def edge_case_spans() -> list[bytes]:
    """Spans that probe each rule: some valid, some not; both paths must agree on each."""
    rng = random.Random(7)
    ids = [rng.randrange(0, 150_000) for _ in range(300)]
    cases: list[dict] = [
        {**_identity(), semconv.LLM_PROMPT_TOKEN_IDS: ids, semconv.llm_response_token_ids(0): ids[:40],
         semconv.llm_response_logprobs(0): [-0.5] * 40, semconv.LLM_POLICY_VERSION: 3,
         semconv.LLM_RETOKENIZED: False, "llm.input_messages.0.message.content": "Привет, 世界 🚀" * 20},
        {**_identity(), semconv.LLM_PROMPT_TOKEN_IDS: [0, 127, 128, 16383, 16384, 2**63 - 1]},
        {**_identity(), semconv.LLM_PROMPT_TOKEN_IDS: pack_token_ids(ids),  # what spanrl's instrumentation writes
         semconv.llm_response_token_ids(0): pack_token_ids(ids[:40]),
         semconv.llm_response_logprobs(0): pack_logprobs([-0.5] * 40)},
        {**_identity(), semconv.LLM_PROMPT_TOKEN_IDS: "", semconv.llm_response_logprobs(3): ""},
        {**_identity(), semconv.LLM_PROMPT_TOKEN_IDS: "AB=="},  # one byte: not a whole id
        {**_identity(), semconv.LLM_PROMPT_TOKEN_IDS: "AQAAAA"},  # unpadded
        {**_identity(), semconv.LLM_PROMPT_TOKEN_IDS: "AQ==AAAA"},  # padding inside
        {**_identity(), semconv.LLM_PROMPT_TOKEN_IDS: "AQAA AAA"},
        {**_identity(), semconv.llm_response_logprobs(0): pack_token_ids([7])},  # 4 bytes: not a double
        {**_identity(), semconv.llm_response_token_ids(0): pack_logprobs([-1.0])},  # 8 bytes: two ids
        {**_identity(), semconv.LLM_PROMPT_TOKEN_IDS: [5, -1]},
        {**_identity(), semconv.LLM_PROMPT_TOKEN_IDS: ["7"]},
        {**_identity(), semconv.LLM_PROMPT_TOKEN_IDS: [1.5]},
        {**_identity(), semconv.LLM_PROMPT_TOKEN_IDS: []},
        {**_identity(), semconv.LLM_PROMPT_TOKEN_IDS: "1 2 3"},
        {**_identity(), semconv.llm_response_token_ids(12): [1, 2]},
        {**_identity(), semconv.llm_response_token_ids(0): [1, -2]},
        {**_identity(), semconv.llm_response_logprobs(0): [-1, 0, -0.25]},
        {**_identity(), semconv.llm_response_logprobs(0): ["-0.5"]},
        {**_identity(), "spanrl.llm.response.٣.token_ids": ["unicode digit"]},
        {**_identity(), "spanrl.llm.response.0.token_ids\n": ["trailing newline"]},
        {**_identity(), "spanrl.llm.response.0.text": "fine"},
        {**_identity(), semconv.LLM_POLICY_VERSION: "3"},
        {**_identity(), semconv.LLM_RETOKENIZED: 1},
        {**_identity(attempt="0")},
        {**_identity(rollout=5)},
        {semconv.ROLLOUT_ID: "", semconv.TASK_ID: ""},
        {semconv.AGENT_NAME: "planner", semconv.variable("answer"): 42, semconv.variable("passages"): ["a", "b"]},
        {"tag.tags": ["x", 1, 2.5, True, b"\x00", {"k": ["v"]}], "llm.tools": {"a": {"b": {"c": [1]}}}},
        {"gen_ai.response.finish_reasons": ["stop"], semconv.ATTEMPT: -3},
        {},
    ]
    spans = [_span(i + 1, attributes) for i, attributes in enumerate(cases)]
    event = Span.Event(time_unix_nano=5, name=semconv.REWARD_EVENT,
                       attributes=[_kv(semconv.REWARD_VALUE, 1.0), _kv("nested", {"k": [1, "x"]})])
    link = Span.Link(trace_id=b"\x02" * 16, span_id=b"\x03" * 8, trace_state="a=b", attributes=[_kv("l", 1)])
    spans.append(_span(100, _identity(), events=[event], links=[link],
                       status=Status(code=Status.STATUS_CODE_ERROR, message="boom"), trace_state="k=v", flags=1))
    spans.append(_span(101, _identity(), dropped_attributes_count=2, dropped_events_count=1,
                       kind=Span.SPAN_KIND_CLIENT))
    spans.append(Span(trace_id=bytes(16), span_id=b"\x01" * 8))  # zero trace id
    spans.append(Span(trace_id=b"\x01" * 16, span_id=b"\x01" * 7))  # short span id
    spans.append(Span(trace_id=b"\x01" * 16, span_id=b"\x01" * 8, parent_span_id=b"\x01" * 3))
    raw = [span.SerializeToString() for span in spans]
    later = _kv(semconv.ROLLOUT_ID, "later").SerializeToString()  # the same key again, as field 9
    raw.append(_span(102, _identity()).SerializeToString() + b"\x4a" + bytes([len(later)]) + later)
    raw.append(_span(103, {"bad utf8": "x"}).SerializeToString().replace(b"span 103", b"span \xff03"))
    raw.append(_span(104, {"x": 1}).SerializeToString() + b"\x88\x01\x05")  # unknown field 17, varint
    raw.append(_span(105, {"x": 1}).SerializeToString() + b"\x0b")  # a group start: not supported
    return raw


def mutated_spans(seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    edge_cases = edge_case_spans()
    bases = edge_cases[:3] + [_span(200, {**_identity(), "k": {"a": [1, "b"]}}).SerializeToString()]
    out = []
    for _ in range(count):
        data = bytearray(rng.choice(bases))
        for _ in range(rng.randrange(1, 4)):
            op = rng.random()
            pos = rng.randrange(len(data))
            if op < 0.5:
                data[pos] = rng.randrange(256)
            elif op < 0.7:
                del data[pos]
            elif op < 0.9:
                data.insert(pos, rng.randrange(256))
            else:
                del data[pos:]
            if not data:
                data.append(0)
        out.append(bytes(data))
    return out


def _request(raw_spans: list[bytes], resource: Resource | None = None) -> bytes:
    shadow = ShadowExportRequest.FromString(ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(resource=resource, scope_spans=[ScopeSpans()])]
    ).SerializeToString())
    shadow.resource_spans[0].scope_spans[0].spans.extend(raw_spans)
    return shadow.SerializeToString()


def _both_paths_agree(raw_spans: list[bytes], resource: Resource | None = None):
    body = _request(raw_spans, resource)
    fast, exact = decode_payload(body, native=True), decode_payload(body, native=False)
    assert fast.rows == exact.rows
    assert (fast.rejected, fast.reasons) == (exact.rejected, exact.reasons)
    return fast, exact


def test_scanner_agrees_with_the_exact_path_on_edge_cases():
    raw = edge_case_spans()
    fast, exact = _both_paths_agree(raw)
    scanned = [otlp_decode._span_scan.scan_span(r) for r in raw]
    # the scanner did the work for the valid spans, not just handed everything to Python
    assert sum(s is not None for s in scanned) >= 8
    assert scanned[2] is not None and scanned[3] is not None  # packed ids and logprobs, and empty ones
    assert 0 < exact.rejected < len(raw)
    first = fast.rows[0]
    assert (first.rollout_id, first.task_id, first.attempt, first.name) == ("r-1", "t-1", 0, "span 1 ✓")
    by_id = {int.from_bytes(r.span_id, "big"): r for r in fast.rows}
    assert by_id[102].rollout_id == "later"  # a repeated attribute: the last one counts, on both paths
    assert by_id[30].attempt == -3


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_scanner_never_accepts_a_span_the_exact_path_rejects(seed):
    raw = mutated_spans(seed, 1500)
    _both_paths_agree(raw)
    accepted_by_scanner = [r for r in raw if otlp_decode._span_scan.scan_span(r) is not None]
    exact = decode_payload(_request(accepted_by_scanner), native=False)
    assert exact.rejected == 0, exact.error_message()


def test_resource_identity_is_appended_on_both_paths():
    resource = Resource(attributes=[_kv(semconv.ROLLOUT_ID, "from-resource"), _kv(semconv.ATTEMPT, "4"),
                                    _kv(semconv.AGENT_NAME, "solver")])
    raw = [_span(1, {semconv.ROLLOUT_ID: "own"}).SerializeToString(), _span(2, {"x": 1}).SerializeToString()]
    fast, _ = _both_paths_agree(raw, resource)
    assert [(r.rollout_id, r.attempt) for r in fast.rows] == [("own", 4), ("from-resource", 4)]
    stored = {kv.key: kv.value for kv in Span.FromString(fast.rows[1].body).attributes}
    assert stored[semconv.AGENT_NAME].string_value == "solver"
    bad = Resource(attributes=[_kv(semconv.ATTEMPT, "zero")])
    fast, _ = _both_paths_agree(raw, bad)
    assert fast.rejected == 2 and "resource spanrl.attempt must be an int" in fast.error_message()


def test_nested_values_deeper_than_the_scanner_goes_are_left_to_the_exact_path():
    value = AnyValue(int_value=1)
    for _ in range(40):
        wrapped = AnyValue()
        wrapped.array_value.values.append(value)
        value = wrapped
    raw = _span(1, {**_identity(), "deep": value}).SerializeToString()
    assert otlp_decode._span_scan.scan_span(raw) is None
    fast, _ = _both_paths_agree([raw])
    assert len(fast.rows) == 1

