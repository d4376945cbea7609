"""The packed token-id and logprob attributes (instrumentation/packed_values.py): exact round trips,
the documented byte layout (so another language can write them), clear errors, and the
receiver's ingest check of both forms."""

from __future__ import annotations

import base64
import binascii
import math
import struct
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from spanrl.instrumentation import semconv
from spanrl.instrumentation.packed_values import (
    TOKEN_ID_TYPECODE,
    PackedValueError,
    asks_packed_ids,
    extend_packed_token_ids,
    pack_logprobs,
    pack_token_ids,
    packed_token_ids_problem,
    unpack_logprobs,
    unpack_token_ids,
)
from spanrl.otlp_receiver.span_checks import attribute_problem


def test_token_ids_round_trip_over_the_whole_id_range_and_the_empty_list():
    ids = [0, 1, 127, 128, 151_642, 2**31, 2**32 - 1]
    assert unpack_token_ids(pack_token_ids(ids)) == ids
    assert pack_token_ids([]) == "" and unpack_token_ids("") == []


def test_arrays_pack_as_their_values_and_are_left_as_they_were():
    """The recorder accumulates a stream's ids in an ``array`` and packs it as it is."""
    from array import array

    from spanrl.instrumentation.packed_values import TOKEN_ID_TYPECODE

    ids, logprobs = array(TOKEN_ID_TYPECODE, [5, 2**32 - 1, 0]), array("d", [-0.5, -2.25])
    assert pack_token_ids(ids) == pack_token_ids([5, 2**32 - 1, 0])
    assert pack_logprobs(logprobs) == pack_logprobs([-0.5, -2.25])
    assert ids.tolist() == [5, 2**32 - 1, 0] and logprobs.tolist() == [-0.5, -2.25]
    assert pack_token_ids(array("H", [7])) == pack_token_ids([7])  # another typecode is converted


def test_logprobs_round_trip_exactly():
    values = [-0.0, -1e-300, -0.1234567890123456789, -37.5, -math.inf]
    assert unpack_logprobs(pack_logprobs(values)) == values


def test_the_layout_is_base64_of_little_endian_uint32_and_float64():
    """What docs/interfaces.md tells another language to write."""
    assert pack_token_ids([1, 258]) == base64.b64encode(struct.pack("<2I", 1, 258)).decode()
    assert pack_logprobs([-0.5]) == base64.b64encode(struct.pack("<d", -0.5)).decode()


@pytest.mark.parametrize("ids, error", [([-1], OverflowError), ([2**32], OverflowError), ([1.5], TypeError),
                                        (["7"], TypeError)])
def test_ids_that_are_not_uint32_are_refused(ids, error):
    with pytest.raises(error):
        pack_token_ids(ids)


@pytest.mark.parametrize("text, words", [("AQID", "whole 4-byte values, got 3 bytes"), ("not base64!", "base64"),
                                         ("AQ", "base64")])
def test_malformed_packed_ids_name_what_is_wrong(text, words):
    with pytest.raises(PackedValueError, match=words):
        unpack_token_ids(text)


def test_the_receiver_accepts_both_forms_and_names_a_bad_packed_value():
    key, logprobs_key = semconv.LLM_PROMPT_TOKEN_IDS, semconv.llm_response_logprobs(0)
    assert attribute_problem(key, AnyValue(string_value=pack_token_ids([5, 6]))) is None
    assert attribute_problem(logprobs_key, AnyValue(string_value=pack_logprobs([-1.0]))) is None
    assert attribute_problem(key, AnyValue(string_value="AQID")) == (
        f"{key}: packed token ids should be whole 4-byte values, got 3 bytes")
    assert attribute_problem(logprobs_key, AnyValue(string_value=pack_token_ids([1]))) == (
        f"{logprobs_key}: packed logprobs should be whole 8-byte values, got 4 bytes")
    assert "must be an array of non-negative ints or the packed string of them, got int" in attribute_problem(
        key, AnyValue(int_value=3))


_BASE64_AND_JUNK = "ABab09+/=!\n é"


@st.composite
def _edited_packed_ids(draw) -> str:
    """Packed ids with one character replaced, put in or taken out, or their padding moved inside
    (or none)."""
    text = pack_token_ids(draw(st.lists(st.integers(0, 2**32 - 1), max_size=9)))
    at = draw(st.integers(0, len(text)))
    char = draw(st.sampled_from(_BASE64_AND_JUNK))
    edit = draw(st.sampled_from(["none", "replace", "insert", "delete", "move padding"]))
    if edit == "move padding":
        data = text.rstrip("=")
        at = min(at, len(data))
        return data[:at] + "=" * (len(text) - len(data)) + data[at:]
    if edit == "replace" and at < len(text):
        return text[:at] + char + text[at + 1:]
    if edit == "insert":
        return text[:at] + char + text[at:]
    return text[:at] + text[at + 1:] if edit == "delete" else text


@given(st.text(alphabet=_BASE64_AND_JUNK, max_size=24) | _edited_packed_ids())
def test_a_packed_string_is_checked_without_decoding_as_strict_decoding_checks_it(text):
    """``packed_token_ids_problem`` (no decoding: what a recorder writes as it came) accepts what
    strict base64 decoding of whole 4-byte ids accepts, padded to a multiple of 4 with at most two
    ``=`` (Python 3.11's strict decoder lets more ``=`` through after a whole group: gh-118314), and
    nothing else; the ids it lets through are appended as they decode."""
    try:
        raw = binascii.a2b_base64(text, strict_mode=True)
        decodes = len(raw) % 4 == 0 and len(text) % 4 == 0 and not text.endswith("===")
    except (binascii.Error, ValueError):
        decodes = False
    assert (packed_token_ids_problem(text) is None) == decodes
    ids = array(TOKEN_ID_TYPECODE)
    assert (extend_packed_token_ids(ids, text) is None) == decodes
    assert ids.tobytes() == (raw if decodes else b"")


@pytest.mark.parametrize("text, words", [("AQID", "whole 4-byte ids, got 3 bytes"), ("not base64!", "base64"),
                                         ("AQAAAA==AQAAAA==", "base64"), ("AQAAAAI=", "got 5 bytes"), ("é", "base64"),
                                         ("AQAAA=AAAAAA", "base64"), ("A===", "base64"), ("AQAAAAIAAA=\n", "base64"),
                                         ("AQAAAAIAAAADAAAA=", "at most two '='")])
def test_a_packed_string_that_is_not_whole_ids_is_named(text, words):
    assert words in packed_token_ids_problem(text)


def test_the_form_of_ids_is_asked_in_the_body_or_a_header_and_a_bad_form_is_named():
    field, header = semconv.TOKEN_IDS_FORM_FIELD, semconv.TOKEN_IDS_FORM_HEADER
    assert asks_packed_ids({}, {field: "packed"}) and asks_packed_ids({header: "packed"}, {})
    assert not asks_packed_ids({header: "packed"}, {field: "lists"})  # the body's word wins
    assert not asks_packed_ids({}, {}) and not asks_packed_ids({header: "lists"})
    with pytest.raises(ValueError, match=f"{field} should be 'packed' or 'lists', got 'zipped'"):
        asks_packed_ids({}, {field: "zipped"})
