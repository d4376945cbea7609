"""What makes an OTLP span usable by spanrl, and how its attribute values read as Python.

``span_problem`` checks one decoded span (ids present and well formed, times the store can hold,
spanrl's own attributes of the right type, nested values that parse) and words the reason a bad
span is rejected; ``otlp_decode`` calls it for every span the C scanner did not accept.
``any_value_to_python`` turns an OTLP ``AnyValue`` into a plain value for the readers of the store.
"""

from __future__ import annotations

import re

from google.protobuf.message import DecodeError
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValueList

from spanrl.instrumentation import semconv
from spanrl.instrumentation.packed_values import PackedValueError, unpack_logprobs, unpack_token_ids

# Keys copied from the resource onto a span that lacks them (one process per rollout may set
# them through OTEL_RESOURCE_ATTRIBUTES).
RESOURCE_FALLBACK_KEYS = (*semconv.ROLLOUT_IDENTITY_KEYS, semconv.AGENT_NAME)
# Span times are fixed64 on the wire but the store's integers are signed 64-bit.
MAX_TIME_NS = 2**63 - 1
_ZERO_TRACE_ID = bytes(16)
_ZERO_SPAN_ID = bytes(8)
_RAW_KINDS = ("array_value", "kvlist_value")  # kept as raw bytes by the shadow schema
# Serialized ArrayValue whose elements are all AnyValue{int_value >= 0}: each element is
# 0x0a LEN 0x18 VARINT with LEN = 1 + the varint's length (a negative int64 takes 10 bytes).
_NON_NEGATIVE_INT_ARRAY = re.compile(
    b"(?:"
    + b"|".join(
        b"\x0a" + bytes([k + 1]) + b"\x18" + b"[\x80-\xff]" * (k - 1) + b"[\x00-\x7f]" for k in range(1, 10)
    )
    + b")*",
    re.DOTALL,
)
# ... and all AnyValue{double_value}: 0x0a 0x09 0x21 + 8 bytes.
_DOUBLE_ARRAY = re.compile(b"(?:\x0a\x09\x21.{8})*", re.DOTALL)
_RESPONSE_KEY = re.compile(
    re.escape(semconv.LLM_RESPONSE_PREFIX) + r"(\d+)(" + re.escape(semconv.LLM_RESPONSE_TOKEN_IDS_SUFFIX)
    + "|" + re.escape(semconv.LLM_RESPONSE_LOGPROBS_SUFFIX) + r")$"
)


def span_problem(span, identity: dict | None = None) -> str | None:
    """Why ``span`` cannot be used, or None when it can. Fills ``identity`` (key -> value) with
    the span's rollout identity attributes on the way (one pass over the attributes)."""
    trace_id, span_id, parent_id = span.trace_id, span.span_id, span.parent_span_id
    if len(trace_id) != 16 or trace_id == _ZERO_TRACE_ID:
        return "trace_id must be 16 bytes and not all zero"
    if len(span_id) != 8 or span_id == _ZERO_SPAN_ID:
        return "span_id must be 8 bytes and not all zero"
    if parent_id and len(parent_id) != 8:
        return "parent_span_id must be empty or 8 bytes"
    for field_name in ("start_time_unix_nano", "end_time_unix_nano"):
        time_ns = getattr(span, field_name)
        if time_ns > MAX_TIME_NS:
            return (f"{field_name} {time_ns} is 2^63 ns or more (after the year 2262): not a time the"
                    " store can hold (SQLite integers are signed 64-bit)")
    for kv in span.attributes:
        key = kv.key
        if key.startswith(semconv.NAMESPACE_PREFIX):
            value = kv.value
            problem = attribute_problem(key, value)
            if problem is not None:
                return problem
            if identity is not None and key in RESOURCE_FALLBACK_KEYS:
                identity[key] = value
        elif kv.value.WhichOneof("value") in _RAW_KINDS:
            problem = _nested_problem(key, kv.value)
            if problem is not None:
                return problem
    return None


def _nested_problem(key: str, value) -> str | None:
    """Arrays and key-value lists stay raw bytes in the shadow schema: check they parse."""
    kind = value.WhichOneof("value")
    try:
        if kind == "array_value":
            ArrayValue.FromString(value.array_value)
        elif kind == "kvlist_value":
            KeyValueList.FromString(value.kvlist_value)
    except DecodeError as exc:
        return f"attribute {key} holds a malformed {kind}: {exc}"
    return None


def attribute_problem(key: str, value) -> str | None:
    """Type check of one spanrl attribute; None when fine or when the key is not typed."""
    if key in semconv.ROLLOUT_IDENTITY_KEYS:
        return _identity_problem(key, value)
    if key == semconv.LLM_PROMPT_TOKEN_IDS:
        return _token_ids_problem(key, value)
    if key.startswith(semconv.LLM_RESPONSE_PREFIX):
        match = _RESPONSE_KEY.match(key)
        if match is None:
            return _nested_problem(key, value)
        if match.group(2) == semconv.LLM_RESPONSE_TOKEN_IDS_SUFFIX:
            return _token_ids_problem(key, value)
        return _logprobs_problem(key, value)
    if key == semconv.LLM_POLICY_VERSION:
        return None if value.WhichOneof("value") == "int_value" else f"{key} must be an int, got {_kind(value)}"
    if key == semconv.LLM_RETOKENIZED:
        return None if value.WhichOneof("value") == "bool_value" else f"{key} must be a bool, got {_kind(value)}"
    return _nested_problem(key, value)


def _identity_problem(key: str, value) -> str | None:
    kind = value.WhichOneof("value")
    if key == semconv.ATTEMPT:
        return None if kind == "int_value" else f"{key} must be an int, got {_kind(value)}"
    return None if kind == "string_value" else f"{key} must be a string, got {_kind(value)}"


def _array(key: str, value, expected: str) -> tuple[ArrayValue | None, str | None]:
    if value.WhichOneof("value") != "array_value":
        return None, f"{key} must be an array of {expected} or the packed string of them, got {_kind(value)}"
    try:
        return ArrayValue.FromString(value.array_value), None
    except DecodeError as exc:
        return None, f"{key} holds a malformed array: {exc}"


def _packed_problem(key: str, value, unpack) -> str | None:
    """The packed form (packed_values.py): a string of base64 whole values."""
    try:
        unpack(value.string_value)
    except PackedValueError as exc:
        return f"{key}: {exc}"
    return None


def _token_ids_problem(key: str, value) -> str | None:
    if value.WhichOneof("value") == "array_value" and _NON_NEGATIVE_INT_ARRAY.fullmatch(value.array_value):
        return None  # the fast path: every element is a non-negative int
    if value.WhichOneof("value") == "string_value":
        return _packed_problem(key, value, unpack_token_ids)
    array, problem = _array(key, value, "non-negative ints")
    if array is None:
        return problem
    values = array.values
    kinds = {v.WhichOneof("value") for v in values}
    if kinds - {"int_value"}:
        wrong = sorted(k or "empty" for k in kinds - {"int_value"})
        return f"{key} must be an array of non-negative ints, got {', '.join(wrong)} elements"
    if values and min(v.int_value for v in values) < 0:
        return f"{key} must be an array of non-negative ints, got a negative id"
    return None


def _logprobs_problem(key: str, value) -> str | None:
    if value.WhichOneof("value") == "array_value" and _DOUBLE_ARRAY.fullmatch(value.array_value):
        return None
    if value.WhichOneof("value") == "string_value":
        return _packed_problem(key, value, unpack_logprobs)
    array, problem = _array(key, value, "doubles")
    if array is None:
        return problem
    kinds = {v.WhichOneof("value") for v in array.values}
    if kinds - {"double_value", "int_value"}:
        return f"{key} must be an array of doubles, got {', '.join(sorted(k or 'empty' for k in kinds))} elements"
    return None


def _kind(value) -> str:
    kind = value.WhichOneof("value")
    return kind.removesuffix("_value") if kind else "an empty value"


# AnyValue kinds whose field is the Python value itself (also span_tree's shadow AnyValue)
SCALAR_KINDS = frozenset(("string_value", "int_value", "double_value", "bool_value", "bytes_value"))


def any_value_to_python(value: AnyValue):
    """An OTLP AnyValue as a plain Python value (arrays as lists, kvlists as dicts)."""
    kind = value.WhichOneof("value")
    if kind in SCALAR_KINDS:
        return getattr(value, kind)
    if kind == "array_value":
        return [any_value_to_python(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value_to_python(kv.value) for kv in value.kvlist_value.values}
    return None
