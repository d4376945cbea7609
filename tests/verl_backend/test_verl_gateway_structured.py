"""The verl backend's gateway passes structured outputs to vLLM, which enforces them: vLLM's CPU
build serves a tiny random-weight model (`spanrl model init`) behind the gateway, and the real
``openai`` client asks the gateway, under any model name, for a strict ``json_schema`` answer,
a Responses ``text.format`` answer and a forced strict tool call. A random model never writes
valid JSON by chance: valid answers are vLLM's grammar at work, reached through the gateway.

vLLM is the folder's one server (conftest.py's ``vllm_server``: greedy by default, so these requests
ask for temperature 1 and a seed each); runs in `.venv-verl` with the rest of this folder.
"""

from __future__ import annotations

import json
import re

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
# vLLM's CPU build takes minutes to start on a small, busy machine (its fixture may run inside the first test)
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def gateway(vllm_server):
    handle = start_gateway(GatewayConfig(served_model_name="policy", spans_endpoint="off"), [vllm_server])
    yield handle
    handle.stop()


def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("stream", [False, True])
def test_strict_json_schema_through_the_gateway_is_enforced_by_vllm(gateway, stream):
    api = client(gateway)
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for seed in SEEDS:
        fields = dict(model="gpt-4o", messages=QUESTION, response_format=response_format, max_tokens=48, seed=seed,
                      temperature=1.0)
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
                                        temperature=1.0, extra_body={"seed": seed})
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
                                            seed=seed, temperature=1.0)
        choice = reply.choices[0]
        if choice.message.tool_calls:
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        else:  # cut by max_tokens inside the arguments: a random model never writes this opening by chance
            assert choice.finish_reason == "length", choice
            assert FORCED_OPENING.match(choice.message.content), choice
