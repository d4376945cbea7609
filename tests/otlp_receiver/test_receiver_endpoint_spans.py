"""The policy endpoint's own LLM span and the agent side's span of the same call become one
transition (``otlp_receiver/endpoint_spans.py``), with real SDK spans encoded as OTLP."""

from __future__ import annotations

import json

from openinference.semconv.trace import SpanAttributes
from opentelemetry import context as context_api

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.assembly import assemble_rollout

from .conftest import rollout_attrs

IDENTITY = rollout_attrs("r")


def endpoint_span(tracer, response_id: str, prompt: list[int], response: list[int]) -> None:
    """As the endpoint sends it: a trace of its own (only the rollout header reached it)."""
    tracer.start_span("POST /v1/chat/completions", context=context_api.Context(), attributes={
        semconv.ROLLOUT_ID: "r", semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM,
        semconv.LLM_SOURCE: semconv.LLM_SOURCE_ENDPOINT, semconv.GENAI_RESPONSE_ID: response_id,
        semconv.LLM_PROMPT_TOKEN_IDS: prompt, semconv.llm_response_token_ids(0): response,
        semconv.LLM_POLICY_VERSION: 5}).end()


def agent_call(tracer, name: str, response_id: str, with_ids: bool, reward: float | None = None) -> None:
    attributes = {**IDENTITY, semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM,
                  semconv.GENAI_RESPONSE_ID: response_id}
    if with_ids:
        attributes.update({semconv.LLM_PROMPT_TOKEN_IDS: [1, 2], semconv.llm_response_token_ids(0): [3]})
    with tracer.start_as_current_span(name, attributes=attributes) as span:
        if reward is not None:
            span.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: reward})


def test_the_endpoints_record_is_the_call_and_the_agents_twin_is_merged(memory_tracer, to_records):
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=IDENTITY):
        agent_call(t, "sdk-call", "chatcmpl-1", with_ids=True, reward=0.5)
    endpoint_span(t, "chatcmpl-1", [1, 2], [3])
    endpoint_span(t, "chatcmpl-2", [7], [8, 9])  # a call only the endpoint saw
    rollout = assemble_rollout("r", to_records(memory_tracer.exporter.get_finished_spans()), "rollout_span")
    names = {s.context.span_id.to_bytes(8, "big").hex(): s.name for s in memory_tracer.exporter.get_finished_spans()}
    assert [(names[t.span_id], t.prompt_token_ids, t.response_token_ids, t.reward) for t in rollout.transitions] == [
        ("POST /v1/chat/completions", (1, 2), (3,), 0.5), ("POST /v1/chat/completions", (7,), (8, 9), 0.0)]
    assert any("merged" in problem for problem in rollout.problems)
    assert rollout.counters == {}  # both records agree: no mismatch


def test_when_the_agents_ids_differ_from_the_endpoints_the_endpoints_win_and_it_is_counted(memory_tracer, to_records):
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=IDENTITY):
        agent_call(t, "sdk-call", "chatcmpl-1", with_ids=True, reward=1.0)  # claims [1, 2] -> [3]
    endpoint_span(t, "chatcmpl-1", [1, 2], [4, 5])  # what the engine sampled
    rollout = assemble_rollout("r", to_records(memory_tracer.exporter.get_finished_spans()), "rollout_span")
    (transition,) = rollout.transitions
    assert (transition.prompt_token_ids, transition.response_token_ids, transition.reward) == ((1, 2), (4, 5), 1.0)
    assert rollout.counters == {"token_id_mismatches": 1}
    assert any("recorded other token ids than the endpoint's" in problem for problem in rollout.problems)


def test_a_nested_endpoint_record_wins_over_the_agents_span_around_it(memory_tracer, to_records):
    """The caller propagated its traceparent: the endpoint's span lies under the agent's."""
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=IDENTITY):
        with t.start_as_current_span("sdk-call", attributes={
                **IDENTITY, semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM,
                semconv.GENAI_RESPONSE_ID: "chatcmpl-1", semconv.LLM_PROMPT_TOKEN_IDS: [1, 2],
                semconv.llm_response_token_ids(0): [9, 9, 9]}):
            t.start_span("POST /v1/chat/completions", attributes={
                semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM,
                semconv.LLM_SOURCE: semconv.LLM_SOURCE_ENDPOINT, semconv.GENAI_RESPONSE_ID: "chatcmpl-1",
                semconv.LLM_PROMPT_TOKEN_IDS: [1, 2], semconv.llm_response_token_ids(0): [3]}).end()
    rollout = assemble_rollout("r", to_records(memory_tracer.exporter.get_finished_spans()), "rollout_span")
    (transition,) = rollout.transitions
    assert transition.response_token_ids == (3,)
    assert rollout.counters == {"token_id_mismatches": 1}


def test_an_agent_span_without_ids_gives_way_to_the_endpoints_span_and_keeps_its_reward(memory_tracer, to_records):
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=IDENTITY):
        agent_call(t, "sdk-call-no-ids", "chatcmpl-1", with_ids=False, reward=0.5)
    endpoint_span(t, "chatcmpl-1", [4, 5], [6])
    rollout = assemble_rollout("r", to_records(memory_tracer.exporter.get_finished_spans()), "rollout_span")
    (transition,) = rollout.transitions
    assert (transition.prompt_token_ids, transition.response_token_ids, transition.policy_version) == ((4, 5), (6,), 5)
    assert transition.reward == 0.5  # the reward on the agent's span follows the call it merged into
    assert not any("no engine token ids" in problem for problem in rollout.problems)


def test_a_framework_span_merged_into_the_sdk_span_follows_it_to_the_endpoints_record(memory_tracer, to_records):
    """LangGraph's ChatOpenAI span (its node in the metadata) merges into the SDK span of the same
    call, which merges into the endpoint's record: the call keeps the node's name and reward."""
    t = memory_tracer.tracer
    out = "llm.output_messages.0.message.content"
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=IDENTITY):
        for number, node in enumerate(["planner", "solver"]):
            metadata = json.dumps({"langgraph_node": node, "langgraph_step": number + 1})
            with t.start_as_current_span(node, attributes={SpanAttributes.METADATA: metadata}):
                framework = t.start_span("ChatOpenAI", attributes={
                    semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM, out: node,
                    SpanAttributes.METADATA: metadata})
                with t.start_as_current_span("ChatCompletion", context=None, attributes={
                        **IDENTITY, semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM, out: node,
                        semconv.GENAI_RESPONSE_ID: f"chatcmpl-{number}", semconv.LLM_PROMPT_TOKEN_IDS: [number],
                        semconv.llm_response_token_ids(0): [9]}):
                    pass
                framework.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: float(number + 1)})
                framework.end()
    for number in range(2):
        endpoint_span(t, f"chatcmpl-{number}", [number], [9])
    rollout = assemble_rollout("r", to_records(memory_tracer.exporter.get_finished_spans()), "rollout_span")
    names = {s.context.span_id.to_bytes(8, "big").hex(): s.name for s in memory_tracer.exporter.get_finished_spans()}
    assert [(names[t.span_id], t.agent_name, t.reward) for t in rollout.transitions] == [
        ("POST /v1/chat/completions", "planner", 1.0), ("POST /v1/chat/completions", "solver", 2.0)]
