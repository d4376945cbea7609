"""rollout(), agent(), emit_reward(), set_variable(), bind_context(), the identity span
processor and the safe defaults, in this process with real, private SDK providers (passed as
``tracer_provider=``; the global provider is never touched)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from spanrl.exporter import safe_defaults
from spanrl.exporter.span_processor import RolloutIdentitySpanProcessor
from spanrl.instrumentation import agent, bind_context, emit_reward, rollout, semconv, set_variable


def spans_of(exporter, rollout_id):
    return [s for s in exporter.get_finished_spans() if s.attributes.get(semconv.ROLLOUT_ID) == rollout_id]


def test_a_failing_rollout_ends_with_error_and_the_exception_propagates(rollout_tracing):
    with pytest.raises(KeyError):
        with rollout("task-fail", attempt=1, rollout_id="helpers-fail",
                     tracer_provider=rollout_tracing.provider) as r:
            assert r.rollout_id == "helpers-fail"
            raise KeyError("missing tool")
    (span,) = spans_of(rollout_tracing.exporter, "helpers-fail")
    assert span.name == semconv.ROLLOUT_SPAN_NAME
    assert span.status.status_code == StatusCode.ERROR
    assert span.status.description == "KeyError: 'missing tool'"
    assert span.attributes[semconv.TASK_ID] == "task-fail" and span.attributes[semconv.ATTEMPT] == 1


def test_rollout_id_is_generated_and_identity_reaches_asyncio_tasks_and_bound_threads(rollout_tracing):
    tracer = rollout_tracing.provider.get_tracer("helpers-test")

    def work(label):
        tracer.start_span(label).end()

    async def in_task():
        work("asyncio-task")

    with rollout("task-inherit", tracer_provider=rollout_tracing.provider) as r:
        asyncio.run(in_task())
        thread = threading.Thread(target=bind_context(work), args=("bound-thread",))
        thread.start()
        thread.join()
        with ThreadPoolExecutor(1) as pool:
            pool.submit(bind_context(work), "bound-pool").result()
            pool.submit(work, "unbound-pool").result()  # documented: needs bind_context
    assert len(r.rollout_id) == 32
    names = {s.name for s in spans_of(rollout_tracing.exporter, r.rollout_id)}
    assert names == {semconv.ROLLOUT_SPAN_NAME, "asyncio-task", "bound-thread", "bound-pool"}
    unbound = [s for s in rollout_tracing.exporter.get_finished_spans() if s.name == "unbound-pool"]
    assert semconv.ROLLOUT_ID not in unbound[0].attributes


def test_reward_variable_and_agent_name(rollout_tracing):
    tracer = rollout_tracing.provider.get_tracer("helpers-test")
    with rollout("task-annotate", rollout_id="helpers-annotate", tracer_provider=rollout_tracing.provider):
        with agent("critic"):
            with tracer.start_as_current_span("judge"):
                emit_reward(0.5, name="partial", response_id="chatcmpl-9")
                set_variable("answer", 42)
        emit_reward(1)
    spans = {s.name: s for s in spans_of(rollout_tracing.exporter, "helpers-annotate")}
    judge, root = spans["judge"], spans[semconv.ROLLOUT_SPAN_NAME]
    assert judge.attributes[semconv.AGENT_NAME] == "critic"
    assert semconv.AGENT_NAME not in root.attributes
    assert judge.attributes[semconv.variable("answer")] == 42
    assert [dict(e.attributes) for e in judge.events if e.name == semconv.REWARD_EVENT] == [
        {semconv.REWARD_VALUE: 0.5, semconv.REWARD_NAME: "partial", semconv.REWARD_RESPONSE_ID: "chatcmpl-9"}
    ]
    assert [dict(e.attributes) for e in root.events] == [
        {semconv.REWARD_VALUE: 1.0, semconv.REWARD_NAME: semconv.DEFAULT_REWARD_NAME}
    ]


def test_a_reward_outside_any_span_still_reaches_the_exporter(rollout_tracing):
    emit_reward(2.0, name="late", tracer_provider=rollout_tracing.provider)
    late = [s for s in rollout_tracing.exporter.get_finished_spans() if s.name == semconv.REWARD_EVENT]
    assert [dict(e.attributes) for e in late[-1].events] == [
        {semconv.REWARD_VALUE: 2.0, semconv.REWARD_NAME: "late"}
    ]


@pytest.mark.parametrize("call, message", [
    (lambda: emit_reward("1.0"), "reward value must be a number"),
    (lambda: emit_reward(float("nan")), "reward value must be finite"),
    (lambda: emit_reward(True), "reward value must be a number"),
    (lambda: set_variable("passages", ["a", "b"]), "json.dumps"),
    (lambda: set_variable("", "x"), "variable name"),
    (lambda: rollout("", attempt=0).__enter__(), "task_id"),
    (lambda: rollout("t", attempt=-1).__enter__(), "attempt"),
])
def test_programmer_errors_are_clear_value_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def make_provider(resource_attributes):
    provider = TracerProvider(resource=Resource.create(resource_attributes))
    exporter = InMemorySpanExporter()
    provider.add_span_processor(RolloutIdentitySpanProcessor())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_processor_stamps_resource_identity_and_context_wins():
    provider, exporter = make_provider(
        {semconv.ROLLOUT_ID: "from-resource", semconv.TASK_ID: "t-r", semconv.ATTEMPT: "4"})
    tracer = provider.get_tracer("any-instrumentor")
    tracer.start_span("plain").end()
    tracer.start_span("own-agent", attributes={semconv.AGENT_NAME: "framework-named"}).end()
    with rollout("t-ctx", attempt=1, rollout_id="from-context", tracer_provider=provider), agent("ctx-agent"):
        tracer.start_span("inside").end()
        tracer.start_span("own-agent-inside", attributes={semconv.AGENT_NAME: "framework-named"}).end()
    spans = {s.name: dict(s.attributes) for s in exporter.get_finished_spans()}
    assert spans["plain"] == {semconv.ROLLOUT_ID: "from-resource", semconv.TASK_ID: "t-r", semconv.ATTEMPT: 4}
    assert spans["inside"] == {semconv.ROLLOUT_ID: "from-context", semconv.TASK_ID: "t-ctx",
                               semconv.ATTEMPT: 1, semconv.AGENT_NAME: "ctx-agent"}
    assert spans["own-agent-inside"][semconv.AGENT_NAME] == "framework-named"


def test_safe_defaults_reach_tracers_created_before_and_yield_to_the_user():
    provider = TracerProvider()
    early = provider.get_tracer("created-before")
    assert safe_defaults.raise_attribute_count_limit(provider, environ={})
    assert safe_defaults.sample_everything(provider, environ={})
    span = early.start_span("wide")
    for i in range(500):
        span.set_attribute(f"a{i}", i)
    assert len(span.attributes) == 500
    span.end()
    user = TracerProvider()
    assert not safe_defaults.raise_attribute_count_limit(user, environ={"OTEL_ATTRIBUTE_COUNT_LIMIT": "10"})
    assert not safe_defaults.sample_everything(user, environ={"OTEL_TRACES_SAMPLER": "always_off"})


def test_a_variable_outside_any_span_gets_a_span_of_the_given_provider(rollout_tracing):
    set_variable("late", "yes", tracer_provider=rollout_tracing.provider)
    (span,) = rollout_tracing.exporter.get_finished_spans()
    assert span.name == semconv.variable("late")
    assert span.attributes[semconv.variable("late")] == "yes"


def test_start_rollout_span_in_a_new_trace_carries_the_identity_without_attaching(rollout_tracing):
    from opentelemetry import baggage
    from opentelemetry import context as context_api

    from spanrl.instrumentation import RolloutIdentity, current_identity, end_rollout_span, start_rollout_span

    tracer = rollout_tracing.provider.get_tracer("helpers-test")
    identity = RolloutIdentity("runner-made", "task-r", 2)
    with tracer.start_as_current_span("runner-loop") as outer:
        span, ctx = start_rollout_span(identity, tracer_provider=rollout_tracing.provider,
                                       parent=context_api.Context())
        assert current_identity() is None  # nothing attached in the caller's thread
    assert current_identity(ctx) == identity
    assert baggage.get_baggage(semconv.ROLLOUT_ID, ctx) == "runner-made"
    tracer.start_span("agent-step", context=ctx).end()
    end_rollout_span(span, "agent did not finish")
    spans = {s.name: s for s in spans_of(rollout_tracing.exporter, "runner-made")}
    root, step = spans[semconv.ROLLOUT_SPAN_NAME], spans["agent-step"]
    assert root.parent is None and root.context.trace_id != outer.get_span_context().trace_id
    assert step.parent.span_id == root.context.span_id
    assert root.status.status_code == StatusCode.ERROR and root.status.description == "agent did not finish"
    assert dict(root.attributes) == identity.as_attributes()
