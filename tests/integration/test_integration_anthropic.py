"""An agent on Anthropic's Python SDK trains with zero code change: run under
``opentelemetry-instrument`` against the embedded policy server's Messages API (``/v1/messages``),
which exports its own span per call to a real ``spanrl receive``. openinference's Anthropic
instrumentor makes the agent's LLM span of each call and spanrl's adds the engine's ids and the
response id to it, so the receiver joins the two witnesses: exactly one transition per call, named
by the agent, with the ids the engine served.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from spanrl.child_processes import free_port
from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.store import SpanStore
from spanrl.trainer_bridge.endpoint_spans import SPANS_ENDPOINT_ENV
from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir
from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

from .conftest import TEST_DEVICE, RecordingPolicyEngine
from .test_integration_endpoint_spans import AGENTS, INSTRUMENT, _stored_records, served_ids, wait_assembled


@pytest.fixture
def span_emitting_server(tmp_path, receiver, monkeypatch):
    """The embedded policy server, its engine recording every request, exporting its spans to ``receiver``."""
    monkeypatch.setenv(SPANS_ENDPOINT_ENV, receiver["grpc"])
    model_dir = create_model_dir(tmp_path / "model", preset="tiny", seed=0)
    engine = RecordingPolicyEngine.from_pretrained(model_dir, device=TEST_DEVICE, model_name="policy")
    server = serve_in_thread(engine, port=free_port())
    try:
        yield server
    finally:
        server.stop()


def run_anthropic_agent(server, receiver, rollout_id: str):
    """The agent under ``opentelemetry-instrument``, its rollout ended; its assembled rollout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "ANTHROPIC_", "OPENAI_"))}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver["grpc"], OTEL_TRACES_EXPORTER="otlp",
               OTEL_SERVICE_NAME="claude-style-agent", PYTHONUNBUFFERED="1",
               OTEL_RESOURCE_ATTRIBUTES=f"{semconv.ROLLOUT_ID}={rollout_id},{semconv.AGENT_NAME}=coder",
               ANTHROPIC_BASE_URL=server.url, ANTHROPIC_API_KEY="unused", ANTHROPIC_MODEL="policy")
    result = subprocess.run([str(INSTRUMENT), sys.executable, str(AGENTS / "anthropic_agent.py")], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    replies = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(replies) == len(server.engine.jobs) == 4
    assert replies[2].startswith("get_weather(")  # the forced call came back as a tool_use block
    spans = server.server.config.app.state.endpoint_spans
    if spans is not None:
        assert spans.flush()
    request = urllib.request.Request(f"{receiver['http']}/spanrl/v1/rollouts/{rollout_id}/complete", data=b"",
                                     method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status in (200, 202)
    store = SpanStore(receiver["db"])
    try:
        return wait_assembled(store, rollout_id)
    finally:
        store.close()


def test_an_instrumented_anthropic_agent_is_one_named_transition_per_call(span_emitting_server, receiver):
    engine, rollout_id = span_emitting_server.engine, "anthropic-sdk-rollout"
    assembled = run_anthropic_agent(span_emitting_server, receiver, rollout_id)
    records = _stored_records(receiver["db"], rollout_id)
    agent_llm = [r for r in records if r.attributes.get("llm.system") == "anthropic"]  # openinference's
    sdk_calls = [r for r in records if r.name == "anthropic.messages.create"]  # the SDK's own span of a call
    endpoint = [r for r in records if r.attributes.get(semconv.LLM_SOURCE) == semconv.LLM_SOURCE_ENDPOINT]
    assert len(agent_llm) == len(sdk_calls) == len(endpoint) == 4  # every witness of each call arrived...
    # ... the agent side recorded the engine's ids too (asked for by spanrl's instrumentor), the same ...
    by_response_id = {r.attributes[semconv.GENAI_RESPONSE_ID]: r for r in endpoint}
    for sdk_call in sdk_calls:
        served = by_response_id[sdk_call.attributes[semconv.GENAI_RESPONSE_ID]]
        assert sdk_call.attributes[semconv.LLM_PROMPT_TOKEN_IDS] == served.attributes[semconv.LLM_PROMPT_TOKEN_IDS]
        assert served.parent_key == sdk_call.key  # the SDK sent its traceparent
    # ... and each call is one transition: the endpoint's record, named by the agent, with the served ids
    assert [(t.prompt_token_ids, t.response_token_ids) for t in assembled.transitions] == served_ids(engine)
    assert {t.span_id for t in assembled.transitions} == {r.key for r in endpoint}
    assert [t.agent_name for t in assembled.transitions] == ["coder"] * 4
    assert all(not t.retokenized and t.policy_version == engine.version for t in assembled.transitions)
    assert assembled.counters == {}


def test_without_the_endpoints_spans_the_agents_own_spans_carry_the_engines_ids(policy_server, receiver):
    """A server exporting no spans: the ids spanrl's instrumentor asked for and recorded on the
    agent's side are the transitions' (no retokenizing)."""
    assert policy_server.server.config.app.state.endpoint_spans is None
    assembled = run_anthropic_agent(policy_server, receiver, "anthropic-agent-side")
    assert [(t.prompt_token_ids, t.response_token_ids) for t in assembled.transitions] == served_ids(
        policy_server.engine)
    assert all(not t.retokenized and t.agent_name == "coder" for t in assembled.transitions)
