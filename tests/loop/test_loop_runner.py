"""The runner against a real bridge API: crashing and hanging in-process agents are failed
rollouts, reported to the bridge, with the rollout span ended as ERROR; the runner goes on."""

from __future__ import annotations

import os
import sys
import threading

from opentelemetry.trace import StatusCode

from spanrl.instrumentation import semconv
from spanrl.runner.runner import Runner
from spanrl.runner.settings import RunnerSettings

AGENTS_DIR = os.path.join(os.path.dirname(__file__), "agents")


def test_crash_and_hang_are_failed_rollouts_and_the_runner_goes_on(bridge, tracer_provider, span_exporter):
    dispatcher, api = bridge
    span_exporter.clear()
    tasks = [("ok1", {"id": "ok1"}), ("boom", {"id": "boom", "behaviour": "crash"}),
             ("stuck", {"id": "stuck", "behaviour": "hang"}), ("ok2", {"id": "ok2"})]
    dispatcher.rollout_timeout_s = 1.0
    attempts = dispatcher.open_round(0, tasks, group_size=2)
    settings = RunnerSettings(agent="flaky_agent:solve", bridge_url=api.url, concurrency=3,
                              python_path=[AGENTS_DIR], bridge_wait_s=10)
    runner = Runner(settings, tracer_provider=tracer_provider)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        outcomes = dispatcher.wait_round(poll_s=0.05)
    finally:
        dispatcher.close()  # the runner hears 410 and stops
        thread.join(timeout=10)
        sys.modules["flaky_agent"].release_hung_agents.set()
    assert not thread.is_alive(), "the runner did not stop when training finished"
    by_task = {}
    for attempt in attempts:
        by_task.setdefault(attempt.task_id, set()).add(outcomes[attempt.rollout_id].status)
    assert by_task == {"ok1": {"ok"}, "ok2": {"ok"}, "boom": {"failed"}, "stuck": {"timeout"}}
    crash_errors = {outcomes[a.rollout_id].error for a in attempts if a.task_id == "boom"}
    assert all("crashed on purpose" in e for e in crash_errors)
    assert runner.counts == {"ok": 4, "failed": 2, "timeout": 2}

    rollout_spans = [s for s in span_exporter.get_finished_spans()
                     if s.name == semconv.ROLLOUT_SPAN_NAME]
    by_id = {s.attributes[semconv.ROLLOUT_ID]: s for s in rollout_spans}
    for attempt in attempts:
        if attempt.task_id.startswith("ok"):
            span = by_id[attempt.rollout_id]
            assert span.status.status_code != StatusCode.ERROR
            assert span.attributes[semconv.variable("output")] == f"answer-{attempt.task_id}"
            assert span.attributes[semconv.TASK_ID] == attempt.task_id
            assert span.attributes[semconv.ATTEMPT] == attempt.attempt
        elif attempt.task_id == "boom":
            assert by_id[attempt.rollout_id].status.status_code == StatusCode.ERROR
            assert "crashed on purpose" in by_id[attempt.rollout_id].status.description
        else:  # the hung agent is abandoned, but its rollout span still ends, as ERROR
            assert by_id[attempt.rollout_id].status.status_code == StatusCode.ERROR
            assert "did not finish" in by_id[attempt.rollout_id].status.description


def test_a_command_attempt_names_its_rollout_to_the_child_and_spans_it_here(bridge, tracer_provider, span_exporter):
    from spanrl.runner.attempts import run_command_attempt
    from spanrl.runner.bridge_client import BridgeClient

    dispatcher, api = bridge
    (attempt,) = dispatcher.open_round(0, [("cmd", {"id": "cmd"})], group_size=1)
    claim = BridgeClient(api.url).claim()
    assert claim is not None and claim.rollout_id == attempt.rollout_id
    child = [sys.executable, "-c", "import os; print(os.environ['OTEL_RESOURCE_ATTRIBUTES'])"]
    result = run_command_attempt(child, claim, "http://127.0.0.1:9", wrap=False,
                                 extra_env={"OTEL_RESOURCE_ATTRIBUTES": "team=rl"},
                                 tracer_provider=tracer_provider)
    expected_identity = (f"{semconv.ROLLOUT_ID}={attempt.rollout_id},{semconv.TASK_ID}=cmd,"
                         f"{semconv.ATTEMPT}=0")
    assert result.status == "ok" and result.output == f"team=rl,{expected_identity}"
    (span,) = span_exporter.get_finished_spans()
    assert span.name == semconv.ROLLOUT_SPAN_NAME
    assert span.attributes[semconv.ROLLOUT_ID] == attempt.rollout_id
    assert span.attributes[semconv.variable("output")] == result.output
