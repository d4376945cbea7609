"""The policy endpoint's own LLM spans, end to end: the embedded policy server exports one span
per generation request over OTLP/gRPC to a real ``spanrl receive`` process.

- A raw ``httpx`` agent (no OpenAI SDK, no spanrl code) sending only the rollout header, or only
  the W3C ``traceparent``/``baggage`` headers, trains: one transition per call with the ids the
  engine produced (recorded in the server's process), though it never asked for ids.
- An OpenAI-SDK agent under ``opentelemetry-instrument`` reports the same calls itself: still
  exactly one transition per call.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from spanrl.child_processes import free_port, wait_for_port
from spanrl.exporter.in_process import span_exporter
from spanrl.exporter.span_processor import install_identity_processor
from spanrl.instrumentation import rollout, semconv
from spanrl.otlp_receiver.span_tree import SpanTree, records_from_bodies
from spanrl.otlp_receiver.store import SpanStore
from spanrl.trainer_bridge.endpoint_spans import SPANS_ENDPOINT_ENV
from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir
from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

from .conftest import TEST_DEVICE, RecordingPolicyEngine

AGENTS = Path(__file__).resolve().parent / "agents"
INSTRUMENT = Path(sys.executable).parent / "opentelemetry-instrument"


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


def endpoint_spans_of(server):
    spans = server.server.config.app.state.endpoint_spans
    assert spans is not None, "the server was started without span export"
    return spans


def served_ids(engine) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [(tuple(job.prompt_ids), tuple(job.result.choices[0].token_ids)) for job in engine.jobs]


def wait_assembled(store: SpanStore, rollout_id: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for assembled in store.completed_rollouts(since=0)[0]:
            if assembled.rollout_id == rollout_id:
                return assembled
        time.sleep(0.1)
    raise AssertionError(f"rollout {rollout_id} was not assembled within {timeout_s} s")


def run_raw_agent_in_a_rollout(base_url: str, receiver, rollout_id: str, flush) -> list[str]:
    """The raw httpx agent inside a rollout of this process (its root span exported to ``receiver``)."""
    provider = TracerProvider()
    install_identity_processor(provider)
    provider.add_span_processor(SimpleSpanProcessor(span_exporter(receiver["grpc"], "grpc", {})))
    propagator = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
    with rollout("task-raw", attempt=2, rollout_id=rollout_id, tracer_provider=provider):
        headers: dict[str, str] = {}
        propagator.inject(headers)  # what OTel's generic HTTP instrumentation puts on a request
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
        env.update(OPENAI_BASE_URL=base_url, OPENAI_MODEL="policy", TRACE_HEADERS=json.dumps(headers),
                   ROLLOUT_ID=rollout_id)
        result = subprocess.run([sys.executable, str(AGENTS / "raw_httpx_agent.py")], env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        flush()  # the endpoint's spans are exported before the rollout ends
    provider.shutdown()
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_raw_httpx_agent_trains_from_the_endpoints_spans(span_emitting_server, receiver):
    engine = span_emitting_server.engine
    replies = run_raw_agent_in_a_rollout(span_emitting_server.base_url, receiver, "raw-httpx-rollout",
                                         lambda: endpoint_spans_of(span_emitting_server).flush())
    assert len(replies) == len(engine.jobs) == 3

    store = SpanStore(receiver["db"])
    try:
        assembled = wait_assembled(store, "raw-httpx-rollout")
    finally:
        store.close()
    assert [(t.prompt_token_ids, t.response_token_ids) for t in assembled.transitions] == served_ids(engine)
    assert assembled.task_id == "task-raw" and assembled.attempt == 2
    for transition in assembled.transitions:
        assert transition.retokenized is False and transition.policy_version == engine.version
    spans = {span.key: span for span in _stored_records(receiver["db"], "raw-httpx-rollout")}
    by_call = [spans[t.span_id] for t in assembled.transitions]
    assert all(span.attributes[semconv.LLM_SOURCE] == semconv.LLM_SOURCE_ENDPOINT for span in by_call)
    root = next(span for span in spans.values() if span.name == semconv.ROLLOUT_SPAN_NAME)
    # call 1 sent only the rollout header (a trace of its own); calls 2 and 3 the caller's traceparent
    assert by_call[0].trace_id != root.trace_id
    assert [span.parent_key for span in by_call[1:]] == [root.key, root.key]
    assert by_call[1].attributes[semconv.TASK_ID] == "task-raw"  # the identity came in the baggage


def _stored_records(db: Path, rollout_id: str):
    store = SpanStore(db)
    try:
        return list(SpanTree(records_from_bodies(s.body for s in store.rollout_spans(rollout_id))).order)
    finally:
        store.close()


def run_instrumented_agent(script: str, rollout_id: str, otlp_endpoint: str, base_url: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=otlp_endpoint, OTEL_TRACES_EXPORTER="otlp",
               OTEL_SERVICE_NAME="sdk-agent", OTEL_RESOURCE_ATTRIBUTES=f"{semconv.ROLLOUT_ID}={rollout_id}",
               OPENAI_BASE_URL=base_url, OPENAI_API_KEY="unused", OPENAI_MODEL="policy", PYTHONUNBUFFERED="1")
    return subprocess.run([str(INSTRUMENT), sys.executable, str(AGENTS / script)], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("script", ["openai_chat_agent.py", "responses_agent.py"])
def test_an_instrumented_sdk_agent_served_by_a_span_emitting_endpoint_keeps_one_transition_per_call(
        span_emitting_server, receiver, script):
    engine = span_emitting_server.engine
    rollout_id = f"sdk-{script}"
    result = run_instrumented_agent(script, rollout_id, receiver["grpc"], span_emitting_server.base_url)
    assert result.returncode == 0, result.stderr[-3000:]
    assert endpoint_spans_of(span_emitting_server).flush()
    request = urllib.request.Request(f"{receiver['http']}/spanrl/v1/rollouts/{rollout_id}/complete", data=b"",
                                     method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status in (200, 202)
    store = SpanStore(receiver["db"])
    try:
        assembled = wait_assembled(store, rollout_id)
    finally:
        store.close()
    records = _stored_records(receiver["db"], rollout_id)
    endpoint_spans = [r for r in records if r.attributes.get(semconv.LLM_SOURCE) == semconv.LLM_SOURCE_ENDPOINT]
    assert len(endpoint_spans) == len(engine.jobs)  # both witnesses reached the receiver...
    assert [(t.prompt_token_ids, t.response_token_ids) for t in assembled.transitions] == served_ids(engine)
    # ... and the endpoint's record of each call is the call (its ids are what the engine
    # sampled), with the agent side's span merged into it; both recorded the same ids
    kept = {t.span_id for t in assembled.transitions}
    assert kept == {r.key for r in endpoint_spans}
    assert assembled.counters == {}


NODE_DIR = Path(__file__).resolve().parents[1] / "node"


def test_a_nodejs_agent_with_only_otel_http_instrumentation_trains(span_emitting_server, receiver):
    node = shutil.which("node")
    assert node, "node is not installed: this test needs Node.js >= 18"
    assert (NODE_DIR / "node_modules" / "openai").is_dir(), f"run `npm install` in {NODE_DIR} (.ci/run does)"
    engine = span_emitting_server.engine
    result = subprocess.run([node, "agent_via_endpoint.js", receiver["grpc"], span_emitting_server.base_url,
                             "policy", "node-endpoint-rollout"], cwd=NODE_DIR, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert endpoint_spans_of(span_emitting_server).flush()
    replies = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(replies) == len(engine.jobs) == 3
    store = SpanStore(receiver["db"])
    try:
        assembled = wait_assembled(store, "node-endpoint-rollout")
    finally:
        store.close()
    assert [(t.prompt_token_ids, t.response_token_ids) for t in assembled.transitions] == served_ids(engine)
    assert assembled.task_id == "node-task"
    records = {r.key: r for r in _stored_records(receiver["db"], "node-endpoint-rollout")}
    for transition in assembled.transitions:
        call = records[transition.span_id]
        assert call.attributes[semconv.LLM_SOURCE] == semconv.LLM_SOURCE_ENDPOINT
        assert call.parent is not None and call.parent.name != semconv.ROLLOUT_SPAN_NAME  # the Node HTTP client span
        assert call.parent.parent is not None and call.parent.parent.name == semconv.ROLLOUT_SPAN_NAME


def test_spanrl_serve_with_spans_endpoint_gives_a_raw_agent_its_transitions(tmp_path, receiver):
    """The CLI: ``spanrl serve --spans-endpoint`` (HTTP in its child process) exports the spans."""
    from transformers import AutoTokenizer

    from spanrl.trainer_bridge.torch_backend.server import chat_format

    model_dir = create_model_dir(tmp_path / "policy", preset="tiny", seed=0)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    process = subprocess.Popen([sys.executable, "-m", "spanrl", "serve", str(model_dir), "--port", str(port),
                                "--spans-endpoint", receiver["grpc"], "--device", TEST_DEVICE], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_port(port, process, "spanrl serve", timeout_s=120)
        replies = run_raw_agent_in_a_rollout(f"http://127.0.0.1:{port}/v1", receiver, "serve-cli-rollout",
                                             lambda: time.sleep(1.5))  # > the spans' 0.5 s export delay
    except AssertionError as failure:  # the agent failed: what the server said is the other half
        process.terminate()
        raise AssertionError(f"{failure}\nspanrl serve said:\n{process.communicate(timeout=30)[1][-3000:]}") from None
    finally:
        if process.poll() is None:
            process.terminate()
            process.communicate(timeout=30)
    store = SpanStore(receiver["db"])
    try:
        assembled = wait_assembled(store, "serve-cli-rollout")
    finally:
        store.close()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    transitions = assembled.transitions
    assert len(transitions) == 3
    assert list(transitions[0].prompt_token_ids) == chat_format.encode_chat(
        tokenizer, [{"role": "user", "content": "What is 2 + 3?"}])
    assert list(transitions[2].prompt_token_ids) == chat_format.encode_text(tokenizer, "CALC 4+4")
    # the ids end with the end-of-text token when the sampled reply stopped there (trained on, never shown)
    assert tokenizer.decode(list(transitions[2].response_token_ids), skip_special_tokens=True) == replies[2]


def test_a_receiver_that_is_down_never_breaks_serving_and_is_said_once(tmp_path, monkeypatch, caplog):
    import httpx

    monkeypatch.setenv(SPANS_ENDPOINT_ENV, f"http://127.0.0.1:{free_port()}")  # nothing listens there
    model_dir = create_model_dir(tmp_path / "model", preset="tiny", seed=0)
    engine = RecordingPolicyEngine.from_pretrained(model_dir, device=TEST_DEVICE, model_name="policy")
    server = serve_in_thread(engine, port=free_port())
    try:
        with caplog.at_level("WARNING"), httpx.Client(timeout=60) as client:
            for question in ("What is 1 + 1?", "What is 2 + 2?", "What is 3 + 3?"):
                reply = client.post(f"{server.base_url}/chat/completions", headers={
                    semconv.ROLLOUT_ID_HEADER: "lost"}, json={"model": "policy", "max_tokens": 4, "messages": [
                        {"role": "user", "content": question}]})
                assert reply.status_code == 200
                endpoint_spans_of(server).flush(timeout_s=10)  # one failed export per call
    finally:
        server.stop()
    warnings = [r.getMessage() for r in caplog.records if "could not export its LLM spans" in r.getMessage()]
    assert len(warnings) == 1 and "said once" in warnings[0], warnings
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry.exporter")]
