"""Anthropic's Messages API through ``spanrl proxy`` in front of ``spanrl serve``: the real
``anthropic`` client -> the proxy -> the embedded policy server (a tiny model), the proxy's spans
exported over OTLP/gRPC to a real ``spanrl receive``. Each call (a message, a stream, a forced tool
call) is one transition with the engine's ids, though the agent never asked for them, its span
carrying the call's text; a prompt
candidate replaces the ``system`` prompt; upstream faults are Anthropic-shaped 502s; upstream 4xx
pass unchanged; the proxy takes its token as ``x-api-key``. The verl gateway (the same relay)
serves them under its model name.
"""

from __future__ import annotations

import anthropic
import httpx
import pytest

from spanrl.child_processes import free_port
from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.span_tree import records_from_bodies
from spanrl.trainer_bridge.endpoint_spans import SPANS_ENDPOINT_ENV
from spanrl.trainer_bridge.relay.proxy import ProxySettings, start_proxy
from spanrl.trainer_bridge.torch_backend.server import chat_format

from .proxy_support import assembled, complete, running_receiver, silent_upstream, span_bodies, unused_port_url

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                            "required": ["city"], "additionalProperties": False}}
GREEDY = {"temperature": 0}  # the anthropic client (2.x) has no temperature argument


@pytest.fixture(autouse=True)
def no_spans_from_the_upstream(monkeypatch):
    """Only the proxy's spans are tested: the server started here reads no OTLP endpoint."""
    for name in (SPANS_ENDPOINT_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def upstream(engine):
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    handle = serve_in_thread(engine, port=free_port())
    yield handle
    handle.stop()


@pytest.fixture
def receiver(tmp_path):
    with running_receiver(tmp_path) as info:
        yield info


@pytest.fixture
def proxy_for(receiver):
    handles = []

    def start(upstream_url: str, **fields):
        fields.setdefault("spans_endpoint", receiver["grpc"])
        handle = start_proxy(ProxySettings(upstream=upstream_url, port=0, **fields))
        handles.append(handle)
        return handle

    yield start
    for handle in handles:
        handle.stop()


def agent(proxy, rollout_id: str | None = None, api_key: str = "unused") -> anthropic.Anthropic:
    headers = {semconv.ROLLOUT_ID_HEADER: rollout_id} if rollout_id else {}
    return anthropic.Anthropic(base_url=proxy.url.removesuffix("/v1"), api_key=api_key, max_retries=0,
                               default_headers=headers, timeout=120)


def test_messages_through_the_proxy_are_one_transition_each_with_the_engines_ids(proxy_for, upstream, engine,
                                                                                  receiver):
    proxy = proxy_for(upstream.base_url, token_ids=True)
    api, model = agent(proxy, "proxy-messages"), engine.model_name
    served = []

    message = api.messages.create(model=model, max_tokens=6, system="Answer.", messages=QUESTION, extra_body=GREEDY)
    extras = message.model_extra or {}
    prompt = chat_format.encode_chat(engine.tokenizer, [{"role": "system", "content": "Answer."}, *QUESTION])
    assert extras[semconv.RESPONSE_PROMPT_TOKEN_IDS] == prompt  # asked by the proxy, not the agent
    served.append((prompt, extras[semconv.RESPONSE_CHOICE_TOKEN_IDS]))
    assert message.model == model and message.id.startswith("msg_")

    with api.messages.stream(model=model, max_tokens=6, messages=QUESTION, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start").message.model_extra or {}
    delta = next(e for e in events if e.type == "message_delta").model_extra or {}
    ids = delta[semconv.RESPONSE_CHOICE_TOKEN_IDS]
    assert "".join(b.text for b in final.content if b.type == "text") == engine.tokenizer.decode(
        ids, skip_special_tokens=True)
    served.append((start[semconv.RESPONSE_PROMPT_TOKEN_IDS], ids))

    forced = api.messages.create(model=model, max_tokens=40, tools=[WEATHER], messages=QUESTION, extra_body=GREEDY,
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert [b.name for b in forced.content if b.type == "tool_use"] == ["get_weather"]
    served.append(((forced.model_extra or {})[semconv.RESPONSE_PROMPT_TOKEN_IDS],
                   (forced.model_extra or {})[semconv.RESPONSE_CHOICE_TOKEN_IDS]))

    complete(receiver, "proxy-messages")
    rollout = assembled(receiver, "proxy-messages")
    assert [(list(t.prompt_token_ids), list(t.response_token_ids)) for t in rollout.transitions] == served
    assert all(not t.retokenized for t in rollout.transitions)
    calls = [r for r in records_from_bodies(span_bodies(receiver, "proxy-messages"))
             if r.attributes.get(semconv.LLM_SOURCE) == semconv.LLM_SOURCE_ENDPOINT]
    assert [r.attributes["http.route"] for r in calls] == ["/v1/messages"] * 3
    by_id = {r.attributes[semconv.GENAI_RESPONSE_ID]: r.attributes for r in calls}
    assert set(by_id) == {message.id, final.id, forced.id}
    # each span carries the call's text too (what a hosted upstream's calls are learnt from)
    assert by_id[message.id]["llm.input_messages.0.message.role"] == "system"
    assert by_id[message.id]["llm.input_messages.1.message.content"] == "What is 2 + 2?"
    assert by_id[final.id]["llm.output_messages.0.message.content"] == "".join(
        b.text for b in final.content if b.type == "text")
    assert by_id[forced.id]["llm.output_messages.0.message.tool_calls.0.tool_call.function.name"] == "get_weather"


def test_a_prompt_candidate_replaces_the_system_prompt(proxy_for, upstream, engine, tmp_path):
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text(f"{engine.model_name}: Answer in one word.\n")
    proxy = proxy_for(upstream.base_url, token_ids=True, prompts=str(prompts))
    for system in ("You are verbose.", None):
        extra = {} if system is None else {"system": system}
        message = agent(proxy).messages.create(model=engine.model_name, max_tokens=2, messages=QUESTION, **extra)
        expected = chat_format.encode_chat(engine.tokenizer, [{"role": "system", "content": "Answer in one word."},
                                                              *QUESTION])
        assert (message.model_extra or {})[semconv.RESPONSE_PROMPT_TOKEN_IDS] == expected


def test_upstream_faults_and_refusals_keep_anthropics_shape(proxy_for, upstream, engine):
    down = unused_port_url()
    with pytest.raises(anthropic.APIStatusError) as caught:
        agent(proxy_for(down)).messages.create(model="claude-x", max_tokens=4, messages=QUESTION)
    assert caught.value.status_code == 502 and down in caught.value.message
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "api_error"
    with silent_upstream() as silent:
        slow = agent(proxy_for(silent, request_timeout_s=0.5))
        for stream in (False, True):
            with pytest.raises(anthropic.APIStatusError) as caught:
                slow.messages.create(model="claude-x", max_tokens=4, messages=QUESTION, stream=stream)
            assert caught.value.status_code == 504 and silent in caught.value.message
            assert caught.value.body["error"]["type"] == "api_error"

    proxy = proxy_for(upstream.base_url)
    body = {"model": engine.model_name, "messages": QUESTION}  # no max_tokens: the server's 400 passes
    direct = httpx.post(f"{upstream.base_url}/messages", json=body)
    relayed = httpx.post(f"{proxy.url}/messages", json=body)
    assert direct.status_code == 400 and (relayed.status_code, relayed.json()) == (400, direct.json())

    guarded = proxy_for(upstream.base_url, token="proxy-token")
    assert agent(guarded, api_key="proxy-token").messages.create(
        model=engine.model_name, max_tokens=2, messages=QUESTION).content is not None
    with pytest.raises(anthropic.AuthenticationError) as refused:
        agent(guarded, api_key="wrong").messages.create(model=engine.model_name, max_tokens=2, messages=QUESTION)
    assert refused.value.body["error"]["type"] == "authentication_error"


def test_the_verl_gateway_relays_messages_under_its_served_name(upstream, engine):
    """The gateway (the same relay): the agent's name becomes the upstream's and comes back, the
    upstream is asked for the engine's ids, every event carries the gateway's policy version."""
    from spanrl.trainer_bridge.verl_backend.gateway import GatewayConfig, start_gateway

    gateway = start_gateway(GatewayConfig(served_model_name="policy"), [upstream.url])
    try:
        client = anthropic.Anthropic(base_url=gateway.url.removesuffix("/v1"), api_key="unused", max_retries=0)
        message = client.messages.create(model="policy", max_tokens=4, messages=QUESTION)
        extras = message.model_extra or {}
        assert message.model == "policy" and extras[semconv.RESPONSE_POLICY_VERSION] == 0
        assert extras[semconv.RESPONSE_PROMPT_TOKEN_IDS] == chat_format.encode_chat(engine.tokenizer, QUESTION)
        with client.messages.stream(model="policy", max_tokens=4, messages=QUESTION) as stream:
            events = list(stream)
        assert next(e for e in events if e.type == "message_start").message.model == "policy"
        relayed = [e.model_extra or {} for e in events if e.type in ("message_start", "message_delta")]
        assert [extra.get(semconv.RESPONSE_POLICY_VERSION) for extra in relayed] == [0, 0]
        assert relayed[1][semconv.RESPONSE_CHOICE_TOKEN_IDS]  # asked for by the gateway
    finally:
        gateway.stop()
