"""Late feedback: POST /spanrl/v1/feedback, late reward events of spans and log records, joined to
the rollout or call they judge, across a kill -9 of the receiver; real servers, real OTLP
exporters, real HTTP, real SQLite."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from opentelemetry._logs import LogRecord
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.feedback_join import with_feedback
from spanrl.otlp_receiver.feedback_store import FeedbackStore
from spanrl.otlp_receiver.store import SpanStore
from spanrl.schema.rollouts import END_ROLLOUT_SPAN

TOKEN = "feedback-secret"


def post(port: int, body, token: str | None = TOKEN, headers: dict | None = None) -> tuple[int, dict]:
    """POST /spanrl/v1/feedback over real HTTP; (status, JSON answer)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/spanrl/v1/feedback", data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def stats(port: int) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/spanrl/v1/stats",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


def assembled(kit, db, rollout_id: str):
    with SpanStore(db) as store:
        return kit.wait_for(lambda: store.assembled_rollout(rollout_id), timeout=20, what=f"{rollout_id} assembled")


def wait_state(kit, db, key: str, state: str):
    with FeedbackStore(db) as book:
        return kit.wait_for(lambda: (s := book.get(f"http:{key}")) is not None and s.state == state and s,
                            timeout=20, what=f"feedback {key} {state}")


def export(port: int, spans) -> None:
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=10,
                                headers={"authorization": f"Bearer {TOKEN}"})
    try:
        assert exporter.export(spans) == SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()


def test_feedback_after_kill9_joins_the_call_and_feedback_before_its_rollout_waits(
        receiver_process, memory_tracer, kit, tmp_path):
    db = tmp_path / "spanrl.db"
    kit.emit_agent_rollout(memory_tracer.tracer, "r-served", calls=2, reward=None)
    kit.emit_agent_rollout(memory_tracer.tracer, "r-later", calls=1, reward=None, base_token=50)
    spans = memory_tracer.exporter.get_finished_spans()
    served = [s for s in spans if s.attributes[semconv.ROLLOUT_ID] == "r-served"]
    later = [s for s in spans if s.attributes[semconv.ROLLOUT_ID] == "r-later"]

    first = receiver_process("--token", TOKEN).start()
    export(first.grpc_port, served)
    rollout = assembled(kit, db, "r-served")
    assert rollout.total_reward is None
    # feedback for a rollout none of whose spans has arrived: kept, pending
    status, answer = post(first.http_port, {"rollout_id": "r-later", "value": 0.5, "idempotency_key": "early"})
    assert (status, answer["state"]) == (202, "pending"), answer
    first.kill()  # kill -9 between the rollout and its feedback

    second = receiver_process("--token", TOKEN).start()
    call = rollout.transitions[1].span_id
    status, answer = post(second.http_port, {"response_id": "resp-r-served-1", "value": 1.0, "name": "thumbs",
                                             "comment": "good answer", "idempotency_key": "k-1"})
    assert status == 200, answer
    assert (answer["state"], answer["rollout_id"], answer["call_span_id"]) == ("joined", "r-served", call)
    with FeedbackStore(db) as book:
        joined = book.feedback_of("r-served")
        assert [(s.feedback.name, s.feedback.value, s.call_span_id) for s in joined] == [("thumbs", 1.0, call)]
        judged = with_feedback(rollout, joined)
    assert judged.total_reward == 1.0
    assert [t.reward for t in judged.transitions] == [0.0, 1.0]
    assert [t.return_ for t in judged.transitions] == [1.0, 1.0]  # identical credit: the rollout's total
    assert [r.source for r in judged.rewards] == ["feedback:http"]

    # the early feedback survived the kill and joins when its rollout arrives
    export(second.grpc_port, later)
    stored = wait_state(kit, db, "early", "joined")
    assert (stored.rollout_id, stored.call_span_id) == ("r-later", None)
    counters = stats(second.http_port)["feedback"]
    assert (counters["received"], counters["joined"], counters["pending"]) == (2, 2, 0)
    assert second.terminate() == 0
    shown = subprocess.run([sys.executable, "-m", "spanrl", "inspect", "feedback", "--db", str(db), "--json"],
                           capture_output=True, text=True, check=True)
    listed = json.loads(shown.stdout)
    assert listed["counters"]["joined"] == 2
    assert {(f["key"], f["state"], f["rollout_id"]) for f in listed["feedback"]} == {
        ("http:early", "joined", "r-later"), ("http:k-1", "joined", "r-served")}
    shown = subprocess.run([sys.executable, "-m", "spanrl", "inspect", "rollout", "r-served", "--db", str(db)],
                           capture_output=True, text=True, check=True)
    assert f"late feedback: thumbs=1 on call {call} (http, good answer)" in shown.stdout


def test_feedback_for_a_rollout_saved_but_not_yet_indexed_joins_in_its_answer(start_receiver, memory_tracer, kit,
                                                                               tmp_path):
    """The window between the assembler saving a rollout and indexing it for feedback: a client
    that sees the rollout assembled and sends feedback at once gets it joined, not pending."""
    db = tmp_path / "spanrl.db"
    server = start_receiver(token=TOKEN, poll_s=3600)  # the assembler's thread never passes
    kit.emit_agent_rollout(memory_tracer.tracer, "r-1", calls=1, reward=None)
    spans = memory_tracer.exporter.get_finished_spans()
    export(server.grpc_port, spans)
    with SpanStore(db) as store:
        kit.wait_for(lambda: len(store.rollout_bodies("r-1")) == len(spans), timeout=20, what="spans stored")
        rollout, _ = server.assembler.assemble("r-1", END_ROLLOUT_SPAN)
        store.save_assembled(rollout)  # saved as the assembler does, before its catch_up
    status, answer = post(server.http_port, {"response_id": "resp-r-1-0", "value": 1.0, "idempotency_key": "now"})
    assert status == 200, answer
    assert (answer["state"], answer["rollout_id"], answer["call_span_id"]) == (
        "joined", "r-1", rollout.transitions[0].span_id)
    # feedback for what nobody has assembled is still kept pending
    status, answer = post(server.http_port, {"rollout_id": "r-unknown", "value": 1.0, "idempotency_key": "later"})
    assert (status, answer["state"]) == (202, "pending"), answer


def test_replayed_feedback_counts_once_and_a_reused_key_is_refused(start_receiver, memory_tracer, kit, tmp_path):
    server = start_receiver(token=TOKEN)
    kit.emit_agent_rollout(memory_tracer.tracer, "r-1", calls=1, reward=None)
    export(server.grpc_port, memory_tracer.exporter.get_finished_spans())
    assembled(kit, tmp_path / "spanrl.db", "r-1")
    body = {"rollout_id": "r-1", "value": 1.0, "idempotency_key": "once"}
    assert post(server.http_port, body)[0] == 200
    status, answer = post(server.http_port, body)  # the client's retry
    assert (status, answer["replayed"], answer["state"]) == (200, True, "joined")
    status, answer = post(server.http_port, {**body, "value": 0.0})
    assert (status, answer["field"]) == (409, "idempotency_key")
    # the header form of the key is the same key
    assert post(server.http_port, {"rollout_id": "r-1", "value": 1.0}, headers={"Idempotency-Key": "once"})[1][
        "replayed"]
    with FeedbackStore(tmp_path / "spanrl.db") as book:
        assert [s.feedback.value for s in book.feedback_of("r-1")] == [1.0]
        counters = book.counters()
    assert (counters["received"], counters["replayed"], counters["joined"]) == (1, 2, 1)


@pytest.mark.parametrize(("body", "field"), [
    (b"{not json", "body"),
    ([1, 2], "body"),
    ({"value": 1.0, "idempotency_key": "k"}, "target"),
    ({"trace_id": "ab" * 16, "span_id": "cd" * 8, "value": 1.0, "idempotency_key": "k"}, "target"),
    ({"rollout_id": "r", "value": "good", "idempotency_key": "k"}, "value"),
    ({"rollout_id": "r", "idempotency_key": "k"}, "value"),
    (b'{"rollout_id": "r", "value": NaN, "idempotency_key": "k"}', "value"),
    ({"rollout_id": "r", "value": 1e9, "idempotency_key": "k"}, "value"),
    ({"rollout_id": "r", "value": True, "idempotency_key": "k"}, "value"),
    (b'{"rollout_id": "r", "value": 1' + b"0" * 400 + b', "idempotency_key": "k"}', "value"),
    ({"rollout_id": "r", "value": 1.0}, "idempotency_key"),
    ({"rollout_id": "r", "value": 1.0, "idempotency_key": ""}, "idempotency_key"),
    ({"trace_id": "xyz", "value": 1.0, "idempotency_key": "k"}, "trace_id"),
    ({"span_id": "00" * 8, "value": 1.0, "idempotency_key": "k"}, "span_id"),
    ({"rollout_id": 7, "value": 1.0, "idempotency_key": "k"}, "rollout_id"),
    ({"rollout_id": "r", "value": 1.0, "idempotency_key": "k", "name": 3}, "name"),
    ({"rollout_id": "r", "value": 1.0, "idempotency_key": "k", "score": 3}, "score"),
])
def test_bad_bodies_are_400_naming_the_field(start_receiver, body, field):
    server = start_receiver(token=TOKEN)
    status, answer = post(server.http_port, body)
    assert (status, answer["field"]) == (400, field), answer
    assert answer["message"].startswith(f"{field}: ")


def test_feedback_needs_the_token(start_receiver):
    server = start_receiver(token=TOKEN)
    status, _ = post(server.http_port, {"rollout_id": "r", "value": 1.0, "idempotency_key": "k"}, token="wrong")
    assert status == 401
    assert stats(server.http_port)["feedback"]["received"] == 0


def test_out_of_range_feedback_is_clipped_when_the_receiver_clips(start_receiver):
    server = start_receiver(reward_min=0.0, reward_max=1.0, reward_out_of_range="clip")
    status, answer = post(server.http_port, {"rollout_id": "r", "value": 7, "idempotency_key": "k"}, token=None)
    assert (status, answer["value"]) == (202, 1.0)
    assert stats(server.http_port)["feedback"]["clipped"] == 1


def test_late_span_events_join_and_evaluations_need_the_opt_in(start_receiver, memory_tracer, kit, tmp_path):
    db = tmp_path / "spanrl.db"
    server = start_receiver(token=TOKEN, evaluation_rewards=True)
    tracer = memory_tracer.tracer
    kit.emit_agent_rollout(tracer, "r-1", calls=2, reward=None)
    spans = memory_tracer.exporter.get_finished_spans()
    export(server.grpc_port, spans)
    rollout = assembled(kit, db, "r-1")
    trace = spans[0].context
    memory_tracer.exporter.clear()
    # hours later: an evaluator in the same trace (no rollout id), and a late span of the rollout itself
    from opentelemetry import trace as trace_api

    parent = trace_api.set_span_in_context(trace_api.NonRecordingSpan(trace))
    with tracer.start_as_current_span("evaluate", context=parent) as evaluator:
        evaluator.add_event(semconv.GENAI_EVALUATION_EVENT, {semconv.GENAI_EVALUATION_NAME: "helpful",
                                                             semconv.GENAI_EVALUATION_SCORE: 0.25})
        evaluator.add_event(semconv.GENAI_EVALUATION_EVENT, {semconv.GENAI_EVALUATION_SCORE: float("inf")})
    with tracer.start_as_current_span("grade", attributes=kit.rollout_attrs("r-1")) as grade:
        grade.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 2.0, semconv.REWARD_NAME: "grade",
                                               semconv.REWARD_RESPONSE_ID: "resp-r-1-0"})
    late = memory_tracer.exporter.get_finished_spans()
    export(server.grpc_port, late)
    export(server.grpc_port, late)  # the exporter's retry: counted once
    with FeedbackStore(db) as book:
        joined = kit.wait_for(lambda: len(book.feedback_of("r-1")) == 2 and book.feedback_of("r-1"), what="joined")
        counters = book.counters()
    by_name = {s.feedback.name: s for s in joined}
    assert (by_name["helpful"].feedback.value, by_name["helpful"].call_span_id) == (0.25, None)
    assert (by_name["grade"].feedback.value, by_name["grade"].call_span_id) == (2.0, rollout.transitions[0].span_id)
    assert counters["rejected"] == 2 and counters["replayed"] == 2  # the infinite score, twice; the retry
    judged = with_feedback(rollout, joined)
    assert judged.total_reward == 2.25
    assert [t.reward for t in judged.transitions] == [2.0, 0.0]


def test_evaluation_events_without_the_opt_in_are_counted_not_joined(start_receiver, memory_tracer, tmp_path):
    server = start_receiver()
    with memory_tracer.tracer.start_as_current_span("evaluate") as evaluator:
        evaluator.add_event(semconv.GENAI_EVALUATION_EVENT, {semconv.GENAI_EVALUATION_SCORE: 1.0})
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{server.grpc_port}", insecure=True, timeout=10)
    assert exporter.export(memory_tracer.exporter.get_finished_spans()) == SpanExportResult.SUCCESS
    exporter.shutdown()
    counters = stats_no_token(server.http_port)
    assert (counters["evaluations_ignored"], counters["received"]) == (1, 0)


def stats_no_token(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/spanrl/v1/stats", timeout=10) as answer:
        return json.loads(answer.read())["feedback"]


def test_an_evaluator_span_that_came_in_time_is_not_counted_twice(start_receiver, memory_tracer, kit, tmp_path):
    db = tmp_path / "spanrl.db"
    server = start_receiver(evaluation_rewards=True)
    tracer = memory_tracer.tracer
    with tracer.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=kit.rollout_attrs("r-1")):
        with tracer.start_as_current_span("llm", attributes={
                **kit.rollout_attrs("r-1"), semconv.LLM_PROMPT_TOKEN_IDS: [1, 2],
                semconv.llm_response_token_ids(0): [3]}):
            pass
        with tracer.start_as_current_span("evaluate") as evaluator:  # no rollout id: joins by its trace
            evaluator.add_event(semconv.GENAI_EVALUATION_EVENT, {semconv.GENAI_EVALUATION_SCORE: 0.5})
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{server.grpc_port}", insecure=True, timeout=10)
    assert exporter.export(memory_tracer.exporter.get_finished_spans()) == SpanExportResult.SUCCESS
    exporter.shutdown()
    rollout = assembled(kit, db, "r-1")
    assert rollout.total_reward == 0.5  # assembly read the evaluator span of its trace
    with FeedbackStore(db) as book:
        kit.wait_for(lambda: book.counters()["duplicates"] == 1, what="the feedback seen as a duplicate")
        assert book.feedback_of("r-1") == []


def test_log_record_evaluations_join_by_span_id(start_receiver, memory_tracer, kit, tmp_path):
    db = tmp_path / "spanrl.db"
    server = start_receiver(token=TOKEN, evaluation_rewards=True)
    kit.emit_agent_rollout(memory_tracer.tracer, "r-1", calls=2, reward=None)
    spans = memory_tracer.exporter.get_finished_spans()
    export(server.grpc_port, spans)
    rollout = assembled(kit, db, "r-1")
    call = rollout.transitions[1]
    context = next(s.context for s in spans if s.context.span_id == int(call.span_id, 16))
    provider = LoggerProvider(resource=Resource.create({"service.name": "evaluator"}))
    provider.add_log_record_processor(SimpleLogRecordProcessor(OTLPLogExporter(
        endpoint=f"http://127.0.0.1:{server.http_port}/v1/logs", headers={"Authorization": f"Bearer {TOKEN}"})))
    try:
        provider.get_logger("evaluator").emit(LogRecord(
            event_name=semconv.GENAI_EVALUATION_EVENT, trace_id=context.trace_id, span_id=context.span_id,
            trace_flags=context.trace_flags,
            attributes={semconv.GENAI_EVALUATION_NAME: "relevance", semconv.GENAI_EVALUATION_SCORE: 0.75}))
    finally:
        provider.shutdown()
    with FeedbackStore(db) as book:
        joined = kit.wait_for(lambda: book.feedback_of("r-1"), what="the log record joined")
    assert [(s.feedback.name, s.feedback.value, s.call_span_id, s.feedback.source) for s in joined] == [
        ("relevance", 0.75, call.span_id, semconv.GENAI_EVALUATION_EVENT)]


def test_unmatched_feedback_expires_and_the_cap_evicts_the_oldest(start_receiver, kit, tmp_path):
    server = start_receiver(feedback_ttl_s=0.5, feedback_max_pending=2)
    for key in ("a", "b", "c"):
        assert post(server.http_port, {"response_id": f"never-{key}", "value": 1.0, "idempotency_key": key},
                    token=None)[0] == 202
    assert stats_no_token(server.http_port)["evicted"] == 1
    counters = kit.wait_for(lambda: (c := stats_no_token(server.http_port))["expired"] == 2 and c,
                            what="the pending feedback expired")
    assert (counters["pending"], counters["joined"]) == (0, 0)
