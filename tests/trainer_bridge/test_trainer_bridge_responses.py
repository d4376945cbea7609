"""The embedded policy server's Responses API (``/v1/responses``), called with the real `openai`
client over HTTP: ids and logprobs as vLLM returns them on that route, stateful follow-ups,
function-call items in the history, the streamed event sequence, and OpenAI-style errors."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

INSTRUCTIONS = "Answer with ANSWER n."
QUESTION = "What is 37 + 45?"
IDS = {"enable_response_messages": True}


def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def ids_of(body: dict) -> tuple[list[int], list[int]]:
    """vLLM's shape: the prompt's ids in input_messages, the reply's in output_messages."""
    (prompt,) = body["input_messages"]
    (reply,) = body["output_messages"]
    assert prompt["type"] == reply["type"] == "raw_message_tokens"
    return prompt["tokens"], reply["tokens"]


def test_response_ids_and_logprobs_are_what_was_sampled(server, engine, forward_logprobs):
    raw = client(server).responses.with_raw_response.create(
        model=engine.model_name, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=12,
        include=["message.output_text.logprobs"], top_logprobs=2, extra_body=IDS)
    assert raw.headers["x-spanrl-policy-version"] == "0"
    body = json.loads(raw.text)
    response = raw.parse()
    assert body["policy_version"] == 0 and body["object"] == "response" and response.id.startswith("resp_")
    prompt_ids, output_ids = ids_of(body)
    assert prompt_ids == engine.encode_chat([{"role": "system", "content": INSTRUCTIONS},
                                             {"role": "user", "content": QUESTION}])
    assert engine.tokenizer.decode(prompt_ids) == body["input_messages"][0]["message"]
    assert 1 <= len(output_ids) <= 12
    assert engine.tokenizer.decode(output_ids, skip_special_tokens=True) == response.output_text
    assert response.status == ("incomplete" if len(output_ids) == 12 and output_ids[-1] not in engine.eos_ids
                               else "completed")
    (message,) = response.output
    (part,) = message.content
    served = torch.tensor([entry.logprob for entry in part.logprobs])
    assert torch.allclose(served, forward_logprobs(engine.model, prompt_ids, output_ids), atol=1e-4)
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    assert response.usage.input_tokens == len(prompt_ids) and response.usage.output_tokens == len(output_ids)
    # without enable_response_messages nor include, no ids and no logprobs
    plain = json.loads(client(server).responses.with_raw_response.create(
        model=engine.model_name, input=QUESTION, max_output_tokens=4).text)
    assert "input_messages" not in plain and plain["output"][0]["content"][0]["logprobs"] is None


def test_stateful_follow_ups_carry_the_conversation_but_not_the_instructions(server, engine):
    api = client(server)
    first = api.responses.create(model=engine.model_name, instructions=INSTRUCTIONS, input=QUESTION,
                                 max_output_tokens=8, temperature=0.0)
    second = api.responses.create(model=engine.model_name, previous_response_id=first.id,
                                  input=[{"role": "user", "content": "And 1 + 1?"}], max_output_tokens=8,
                                  extra_body=IDS)
    assert second.previous_response_id == first.id
    prompt_ids, _ = ids_of(second.model_dump())
    assert prompt_ids == engine.encode_chat([
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And 1 + 1?"}])
    third = api.responses.create(model=engine.model_name, previous_response_id=second.id, input="Thanks",
                                 max_output_tokens=4, extra_body=IDS, store=False)
    prompt_ids, _ = ids_of(third.model_dump())
    assert prompt_ids == engine.encode_chat([
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And 1 + 1?"}, {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Thanks"}])
    # stored responses can be read back; one made with store=false cannot be continued
    assert api.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(openai.NotFoundError) as raised:
        api.responses.create(model=engine.model_name, previous_response_id=third.id, input="more")
    assert raised.value.status_code == 404
    assert raised.value.body["param"] == "previous_response_id"
    assert raised.value.body["code"] == "previous_response_not_found"
    api.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(second.id)


def test_function_call_items_are_rendered_into_the_prompt(server, engine):
    items = [
        {"role": "developer", "content": "Use the calculator."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 37, "b": 45}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "82"},
    ]
    response = client(server).responses.create(model=engine.model_name, input=items, max_output_tokens=6,
                                               extra_body=IDS)
    prompt_ids, output_ids = ids_of(response.model_dump())
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 37, "b": 45}'}}
    assert prompt_ids == engine.encode_chat([
        {"role": "system", "content": "Use the calculator."}, {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "82", "tool_call_id": "call_1"}])
    rendered = engine.tokenizer.decode(prompt_ids)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 37, "b": 45}}\n</tool_call>' in rendered
    assert "<|im_start|>user\n<tool_response>\n82\n</tool_response><|im_end|>" in rendered
    assert engine.tokenizer.decode(output_ids, skip_special_tokens=True) == response.output_text


def test_streamed_events_are_the_sequence_the_client_parses(server, engine):
    api = client(server)
    events = list(api.responses.create(model=engine.model_name, input=QUESTION, max_output_tokens=10, stream=True,
                                       include=["message.output_text.logprobs"], extra_body=IDS))
    types = [event.type for event in events]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in deltas)
    done = events[-1].response
    assert events[0].response.status == "in_progress" and done.output_text == text == events[-4].text
    prompt_ids, output_ids = ids_of(done.model_dump())
    assert len(output_ids) == len(deltas) and 1 <= len(output_ids) <= 10
    assert prompt_ids == engine.encode_chat([{"role": "user", "content": QUESTION}])
    assert engine.tokenizer.decode(output_ids, skip_special_tokens=True) == text
    assert [d.logprobs[0].logprob for d in deltas] == [e.logprob for e in done.output[0].content[0].logprobs]
    assert done.model_dump()["policy_version"] == 0
    # the SDK's stream helper reaches the same final response, and a follow-up continues it
    with api.responses.stream(model=engine.model_name, input=QUESTION, max_output_tokens=6) as stream:
        final = stream.get_final_response()
    follow = api.responses.create(model=engine.model_name, previous_response_id=final.id, input="ok",
                                  max_output_tokens=2, extra_body=IDS)
    assert ids_of(follow.model_dump())[0][:len(prompt_ids)] == prompt_ids


MALFORMED = [
    ([{"role": "user", "content": "hi"}, {"type": "function_call", "name": "add", "arguments": "{}"}],
     "input[1].call_id"),
    ([{"type": "function_call_output", "call_id": "c", "output": 3}], "input[0].output"),
    ([{"role": "robot", "content": "hi"}], "input[0].role"),
    ([{"type": "message", "role": "user", "content": [{"type": "input_text"}]}], "input[0].content[0].text"),
    ([{"type": "web_search_call", "id": "ws"}], "input[0].type"),
    (["hello"], "input[0]"),
]


def test_malformed_items_are_400_naming_the_field(server, engine):
    for items, param in MALFORMED:
        with pytest.raises(openai.BadRequestError) as raised:
            client(server).responses.create(model=engine.model_name, input=items, max_output_tokens=2)
        assert raised.value.status_code == 400
        assert raised.value.body["param"] == param, raised.value.body
        assert param in raised.value.body["message"]


def test_models_lists_the_route_and_unknown_ids_are_404(server, engine):
    fields = httpx.get(f"{server.base_url}/models").json()["data"][0]["request_fields"]
    assert "previous_response_id" in fields["/v1/responses"]["implemented"]
    missing = httpx.post(f"{server.base_url}/responses", json={
        "model": engine.model_name, "input": "hi", "previous_response_id": "resp_nope"})
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "invalid_request_error"
