"""kill -9 while the real exporter is sending: acknowledged spans survive, rollouts complete."""

from __future__ import annotations

import threading

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.store import SpanStore

CALLS = 300
BATCH = 6


def make_rollout(tracer, rollout_id: str, calls: int) -> list:
    identity = {semconv.ROLLOUT_ID: rollout_id, semconv.TASK_ID: "crash", semconv.ATTEMPT: 0}
    with tracer.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=identity) as root:
        for i in range(calls):
            with tracer.start_as_current_span(
                f"llm-{i}",
                attributes={
                    **identity, semconv.LLM_PROMPT_TOKEN_IDS: [i, i + 1, i + 2],
                    semconv.llm_response_token_ids(0): [1000 + i],
                },
            ):
                pass
        root.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 1.0})


def keys(spans) -> set[tuple[bytes, bytes]]:
    return {
        (s.context.trace_id.to_bytes(16, "big"), s.context.span_id.to_bytes(8, "big")) for s in spans
    }


def test_sigkill_during_export_loses_no_acknowledged_span(receiver_process, memory_tracer, kit, tmp_path):
    make_rollout(memory_tracer.tracer, "r-crash", CALLS)
    make_rollout(memory_tracer.tracer, "r-open", 3)
    finished = memory_tracer.exporter.get_finished_spans()
    crash_spans = [s for s in finished if s.attributes[semconv.ROLLOUT_ID] == "r-crash"]
    open_spans = [s for s in finished if s.attributes[semconv.ROLLOUT_ID] == "r-open"]
    crash_root = crash_spans.pop()  # the root ends last
    assert crash_root.name == semconv.ROLLOUT_SPAN_NAME
    batches = [crash_spans[i : i + BATCH] for i in range(0, len(crash_spans), BATCH)]

    first = receiver_process("--grace-s", "30").start()
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{first.grpc_port}", insecure=True, timeout=2)
    # r-open ends (its root arrives) but its grace delay is still running at the crash
    assert exporter.export(open_spans) == SpanExportResult.SUCCESS

    acked: list[list] = []
    unsent: list[list] = []
    enough = threading.Event()

    def send() -> None:
        for index, batch in enumerate(batches):
            if exporter.export(batch) == SpanExportResult.SUCCESS:
                acked.append(batch)
                if len(acked) >= 5:
                    enough.set()
            else:
                unsent.extend(batches[index:])
                break
        enough.set()

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert enough.wait(30)
        first.kill()  # SIGKILL while the exporter keeps sending
    finally:
        sender.join(timeout=60)
        exporter.shutdown()
    assert 5 <= len(acked) < len(batches), "the kill should land while batches are still being sent"

    acked_keys = keys(span for batch in acked for span in batch)
    with SpanStore(tmp_path / "spanrl.db") as store:
        stored = store.span_keys()
        assert acked_keys <= stored, f"{len(acked_keys - stored)} acknowledged spans lost"
        assert keys(open_spans) <= stored
        assert store.completed_rollouts(0)[0] == []

    second = receiver_process("--grace-s", "0.2").start()
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{second.grpc_port}", insecure=True, timeout=10)
    try:
        for batch in unsent:  # the exporter's retry of what was not acknowledged
            assert exporter.export(batch) == SpanExportResult.SUCCESS
        assert exporter.export([crash_root]) == SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    with SpanStore(tmp_path / "spanrl.db") as store:
        rollouts = kit.wait_for(
            lambda: store.completed_rollouts(0)[0] if len(store.completed_rollouts(0)[0]) == 2 else None,
            timeout=20, what="both rollouts assembled")
        by_id = {r.rollout_id: r for r in rollouts}
        assert by_id["r-open"].end_reason == "rollout_span"  # open at the crash, completed after restart
        assert len(by_id["r-open"].transitions) == 3
        crash = by_id["r-crash"]
        assert [t.response_token_ids for t in crash.transitions] == [(1000 + i,) for i in range(CALLS)]
        assert crash.total_reward == 1.0
        assert store.span_count() == CALLS + 1 + 4
    assert second.terminate() == 0
