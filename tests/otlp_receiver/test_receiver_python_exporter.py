"""The real OTel Python SDK exporter (gRPC and HTTP/protobuf) against a real receiver."""

from __future__ import annotations

import pytest

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.store import SpanStore


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_sdk_rollout_arrives_and_assembles(protocol, start_receiver, tracer_to, kit, tmp_path):
    server = start_receiver()
    endpoint = (
        f"127.0.0.1:{server.grpc_port}" if protocol == "grpc" else f"http://127.0.0.1:{server.http_port}/v1/traces"
    )
    agent = tracer_to(endpoint, protocol)
    kit.emit_agent_rollout(agent.tracer, "r-py", calls=3, reward=1.0)
    agent.provider.force_flush()

    store = SpanStore(server.settings.db)
    rollouts = kit.wait_for(lambda: store.completed_rollouts(0)[0], what="assembled rollout")
    (rollout,) = rollouts
    assert rollout.rollout_id == "r-py"
    assert rollout.task_id == "task-1" and rollout.attempt == 0
    assert rollout.status == "ok" and rollout.end_reason == "rollout_span"
    assert rollout.total_reward == 1.0
    assert [t.prompt_token_ids for t in rollout.transitions] == [(10, 11, 0), (11, 12, 0), (12, 13, 0)]
    assert [t.response_token_ids for t in rollout.transitions] == [(110, 2), (111, 2), (112, 2)]
    assert rollout.transitions[0].response_logprobs == (-0.5, -0.25)
    assert all(t.policy_version == 3 for t in rollout.transitions)
    assert all(t.return_ == 1.0 for t in rollout.transitions)  # identical credit
    # the root's reward judges the rollout's last call
    assert [t.reward for t in rollout.transitions] == [0.0, 0.0, 1.0]
    assert rollout.variables == {"answer": "42"}
    assert store.span_count() == 1 + 3 * 2
    assert rollout.sequence >= 1
    again, cursor = store.completed_rollouts(since=rollout.sequence)
    assert again == [] and cursor == rollout.sequence
    store.close()


def test_identity_from_resource_attributes(start_receiver, tracer_to, kit):
    """One process per rollout: identity only in OTEL_RESOURCE_ATTRIBUTES-style resource."""
    server = start_receiver()
    agent = tracer_to(
        f"127.0.0.1:{server.grpc_port}", "grpc",
        resource_attrs={semconv.ROLLOUT_ID: "r-res", semconv.TASK_ID: "t-res", semconv.ATTEMPT: 2},
    )
    with agent.tracer.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
        with agent.tracer.start_as_current_span(
            "chat", attributes={semconv.LLM_PROMPT_TOKEN_IDS: [1, 2], semconv.llm_response_token_ids(0): [3]}
        ):
            pass
    agent.provider.force_flush()
    store = SpanStore(server.settings.db)
    (rollout,) = kit.wait_for(lambda: store.completed_rollouts(0)[0])
    assert (rollout.rollout_id, rollout.task_id, rollout.attempt) == ("r-res", "t-res", 2)
    assert rollout.transitions[0].prompt_token_ids == (1, 2)
    store.close()


def test_token_required_when_configured(start_receiver, tracer_to, kit):
    server = start_receiver(token="s3cret")
    wrong = tracer_to(f"127.0.0.1:{server.grpc_port}", "grpc", headers={"authorization": "Bearer nope"})
    with wrong.tracer.start_as_current_span("x", attributes=kit.rollout_attrs("r-unauth")):
        pass
    wrong.provider.force_flush()
    store = SpanStore(server.settings.db)
    assert store.span_count() == 0
    good_grpc = tracer_to(f"127.0.0.1:{server.grpc_port}", "grpc", headers={"authorization": "Bearer s3cret"})
    good_http = tracer_to(
        f"http://127.0.0.1:{server.http_port}/v1/traces", "http", headers={"Authorization": "Bearer s3cret"}
    )
    for agent in (good_grpc, good_http):
        with agent.tracer.start_as_current_span("y", attributes=kit.rollout_attrs("r-auth")):
            pass
        agent.provider.force_flush()
    assert store.span_count() == 2
    store.close()


def test_metrics_exported_by_the_sdk_are_accepted(start_receiver):
    """The distro exports metrics to the same endpoint by default: it must succeed."""
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricExportResult

    server = start_receiver()
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    provider.get_meter("m").create_counter("calls").add(3)
    data = reader.get_metrics_data()
    provider.shutdown()
    grpc_exporter = GrpcMetrics(endpoint=f"127.0.0.1:{server.grpc_port}", insecure=True)
    http_exporter = HttpMetrics(endpoint=f"http://127.0.0.1:{server.http_port}/v1/metrics")
    try:
        assert grpc_exporter.export(data) == MetricExportResult.SUCCESS
        assert http_exporter.export(data) == MetricExportResult.SUCCESS
    finally:
        grpc_exporter.shutdown()
        http_exporter.shutdown()
