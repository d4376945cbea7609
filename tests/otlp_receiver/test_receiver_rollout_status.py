"""A rollout's status says what was seen: no root span, a crash outside the runner, a reused id.

Span trees made by the real OTel SDK (InMemorySpanExporter -> OTLP -> records -> assembly).
"""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry.trace import Status, StatusCode

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.assembly import assemble_rollout
from spanrl.schema.rollouts import rollout_from_dict, rollout_to_dict

LLM = {
    semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM,
    semconv.LLM_PROMPT_TOKEN_IDS: [1, 2],
    semconv.llm_response_token_ids(0): [3],
}


def _assemble(memory_tracer, to_records, end_reason="explicit"):
    return assemble_rollout("r", to_records(memory_tracer.exporter.get_finished_spans()), end_reason)


def test_with_a_rollout_span_status_needs_no_reason(memory_tracer, to_records):
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME) as root:
        with t.start_as_current_span("llm", attributes=LLM):
            pass
        with t.start_as_current_span("tool") as tool:
            tool.set_status(Status(StatusCode.ERROR, "tool failed"))  # handled by the agent
        root.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 1.0})
    rollout = _assemble(memory_tracer, to_records, "rollout_span")
    assert (rollout.status, rollout.error, rollout.status_reason) == ("ok", None, None)


def test_no_rollout_span_and_no_reward_is_ok_only_with_a_reason(memory_tracer, to_records):
    t = memory_tracer.tracer
    with t.start_as_current_span("agent"):
        with t.start_as_current_span("llm", attributes=LLM):
            pass
        with t.start_as_current_span("tool") as tool:
            tool.set_status(Status(StatusCode.ERROR, "tool failed"))
    rollout = _assemble(memory_tracer, to_records, "idle_timeout")
    assert rollout.status == "ok" and rollout.error is None
    assert rollout.status_reason == (
        "no spanrl.rollout span arrived, so how the agent ended is unknown (the rollout ended by"
        " idle_timeout); 1 span(s) ended with status ERROR; no reward"
    )
    assert rollout_from_dict(rollout_to_dict(rollout)) == rollout  # kept by the store


def test_crash_outside_the_runner_is_failed(memory_tracer, to_records):
    """No spanrl.rollout span, and the agent's own top-level span ended with ERROR."""
    t = memory_tracer.tracer
    try:
        with t.start_as_current_span("agent"):
            with t.start_as_current_span("llm", attributes=LLM):
                pass
            raise RuntimeError("agent crashed")
    except RuntimeError:
        pass
    rollout = _assemble(memory_tracer, to_records)
    assert rollout.status == "failed"
    assert rollout.error == ("no spanrl.rollout span arrived, and top-level span 'agent' ended with status"
                             " ERROR: RuntimeError: agent crashed")
    assert len(rollout.transitions) == 1  # still shown, never trained on (the loop skips failed)


def test_separate_runs_under_one_rollout_id_are_failed_not_merged(memory_tracer, to_records):
    t = memory_tracer.tracer
    for run in range(2):  # two runs, each its own trace, both with the same rollout id
        with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, context=otel_context.Context()) as root:
            for _ in range(3):
                with t.start_as_current_span("llm", attributes=LLM):
                    pass
            root.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 1.0 + run})
    rollout = _assemble(memory_tracer, to_records, "rollout_span")
    assert rollout.status == "failed"
    assert rollout.error.startswith("rollout id reused: 2 separate spanrl.rollout spans (runs) carry it")


def test_a_nested_rollout_span_is_not_a_reuse(memory_tracer, to_records):
    """An agent that opens ``rollout()`` inside the runner's rollout span: one run."""
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
        with t.start_as_current_span("agent"):
            with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
                with t.start_as_current_span("llm", attributes=LLM):
                    pass
    rollout = _assemble(memory_tracer, to_records, "rollout_span")
    assert (rollout.status, rollout.error) == ("ok", None)
    assert "2 spanrl.rollout spans; the earliest is the root" in rollout.problems
