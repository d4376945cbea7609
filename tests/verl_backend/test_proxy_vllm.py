"""``spanrl proxy`` in front of vLLM (its CPU build), as users run vLLM: ``vllm serve`` of a
tiny model (the folder's one server, conftest.py's ``vllm_server``), the real ``openai`` client
through the proxy, the proxy's spans to a real ``spanrl receive``. Chat (streamed or not),
completions, the Responses API (streamed or not) and tools (offered, an earlier call and its
result) pass; a prompt candidate for the model replaces the agent's instructions before vLLM
sees them (its prompt ids say so); every call is one transition with vLLM's token ids. (A random
tiny model writes no tool call of its own; the proxy relaying one is tested with a warm-started
model in tests/trainer_bridge/test_proxy.py.)"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from spanrl.child_processes import free_port, wait_for_port
from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.store import SpanStore
from spanrl.trainer_bridge.relay.proxy import ProxySettings, start_proxy

SERVED = "tiny"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def receiver(tmp_path_factory):
    db = tmp_path_factory.mktemp("receiver") / "spanrl.db"
    grpc_port, http_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "spanrl", "receive", "--db", str(db), "--grpc-port", str(grpc_port),
         "--http-port", str(http_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(grpc_port, process, "spanrl receive")
        wait_for_port(http_port, process, "spanrl receive")
        yield {"db": db, "grpc": f"http://127.0.0.1:{grpc_port}", "http": f"http://127.0.0.1:{http_port}"}
    finally:
        process.terminate()
        process.wait(30)


def assembled(receiver, rollout_id: str):
    request = urllib.request.Request(f"{receiver['http']}/spanrl/v1/rollouts/{rollout_id}/complete", data=b"",
                                     method="POST")
    urllib.request.urlopen(request, timeout=10).close()
    with SpanStore(receiver["db"]) as store:
        deadline = time.monotonic() + 60
        while (rollout := store.assembled_rollout(rollout_id)) is None:
            assert time.monotonic() < deadline, f"rollout {rollout_id} was not assembled"
            time.sleep(0.2)
    return rollout


def tokens(messages: list[dict]) -> list[int]:
    return [token for message in messages for token in message["tokens"]]


def test_the_proxy_relays_every_api_to_vllm_with_its_ids_and_the_substituted_instructions(
        vllm_server, receiver, tmp_path, tiny_models):
    from transformers import AutoTokenizer

    prompts = tmp_path / "prompts.yaml"
    prompts.write_text(f"{SERVED}: Answer as the proxy says.\n")  # a resource for every agent calling the model
    proxy = start_proxy(ProxySettings(upstream=f"{vllm_server}/v1", port=0, token_ids=True, prompts=str(prompts),
                                      spans_endpoint=receiver["grpc"]))
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["tied"])
    try:
        api = openai.OpenAI(base_url=proxy.url, api_key="unused", max_retries=0,
                            default_headers={semconv.ROLLOUT_ID_HEADER: "vllm-proxy"})
        own = [{"role": "system", "content": "The agent's own prompt."}, {"role": "user", "content": "Hi?"}]
        served = []

        chat = api.chat.completions.create(model=SERVED, messages=own, max_tokens=6)
        text = tokenizer.apply_chat_template([{"role": "system", "content": "Answer as the proxy says."}, own[1]],
                                             add_generation_prompt=True, tokenize=False)
        expected = tokenizer.encode(text, add_special_tokens=False)
        assert chat.model_extra["prompt_token_ids"] == expected  # vLLM saw the candidate, not the agent's prompt
        assert len(chat.choices[0].logprobs.content) == len(chat.choices[0].model_extra["token_ids"])
        served.append((chat.model_extra["prompt_token_ids"], chat.choices[0].model_extra["token_ids"]))

        prompt, ids = None, []
        for chunk in api.chat.completions.create(model=SERVED, messages=own, max_tokens=6, stream=True):
            prompt = prompt or chunk.model_extra.get("prompt_token_ids")
            ids += [i for choice in chunk.choices for i in choice.model_extra.get("token_ids") or []]
        assert prompt == expected and ids
        served.append((prompt, ids))

        completion = api.completions.create(model=SERVED, prompt="12 + 30 =", max_tokens=4)
        served.append((completion.choices[0].model_extra["prompt_token_ids"],
                       completion.choices[0].model_extra["token_ids"]))

        called = [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
        tools = api.chat.completions.create(model=SERVED, messages=[*own, *called], tools=[WEATHER], max_tokens=6)
        direct = openai.OpenAI(base_url=f"{vllm_server}/v1", api_key="unused", max_retries=0).chat.completions.create(
            model=SERVED, messages=[{"role": "system", "content": "Answer as the proxy says."}, own[1], *called],
            tools=[WEATHER], max_tokens=1, extra_body={"return_token_ids": True})
        assert tools.model_extra["prompt_token_ids"] == direct.model_extra["prompt_token_ids"]  # the same request
        seen = tokenizer.decode(tools.model_extra["prompt_token_ids"])
        assert "get_weather" in seen and "21 C" in seen and "The agent's own prompt." not in seen
        served.append((tools.model_extra["prompt_token_ids"], tools.choices[0].model_extra["token_ids"]))

        response = api.responses.create(model=SERVED, input="Hi?", instructions="The agent's own.",
                                        max_output_tokens=6)
        assert "Answer as the proxy says." in tokenizer.decode(tokens(response.model_extra["input_messages"]))
        served.append((tokens(response.model_extra["input_messages"]), tokens(response.model_extra["output_messages"])))
        events = list(api.responses.create(model=SERVED, input="Hi?", max_output_tokens=6, stream=True))
        final = next(e for e in events if e.type == "response.completed").response.model_extra
        served.append((tokens(final["input_messages"]), tokens(final["output_messages"])))
    finally:
        proxy.stop()  # its last spans leave first
    rollout = assembled(receiver, "vllm-proxy")
    assert [(list(t.prompt_token_ids), list(t.response_token_ids)) for t in rollout.transitions] == served
    assert all(t.response_logprobs is not None for t in rollout.transitions[:2])
