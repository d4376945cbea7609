"""The OpenAI instrumentor in this process, against vLLM's recorded answers: what it changes and
restores, and that odd or error responses never break a call."""

from __future__ import annotations

import logging

import openai
import openai._base_client as base_client
import pytest
from opentelemetry import context as context_api
from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY
from opentelemetry.trace import StatusCode

from spanrl.instrumentation import semconv
from spanrl.instrumentation.openai_instrumentor import SpanrlOpenAIInstrumentor
from spanrl.instrumentation.packed_values import unpacked_attributes

PATCHED_BY_SPANRL = [
    (base_client.BaseClient, "_build_request"),
    (base_client.AsyncAPIClient, "_process_response"),
    (base_client.BaseClient, "_process_response_data"),
]
PATCHED_BY_OPENINFERENCE = [(openai.OpenAI, "request"), (openai.AsyncOpenAI, "request")]
MESSAGES = [{"role": "user", "content": "hello"}]


def llm_attributes(exporter):
    return [unpacked_attributes(s.attributes) for s in exporter.get_finished_spans()
            if s.attributes.get("openinference.span.kind") == "LLM"]


def test_uninstrument_restores_exactly_what_instrument_changed():
    from openinference.instrumentation.openai import OpenAIInstrumentor

    openinference_was_on = OpenAIInstrumentor().is_instrumented_by_opentelemetry
    ours_before = [cls.__dict__[name] for cls, name in PATCHED_BY_SPANRL]
    theirs_before = [getattr(cls, name) for cls, name in PATCHED_BY_OPENINFERENCE]
    instrumentor = SpanrlOpenAIInstrumentor()
    instrumentor.instrument()
    try:
        assert all(cls.__dict__[name] is not before
                   for (cls, name), before in zip(PATCHED_BY_SPANRL, ours_before, strict=True))
        assert OpenAIInstrumentor().is_instrumented_by_opentelemetry  # turned on for us
    finally:
        instrumentor.uninstrument()
    assert [cls.__dict__[name] for cls, name in PATCHED_BY_SPANRL] == ours_before
    # openinference's own uninstrument restores its methods (it leaves an equal attribute)
    assert [getattr(cls, name) for cls, name in PATCHED_BY_OPENINFERENCE] == theirs_before
    assert OpenAIInstrumentor().is_instrumented_by_opentelemetry == openinference_was_on


def test_an_sdk_it_cannot_patch_is_logged_and_left_untouched(monkeypatch, caplog):
    # an OpenAI SDK without one of the methods spanrl wraps (a future release, say)
    monkeypatch.delattr(base_client.AsyncAPIClient, "_process_response")
    before = [cls.__dict__.get(name) for cls, name in PATCHED_BY_SPANRL]
    instrumentor = SpanrlOpenAIInstrumentor()
    with caplog.at_level(logging.ERROR, logger="spanrl"):
        instrumentor.instrument()  # must not raise: opentelemetry-instrument would stop
    try:
        assert "could not instrument the OpenAI SDK" in caplog.text
        assert [cls.__dict__.get(name) for cls, name in PATCHED_BY_SPANRL] == before
    finally:
        instrumentor.uninstrument()


def test_malformed_ids_are_logged_and_the_call_returns(private_tracing, vllm_recording_malformed, caplog):
    client = openai.OpenAI(base_url=vllm_recording_malformed.base_url, api_key="k")
    with caplog.at_level(logging.WARNING, logger="spanrl"):
        response = client.chat.completions.create(model="p", messages=MESSAGES)
        chunks = list(client.chat.completions.create(model="p", messages=MESSAGES, stream=True))
    assert response.choices[0].message.content and chunks
    # a string is read as the packed form (spanrl's server): "not-a-list" is not base64
    assert any("choices[0].token_ids should be packed ids (base64)" in r.getMessage() for r in caplog.records)
    spans = llm_attributes(private_tracing.exporter)
    assert len(spans) == 2
    for attributes, response_id in zip(spans, [response.id, chunks[0].id], strict=True):
        plan = vllm_recording_malformed.sent[response_id]
        assert attributes[semconv.LLM_PROMPT_TOKEN_IDS] == tuple(plan["prompt_token_ids"])
        assert semconv.llm_response_token_ids(0) not in attributes


def test_the_agents_own_return_token_ids_choice_is_kept(private_tracing, vllm_recording):
    client = openai.OpenAI(base_url=vllm_recording.base_url, api_key="k")
    client.chat.completions.create(model="p", messages=MESSAGES, extra_body={"return_token_ids": False})
    assert vllm_recording.requests[-1]["return_token_ids"] is False
    (attributes,) = llm_attributes(private_tracing.exporter)
    assert semconv.LLM_PROMPT_TOKEN_IDS not in attributes
    assert attributes[semconv.LLM_POLICY_VERSION] == 7  # from the header and body still


def test_calls_inside_a_rollout_name_it_in_a_header_for_sticky_routing(private_tracing, vllm_recording):
    from spanrl.instrumentation.rollout import rollout

    client = openai.OpenAI(base_url=vllm_recording.base_url, api_key="k")
    outside = client.chat.completions.with_raw_response.create(model="p", messages=MESSAGES)
    assert semconv.ROLLOUT_ID_HEADER not in outside.http_request.headers
    with rollout("task-1", rollout_id="r-42", tracer_provider=private_tracing.provider):
        inside = client.chat.completions.with_raw_response.create(model="p", messages=MESSAGES)
        chosen = client.chat.completions.with_raw_response.create(
            model="p", messages=MESSAGES, extra_headers={"X-Spanrl-Rollout-Id": "mine"})
    assert inside.http_request.headers[semconv.ROLLOUT_ID_HEADER] == "r-42"
    assert chosen.http_request.headers[semconv.ROLLOUT_ID_HEADER] == "mine"  # the agent's own value wins


def test_a_retried_call_asks_for_ids_and_names_its_rollout_once_per_attempt(private_tracing, vllm_recording):
    """The flag and the header go on each attempt's options, as new dicts: a retry carries each
    once, and the agent's own extra body and headers stay as they were."""
    from spanrl.instrumentation.rollout import rollout

    client = openai.OpenAI(base_url=vllm_recording.base_url, api_key="k", max_retries=2)
    agents_body, agents_headers = {"top_k": 5}, {"x-agent": "a"}
    vllm_recording.unavailable_next = 2
    with rollout("task-1", rollout_id="r-7", tracer_provider=private_tracing.provider):
        client.chat.completions.create(model="p", messages=MESSAGES, top_p=0.5,
                                       extra_body=agents_body, extra_headers=agents_headers)
    assert agents_body == {"top_k": 5} and agents_headers == {"x-agent": "a"}
    assert len(vllm_recording.requests) == 3  # two 503s, then the answer
    for body, headers in zip(vllm_recording.requests, vllm_recording.request_headers, strict=True):
        assert body["return_token_ids"] is True and body["top_k"] == 5
        assert headers[semconv.ROLLOUT_ID_HEADER] == "r-7" and headers["x-agent"] == "a"
    (attributes,) = llm_attributes(private_tracing.exporter)
    assert attributes[semconv.LLM_PROMPT_TOKEN_IDS] and attributes[semconv.llm_response_token_ids(0)]


def test_the_agent_sees_no_id_fields_it_did_not_ask_for_and_keeps_those_it_did(private_tracing, vllm_recording):
    """The ids come because spanrl asked: once recorded they are taken out of the body and the
    chunks, so the agent's objects and openinference's ``output.value`` are as without spanrl (the
    ids travel once, packed), and openinference's request parameters hold none of spanrl's
    fields (``return_token_ids``, ``spanrl_token_ids``). An agent that asks for them itself gets them."""
    client = openai.OpenAI(base_url=vllm_recording.base_url, api_key="k")
    chat = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "What is 2+3?"}], n=2, logprobs=True)
    chunks = list(client.chat.completions.create(model="p", messages=MESSAGES, stream=True))
    completion = client.completions.create(model="policy", prompt="2+3=")
    for response in (chat, completion, *chunks):
        extras = [response.model_extra or {}] + [choice.model_extra or {} for choice in response.choices]
        assert not any(key in extra for extra in extras for key in ("prompt_token_ids", "token_ids")), response
    spans = [s for s in private_tracing.exporter.get_finished_spans()
             if s.attributes.get("openinference.span.kind") == "LLM"]
    assert len(spans) == 3
    for span in spans:  # nor do openinference's records of the request and the response
        assert "token_ids" not in span.attributes["output.value"]
        assert "token_ids" not in span.attributes["llm.invocation_parameters"], span.attributes
    sent = [vllm_recording.sent[r.id] for r in (chat, chunks[0], completion)]
    for attributes, plan in zip(llm_attributes(private_tracing.exporter), sent, strict=True):
        for i, choice in enumerate(plan["choices"]):
            assert attributes[semconv.llm_response_token_ids(i)] == tuple(choice["token_ids"])
    assert len(sent[0]["choices"]) == 2
    assert semconv.llm_response_logprobs(1) in llm_attributes(private_tracing.exporter)[0]
    # vLLM never answers as spanrl's server: however often called, it is not asked for packed ids
    # (a field it does not know, which many vLLM versions log a warning for: endpoints.py)
    assert len(vllm_recording.requests) == 3 and not any(
        semconv.TOKEN_IDS_FORM_FIELD in body for body in vllm_recording.requests)

    asked = client.chat.completions.create(model="p", messages=MESSAGES, extra_body={"return_token_ids": True})
    plan = vllm_recording.sent[asked.id]
    assert asked.model_extra["prompt_token_ids"] == plan["prompt_token_ids"]
    assert asked.choices[0].model_extra["token_ids"] == plan["choices"][0]["token_ids"]
    assert llm_attributes(private_tracing.exporter)[-1][semconv.LLM_PROMPT_TOKEN_IDS] == tuple(plan["prompt_token_ids"])


def test_ids_never_land_on_a_span_that_is_not_the_calls_llm_span(private_tracing, vllm_recording):
    client = openai.OpenAI(base_url=vllm_recording.base_url, api_key="k")
    tracer = private_tracing.provider.get_tracer("outer")
    with tracer.start_as_current_span("outer-step"):
        token = context_api.attach(context_api.set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))
        try:
            client.chat.completions.create(model="p", messages=MESSAGES)
        finally:
            context_api.detach(token)
    (outer,) = private_tracing.exporter.get_finished_spans()
    assert outer.name == "outer-step"
    assert not any(k.startswith("spanrl.llm") for k in outer.attributes)


def test_a_stream_left_early_still_ends_its_span_without_errors(private_tracing, vllm_recording, caplog):
    client = openai.OpenAI(base_url=vllm_recording.base_url, api_key="k")
    with caplog.at_level(logging.WARNING):
        with client.chat.completions.create(model="p", messages=MESSAGES, stream=True) as stream:
            next(iter(stream))
    (attributes,) = llm_attributes(private_tracing.exporter)
    assert semconv.LLM_PROMPT_TOKEN_IDS in attributes  # sent in the first chunk
    assert not [r for r in caplog.records if r.name.startswith("spanrl")]


def _recorded(streaming, header, *bodies):
    from opentelemetry.sdk.trace import TracerProvider

    from spanrl.instrumentation.llm_span_recorder import LLMSpanRecorder

    span = TracerProvider().get_tracer("recorder-test").start_span("llm")
    recorder = LLMSpanRecorder(span, streaming=streaming, header_policy_version=header)
    for body in bodies:
        recorder.observe(body)
    span.end()
    return unpacked_attributes(span.attributes)


def test_policy_version_prefers_the_body_and_falls_back_to_the_header():
    assert _recorded(False, "12", {"id": "a", "choices": []})[semconv.LLM_POLICY_VERSION] == 12
    assert _recorded(False, "12", {"policy_version": 3})[semconv.LLM_POLICY_VERSION] == 3
    assert semconv.LLM_POLICY_VERSION not in _recorded(False, "v2", {"policy_version": True})


def test_a_bodys_packed_ids_are_written_as_they_came_and_a_malformed_field_is_named_and_left_out(caplog):
    """A whole body's packed strings (spanrl's server) become the attributes as they are; a
    malformed one is named in the log and left out, while the call's other fields are kept."""
    from spanrl.instrumentation.packed_values import pack_token_ids

    prompt, reply = pack_token_ids([1, 2, 3]), pack_token_ids([40, 41])
    body = {"id": "b", "object": "chat.completion", "prompt_token_ids": prompt, "policy_version": 4,
            "choices": [{"index": 0, "token_ids": reply, "logprobs": {"content": [{"logprob": -0.5}] * 2}}]}
    attributes = _recorded(False, None, body)
    assert attributes[semconv.LLM_PROMPT_TOKEN_IDS] == (1, 2, 3)
    assert attributes[semconv.llm_response_token_ids(0)] == (40, 41)
    assert attributes[semconv.llm_response_logprobs(0)] == (-0.5, -0.5)
    completion = {"object": "text_completion", "choices": [{"prompt_token_ids": prompt, "token_ids": reply}]}
    assert _recorded(False, None, completion)[semconv.LLM_PROMPT_TOKEN_IDS] == (1, 2, 3)

    broken = {**body, "choices": [{**body["choices"][0], "token_ids": reply + "!"}]}
    with caplog.at_level(logging.WARNING, logger="spanrl"):
        attributes = _recorded(False, None, broken)
    assert any("choices[0].token_ids should be packed ids (base64)" in r.getMessage() for r in caplog.records)
    assert semconv.llm_response_token_ids(0) not in attributes
    assert attributes[semconv.LLM_PROMPT_TOKEN_IDS] == (1, 2, 3) and attributes[semconv.LLM_POLICY_VERSION] == 4
    assert attributes[semconv.llm_response_logprobs(0)] == (-0.5, -0.5)


# Chunks as vLLM sends them (a chunk's object and the policy version: the recorder's fast path for
# a stream's middle chunks), and bare (the general path)
VLLM_CHUNK = {"object": "chat.completion.chunk", "policy_version": 3}
CHUNK_SHAPES = pytest.mark.parametrize("shape", [VLLM_CHUNK, {}], ids=["vllm-chunks", "bare-chunks"])


@CHUNK_SHAPES
def test_stream_ids_are_concatenated_per_choice_index_whatever_the_order(shape):
    chunks = [
        {"id": "s", "prompt_token_ids": [1, 2], "choices": [{"index": 1, "token_ids": [20]}]},
        {"id": "s", "choices": [{"index": 0, "token_ids": [10, 11]}, {"index": 1, "token_ids": [21]}]},
        {"id": "s", "choices": [{"index": 1, "token_ids": [22], "finish_reason": "length"}]},
        {"id": "s", "choices": [{"index": 0, "token_ids": [12], "finish_reason": "stop"}]},
        {"id": "s", "choices": [{"index": 0, "token_ids": [13]}]},  # late ids still count
    ]
    attributes = _recorded(True, None, *({**shape, **chunk} for chunk in chunks))
    assert attributes[semconv.LLM_PROMPT_TOKEN_IDS] == (1, 2)
    assert attributes[semconv.llm_response_token_ids(0)] == (10, 11, 12, 13)
    assert attributes[semconv.llm_response_token_ids(1)] == (20, 21, 22)
    assert attributes[semconv.GENAI_RESPONSE_ID] == "s"


def test_an_error_answer_raises_as_usual_and_records_no_ids(private_tracing, vllm_recording, caplog):
    client = openai.OpenAI(base_url=vllm_recording.base_url, api_key="k", max_retries=0)
    with caplog.at_level(logging.WARNING, logger="spanrl"):
        with pytest.raises(openai.NotFoundError, match="The model `missing-model` does not exist"):
            client.chat.completions.create(model="missing-model", messages=MESSAGES)
    assert vllm_recording.requests[-1]["return_token_ids"] is True
    (span,) = [s for s in private_tracing.exporter.get_finished_spans()
               if s.attributes.get("openinference.span.kind") == "LLM"]
    assert span.status.status_code == StatusCode.ERROR  # openinference's account of the failure
    assert not any(k.startswith("spanrl.llm.") for k in span.attributes)
    assert not caplog.records


def test_a_process_whose_resource_names_a_rollout_sends_it_in_the_header(vllm_recording):
    """What ``spanrl run`` gives an agent process (the rollout id on its resource) reaches the
    header; a provider with another resource gets its own id, not the first one's."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    headers = []
    for rollout_id in ("proc-1", "proc-2", None):
        attributes = {"service.name": "agent"} | ({semconv.ROLLOUT_ID: rollout_id} if rollout_id else {})
        provider = TracerProvider(resource=Resource.create(attributes))
        instrumentor = SpanrlOpenAIInstrumentor()
        instrumentor.instrument(tracer_provider=provider)
        try:
            client = openai.OpenAI(base_url=vllm_recording.base_url, api_key="k")
            raw = client.chat.completions.with_raw_response.create(model="p", messages=MESSAGES)
            headers.append(raw.http_request.headers.get(semconv.ROLLOUT_ID_HEADER))
        finally:
            instrumentor.uninstrument()
            provider.shutdown()
    assert headers == ["proc-1", "proc-2", None]


@CHUNK_SHAPES
def test_a_stream_choice_with_an_id_out_of_range_is_left_out_and_the_others_kept(caplog, shape):
    chunks = [
        {"id": "s", "prompt_token_ids": [1, 2], "choices": [{"index": 0, "token_ids": [10]},
                                                            {"index": 1, "token_ids": [20]}]},
        {"id": "s", "choices": [{"index": 0, "token_ids": [-1]}, {"index": 1, "token_ids": [2**32]}]},
        {"id": "s", "choices": [{"index": 0, "token_ids": [11], "finish_reason": "stop"}]},
        {"id": "s", "choices": [{"index": 1, "token_ids": [21], "finish_reason": "stop"}]},
        {"id": "s", "choices": [{"index": 2, "token_ids": [30, 31], "finish_reason": "stop"}]},
    ]
    with caplog.at_level(logging.WARNING, logger="spanrl"):
        attributes = _recorded(True, None, *({**shape, **chunk} for chunk in chunks))
    assert attributes[semconv.LLM_PROMPT_TOKEN_IDS] == (1, 2)
    assert semconv.llm_response_token_ids(0) not in attributes  # a shortened sequence is never written
    assert semconv.llm_response_token_ids(1) not in attributes
    assert attributes[semconv.llm_response_token_ids(2)] == (30, 31)
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("spanrl")]
    assert len(warnings) == 1 and "choices[0].token_ids should hold only ints from 0 to 2**32-1" in warnings[0]


@pytest.mark.parametrize("bad_ids", [[12, -1, 13], [12, 2**32], "12", [1.5]])
def test_a_single_choice_streams_broken_middle_chunk_leaves_its_ids_out(caplog, bad_ids):
    """One choice, as most agents stream: a middle chunk with a bad id is caught (never written
    shortened or with the part before the bad id); logprobs on a chunk are kept in order."""
    chunk = {**VLLM_CHUNK, "id": "s"}
    good = [{**chunk, "prompt_token_ids": [1, 2], "choices": [{"index": 0, "token_ids": []}]},
            {**chunk, "choices": [{"index": 0, "token_ids": [10, 11]}]},
            {**chunk, "choices": [{"index": 0, "token_ids": [12], "logprobs": {"content": [{"logprob": -0.5}]}}]},
            {**chunk, "choices": [{"index": 0, "token_ids": [13], "finish_reason": "stop"}]}]
    assert _recorded(True, None, *good)[semconv.llm_response_token_ids(0)] == (10, 11, 12, 13)
    broken = [*good[:2], {**chunk, "choices": [{"index": 0, "token_ids": bad_ids}]}, good[3]]
    with caplog.at_level(logging.WARNING, logger="spanrl"):
        attributes = _recorded(True, None, *broken)
    assert attributes[semconv.LLM_PROMPT_TOKEN_IDS] == (1, 2)
    assert attributes[semconv.LLM_POLICY_VERSION] == 3
    assert semconv.llm_response_token_ids(0) not in attributes
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("spanrl")]
    assert len(warnings) == 1 and "choices[0].token_ids should" in warnings[0]


def test_a_method_another_library_wrapped_first_keeps_its_wrapper(vllm_recording):
    """spanrl puts plain functions in the SDK's methods' place; one another library had already
    wrapped (wrapt, as OpenTelemetry instrumentors do) is called through, bound, and put back."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from wrapt import wrap_function_wrapper

    original = base_client.BaseClient.__dict__["_process_response_data"]
    seen = []

    def theirs(wrapped, instance, args, kwargs):
        seen.append(type(instance).__name__)
        return wrapped(*args, **kwargs)

    wrap_function_wrapper(base_client, "BaseClient._process_response_data", theirs)
    wrapped_by_them = base_client.BaseClient.__dict__["_process_response_data"]
    provider, exporter = TracerProvider(), InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = SpanrlOpenAIInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        client = openai.OpenAI(base_url=vllm_recording.base_url, api_key="k")
        response = client.chat.completions.create(model="p", messages=MESSAGES)
    finally:
        instrumentor.uninstrument()
        assert base_client.BaseClient.__dict__["_process_response_data"] is wrapped_by_them
        base_client.BaseClient._process_response_data = original
        provider.shutdown()
    assert seen == ["OpenAI"]
    (attributes,) = llm_attributes(exporter)
    sent = vllm_recording.sent[response.id]["choices"][0]["token_ids"]
    assert attributes[semconv.llm_response_token_ids(0)] == tuple(sent)


def test_the_sdks_keyword_only_method_is_replaced_by_one_of_the_same_shape():
    """Every chunk of a stream passes ``_process_response_data``: with the installed SDK's
    ``(self, *, data, cast_to, response)`` spanrl's replacement takes the same keywords (no
    ``**kwargs`` dict a chunk); another shape gets a replacement that passes on whatever it is given
    (the wrapped method above, streamed and not, in the tests of the whole SDK)."""
    import inspect

    instrumentor = SpanrlOpenAIInstrumentor()
    instrumentor.instrument()
    try:
        ours = base_client.BaseClient.__dict__["_process_response_data"]
        parameters = inspect.signature(ours, follow_wrapped=False).parameters.values()
    finally:
        instrumentor.uninstrument()
    assert [(p.name, p.kind) for p in parameters] == [("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [
        (name, inspect.Parameter.KEYWORD_ONLY) for name in ("data", "cast_to", "response")]

    from spanrl.instrumentation.sdk_calls import _process_response_data_patch

    def positional(self, data, cast_to, response):  # an SDK of another shape
        return (self, data, cast_to, response)

    other = _process_response_data_patch(positional)
    assert [p.kind for p in inspect.signature(other, follow_wrapped=False).parameters.values()] == [
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]
    assert other("client", {"id": "x"}, dict, None) == ("client", {"id": "x"}, dict, None)
    assert other("client", data=1, cast_to=int, response=None) == ("client", 1, int, None)


def test_a_call_outside_openinferences_span_carries_no_recorder(private_tracing, vllm_recording):
    # the recorder rides on the httpx request only when the call has its own LLM span
    client = openai.OpenAI(base_url=vllm_recording.base_url, api_key="k")
    traced = client.chat.completions.with_raw_response.create(model="p", messages=MESSAGES)
    token = context_api.attach(context_api.set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))
    try:
        suppressed = client.chat.completions.with_raw_response.create(model="p", messages=MESSAGES)
    finally:
        context_api.detach(token)
    assert hasattr(traced.http_request, "_spanrl_recorder")  # None again once openinference read the body
    assert not hasattr(suppressed.http_request, "_spanrl_recorder")
    (attributes,) = llm_attributes(private_tracing.exporter)
    assert semconv.llm_response_token_ids(0) in attributes
