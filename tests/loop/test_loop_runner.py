"""The runner against a real bridge API: crashing and hanging in-process agents are failed
rollouts, reported to the bridge, with the rollout span ended as ERROR; the runner goes on."""

from __future__ import annotations

import json
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


def claim_of(task: dict, timeout_s: float = 30.0):
    from spanrl.bridge_protocol import ClaimedAttempt

    return ClaimedAttempt("r-1", "t", 0, task, 0, timeout_s, "http://127.0.0.1:9/v1", "policy")


def test_a_task_too_large_for_an_environment_variable_arrives_through_a_file(tmp_path):
    """Linux refuses an environment string over 128 KiB (execve fails): such a task comes in a
    file only its owner can read, named by SPANRL_TASK_FILE, and removed afterwards."""
    from spanrl.runner.attempts import run_command_attempt

    task = {"id": "big", "context": "x" * 300_000}
    peek = tmp_path / "peek.json"
    agent = [sys.executable, os.path.join(AGENTS_DIR, "peek_agent.py")]
    result = run_command_attempt(agent, claim_of(task), "http://127.0.0.1:9", wrap=False,
                                 extra_env={"PEEK_OUT": str(peek)})
    assert result.status == "ok", result.error
    seen = json.loads(peek.read_text())
    assert "SPANRL_TASK" not in seen["environ"]
    assert json.loads(seen["task_file"]) == task and json.loads(seen["stdin"]) == task
    assert seen["task_file_mode"] == "0o600"
    assert not os.path.exists(seen["environ"]["SPANRL_TASK_FILE"])
    small = run_command_attempt(agent, claim_of({"id": "small"}), "http://127.0.0.1:9", wrap=False,
                                extra_env={"PEEK_OUT": str(peek)})
    assert small.status == "ok" and "SPANRL_TASK_FILE" not in json.loads(peek.read_text())["environ"]


def test_an_agent_printing_without_end_is_read_into_bounded_buffers():
    """64 MiB on stdout and on stderr: the runner keeps only their tails, and still finds the
    output (the last stdout line) and the end of stderr of a failing agent."""
    from spanrl.runner.agent_process import OUTPUT_TAIL_BYTES, STDERR_TAIL_BYTES, run_child
    from spanrl.runner.attempts import run_command_attempt

    flood = ("import sys\nchunk = b'y' * (1 << 20)\n"
             "for _ in range(64):\n    sys.stdout.buffer.write(chunk); sys.stderr.buffer.write(chunk)\n"
             "print(); print('the answer'); print('last words', file=sys.stderr)\n")
    result = run_child([sys.executable, "-c", flood], dict(os.environ), b"", 120)
    assert result.returncode == 0
    assert len(result.stdout_tail) == OUTPUT_TAIL_BYTES and result.stdout_tail.endswith(b"\nthe answer\n")
    assert len(result.stderr_tail) == STDERR_TAIL_BYTES and result.stderr_tail.endswith(b"last words\n")
    ok = run_command_attempt([sys.executable, "-c", flood], claim_of({"id": "f"}), "http://127.0.0.1:9", wrap=False)
    assert (ok.status, ok.output) == ("ok", "the answer")
    failing = flood + "sys.exit(5)\n"
    failed = run_command_attempt([sys.executable, "-c", failing], claim_of({"id": "f"}), "http://127.0.0.1:9",
                                 wrap=False)
    assert failed.status == "failed" and "code 5" in failed.error and failed.error.endswith("last words")


def test_the_runner_stops_once_too_many_in_process_agents_hang_past_their_timeout(bridge, tracer_provider):
    dispatcher, api = bridge
    dispatcher.rollout_timeout_s = 0.3
    dispatcher.open_round(0, [(f"stuck{i}", {"id": f"stuck{i}", "behaviour": "hang"}) for i in range(4)],
                          group_size=1)
    settings = RunnerSettings(agent="flaky_agent:solve", bridge_url=api.url, concurrency=1, python_path=[AGENTS_DIR],
                              bridge_wait_s=10, max_abandoned_agents=2)
    runner = Runner(settings, tracer_provider=tracer_provider)  # loads flaky_agent
    sys.modules["flaky_agent"].release_hung_agents.clear()  # an earlier test may have released them
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    thread.join(timeout=60)  # it returns on its own: it gave up
    stopped_on_its_own = not thread.is_alive()
    runner.stop()
    sys.modules["flaky_agent"].release_hung_agents.set()
    assert stopped_on_its_own
    assert runner.counts == {"timeout": 2}
    assert runner.gave_up and "max_abandoned_agents: 2" in runner.stop_reason
    assert "run it as a command" in runner.stop_reason
    assert dispatcher.claim() is not None  # the attempts after the second hang were left unclaimed
