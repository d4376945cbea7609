"""``LLMSpanRecorder`` on Responses API bodies and stream events (vLLM's shapes on that route),
writing onto real SDK spans of a private provider: what it records, and what it leaves out."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spanrl.instrumentation import semconv
from spanrl.instrumentation.llm_span_recorder import LLMSpanRecorder
from spanrl.instrumentation.packed_values import unpacked_attributes


def response_body(prompt=(5, 6, 7), output=(8, 9), logprobs=(-0.5, -1.25), version=3):
    part = {"type": "output_text", "text": "hi", "annotations": [],
            "logprobs": None if logprobs is None else [{"token": "x", "logprob": v, "bytes": []} for v in logprobs]}
    return {
        "id": "resp_1", "object": "response", "status": "completed", "policy_version": version,
        "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "content": [part]}],
        "input_messages": [{"type": "raw_message_tokens", "message": "p", "tokens": list(prompt)}],
        "output_messages": [{"type": "raw_message_tokens", "message": "hi", "tokens": list(output)}],
    }


@pytest.fixture
def record():
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")

    def run(payloads, streaming=False, header=None):
        with tracer.start_as_current_span("llm") as span:
            recorder = LLMSpanRecorder(span, streaming=streaming, header_policy_version=header)
            for payload in payloads:
                recorder.observe(payload)
        (finished,) = exporter.get_finished_spans()
        exporter.clear()
        return unpacked_attributes(finished.attributes)

    yield run
    provider.shutdown()


def test_a_response_body_gives_prompt_reply_logprobs_version_and_id(record):
    attributes = record([response_body()])
    assert attributes == {
        semconv.GENAI_RESPONSE_ID: "resp_1", semconv.LLM_POLICY_VERSION: 3,
        semconv.LLM_PROMPT_TOKEN_IDS: (5, 6, 7), semconv.llm_response_token_ids(0): (8, 9),
        semconv.llm_response_logprobs(0): (-0.5, -1.25),
    }


def test_a_stream_is_recorded_from_its_final_response_event_only(record):
    started = {**response_body(), "status": "in_progress", "output_messages": [{"tokens": [1]}]}
    created = {"type": "response.created", "sequence_number": 0, "response": started}
    delta = {"type": "response.output_text.delta", "sequence_number": 1, "delta": "h", "item_id": "msg_1"}
    body = response_body(prompt=(1, 2), output=(3, 4, 5), logprobs=None)
    done = {"type": "response.completed", "sequence_number": 2, "response": body}
    attributes = record([created, delta, done], streaming=True, header="4")
    assert attributes[semconv.LLM_PROMPT_TOKEN_IDS] == (1, 2)
    assert attributes[semconv.llm_response_token_ids(0)] == (3, 4, 5)
    assert semconv.llm_response_logprobs(0) not in attributes
    assert attributes[semconv.LLM_POLICY_VERSION] == 3  # the body's value wins over the header's
    # the SDK's {"event", "data"} form and an incomplete response are read the same way
    wrapped = {"event": "response.incomplete", "data": {**done, "type": "response.incomplete"}}
    assert record([wrapped], streaming=True)[semconv.llm_response_token_ids(0)] == (3, 4, 5)


def test_without_ids_or_with_broken_ones_nothing_is_made_up(record, caplog):
    plain = response_body()
    del plain["input_messages"], plain["output_messages"]
    assert record([plain]) == {semconv.GENAI_RESPONSE_ID: "resp_1", semconv.LLM_POLICY_VERSION: 3}
    # one logprob short of the ids: the logprobs are left out, the ids kept
    short = record([response_body(logprobs=(-0.5,))])
    assert short[semconv.llm_response_token_ids(0)] == (8, 9) and semconv.llm_response_logprobs(0) not in short
    broken = response_body()
    broken["output_messages"][0]["tokens"] = ["8", 9]
    with caplog.at_level(logging.WARNING, logger="spanrl"):
        attributes = record([broken])
    assert semconv.llm_response_token_ids(0) not in attributes
    assert "output_messages[0].tokens" in caplog.text


def test_ids_spanrl_asked_for_are_recorded_then_taken_out_of_every_shape():
    """With ``removes_id_fields`` (spanrl added the request flag) the recorder reads the ids, then
    takes them out of the body or event in place: Responses bodies and final events, Anthropic's
    message, ``message_start`` and ``message_delta``; the other fields stay."""
    provider, exporter = TracerProvider(), InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    anthropic_start = {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [], "prompt_token_ids": [5, 6]}}
    cases = [
        ([response_body()], False),
        ([{"type": "response.completed", "sequence_number": 3, "response": response_body()}], True),
        ([{"event": "response.completed", "data": {"type": "response.completed", "response": response_body()}}], True),
        ([{"id": "msg_1", "type": "message", "role": "assistant", "content": [], "prompt_token_ids": [5, 6],
           "token_ids": [8, 9]}], False),
        ([anthropic_start, {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "token_ids": [8, 9]}], True),
    ]
    for payloads, streaming in cases:
        with tracer.start_as_current_span("llm") as span:
            recorder = LLMSpanRecorder(span, streaming=streaming)
            recorder.removes_id_fields = True
            for payload in payloads:
                recorder.observe(payload)
        (finished,) = exporter.get_finished_spans()
        exporter.clear()
        attributes = unpacked_attributes(finished.attributes)
        assert attributes[semconv.llm_response_token_ids(0)] == (8, 9), payloads
        assert attributes[semconv.LLM_PROMPT_TOKEN_IDS] in ((5, 6, 7), (5, 6)), payloads
        text = repr(payloads)
        for field in ("input_messages", "output_messages", "prompt_token_ids", "token_ids"):
            assert f"'{field}'" not in text, (field, text)
        assert "'output'" in text or "'type'" in text  # the rest of each payload is still there
    provider.shutdown()
