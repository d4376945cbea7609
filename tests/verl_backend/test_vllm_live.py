"""Against a running vLLM server (the CPU build, as `.ci/verl_env.sh` installs it), not a recording:
an unchanged OpenAI-SDK agent of tests/instrumentation/agents under `opentelemetry-instrument`
sends its spans to the real receiver, whose transitions must carry exactly the ids vLLM saw and
sampled; and the verl backend's gateway relays agents' calls to vLLM with ids, version and its own
model name. vLLM is the folder's one server (conftest.py's ``vllm_server``); it samples greedily by
default, so a call asked again directly gives the engine's ids to compare with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.server import ReceiverServer
from spanrl.otlp_receiver.settings import ReceiverSettings
from spanrl.otlp_receiver.store import SpanStore
from spanrl.trainer_bridge.verl_backend.gateway import GatewayConfig, start_gateway

from .vllm_server import VLLM_MAX_NEW_TOKENS

REPO = Path(__file__).resolve().parents[2]
AGENTS = REPO / "tests" / "instrumentation" / "agents"
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]  # what openai_calls_agent.py asks
SERVED = "policy"  # the model name the test agents call
# the first test may also wait for vLLM to start (measured 30-90 s on 2 quiet cores, minutes on busy ones)
pytestmark = pytest.mark.timeout(900)


def engine_chat(url: str) -> tuple[list[int], list[int]]:
    """Ask vLLM itself (no spanrl part in between) for MESSAGES' answer: its prompt and response ids."""
    body = {"model": SERVED, "messages": MESSAGES, "return_token_ids": True}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60.0)
    reply.raise_for_status()
    answer = reply.json()
    return answer["prompt_token_ids"], answer["choices"][0]["token_ids"]


def test_an_sdk_agents_transitions_carry_the_ids_vllm_saw_and_sampled(vllm_server, tmp_path):
    db = tmp_path / "spanrl.db"
    receiver = ReceiverServer(ReceiverSettings(grpc_port=0, http_port=0, db=str(db), grace_s=0.2, poll_s=0.05,
                                               idle_timeout_s=0)).start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver.grpc_port}", OTEL_TRACES_EXPORTER="otlp",
                   OTEL_SERVICE_NAME="live-agent", OTEL_RESOURCE_ATTRIBUTES=f"{semconv.ROLLOUT_ID}=live",
                   OPENAI_BASE_URL=f"{vllm_server}/v1", OPENAI_API_KEY="unused", PYTHONUNBUFFERED="1")
        instrument = str(Path(sys.executable).parent / "opentelemetry-instrument")
        result = subprocess.run([instrument, sys.executable, str(AGENTS / "openai_calls_agent.py"), "quick"],
                                env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        made = json.loads(result.stdout.strip().splitlines()[-1])  # chat, chat stream, async chat, async stream
        store = SpanStore(db)
        try:
            store.complete_rollout("live")
            deadline = time.monotonic() + 60
            while store.assembled_rollout("live") is None:
                assert time.monotonic() < deadline, "the rollout was not assembled"
                time.sleep(0.1)
            rollout = store.assembled_rollout("live")
        finally:
            store.close()
    finally:
        receiver.stop()
    assert rollout is not None and len(rollout.transitions) == len(made) == 4, rollout
    prompt_ids, response_ids = engine_chat(vllm_server)
    assert 1 <= len(response_ids) <= VLLM_MAX_NEW_TOKENS
    for transition in rollout.transitions:
        assert list(transition.prompt_token_ids) == prompt_ids
        assert list(transition.response_token_ids) == response_ids
        assert not transition.retokenized
    assert not [p for p in rollout.problems if "token ids" in p], rollout.problems


def test_the_gateway_relays_agents_calls_to_vllm_with_ids_and_the_policy_version(vllm_server):
    prompt_ids, response_ids = engine_chat(vllm_server)
    gateway = start_gateway(GatewayConfig(served_model_name="policy-in-training", spans_endpoint="off"), [vllm_server])
    try:
        gateway.set_policy_version(4)
        client = openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(model="policy-in-training", messages=MESSAGES)
        body = json.loads(raw.text)
        assert raw.headers["x-spanrl-policy-version"] == "4"
        assert body["model"] == "policy-in-training" and body["policy_version"] == 4
        assert body["prompt_token_ids"] == prompt_ids  # asked for by the gateway, unasked by the agent
        assert body["choices"][0]["token_ids"] == response_ids
        assert len(body["choices"][0]["logprobs"]["content"]) == len(response_ids)

        with client.chat.completions.with_streaming_response.create(
                model="policy-in-training", messages=MESSAGES, stream=True) as streamed:
            assert streamed.headers["x-spanrl-policy-version"] == "4"
            chunks = [chunk.model_dump() for chunk in streamed.parse()]
        assert {c["model"] for c in chunks} == {"policy-in-training"} and {c["policy_version"] for c in chunks} == {4}
        assert chunks[0]["prompt_token_ids"] == prompt_ids
        assert [i for c in chunks for choice in c["choices"] for i in (choice.get("token_ids") or [])] == response_ids
        assert gateway.stats().upstreams[0].requests == 2
    finally:
        gateway.stop()
