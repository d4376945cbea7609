"""A wire-compatible "shadow" of the OTLP trace schema, for fast validation at ingest.

Used by ``otlp_decode.py``. It reads the same bytes as ``ExportTraceServiceRequest`` but
keeps each span as its raw bytes (stored as they came, never re-serialized) and each array or
key-value-list attribute value as raw bytes (a token-id array is then checked with one C-speed
regular expression instead of a Python loop over hundreds of AnyValue messages). Everything
else of a span is parsed with its real types (events, links and status use the real OTLP
messages), so malformed spans are still caught at ingest.

Field numbers are those of opentelemetry/proto/{trace,common,resource}/v1/*.proto.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from opentelemetry.proto.trace.v1 import trace_pb2

_F = descriptor_pb2.FieldDescriptorProto
_PACKAGE = "spanrl.otlp_shadow"


def _field(message, name, number, kind, label=_F.LABEL_OPTIONAL, type_name=None, oneof=None):
    field = message.field.add(name=name, number=number, type=kind, label=label)
    if type_name:
        field.type_name = type_name
    if oneof is not None:
        field.oneof_index = oneof
    return field


def _build_file() -> descriptor_pb2.FileDescriptorProto:
    f = descriptor_pb2.FileDescriptorProto(
        name="spanrl/otlp_shadow.proto", package=_PACKAGE, syntax="proto3",
        dependency=[trace_pb2.DESCRIPTOR.name],
    )
    any_value = f.message_type.add(name="AnyValue")
    any_value.oneof_decl.add(name="value")
    _field(any_value, "string_value", 1, _F.TYPE_STRING, oneof=0)
    _field(any_value, "bool_value", 2, _F.TYPE_BOOL, oneof=0)
    _field(any_value, "int_value", 3, _F.TYPE_INT64, oneof=0)
    _field(any_value, "double_value", 4, _F.TYPE_DOUBLE, oneof=0)
    _field(any_value, "array_value", 5, _F.TYPE_BYTES, oneof=0)  # raw ArrayValue bytes
    _field(any_value, "kvlist_value", 6, _F.TYPE_BYTES, oneof=0)  # raw KeyValueList bytes
    _field(any_value, "bytes_value", 7, _F.TYPE_BYTES, oneof=0)

    key_value = f.message_type.add(name="KeyValue")
    _field(key_value, "key", 1, _F.TYPE_STRING)
    _field(key_value, "value", 2, _F.TYPE_MESSAGE, type_name=f".{_PACKAGE}.AnyValue")

    repeated = _F.LABEL_REPEATED
    resource = f.message_type.add(name="Resource")
    _field(resource, "attributes", 1, _F.TYPE_MESSAGE, repeated, f".{_PACKAGE}.KeyValue")

    span = f.message_type.add(name="Span")
    _field(span, "trace_id", 1, _F.TYPE_BYTES)
    _field(span, "span_id", 2, _F.TYPE_BYTES)
    _field(span, "trace_state", 3, _F.TYPE_STRING)
    _field(span, "parent_span_id", 4, _F.TYPE_BYTES)
    _field(span, "name", 5, _F.TYPE_STRING)
    _field(span, "kind", 6, _F.TYPE_ENUM, type_name=".opentelemetry.proto.trace.v1.Span.SpanKind")
    _field(span, "start_time_unix_nano", 7, _F.TYPE_FIXED64)
    _field(span, "end_time_unix_nano", 8, _F.TYPE_FIXED64)
    _field(span, "attributes", 9, _F.TYPE_MESSAGE, repeated, f".{_PACKAGE}.KeyValue")
    _field(span, "events", 11, _F.TYPE_MESSAGE, repeated, ".opentelemetry.proto.trace.v1.Span.Event")
    _field(span, "links", 13, _F.TYPE_MESSAGE, repeated, ".opentelemetry.proto.trace.v1.Span.Link")
    _field(span, "status", 15, _F.TYPE_MESSAGE, type_name=".opentelemetry.proto.trace.v1.Status")

    scope_spans = f.message_type.add(name="ScopeSpans")
    _field(scope_spans, "spans", 2, _F.TYPE_BYTES, repeated)  # each span's raw bytes

    resource_spans = f.message_type.add(name="ResourceSpans")
    _field(resource_spans, "resource", 1, _F.TYPE_MESSAGE, type_name=f".{_PACKAGE}.Resource")
    _field(resource_spans, "scope_spans", 2, _F.TYPE_MESSAGE, repeated, f".{_PACKAGE}.ScopeSpans")

    request = f.message_type.add(name="ExportTraceServiceRequest")
    _field(request, "resource_spans", 1, _F.TYPE_MESSAGE, repeated, f".{_PACKAGE}.ResourceSpans")
    return f


def _load():
    pool = descriptor_pool.Default()
    try:
        file = pool.FindFileByName("spanrl/otlp_shadow.proto")
    except KeyError:
        file = pool.Add(_build_file())
        file = pool.FindFileByName("spanrl/otlp_shadow.proto")
    return {
        name: message_factory.GetMessageClass(file.message_types_by_name[name])
        for name in ("Span", "ExportTraceServiceRequest")
    }


_CLASSES = _load()
ShadowSpan = _CLASSES["Span"]
ShadowExportRequest = _CLASSES["ExportTraceServiceRequest"]
