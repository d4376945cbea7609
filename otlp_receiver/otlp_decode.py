"""OTLP trace payloads -> validated span rows ready for the store.

Called by the gRPC and HTTP services for every Export request. Parses protobuf or the OTLP
JSON encoding, checks each span on its own (ids present and well formed, spanrl attributes of
the right type) and turns the usable ones into ``SpanRow``s: the span's bytes as they came (read
through the wire-compatible schema of ``otlp_shadow``) plus the few columns the store indexes.
A bad span is rejected with a reason; the good spans of the same request are kept. Rollout
identity missing on a span is copied from its resource.

Two paths, one result: the C scanner ``_span_scan`` (built at install when a compiler is
there) accepts the spans it can prove valid in one pass over their bytes; every other span,
and every span when the scanner is not built, goes through the exact Python checks of
``span_checks`` (``span_problem``), which also word the rejections.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.otlp_shadow import ShadowExportRequest, ShadowSpan
from spanrl.otlp_receiver.span_checks import RESOURCE_FALLBACK_KEYS, attribute_problem, span_problem

try:  # optional C accelerator (otlp_receiver/_span_scan.c); the Python path gives the same result
    from spanrl.otlp_receiver import _span_scan  # type: ignore[attr-defined]  # C, no stub
except ImportError:  # pragma: no cover - depends on the install having had a C compiler
    _span_scan = None

NATIVE_SCANNER = _span_scan is not None

MAX_REASONS_IN_MESSAGE = 5
_ATTRIBUTE_TAG = b"\x4a"  # Span field 9 (attributes), wire type 2


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

    def refuse(self, refused, max_reasons: int = 50) -> None:
        """Move rows the store refused (``store.RejectedSpan``: index into ``rows``, reason)
        from the accepted rows to the rejected ones."""
        by_index = {item.index: item.reason for item in refused}
        kept: list[SpanRow] = []
        for index, row in enumerate(self.rows):
            reason = by_index.get(index)
            if reason is None:
                kept.append(row)
                continue
            self.rejected += 1
            if len(self.reasons) < max_reasons:
                self.reasons.append(f"span {row.span_id.hex()} ({row.name!r}): {reason}")
        self.rows = kept

    def error_message(self) -> str:
        shown = "; ".join(self.reasons[:MAX_REASONS_IN_MESSAGE])
        more = len(self.reasons) - MAX_REASONS_IN_MESSAGE
        suffix = f"; and {more} more" if more > 0 else ""
        return f"rejected {self.rejected} span(s): {shown}{suffix}"


def parse_json_request(body: bytes, message_type=ExportTraceServiceRequest):
    """Parse the OTLP/JSON encoding: ids are hex strings, not base64 as in proto3 JSON."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PayloadError(f"body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # nested deeper than Python recurses: the client's doing, a 400
        raise PayloadError("body is nested too deeply to be an OTLP request") from exc
    if not isinstance(data, dict):
        raise PayloadError("body must be a JSON object (an OTLP Export request)")
    if message_type is ExportTraceServiceRequest:
        _hex_ids_to_base64(data)
    elif message_type.__name__ == "ExportLogsServiceRequest":  # log records link to spans by hex ids too
        for resource_logs in _list(data, "resourceLogs", "resource_logs"):
            for scope_logs in _list(resource_logs, "scopeLogs", "scope_logs"):
                for record in _list(scope_logs, "logRecords", "log_records"):
                    _convert_ids(record)
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


def decode_request(request: ExportTraceServiceRequest) -> DecodedRequest:
    """``decode_payload`` of an already parsed request (tests, JSON)."""
    return decode_payload(request.SerializeToString())


def decode_payload(body: bytes, max_reasons: int = 50, native: bool = True) -> DecodedRequest:
    """Validate every span of a protobuf Export request; return the rows to store and the
    rejections. Spans are kept as the bytes that came (see ``otlp_shadow``).

    ``native=False`` skips the C scanner (tests compare both paths)."""
    try:
        request = ShadowExportRequest.FromString(body)
    except DecodeError as exc:
        raise PayloadError(f"body is not a valid ExportTraceServiceRequest protobuf: {exc}") from exc
    scan = _span_scan.scan_span if native and _span_scan is not None else None
    rows: list[SpanRow] = []
    reasons: list[str] = []
    rejected = 0
    for resource_spans in request.resource_spans:
        fallback = [
            _resource_identity_value(kv)
            for kv in resource_spans.resource.attributes if kv.key in RESOURCE_FALLBACK_KEYS
        ]
        fallback_problem = next(
            (f"resource {p}" for kv in fallback if (p := attribute_problem(kv.key, kv.value))), None
        )
        identities = [_ResourceIdentity(kv) for kv in fallback]  # encoded once per resource
        # A resource with ill-typed identity rejects its spans: the exact path says so.
        fast = scan is not None and fallback_problem is None
        for scope_spans in resource_spans.scope_spans:
            for raw in scope_spans.spans:
                if fast and scan is not None:
                    scanned = scan(raw)
                    if scanned is not None:
                        rows.append(_row_from_scan(scanned, raw, identities))
                        continue
                problem: str | None
                try:
                    span = ShadowSpan.FromString(raw)
                except DecodeError as exc:
                    problem, span = f"not a valid protobuf Span: {exc}", None
                else:
                    identity: dict = {}
                    problem = span_problem(span, identity) or (fallback_problem if fallback else None)
                if problem is not None:
                    rejected += 1
                    if len(reasons) < max_reasons:
                        name = "?" if span is None else f"{span.span_id.hex() or '?'} ({span.name!r})"
                        reasons.append(f"span {name}: {problem}")
                    continue
                rows.append(_row(span, raw, identities, identity))
    return DecodedRequest(rows, rejected, reasons)


def _resource_identity_value(kv):
    """``OTEL_RESOURCE_ATTRIBUTES`` can only carry strings: a resource ``spanrl.attempt`` of
    digits is read as the int it names (on spans the contract's int type is required)."""
    if kv.key == semconv.ATTEMPT and kv.value.WhichOneof("value") == "string_value":
        text = kv.value.string_value.strip()
        if text.isdigit():
            converted = type(kv)()
            converted.key = kv.key
            converted.value.int_value = int(text)
            return converted
    return kv


class _ResourceIdentity:
    """One identity attribute of a resource, ready to append to spans that lack it: ``encoded``
    is the span field that adds it (a length-delimited field 9 appended to a span's bytes adds
    one attribute); ``any_value`` its AnyValue, ``value`` the Python value inside."""

    __slots__ = ("key", "present_bit", "encoded", "any_value", "value")

    def __init__(self, kv) -> None:
        self.key = kv.key
        self.present_bit = _PRESENT_BITS.get(kv.key, 0)
        encoded = kv.SerializeToString()
        self.encoded = _ATTRIBUTE_TAG + _varint(len(encoded)) + encoded
        self.any_value = kv.value
        kind = kv.value.WhichOneof("value")
        self.value = getattr(kv.value, kind) if kind else None


_PRESENT_BITS = (
    {
        semconv.ROLLOUT_ID: _span_scan.HAS_ROLLOUT_ID,
        semconv.TASK_ID: _span_scan.HAS_TASK_ID,
        semconv.ATTEMPT: _span_scan.HAS_ATTEMPT,
        semconv.AGENT_NAME: _span_scan.HAS_AGENT_NAME,
    }
    if _span_scan is not None
    else {}
)


def _row_from_scan(scanned: tuple, raw: bytes, fallback: list[_ResourceIdentity]) -> SpanRow:
    """A row from what ``_span_scan.scan_span`` read, with the resource's identity appended."""
    trace_id, span_id, name, start_ns, rollout, task, attempt, present = scanned
    for item in fallback:
        if not present & item.present_bit:
            raw += item.encoded
            present |= item.present_bit
            if item.key == semconv.ROLLOUT_ID:
                rollout = item.value
            elif item.key == semconv.TASK_ID:
                task = item.value
            elif item.key == semconv.ATTEMPT:
                attempt = item.value
    return SpanRow(trace_id, span_id, rollout or None, task, attempt, name, start_ns, raw)


def _row(span, raw: bytes, fallback: list[_ResourceIdentity], identity: dict) -> SpanRow:
    """``identity``: the span's own identity attributes (collected by ``span_problem``)."""
    for item in fallback:
        if item.key not in identity:
            raw += item.encoded
            identity[item.key] = item.any_value
    rollout = identity.get(semconv.ROLLOUT_ID)
    task = identity.get(semconv.TASK_ID)
    attempt = identity.get(semconv.ATTEMPT)
    return SpanRow(
        trace_id=span.trace_id,
        span_id=span.span_id,
        rollout_id=(rollout.string_value or None) if rollout is not None else None,
        task_id=task.string_value if task is not None else None,
        attempt=attempt.int_value if attempt is not None else None,
        name=span.name,
        start_ns=span.start_time_unix_nano,
        body=raw,
    )


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)
