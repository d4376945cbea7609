"""Rollout identity in a real agent process: two rollouts at once (threads, asyncio tasks,
a thread pool) never mix, rewards and variables land on their rollout, a failing rollout
ends with status ERROR; and the same through ``start_tracing`` with a bearer token."""

from __future__ import annotations

import json

import pytest

from spanrl.instrumentation import semconv
from spanrl.instrumentation.packed_values import unpack_token_ids

STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR
ROLLOUTS = {
    "thread-1": ("task-thread-1", 1, "solver-1"),
    "thread-2": ("task-thread-2", 2, "solver-2"),
    "async-1": ("task-async-1", 0, "planner-1"),
    "async-2": ("task-async-2", 0, "planner-2"),
}


def check_rollouts(collector, received):
    spans = collector.spans()
    assert set(received) == set(ROLLOUTS)
    for span in spans:
        # every span made inside a rollout carries its identity, whatever made it
        assert span["attributes"].get(semconv.ROLLOUT_ID) in ROLLOUTS, span
    for rollout_id, (task_id, attempt, agent_name) in ROLLOUTS.items():
        mine = [s for s in spans if s["attributes"][semconv.ROLLOUT_ID] == rollout_id]
        for span in mine:
            assert span["attributes"][semconv.TASK_ID] == task_id
            assert span["attributes"][semconv.ATTEMPT] == attempt
        roots = [s for s in mine if s["name"] == semconv.ROLLOUT_SPAN_NAME]
        assert len(roots) == 1
        root = roots[0]
        # the rollout's spans form one tree under its rollout span
        assert {s["trace_id"] for s in mine} == {root["trace_id"]}
        llm = [s for s in mine if s["attributes"].get("openinference.span.kind") == "LLM"]
        assert sorted(s["attributes"][semconv.GENAI_RESPONSE_ID] for s in llm) == sorted(received[rollout_id])
        named = [s for s in llm if s["attributes"].get(semconv.AGENT_NAME) == agent_name]
        assert len(named) == 3  # the calls inside agent(name); the pooled call is outside it
        assert all(s["attributes"].get(semconv.LLM_PROMPT_TOKEN_IDS) for s in llm)
        rewards = [attrs for s in mine for name, attrs in s["events"] if name == semconv.REWARD_EVENT]
        assert len(rewards) == 1
    thread_root = {s["attributes"][semconv.ROLLOUT_ID]: s for s in spans if s["name"] == semconv.ROLLOUT_SPAN_NAME}
    assert thread_root["thread-2"]["attributes"][semconv.variable("answer")] == "answer-2"
    reward = [a for n, a in thread_root["async-1"]["events"] if n == semconv.REWARD_EVENT][0]
    assert reward == {semconv.REWARD_VALUE: 11.0, semconv.REWARD_NAME: "score"}
    assert thread_root["async-2"]["status_code"] == STATUS_ERROR
    assert thread_root["async-2"]["status_message"] == "ValueError: rollout async-2 failed on purpose"
    assert thread_root["async-1"]["status_code"] != STATUS_ERROR


@pytest.mark.parametrize("mode", ["opentelemetry-instrument", "in-process"])
def test_concurrent_rollouts_never_mix(mode, trace_collector, vllm_recording, run_agent, harness):
    env = harness.agent_environment(trace_collector.endpoint, vllm_recording.base_url,
                                    OTEL_SPANRL_RECEIVER_TOKEN="secret-token")
    if mode == "in-process":
        result = run_agent("concurrent_rollouts_agent.py", env, "in-process", instrument=False)
    else:
        result = run_agent("concurrent_rollouts_agent.py", env)
    assert result.returncode == 0, result.stderr
    received = json.loads(result.stdout.strip().splitlines()[-1])
    assert sum(len(ids) for ids in received.values()) == 14
    assert harness.wait_for(lambda: sum(
        s["attributes"].get("openinference.span.kind") == "LLM" for s in trace_collector.spans()) >= 14)
    check_rollouts(trace_collector, received)
    if mode == "in-process":
        assert all(m.get("authorization") == "Bearer secret-token" for m in trace_collector.metadata)
    else:  # opentelemetry-instrument sends OTEL_EXPORTER_OTLP_HEADERS only, and spanrl says so
        assert "OTEL_EXPORTER_OTLP_HEADERS" in result.stderr


def test_start_tracing_over_otlp_http(otlp_http_collector, vllm_recording, run_agent, harness):
    env = harness.agent_environment("http://127.0.0.1:9", vllm_recording.base_url,
                                    OTEL_SPANRL_RECEIVER_TOKEN="http-token")
    result = run_agent("in_process_http_agent.py", env, otlp_http_collector.endpoint, instrument=False)
    assert result.returncode == 0, result.stderr
    response_id = result.stdout.strip().splitlines()[-1]
    # stop_tracing flushed: everything is there when the process ends
    spans = [span for request in otlp_http_collector.requests for rs in request.resource_spans
             for ss in rs.scope_spans for span in ss.spans]
    by_name = {span.name: span for span in spans}
    assert set(by_name) == {semconv.ROLLOUT_SPAN_NAME, "ChatCompletion"}
    llm = {kv.key: kv.value for kv in by_name["ChatCompletion"].attributes}
    assert llm[semconv.ROLLOUT_ID].string_value == "http-rollout"
    assert llm[semconv.ATTEMPT].int_value == 3
    assert llm[semconv.GENAI_RESPONSE_ID].string_value == response_id
    sent = vllm_recording.sent[response_id]
    # the packed form on the wire (one string, not an array the SDK checks element by element)
    assert unpack_token_ids(llm[semconv.LLM_PROMPT_TOKEN_IDS].string_value) == sent["prompt_token_ids"]
    assert all(h["authorization"] == "Bearer http-token" and h["x-team"] == "rl"
               for h in otlp_http_collector.headers)


def test_start_tracing_sets_up_a_given_provider_and_leaves_the_global_one(otlp_http_collector):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from spanrl.exporter.in_process import start_tracing, stop_tracing
    from spanrl.instrumentation import emit_reward, rollout

    provider = TracerProvider()
    global_before = trace.get_tracer_provider()
    assert start_tracing(otlp_http_collector.endpoint, protocol="http/protobuf", instrument_openai=False,
                         tracer_provider=provider) is provider
    try:
        with rollout("task-private", rollout_id="private-rollout", tracer_provider=provider):
            provider.get_tracer("agent").start_span("step").end()
            emit_reward(0.5, tracer_provider=provider)
    finally:
        stop_tracing()
        provider.shutdown()
    assert trace.get_tracer_provider() is global_before
    spans = {span.name: {kv.key: kv.value for kv in span.attributes}
             for request in otlp_http_collector.requests for rs in request.resource_spans
             for ss in rs.scope_spans for span in ss.spans}
    assert set(spans) == {semconv.ROLLOUT_SPAN_NAME, "step"}
    # the identity processor was added to the given provider: the plain span carries the rollout
    assert spans["step"][semconv.ROLLOUT_ID].string_value == "private-rollout"


def test_the_hook_prepares_a_given_provider(monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from spanrl.exporter.hook import post_instrument
    from spanrl.instrumentation import agent

    monkeypatch.setenv("OTEL_SPANRL_SAFE_DEFAULTS", "false")  # keep this process's signals alone
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    post_instrument(tracer_provider=provider)
    with agent("hooked"):
        provider.get_tracer("any").start_span("named").end()
    (span,) = exporter.get_finished_spans()
    assert span.attributes[semconv.AGENT_NAME] == "hooked"
