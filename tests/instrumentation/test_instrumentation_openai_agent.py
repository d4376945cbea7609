"""End to end: an unmodified OpenAI-SDK agent under ``opentelemetry-instrument`` exports, over
real OTLP/gRPC, LLM spans carrying exactly the token ids vLLM sent: a recording of its answers,
replayed by ``vllm_replay_server.py`` (fast, and here where vLLM is not installed). The same
agent against a running vLLM server: tests/verl_backend/test_vllm_live.py (in `.venv-verl`)."""

from __future__ import annotations

import json

from spanrl.instrumentation import semconv

ROLLOUT = {"spanrl.rollout.id": "rollout-e2e", "spanrl.task.id": "task-7", "spanrl.attempt": 2}
RESOURCE_IDENTITY = "spanrl.rollout.id=rollout-e2e,spanrl.task.id=task-7,spanrl.attempt=2"
# Every spanrl key an LLM span may carry (semconv's vocabulary for LLM spans).
ALLOWED_FIXED_KEYS = {
    *semconv.ROLLOUT_IDENTITY_KEYS,
    semconv.AGENT_NAME,
    semconv.LLM_PROMPT_TOKEN_IDS,
    semconv.LLM_POLICY_VERSION,
    semconv.LLM_RETOKENIZED,
}


def llm_spans(collector):
    return [s for s in collector.spans() if s["attributes"].get("openinference.span.kind") == "LLM"]


def spanrl_keys(span):
    return {k for k in span["attributes"] if k.startswith("spanrl.")}


def expected_keys(plan):
    keys = set(semconv.ROLLOUT_IDENTITY_KEYS) | {semconv.LLM_POLICY_VERSION}
    if plan["with_ids"]:
        keys.add(semconv.LLM_PROMPT_TOKEN_IDS)
        keys |= {semconv.llm_response_token_ids(i) for i in range(len(plan["choices"]))}
    if plan["with_logprobs"]:
        keys |= {semconv.llm_response_logprobs(i) for i in range(len(plan["choices"]))}
    return keys


def test_every_call_kind_carries_the_exact_ids_the_server_sent(
    trace_collector, vllm_recording, run_agent, harness
):
    env = harness.agent_environment(
        trace_collector.endpoint, vllm_recording.base_url, OTEL_RESOURCE_ATTRIBUTES=RESOURCE_IDENTITY
    )
    result = run_agent("openai_calls_agent.py", env, "all")
    assert result.returncode == 0, result.stderr
    made = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(made) == 13
    assert all(body.get("return_token_ids") is True for body in vllm_recording.requests)

    assert harness.wait_for(lambda: len(llm_spans(trace_collector)) >= len(made))
    spans = llm_spans(trace_collector)
    by_response_id = {s["attributes"].get(semconv.GENAI_RESPONSE_ID): s for s in spans}
    # One LLM span per call, each found by the completion id the agent received.
    assert len(spans) == len(made)
    assert set(by_response_id) == set(made.values())

    for label, response_id in made.items():
        span, plan = by_response_id[response_id], vllm_recording.sent[response_id]
        attributes = span["attributes"]
        assert spanrl_keys(span) == expected_keys(plan), label
        assert attributes[semconv.LLM_PROMPT_TOKEN_IDS] == tuple(plan["prompt_token_ids"]), label
        for i, choice in enumerate(plan["choices"]):
            assert attributes[semconv.llm_response_token_ids(i)] == tuple(choice["token_ids"]), label
            if plan["with_logprobs"]:
                assert attributes[semconv.llm_response_logprobs(i)] == tuple(choice["logprobs"]), label
        assert attributes[semconv.LLM_POLICY_VERSION] == 7
        for key, value in ROLLOUT.items():
            assert attributes[key] == value, (label, key)

    # The identity from OTEL_RESOURCE_ATTRIBUTES is on every span, not only LLM spans.
    for span in trace_collector.spans():
        assert {k: span["attributes"].get(k) for k in ROLLOUT} == ROLLOUT, span["name"]
    assert "Traceback" not in result.stderr
    # spanrl lets openinference's own entry point turn it on: no double-instrument warning
    assert "already instrumented" not in result.stderr


def test_endpoint_ignoring_return_token_ids_still_works(
    trace_collector, vllm_recording_without_ids, run_agent, harness
):
    env = harness.agent_environment(trace_collector.endpoint, vllm_recording_without_ids.base_url)
    result = run_agent("openai_calls_agent.py", env, "quick")
    assert result.returncode == 0, result.stderr
    made = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(body.get("return_token_ids") is True for body in vllm_recording_without_ids.requests)
    assert harness.wait_for(lambda: len(llm_spans(trace_collector)) >= len(made))
    for span in llm_spans(trace_collector):
        assert semconv.LLM_PROMPT_TOKEN_IDS not in span["attributes"]
        assert not any(k.endswith(semconv.LLM_RESPONSE_TOKEN_IDS_SUFFIX) for k in span["attributes"])
        assert span["attributes"][semconv.GENAI_RESPONSE_ID] in made.values()
    assert "Traceback" not in result.stderr
    assert "spanrl" not in result.stderr  # nothing to warn about: no ids is not an error


def test_flag_turns_token_id_requests_off(trace_collector, vllm_recording, run_agent, harness):
    env = harness.agent_environment(trace_collector.endpoint, vllm_recording.base_url)
    result = run_agent("openai_calls_agent.py", env, "quick",
                       flags=("--spanrl_request_token_ids", "false"))
    assert result.returncode == 0, result.stderr
    assert vllm_recording.requests
    assert not any("return_token_ids" in body for body in vllm_recording.requests)
    assert harness.wait_for(lambda: len(llm_spans(trace_collector)) >= 4)
    assert not any(semconv.LLM_PROMPT_TOKEN_IDS in s["attributes"] for s in llm_spans(trace_collector))


def test_agent_runs_when_the_receiver_is_down(vllm_recording, run_agent, harness):
    dead_endpoint = f"http://127.0.0.1:{harness.free_port()}"
    env = harness.agent_environment(dead_endpoint, vllm_recording.base_url,
                                    OTEL_EXPORTER_OTLP_TIMEOUT="1")
    result = run_agent("openai_calls_agent.py", env, "quick", timeout=90)
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout.strip().splitlines()[-1])) == 4


def test_spanrl_turns_openinference_on_when_its_entry_point_is_disabled(
    trace_collector, vllm_recording, run_agent, harness
):
    env = harness.agent_environment(trace_collector.endpoint, vllm_recording.base_url,
                                    OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="openai")
    result = run_agent("openai_calls_agent.py", env, "quick")
    assert result.returncode == 0, result.stderr
    made = json.loads(result.stdout.strip().splitlines()[-1])
    assert harness.wait_for(lambda: len(llm_spans(trace_collector)) >= len(made))
    spans = llm_spans(trace_collector)
    assert sorted(s["attributes"][semconv.GENAI_RESPONSE_ID] for s in spans) == sorted(made.values())
    assert all(s["attributes"][semconv.LLM_PROMPT_TOKEN_IDS] for s in spans)
