"""Anthropic's Messages API on the embedded policy server, through the real ``anthropic`` client.

The server runs its HTTP front end in a child process (as ``spanrl serve`` does) and in a thread
(the ``server`` fixture's two forms), and as the ``spanrl serve`` command itself; the client
speaks to it over HTTP. A reply, a stream, a
system prompt, a forced tool call answered with its result, token ids and the policy version, the
x-api-key token, and Anthropic-shaped 400s naming the field.
"""

from __future__ import annotations

import anthropic
import httpx
import pytest

from spanrl.instrumentation import semconv
from spanrl.trainer_bridge.torch_backend.server import chat_format

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                            "required": ["city"], "additionalProperties": False}}


# the anthropic client (2.x) has no temperature argument: it goes in the body, as older clients send it
GREEDY = {"temperature": 0}


def client_of(server, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0, timeout=120)


def test_a_message_and_its_stream_carry_what_the_engine_sampled(server, engine):
    client = client_of(server)
    message = client.messages.create(model=engine.model_name, max_tokens=5, system="You add numbers.",
                                     messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                     extra_body={semconv.REQUEST_RETURN_TOKEN_IDS: True, **GREEDY})
    assert message.id.startswith("msg_") and message.role == "assistant" and message.type == "message"
    assert message.stop_reason in ("end_turn", "max_tokens")
    extras = message.model_extra or {}
    prompt = chat_format.encode_chat(engine.tokenizer, [{"role": "system", "content": "You add numbers."},
                                                        {"role": "user", "content": "What is 2 + 3?"}])
    assert extras[semconv.RESPONSE_PROMPT_TOKEN_IDS] == prompt  # the system prompt is the chat's system message
    ids = extras[semconv.RESPONSE_CHOICE_TOKEN_IDS]
    assert message.usage.input_tokens == len(prompt) and message.usage.output_tokens == len(ids) <= 5
    text = "".join(block.text for block in message.content if block.type == "text")
    assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert extras[semconv.RESPONSE_POLICY_VERSION] == engine.version

    with client.messages.stream(model=engine.model_name, max_tokens=5, extra_body=GREEDY,
                                system=[{"type": "text", "text": "You add numbers."}],
                                messages=[{"role": "user", "content": "What is 2 + 3?"}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert "".join(b.text for b in final.content if b.type == "text") == text  # greedy: the same reply
    assert final.stop_reason == message.stop_reason and final.usage.output_tokens == len(ids)


def test_a_stop_sequence_ends_the_reply_and_is_named(server, engine):
    client = client_of(server)
    free = client.messages.create(model=engine.model_name, max_tokens=8, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": "What is 7 + 1?"}])
    text = free.content[0].text
    stop = text.strip()[1:3] or text[-1]
    message = client.messages.create(model=engine.model_name, max_tokens=8, stop_sequences=[stop], extra_body=GREEDY,
                                     messages=[{"role": "user", "content": "What is 7 + 1?"}])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert "".join(b.text for b in message.content) == text[:text.find(stop)]


def test_a_forced_tool_call_and_its_result_round_trip(server, engine):
    client = client_of(server)
    question = [{"role": "user", "content": "Weather in Paris?"}]
    message = client.messages.create(model=engine.model_name, max_tokens=40, tools=[WEATHER], messages=question,
                                     tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    calls = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" or message.stop_reason == "max_tokens"
    assert calls and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
    assert isinstance(calls[0].input, dict)

    with client.messages.stream(model=engine.model_name, max_tokens=40, tools=[WEATHER], messages=question,
                                tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    streamed_calls = [block for block in streamed.content if block.type == "tool_use"]
    assert [(c.name, c.input) for c in streamed_calls] == [(c.name, c.input) for c in calls]

    follow_up = [*question, {"role": "assistant", "content": [c.model_dump() for c in calls]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                               "content": "sunny, 21 C"}]}]
    answer = client.messages.create(model=engine.model_name, max_tokens=4, tools=[WEATHER], messages=follow_up,
                                    extra_body={semconv.REQUEST_RETURN_TOKEN_IDS: True})
    # the call and its result are rendered as the chat template writes a tool call and a tool message
    rendered = chat_format.render_chat(engine.tokenizer, [
        {"role": "user", "content": "Weather in Paris?"},
        chat_format.chat_message("assistant", "", [chat_format.ToolCall(calls[0].id, "get_weather",
                                                                        _json(calls[0].input))]),
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": calls[0].id}],
        [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                           "parameters": WEATHER["input_schema"]}}])
    assert (answer.model_extra or {})[semconv.RESPONSE_PROMPT_TOKEN_IDS] == chat_format.encode_text(
        engine.tokenizer, rendered)


def test_a_last_assistant_message_is_a_prefill_the_reply_continues(server, engine):
    history = [{"role": "user", "content": "What is 2 + 3?"}]
    message = client_of(server).messages.create(
        model=engine.model_name, max_tokens=3, messages=[*history, {"role": "assistant", "content": "ANSWER"}],
        extra_body={semconv.REQUEST_RETURN_TOKEN_IDS: True, **GREEDY})
    prompt = chat_format.render_chat(engine.tokenizer, history) + "ANSWER"
    assert (message.model_extra or {})[semconv.RESPONSE_PROMPT_TOKEN_IDS] == chat_format.encode_text(
        engine.tokenizer, prompt)


def _json(value) -> str:
    import json

    return json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize(("body", "field"), [
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
])
def test_bad_input_is_an_anthropic_400_naming_the_field(server, engine, body, field):
    body = {**body, "model": engine.model_name}
    reply = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert field in error["error"]["message"]
    if "max_tokens" in body:  # the client itself refuses a call without max_tokens
        with pytest.raises(anthropic.BadRequestError):
            client_of(server).messages.create(**body)


def test_the_agents_token_is_taken_as_x_api_key(engine):
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    handle = serve_in_thread(engine, api_token="secret-token")
    try:
        question = {"model": engine.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        assert client_of(handle, "secret-token").messages.create(**question).content is not None
        with pytest.raises(anthropic.AuthenticationError) as refused:
            client_of(handle, "wrong").messages.create(**question)
        assert refused.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.NotFoundError):
            client_of(handle, "secret-token").messages.create(**{**question, "model": "no-such-model"})
    finally:
        handle.stop()


def test_spanrl_serve_answers_the_anthropic_client(tiny_model_dir):
    """The CLI as users run it, with a token: the client sends it as ``x-api-key``."""
    import os
    import subprocess
    import sys

    from spanrl.child_processes import free_port, wait_for_port

    from .conftest import TEST_DEVICE

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    process = subprocess.Popen([sys.executable, "-m", "spanrl", "serve", str(tiny_model_dir), "--port", str(port),
                                "--token", "agents-token", "--served-model-name", "*", "--device", TEST_DEVICE],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_port(port, process, "spanrl serve", timeout_s=120)
        client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="agents-token", max_retries=0)
        message = client.messages.create(model="claude-sonnet", max_tokens=4, system="Be brief.",
                                         messages=[{"role": "user", "content": "What is 2 + 3?"}])
        assert message.model == "claude-sonnet" and message.usage.output_tokens <= 4
        with client.messages.stream(model="claude-sonnet", max_tokens=4,
                                    messages=[{"role": "user", "content": "What is 2 + 3?"}]) as stream:
            assert stream.get_final_message().usage.output_tokens <= 4
    finally:
        process.terminate()
        process.communicate(timeout=30)
