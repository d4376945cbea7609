"""Training from traffic (the core of ``--from-traffic``): served conversations wait in a rolling
window until their late feedback arrives, then become samples grouped by their first prompt or,
alone, scored against their agent's running mean. A real receiver, the real OTLP exporter, real
HTTP feedback, real SQLite."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.server import ReceiverServer
from spanrl.otlp_receiver.settings import ReceiverSettings
from spanrl.trainer_bridge.traffic_window import (
    LEFT_OUT_TOO_OLD,
    AgentBaselines,
    TrafficSettings,
    TrafficWindow,
    traffic_samples,
)


@pytest.fixture
def receiver(tmp_path):
    server = ReceiverServer(ReceiverSettings(grpc_port=0, http_port=0, db=str(tmp_path / "spanrl.db"), grace_s=0.1,
                                             poll_s=0.05, idle_timeout_s=0)).start()
    provider = TracerProvider(resource=Resource.create({"service.name": "served-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(
        endpoint=f"127.0.0.1:{server.grpc_port}", insecure=True, timeout=10)))
    yield server, provider.get_tracer("agent")
    provider.shutdown()
    server.stop()


def serve(tracer, rollout_id: str, prompt: list[int], agent: str = "helper") -> None:
    """One served conversation: a rollout of one call, no reward of its own."""
    identity = {semconv.ROLLOUT_ID: rollout_id, semconv.AGENT_NAME: agent}
    with tracer.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=identity):
        with tracer.start_as_current_span("llm", attributes={
                **identity, semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM,
                semconv.LLM_PROMPT_TOKEN_IDS: prompt, semconv.llm_response_token_ids(0): [7, 8],
                semconv.llm_response_logprobs(0): [-0.1, -0.2], semconv.GENAI_RESPONSE_ID: f"resp-{rollout_id}"}):
            pass


def feedback(port: int, rollout_id: str, value: float) -> None:
    body = json.dumps({"response_id": f"resp-{rollout_id}", "value": value, "idempotency_key": rollout_id}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/spanrl/v1/feedback", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status in (200, 202)


def wait(predicate, what: str):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_judged_rollouts_become_samples_grouped_by_prompt_or_by_agent_baseline(receiver, tmp_path):
    server, tracer = receiver
    for rollout_id in ("same-a", "same-b"):
        serve(tracer, rollout_id, [1, 2, 3])
    serve(tracer, "alone-1", [9, 9], agent="helper")
    serve(tracer, "alone-2", [5, 5], agent="helper")
    serve(tracer, "never-judged", [4, 4])
    window = TrafficWindow(str(tmp_path / "spanrl.db"), TrafficSettings(max_age_s=3600))
    try:
        wait(lambda: (window.poll(), len(window.waiting) == 5)[1], "five rollouts in the window")
        assert window.judged() == []  # no feedback yet: nothing to train on
        for rollout_id, value in (("same-a", 1.0), ("same-b", 0.0), ("alone-1", 0.2), ("alone-2", 0.8)):
            feedback(server.http_port, rollout_id, value)
        wait(lambda: (window.poll(), len(window.judged()) == 4)[1], "four judged rollouts")
        taken = window.take(10)
        assert [r.rollout_id for r in taken] == ["same-a", "same-b", "alone-1", "alone-2"]
        assert window.take(10) == []  # each is trained once
        samples, counts = traffic_samples(taken, AgentBaselines(decay=0.5), step=0)
        assert counts == {"grouped": 2, "by_agent_baseline": 2}
        by_rollout = {s.rollout_id: s for s in samples}
        assert by_rollout["same-a"].advantage > 0 > by_rollout["same-b"].advantage  # GRPO within the group
        assert by_rollout["same-a"].group_id == by_rollout["same-b"].group_id
        # the helper's baseline: 1.0, then 0.5 (same-b), then 0.35 (alone-1: advantage 0.2 - 0.5)
        assert by_rollout["alone-1"].advantage == pytest.approx(0.2 - 0.5)
        assert by_rollout["alone-2"].advantage == pytest.approx(0.8 - 0.35)
        assert by_rollout["alone-2"].old_logprobs == [-0.1, -0.2]
        # the unjudged one ages out of the window, counted
        window.poll(now=time.time() + 7200)
        assert (window.waiting, window.left_out[LEFT_OUT_TOO_OLD]) == ({}, 1)
    finally:
        window.close()


def test_from_traffic_needs_no_tasks_and_refuses_what_it_cannot_do(tmp_path):
    from spanrl.errors import SettingError
    from spanrl.trainer_bridge.train_settings import TrainSettings

    settings = TrainSettings(from_traffic=True, model=str(tmp_path))
    assert settings.tasks == "" and settings.traffic_window == 1024
    with pytest.raises(SettingError, match="'tasks' is required"):
        TrainSettings(model=str(tmp_path))
    for wrong in ({"val_tasks": "held-out.jsonl"}, {"async_training": True}, {"algorithm": "sft"},
                  {"traffic_baseline_decay": 1.0}, {"traffic_window": 0}):
        with pytest.raises(SettingError, match="from_traffic"):
            TrainSettings(from_traffic=True, model=str(tmp_path), **wrong)
