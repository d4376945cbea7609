"""OTLP trace payloads -> validated span rows ready for the store.

Called by the gRPC and HTTP services for every Export request. Parses protobuf or the OTLP
JSON encoding, checks each span on its own (ids present and well formed, spanrl attributes of
the right type) and turns the usable ones into ``SpanRow``s: the serialized span plus the few
columns the store indexes. A bad span is rejected with a reason; the good spans of the same
request are kept. Rollout identity missing on a span is copied from its resource.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from spanrl.instrumentation import semconv

# Keys copied from the resource onto a span that lacks them (one process per rollout may set
# them through OTEL_RESOURCE_ATTRIBUTES).
RESOURCE_FALLBACK_KEYS = (*semconv.ROLLOUT_IDENTITY_KEYS, semconv.AGENT_NAME)
MAX_REASONS_IN_MESSAGE = 5
_RESPONSE_KEY = re.compile(
    re.escape(semconv.LLM_RESPONSE_PREFIX) + r"(\d+)(" + re.escape(semconv.LLM_RESPONSE_TOKEN_IDS_SUFFIX)
    + "|" + re.escape(semconv.LLM_RESPONSE_LOGPROBS_SUFFIX) + r")$"
)


class PayloadError(ValueError):
    """The request body is not an OTLP message at all (answered INVALID_ARGUMENT / 400)."""


@dataclass(slots=True)
class SpanRow:
    """One accepted span as the store keeps it."""

    trace_id: bytes
    span_id: bytes
    rollout_id: str | None
    task_id: str | None
    attempt: int | None
    name: str
    start_ns: int
    body: bytes  # serialized opentelemetry.proto.trace.v1.Span (identity already resolved)

    @property
    def is_rollout_root(self) -> bool:
        return self.name == semconv.ROLLOUT_SPAN_NAME


@dataclass(slots=True)
class DecodedRequest:
    rows: list[SpanRow]
    rejected: int
    reasons: list[str]

    def response(self) -> ExportTraceServiceResponse:
        """The Export response: ``partial_success`` left unset when every span was accepted."""
        response = ExportTraceServiceResponse()
        if self.rejected:
            response.partial_success.rejected_spans = self.rejected
            response.partial_success.error_message = self.error_message()
        return response

    def error_message(self) -> str:
        shown = "; ".join(self.reasons[:MAX_REASONS_IN_MESSAGE])
        more = len(self.reasons) - MAX_REASONS_IN_MESSAGE
        suffix = f"; and {more} more" if more > 0 else ""
        return f"rejected {self.rejected} span(s): {shown}{suffix}"


def parse_protobuf_request(body: bytes) -> ExportTraceServiceRequest:
    try:
        return ExportTraceServiceRequest.FromString(body)
    except DecodeError as exc:
        raise PayloadError(f"body is not a valid ExportTraceServiceRequest protobuf: {exc}") from exc


def parse_json_request(body: bytes, message_type=ExportTraceServiceRequest):
    """Parse the OTLP/JSON encoding: ids are hex strings, not base64 as in proto3 JSON."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PayloadError(f"body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise PayloadError("body must be a JSON object (an OTLP Export request)")
    if message_type is ExportTraceServiceRequest:
        _hex_ids_to_base64(data)
    try:
        return json_format.ParseDict(data, message_type(), ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise PayloadError(f"body is not a valid OTLP/JSON {message_type.__name__}: {exc}") from exc


def _hex_ids_to_base64(data: dict) -> None:
    for resource_spans in _list(data, "resourceSpans", "resource_spans"):
        for scope_spans in _list(resource_spans, "scopeSpans", "scope_spans"):
            for span in _list(scope_spans, "spans"):
                _convert_ids(span)
                for link in _list(span, "links"):
                    _convert_ids(link)


def _list(obj, *keys) -> list:
    if not isinstance(obj, dict):
        return []
    for key in keys:
        value = obj.get(key)
        if isinstance(value, list):
            return value
    return []


def _convert_ids(obj) -> None:
    if not isinstance(obj, dict):
        return
    for key in ("traceId", "trace_id", "spanId", "span_id", "parentSpanId", "parent_span_id"):
        value = obj.get(key)
        if isinstance(value, str):
            try:
                raw = bytes.fromhex(value)
            except ValueError:
                # Not hex: leave something that fails the id check with a clear message.
                raw = b"\x00invalid-hex"
            obj[key] = base64.b64encode(raw).decode("ascii")


def decode_request(request: ExportTraceServiceRequest, max_reasons: int = 50) -> DecodedRequest:
    """Validate every span of ``request``; return the rows to store and the rejections."""
    rows: list[SpanRow] = []
    reasons: list[str] = []
    rejected = 0
    for resource_spans in request.resource_spans:
        fallback = {
            kv.key: kv.value
            for kv in resource_spans.resource.attributes
            if kv.key in RESOURCE_FALLBACK_KEYS
        }
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                problem = span_problem(span)
                if problem is None and fallback:
                    problem = _apply_resource_fallback(span, fallback)
                if problem is not None:
                    rejected += 1
                    if len(reasons) < max_reasons:
                        reasons.append(f"span {span.span_id.hex() or '?'} ({span.name!r}): {problem}")
                    continue
                rows.append(_row(span))
    return DecodedRequest(rows, rejected, reasons)


def _apply_resource_fallback(span, fallback: dict[str, AnyValue]) -> str | None:
    present = {kv.key for kv in span.attributes if kv.key in RESOURCE_FALLBACK_KEYS}
    for key, value in fallback.items():
        if key not in present:
            problem = _identity_problem(key, value)
            if problem is not None:
                return f"resource {problem}"
            span.attributes.add(key=key).value.CopyFrom(value)
    return None


def _row(span) -> SpanRow:
    rollout_id = task_id = attempt = None
    for kv in span.attributes:
        key = kv.key
        if key == semconv.ROLLOUT_ID:
            rollout_id = kv.value.string_value
        elif key == semconv.TASK_ID:
            task_id = kv.value.string_value
        elif key == semconv.ATTEMPT:
            attempt = kv.value.int_value
    return SpanRow(
        trace_id=span.trace_id,
        span_id=span.span_id,
        rollout_id=rollout_id or None,
        task_id=task_id,
        attempt=attempt,
        name=span.name,
        start_ns=span.start_time_unix_nano,
        body=span.SerializeToString(),
    )


def span_problem(span) -> str | None:
    """Why ``span`` cannot be used, or None when it can."""
    if len(span.trace_id) != 16 or not any(span.trace_id):
        return "trace_id must be 16 bytes and not all zero"
    if len(span.span_id) != 8 or not any(span.span_id):
        return "span_id must be 8 bytes and not all zero"
    if span.parent_span_id and len(span.parent_span_id) != 8:
        return "parent_span_id must be empty or 8 bytes"
    for kv in span.attributes:
        key = kv.key
        if key.startswith("spanrl."):
            problem = attribute_problem(key, kv.value)
            if problem is not None:
                return problem
    return None


def attribute_problem(key: str, value: AnyValue) -> str | None:
    """Type check of one spanrl attribute; None when fine or when the key is not typed."""
    if key in semconv.ROLLOUT_IDENTITY_KEYS:
        return _identity_problem(key, value)
    if key == semconv.LLM_PROMPT_TOKEN_IDS:
        return _token_ids_problem(key, value)
    if key.startswith(semconv.LLM_RESPONSE_PREFIX):
        match = _RESPONSE_KEY.match(key)
        if match is None:
            return None
        if match.group(2) == semconv.LLM_RESPONSE_TOKEN_IDS_SUFFIX:
            return _token_ids_problem(key, value)
        return _logprobs_problem(key, value)
    if key == semconv.LLM_POLICY_VERSION:
        return None if value.WhichOneof("value") == "int_value" else f"{key} must be an int, got {_kind(value)}"
    if key == semconv.LLM_RETOKENIZED:
        return None if value.WhichOneof("value") == "bool_value" else f"{key} must be a bool, got {_kind(value)}"
    return None


def _identity_problem(key: str, value: AnyValue) -> str | None:
    kind = value.WhichOneof("value")
    if key == semconv.ATTEMPT:
        return None if kind == "int_value" else f"{key} must be an int, got {_kind(value)}"
    return None if kind == "string_value" else f"{key} must be a string, got {_kind(value)}"


def _token_ids_problem(key: str, value: AnyValue) -> str | None:
    if value.WhichOneof("value") != "array_value":
        return f"{key} must be an array of non-negative ints, got {_kind(value)}"
    values = value.array_value.values
    kinds = {v.WhichOneof("value") for v in values}
    if kinds - {"int_value"}:
        wrong = sorted(k or "empty" for k in kinds - {"int_value"})
        return f"{key} must be an array of non-negative ints, got {', '.join(wrong)} elements"
    if values and min(v.int_value for v in values) < 0:
        return f"{key} must be an array of non-negative ints, got a negative id"
    return None


def _logprobs_problem(key: str, value: AnyValue) -> str | None:
    if value.WhichOneof("value") != "array_value":
        return f"{key} must be an array of doubles, got {_kind(value)}"
    kinds = {v.WhichOneof("value") for v in value.array_value.values}
    if kinds - {"double_value", "int_value"}:
        return f"{key} must be an array of doubles, got {', '.join(sorted(k or 'empty' for k in kinds))} elements"
    return None


def _kind(value: AnyValue) -> str:
    kind = value.WhichOneof("value")
    return kind.removesuffix("_value") if kind else "an empty value"


def any_value_to_python(value: AnyValue):
    """An OTLP AnyValue as a plain Python value (arrays as lists, kvlists as dicts)."""
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "int_value":
        return value.int_value
    if kind == "double_value":
        return value.double_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "array_value":
        return [any_value_to_python(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value_to_python(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return value.bytes_value
    return None


