"""Ingest validation: the fast (serialized-bytes) checks agree with the exact ones."""

from __future__ import annotations

import random

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.otlp_decode import decode_payload, decode_request


def span_with(n: int, key: str, value: AnyValue) -> Span:
    return Span(trace_id=b"\x01" * 16, span_id=n.to_bytes(8, "big"), name=f"s{n}",
                attributes=[KeyValue(key=key, value=value)])


def array(values) -> AnyValue:
    v = AnyValue()
    v.array_value.SetInParent()
    for x in values:
        element = v.array_value.values.add()
        if isinstance(x, str):
            element.string_value = x
        elif isinstance(x, float):
            element.double_value = x
        else:
            element.int_value = x
    return v


def test_token_id_checks_match_the_exact_rule():
    rng = random.Random(1)
    cases = [[], [0], [2**63 - 1], [-1], [5, -(2**63)], ["7"], [1.5], [0, 127, 128, 16383, 16384]]
    for _ in range(300):
        n = rng.randrange(1, 20)
        cases.append([rng.choice([rng.randrange(0, 2 ** rng.randrange(1, 63)), -rng.randrange(1, 99), "x"])
                      if rng.random() < 0.05 else rng.randrange(0, 2 ** rng.randrange(1, 63)) for _ in range(n)])
    spans = [span_with(i + 1, semconv.LLM_PROMPT_TOKEN_IDS, array(c)) for i, c in enumerate(cases)]
    decoded = decode_request(ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])]
    ))
    kept = {int.from_bytes(r.span_id, "big") - 1 for r in decoded.rows}
    expected = {i for i, c in enumerate(cases) if all(isinstance(x, int) and x >= 0 for x in c)}
    assert kept == expected
    assert decoded.rejected == len(cases) - len(expected)


def test_logprobs_accept_doubles_and_ints_only():
    spans = [
        span_with(1, semconv.llm_response_logprobs(0), array([-0.5, -1.25])),
        span_with(2, semconv.llm_response_logprobs(0), array([-1, 0])),
        span_with(3, semconv.llm_response_logprobs(0), array(["-0.5"])),
        span_with(4, semconv.LLM_POLICY_VERSION, AnyValue(string_value="3")),
    ]
    decoded = decode_request(ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])]
    ))
    assert [int.from_bytes(r.span_id, "big") for r in decoded.rows] == [1, 2]
    assert "policy_version must be an int, got string" in decoded.error_message()


def test_malformed_nested_value_rejects_only_that_span():
    good = span_with(1, "llm.tools", array(["a"])).SerializeToString()
    bad = span_with(2, "llm.tools", array(["b"])).SerializeToString()
    # corrupt the inner ArrayValue: a length prefix pointing past its end
    bad = bad.replace(b"\x0a\x03\x0a\x01b", b"\x0a\x09\x0a\x01b")
    scope = ScopeSpans()
    body = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[scope])]).SerializeToString()
    # rebuild with raw span bytes so the corruption survives
    from spanrl.otlp_receiver.otlp_shadow import ShadowExportRequest

    shadow = ShadowExportRequest.FromString(body)
    shadow.resource_spans[0].scope_spans[0].spans.extend([good, bad, b"\xff\xff\xff"])
    decoded = decode_payload(shadow.SerializeToString())
    assert [int.from_bytes(r.span_id, "big") for r in decoded.rows] == [1]
    assert decoded.rejected == 2
    assert "llm.tools holds a malformed array_value" in decoded.error_message()
    assert "not a valid protobuf Span" in decoded.error_message()


def test_resource_identity_is_appended_to_the_stored_span():
    resource = Resource(attributes=[
        KeyValue(key=semconv.ROLLOUT_ID, value=AnyValue(string_value="from-resource")),
        KeyValue(key=semconv.ATTEMPT, value=AnyValue(int_value=3)),
    ])
    own = span_with(1, semconv.ROLLOUT_ID, AnyValue(string_value="own"))
    plain = span_with(2, "x", AnyValue(int_value=1))
    decoded = decode_request(ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(resource=resource, scope_spans=[ScopeSpans(spans=[own, plain])])]
    ))
    first, second = decoded.rows
    assert (first.rollout_id, first.attempt) == ("own", 3)
    assert (second.rollout_id, second.attempt) == ("from-resource", 3)
    stored = {kv.key: kv.value for kv in Span.FromString(second.body).attributes}
    assert stored[semconv.ROLLOUT_ID].string_value == "from-resource" and stored["x"].int_value == 1
    # OTEL_RESOURCE_ATTRIBUTES carries only strings: digits are read as the int attempt
    env_resource = Resource(attributes=[KeyValue(key=semconv.ATTEMPT, value=AnyValue(string_value="2"))])
    (row,) = decode_request(ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(resource=env_resource, scope_spans=[ScopeSpans(spans=[plain])])]
    )).rows
    assert row.attempt == 2
    stored = {kv.key: kv.value for kv in Span.FromString(row.body).attributes}
    assert stored[semconv.ATTEMPT].int_value == 2
    bad_resource = Resource(attributes=[KeyValue(key=semconv.ATTEMPT, value=AnyValue(string_value="zero"))])
    decoded = decode_request(ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(resource=bad_resource, scope_spans=[ScopeSpans(spans=[plain])])]
    ))
    assert decoded.rejected == 1 and "resource spanrl.attempt must be an int" in decoded.error_message()
