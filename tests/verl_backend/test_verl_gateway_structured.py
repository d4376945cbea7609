"""The verl backend's gateway passes structured outputs to vLLM, which enforces them: vLLM's CPU
build serves a tiny random-weight model (`spanrl model init`) behind the gateway, and the real
``openai`` client asks the gateway, under any model name, for a strict ``json_schema`` answer,
a Responses ``text.format`` answer and a forced strict tool call. A random model never writes
valid JSON by chance: valid answers are vLLM's grammar at work, reached through the gateway.

One vLLM server for the module (its start takes a while on CPU); runs in `.venv-verl` with the
rest of this folder.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import jsonschema
import openai
import pytest

from spanrl.trainer_bridge.verl_backend.gateway import GatewayConfig, start_gateway

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
          "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}, "sure": {"type": "boolean"}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True, "description": "The weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["days"],
                   "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
QUESTION = [{"role": "user", "content": "How tall is the tower?"}]
SEEDS = range(8)
FORCED_OPENING = re.compile(r'<tool_call>\s*\{"name": "get_weather", "arguments": \{')  # vLLM's form of the call
# vLLM's CPU build takes minutes to start on a small, busy machine (its fixture runs inside the first test)
pytestmark = pytest.mark.timeout(1800)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_url(tiny_models):
    """vLLM's OpenAI server (CPU build) on the tied tiny model, JSON without free whitespace."""
    port = free_port()
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_models["tied"],
         "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         "--max-model-len", "2048", "--max-num-seqs", "16",
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",  # what vLLM needs for tool_choice
         "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited: {process.stdout.read()[-3000:]}")
            assert time.monotonic() < deadline, "vLLM did not come up in 10 minutes"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def gateway(vllm_url):
    handle = start_gateway(GatewayConfig(served_model_name="policy", spans_endpoint="off"), [vllm_url])
    yield handle
    handle.stop()


def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("stream", [False, True])
def test_strict_json_schema_through_the_gateway_is_enforced_by_vllm(gateway, stream):
    api = client(gateway)
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for seed in SEEDS:
        fields = dict(model="gpt-4o", messages=QUESTION, response_format=response_format, max_tokens=48, seed=seed)
        if stream:
            chunks = list(api.chat.completions.create(stream=True, **fields))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert {c.model for c in chunks} == {"gpt-4o"}  # any name, echoed
        else:
            reply = api.chat.completions.create(**fields)
            text = reply.choices[0].message.content
            assert reply.model == "gpt-4o" and reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_responses_text_format_through_the_gateway_is_enforced_by_vllm(gateway):
    api = client(gateway)
    text_format = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}
    for seed in SEEDS:
        response = api.responses.create(model="agent", input="How tall?", text=text_format, max_output_tokens=48,
                                        extra_body={"seed": seed})
        assert response.model == "agent"
        jsonschema.validate(json.loads(response.output_text), SCHEMA)


def test_a_forced_tool_call_through_the_gateway_is_steered_by_vllm(gateway):
    """vLLM writes a forced call in its own form and lets its arguments' JSON take any whitespace
    (a random model may wander in blanks until max_tokens): every reply is the forced call, its
    arguments schema-true where it finished, its opening where it was cut."""
    api = client(gateway)
    for seed in SEEDS:
        reply = api.chat.completions.create(model="triage", messages=QUESTION, tools=[WEATHER], max_tokens=48,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            seed=seed)
        choice = reply.choices[0]
        if choice.message.tool_calls:
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        else:  # cut by max_tokens inside the arguments: a random model never writes this opening by chance
            assert choice.finish_reason == "length", choice
            assert FORCED_OPENING.match(choice.message.content), choice
