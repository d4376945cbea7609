"""The verl gateway's own LLM span per request: in front of a real upstream (spanrl's embedded
policy server, speaking vLLM's dialect), exported over OTLP/gRPC to a real ``spanrl receive``;
the agent is the real ``openai`` client with no instrumentation, sending only the rollout header."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from spanrl.child_processes import free_port, wait_for_port
from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.store import SpanStore
from spanrl.trainer_bridge.endpoint_spans import SPANS_ENDPOINT_ENV
from spanrl.trainer_bridge.verl_backend.gateway import GatewayConfig, start_gateway

TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")
SERVED = "policy-in-training"
ROLLOUT_ID = "gateway-rollout"


@pytest.fixture
def receiver(tmp_path):
    db = tmp_path / "spanrl.db"
    grpc_port, http_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "spanrl", "receive", "--db", str(db), "--grpc-port", str(grpc_port),
         "--http-port", str(http_port), "--grace-s", "0.3"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_port(grpc_port, process, "spanrl receive")
        wait_for_port(http_port, process, "spanrl receive")
        yield {"db": db, "grpc": f"http://127.0.0.1:{grpc_port}", "http": f"http://127.0.0.1:{http_port}"}
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


@pytest.fixture
def upstream(tiny_model_dir, monkeypatch):
    """One embedded policy server that emits no spans of its own (only the gateway's are tested)."""
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    for name in (SPANS_ENDPOINT_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    engine = PolicyEngine.from_pretrained(tiny_model_dir, device=TEST_DEVICE, dtype="float32")
    server = serve_in_thread(engine)
    yield server
    server.stop()


def test_the_gateway_emits_one_span_per_call_with_the_upstreams_ids(upstream, receiver):
    gateway = start_gateway(GatewayConfig(served_model_name=SERVED, spans_endpoint=receiver["grpc"]), [upstream.url])
    try:
        gateway.set_policy_version(3)
        client = openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0,
                               default_headers={semconv.ROLLOUT_ID_HEADER: ROLLOUT_ID})
        served = []  # (prompt ids, response ids, logprobs) as the gateway relayed them
        raw = client.chat.completions.with_raw_response.create(
            model=SERVED, max_tokens=6, messages=[{"role": "user", "content": "What is 37 + 45?"}])
        body = json.loads(raw.text)
        choice = body["choices"][0]
        served.append((body["prompt_token_ids"], choice["token_ids"],
                       [entry["logprob"] for entry in choice["logprobs"]["content"]]))
        stream = client.completions.create(model=SERVED, prompt="CALC 4+4", max_tokens=5, stream=True,
                                           extra_body={"return_token_ids": True})
        prompt_ids, ids, logprobs = None, [], []
        for chunk in stream:
            extra = chunk.choices[0].model_extra
            prompt_ids = prompt_ids or extra.get("prompt_token_ids")
            ids += extra.get("token_ids") or []
            logprobs += chunk.choices[0].logprobs.token_logprobs
        served.append((prompt_ids, ids, logprobs))
    finally:
        gateway.stop()  # flushes the gateway's spans
    request = urllib.request.Request(f"{receiver['http']}/spanrl/v1/rollouts/{ROLLOUT_ID}/complete", data=b"",
                                     method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status in (200, 202)
    store = SpanStore(receiver["db"])
    try:
        deadline = time.monotonic() + 20
        while not (done := [r for r in store.completed_rollouts(since=0)[0] if r.rollout_id == ROLLOUT_ID]):
            assert time.monotonic() < deadline, "the rollout was not assembled"
            time.sleep(0.1)
    finally:
        store.close()
    transitions = done[0].transitions
    assert [(list(t.prompt_token_ids), list(t.response_token_ids)) for t in transitions] == [
        (prompt, response) for prompt, response, _ in served]
    for transition, (_, response, logprobs) in zip(transitions, served, strict=True):
        assert len(response) > 0
        assert transition.policy_version == 3  # the gateway's version, not the upstream's 0
        assert transition.response_logprobs == pytest.approx(logprobs)
        assert transition.retokenized is False
