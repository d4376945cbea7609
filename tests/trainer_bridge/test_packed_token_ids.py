"""The packed form of token ids: spanrl's server answers a request with ``"spanrl_token_ids":
"packed"`` (or the header ``x-spanrl-token-ids: packed``) with one string per id list (but a
stream's per-token ids), holding the ids it sends as lists otherwise, on every route; an
instrumented agent asks for it in the body, records the same ids and sees no id field in its
objects; a packed string is checked as it is written, without decoding it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from spanrl.instrumentation import semconv
from spanrl.instrumentation.packed_values import unpack_token_ids, unpacked_attributes

PACKED = {semconv.TOKEN_IDS_FORM_FIELD: semconv.TOKEN_IDS_FORM_PACKED}  # in the body
PACKED_HEADER = {semconv.TOKEN_IDS_FORM_HEADER: semconv.TOKEN_IDS_FORM_PACKED}
GREEDY = {"temperature": 0, "max_tokens": 8}


def _answers(server, path: str, body: dict) -> tuple[dict, dict]:
    """The same greedy request answered with lists (not asked) and packed (asked in the body)."""
    lists = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    packed = httpx.post(f"{server.url}{path}", json={**body, **PACKED}, timeout=60)
    assert lists.status_code == packed.status_code == 200, (lists.text, packed.text)
    return lists.json(), packed.json()


def _packed_equals(packed: object, ids: list[int]) -> None:
    assert isinstance(packed, str), packed
    assert isinstance(ids, list) and ids, ids
    assert unpack_token_ids(packed) == ids


def test_chat_and_completions_answer_the_same_ids_packed(server, engine):
    chat = {"model": engine.model_name, "messages": [{"role": "user", "content": "What is 37 + 45?"}],
            "return_token_ids": True, **GREEDY}
    lists, packed = _answers(server, "/v1/chat/completions", chat)
    _packed_equals(packed["prompt_token_ids"], lists["prompt_token_ids"])
    _packed_equals(packed["choices"][0]["token_ids"], lists["choices"][0]["token_ids"])
    assert packed["choices"][0]["message"] == lists["choices"][0]["message"]

    completion = {"model": engine.model_name, "prompt": "37 + 45 =", "return_token_ids": True, **GREEDY}
    lists, packed = _answers(server, "/v1/completions", completion)
    _packed_equals(packed["choices"][0]["prompt_token_ids"], lists["choices"][0]["prompt_token_ids"])
    _packed_equals(packed["choices"][0]["token_ids"], lists["choices"][0]["token_ids"])


def test_responses_and_messages_answer_the_same_ids_packed(server, engine):
    responses = {"model": engine.model_name, "input": "What is 37 + 45?", "enable_response_messages": True,
                 "temperature": 0, "max_output_tokens": 8}
    lists, packed = _answers(server, "/v1/responses", responses)
    for field in (semconv.RESPONSE_INPUT_MESSAGES, semconv.RESPONSE_OUTPUT_MESSAGES):
        _packed_equals(packed[field][0]["tokens"], lists[field][0]["tokens"])

    messages = {"model": engine.model_name, "messages": [{"role": "user", "content": "What is 37 + 45?"}],
                "return_token_ids": True, **GREEDY}
    lists, packed = _answers(server, "/v1/messages", messages)
    _packed_equals(packed["prompt_token_ids"], lists["prompt_token_ids"])
    _packed_equals(packed["token_ids"], lists["token_ids"])


def _stream_ids(server, body: dict, headers: dict) -> tuple[list, list]:
    """The prompt's ids and the reply's, as each chunk of a chat stream carries them."""
    prompt, reply = [], []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if "prompt_token_ids" in chunk:
                prompt.append(chunk["prompt_token_ids"])
            reply += [choice["token_ids"] for choice in chunk["choices"] if "token_ids" in choice]
    return prompt, reply


def test_a_stream_packs_its_prompts_ids_and_keeps_each_tokens_id_a_list(server, engine):
    """A stream's first chunk carries the prompt's ids packed; each token's chunk keeps its one id
    a list (a one-element list parses for less than a packed string decodes)."""
    body = {"model": engine.model_name, "messages": [{"role": "user", "content": "What is 37 + 45?"}],
            "return_token_ids": True, "stream": True, **GREEDY}
    prompt_lists, reply_lists = _stream_ids(server, body, {})
    prompt_packed, reply_packed = _stream_ids(server, body, PACKED_HEADER)
    assert [unpack_token_ids(p) for p in prompt_packed] == prompt_lists and len(prompt_lists) == 1
    assert reply_packed == reply_lists and sum(reply_lists, [])


def test_an_instrumented_agent_records_the_servers_ids_and_never_sees_them(server, engine, private_tracing):
    """spanrl's instrumentation asks for the packed form in the body (no header) once the server
    answered as spanrl's (its first call gets lists: instrumentation/endpoints.py); its spans hold
    the ids the engine served (the same request's answer as lists), and the agent's objects hold no ids."""
    from spanrl.instrumentation.endpoints import PACKING_ENDPOINTS

    messages = [{"role": "user", "content": "What is 37 + 45?"}]
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    PACKING_ENDPOINTS.discard(str(client.base_url))  # as in a new process
    raws = [client.chat.completions.with_raw_response.create(model=engine.model_name, messages=messages, **GREEDY)
            for _ in range(2)]
    first, then = (json.loads(raw.http_request.content) for raw in raws)
    assert first["return_token_ids"] is True and semconv.TOKEN_IDS_FORM_FIELD not in first
    assert then[semconv.TOKEN_IDS_FORM_FIELD] == semconv.TOKEN_IDS_FORM_PACKED and then["return_token_ids"] is True
    assert all(semconv.TOKEN_IDS_FORM_HEADER not in raw.http_request.headers for raw in raws)
    assert [type(json.loads(raw.text)["prompt_token_ids"]) for raw in raws] == [list, str]
    for raw in raws:
        reply = raw.parse()
        assert "prompt_token_ids" not in (reply.model_extra or {})
        assert "token_ids" not in (reply.choices[0].model_extra or {})
    lists = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": engine.model_name, "messages": messages, "return_token_ids": True, **GREEDY}).json()
    spans = [unpacked_attributes(s.attributes) for s in private_tracing.exporter.get_finished_spans()
             if s.attributes.get("openinference.span.kind") == "LLM"]
    assert len(spans) == 2
    for span in spans:
        assert span[semconv.LLM_PROMPT_TOKEN_IDS] == tuple(lists["prompt_token_ids"])
        assert span[semconv.llm_response_token_ids(0)] == tuple(lists["choices"][0]["token_ids"])


@pytest.mark.parametrize("value", ["not base64!", "AQAA", "AQAAAAI="])
def test_a_packed_field_that_is_not_whole_ids_is_named_and_left_out(value):
    """A string that is not base64 of whole 4-byte ids: the reader says what is wrong and appends
    nothing, as for a malformed list (the recorder names the field: test_instrumentation_openai_unit)."""
    from array import array

    from spanrl.instrumentation.packed_values import TOKEN_ID_TYPECODE
    from spanrl.instrumentation.response_token_fields import extend_token_ids

    ids = array(TOKEN_ID_TYPECODE, [7])
    assert "packed" in (extend_token_ids(ids, value) or "")
    assert ids.tolist() == [7]  # nothing appended


def test_a_relay_packs_every_shape_and_leaves_per_token_ids_and_non_ids_as_they_came():
    """``packed_replies`` on the reply shapes a relay passes (vLLM's lists), for a request that asked."""
    import contextvars

    from spanrl.trainer_bridge.relay.packed_replies import note_id_form, pack_reply_ids

    def packed(data: dict, stream_event: bool = False) -> dict:
        def run() -> dict:
            note_id_form({}, PACKED)
            pack_reply_ids(data, stream_event)
            return data
        return contextvars.copy_context().run(run)

    tokens = {"type": "raw_message_tokens", "message": "x", "tokens": [5, 6]}
    response = packed({"object": "response", "input_messages": [dict(tokens)], "output_messages": [dict(tokens)]})
    assert [m["tokens"] for m in response["input_messages"] + response["output_messages"]] == [
        "BQAAAAYAAAA=", "BQAAAAYAAAA="]
    event = packed({"type": "response.completed", "response": {"output_messages": [dict(tokens)]}}, True)
    assert unpack_token_ids(event["response"]["output_messages"][0]["tokens"]) == [5, 6]
    start = packed({"type": "message_start", "message": {"prompt_token_ids": [1, 2]}}, True)
    delta = packed({"type": "message_delta", "token_ids": [3, 4]}, True)
    assert unpack_token_ids(start["message"]["prompt_token_ids"]) == [1, 2]
    assert unpack_token_ids(delta["token_ids"]) == [3, 4]
    chunk = packed({"object": "chat.completion.chunk", "prompt_token_ids": [1], "choices": [{"token_ids": [9]}]}, True)
    assert chunk["choices"][0]["token_ids"] == [9] and unpack_token_ids(chunk["prompt_token_ids"]) == [1]
    body = packed({"object": "text_completion", "choices": [{"prompt_token_ids": [1], "token_ids": [9, "x"]}]})
    assert body["choices"][0]["token_ids"] == [9, "x"]  # not ids: as it came, for the agent's reader to name
    assert unpack_token_ids(body["choices"][0]["prompt_token_ids"]) == [1]
    note_id_form({}, {})  # a request that did not ask: lists stay lists
    unasked = {"prompt_token_ids": [1]}
    pack_reply_ids(unasked, False)
    assert unasked == {"prompt_token_ids": [1]}


def test_the_header_asks_too_the_bodys_word_wins_and_a_bad_form_is_refused(server, engine):
    """A client that cannot add a body field asks with the header; ``lists`` in the body overrides
    it; a form the server does not know is refused naming the field."""
    chat = {"model": engine.model_name, "messages": [{"role": "user", "content": "What is 37 + 45?"}],
            "return_token_ids": True, **GREEDY}
    url = f"{server.url}/v1/chat/completions"
    by_header = httpx.post(url, json=chat, headers=PACKED_HEADER, timeout=60).json()
    assert isinstance(by_header["prompt_token_ids"], str)
    overridden = httpx.post(url, json={**chat, semconv.TOKEN_IDS_FORM_FIELD: "lists"}, headers=PACKED_HEADER,
                            timeout=60).json()
    assert overridden["prompt_token_ids"] == unpack_token_ids(by_header["prompt_token_ids"])
    refused = httpx.post(url, json={**chat, semconv.TOKEN_IDS_FORM_FIELD: "zipped"}, timeout=60)
    assert refused.status_code == 422 and semconv.TOKEN_IDS_FORM_FIELD in refused.text  # as any bad field


def test_a_relay_answers_the_form_itself_and_never_sends_the_field_upstream():
    from spanrl.trainer_bridge.relay.config import RelayConfig
    from spanrl.trainer_bridge.relay.packed_replies import note_id_form
    from spanrl.trainer_bridge.relay.rewrite import rewrite_request

    body = {"model": "m", "messages": [], semconv.TOKEN_IDS_FORM_FIELD: "packed"}
    payload = rewrite_request(body, "/v1/chat/completions", RelayConfig(name="proxy"), None)
    assert semconv.TOKEN_IDS_FORM_FIELD not in payload and body[semconv.TOKEN_IDS_FORM_FIELD] == "packed"
    with pytest.raises(ValueError, match=semconv.TOKEN_IDS_FORM_FIELD):
        note_id_form({}, {semconv.TOKEN_IDS_FORM_FIELD: 3})
