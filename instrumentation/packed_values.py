"""Token ids and logprobs as one string attribute each: the packed form of docs/interfaces.md §3.

An array attribute costs the agent per element: the OpenTelemetry SDK checks each element's type
when it is set, and the exporter encodes each element as a protobuf message of its own. For the
ids of a 1,000-token prompt that is ~300 µs of the agent's CPU per LLM call. Packed, the same
ids are one string, made and checked in C:

- token ids: base64 (standard alphabet, padded) of the ids as little-endian unsigned 32-bit ints;
- logprobs: base64 of the values as little-endian IEEE-754 doubles (exact, unlike decimal text).

spanrl's instrumentation writes this form; the receiver reads it and the plain arrays alike, so
another language's agent may write either. Agent-side: no numpy, no torch.
"""

from __future__ import annotations

import base64
import binascii
import sys
from array import array
from collections.abc import Iterable, Mapping
from typing import Any

from spanrl.instrumentation import semconv

# the array typecode of unsigned 32-bit ints: "I" on every common platform
TOKEN_ID_TYPECODE = next(code for code in "IL" if array(code).itemsize == 4)
_SWAP = sys.byteorder == "big"  # the wire is little-endian


class PackedValueError(ValueError):
    """A packed attribute that is not base64 of whole 4-byte ids or 8-byte doubles."""


def pack_token_ids(ids: Iterable[int]) -> str:
    """``ids`` packed (an ``array`` of ``TOKEN_ID_TYPECODE`` is used as it is); OverflowError for
    an id outside 0..2**32-1, TypeError for a non-int."""
    return _encode(ids if type(ids) is array and ids.typecode == TOKEN_ID_TYPECODE else array(TOKEN_ID_TYPECODE, ids))


def pack_logprobs(values: Iterable[float]) -> str:
    """``values`` packed as doubles (an ``array("d")`` is used as it is); TypeError for a non-number."""
    return _encode(values if type(values) is array and values.typecode == "d" else array("d", values))


def asks_packed_ids(headers: Mapping[str, str], body: Mapping[str, Any] | None = None) -> bool:
    """Whether a request asks for its answer's ids packed: its JSON ``body`` says
    ``"spanrl_token_ids": "packed"`` (what spanrl's instrumentation sends with the id flag it adds),
    or its ``headers`` say ``x-spanrl-token-ids: packed``. ValueError naming the field when the
    body's value is neither ``packed`` nor ``lists``."""
    form = body.get(semconv.TOKEN_IDS_FORM_FIELD) if body is not None else None
    if form is not None and form not in _ID_FORMS:
        raise ValueError(f"{semconv.TOKEN_IDS_FORM_FIELD} should be {semconv.TOKEN_IDS_FORM_PACKED!r} or "
                         f"{semconv.TOKEN_IDS_FORM_LISTS!r}, got {form!r}")
    if form is not None:
        return form == semconv.TOKEN_IDS_FORM_PACKED
    return headers.get(semconv.TOKEN_IDS_FORM_HEADER, "").strip() == semconv.TOKEN_IDS_FORM_PACKED


_ID_FORMS = (semconv.TOKEN_IDS_FORM_PACKED, semconv.TOKEN_IDS_FORM_LISTS)


def extend_packed_token_ids(ids: array, text: str) -> str | None:
    """Append the ids packed in ``text`` to ``ids`` (an array of ``TOKEN_ID_TYPECODE``); what is
    wrong with ``text`` (``packed_token_ids_problem``), or None. The form spanrl's server answers
    in when asked (docs/interfaces.md §1): one C pass, no int per id."""
    problem = packed_token_ids_problem(text)
    if problem is not None:
        return problem
    raw = binascii.a2b_base64(text)  # checked already: the plain decoder is the faster one
    if _SWAP:
        values = array(ids.typecode, raw)
        values.byteswap()
        ids.extend(values)
    else:
        ids.frombytes(raw)
    return None


def packed_token_ids_problem(text: str) -> str | None:
    """What is wrong with ``text`` as packed ids, or None, checked without decoding: only base64's
    standard alphabet, a length a multiple of 4, at most two ``=`` and only at the end, and whole
    4-byte ids: what strict decoding of whole ids accepts, but for the ``=`` that Python 3.11's
    strict decoder lets through after a whole group (gh-118314). A recorder writes a string that
    passes as it came (~5x cheaper than decoding it and encoding it again)."""
    try:
        raw = text.encode("ascii")
    except UnicodeEncodeError:
        raw = b""  # not base64: the decoder below names the problem
    else:
        not_alphabet = raw.translate(None, _BASE64_ALPHABET)  # for base64: "", "=" or "==", the padding
        if (len(raw) % 16, not_alphabet) in _WHOLE_IDS_ENDINGS and raw.endswith(not_alphabet):
            return None
        if not len(raw) % 4 and not_alphabet in _PADDINGS and raw.endswith(not_alphabet):
            return f"should be packed whole 4-byte ids, got {len(raw) // 4 * 3 - len(not_alphabet)} bytes"
    try:  # the strict decoder names what is wrong
        binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        return f"should be packed ids (base64): {exc}"
    return "should be packed ids (base64): padded to a multiple of 4 characters with at most two '='"


_BASE64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_PADDINGS = (b"==", b"", b"=")
# Base64 of whole 4-byte ids, by its length modulo 16 and its padding: 3 ids are 12 bytes, 16
# characters; what is left is 0 ids (no padding), 1 (6 characters and "=="), or 2 (11 and "=").
_WHOLE_IDS_ENDINGS = frozenset({(0, b""), (8, b"=="), (12, b"=")})


def unpack_token_ids(text: str) -> list[int]:
    """The ids of a packed token-id attribute; PackedValueError naming what is wrong."""
    return _decode(text, TOKEN_ID_TYPECODE, "token ids").tolist()


def unpack_logprobs(text: str) -> list[float]:
    """The values of a packed logprob attribute; PackedValueError naming what is wrong."""
    return _decode(text, "d", "logprobs").tolist()


def _encode(values: array) -> str:
    if _SWAP:  # on a copy: the caller's array stays as it was
        values = array(values.typecode, values)
        values.byteswap()
    return binascii.b2a_base64(values, newline=False).decode("ascii")  # reads the array's buffer, no copy


def _decode(text: str, typecode: str, what: str) -> array:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise PackedValueError(f"packed {what} should be base64: {exc}") from None
    values = array(typecode)
    if len(raw) % values.itemsize:
        raise PackedValueError(f"packed {what} should be whole {values.itemsize}-byte values, got {len(raw)} bytes")
    values.frombytes(raw)
    if _SWAP:
        values.byteswap()
    return values


def unpacked_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a span's ``attributes`` with spanrl's packed ids and logprobs as tuples: for
    reading spans (an exporter, a test) as the arrays they stand for."""
    result = dict(attributes)
    for key, value in result.items():
        if not isinstance(value, str) or not key.startswith(semconv.LLM_PREFIX):
            continue
        if key == semconv.LLM_PROMPT_TOKEN_IDS or (key.startswith(semconv.LLM_RESPONSE_PREFIX)
                                                   and key.endswith(semconv.LLM_RESPONSE_TOKEN_IDS_SUFFIX)):
            result[key] = tuple(unpack_token_ids(value))
        elif key.startswith(semconv.LLM_RESPONSE_PREFIX) and key.endswith(semconv.LLM_RESPONSE_LOGPROBS_SUFFIX):
            result[key] = tuple(unpack_logprobs(value))
    return result
