"""Training goes on when the agent process crashes on some tasks and hangs on others.

The agent is a command run under ``opentelemetry-instrument`` by ``spanrl run``: it exits
with an error on ``crash`` tasks, sleeps forever on ``hang`` tasks (killed at the rollout
timeout) and runs the calculator agent on the others. Receiver and runner are real child
processes; the trainer runs here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from spanrl.child_processes import free_port, wait_for_port
from spanrl.errors import UserError
from spanrl.schema.metrics import read_metrics
from spanrl.trainer_bridge.session import run_training
from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir
from spanrl.trainer_bridge.train_settings import TrainSettings

# where models run in these tests: cpu, or cuda on a GPU machine (docs/gpu.md)
TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
UNUSED_INSTRUMENTORS = "spanrl_anthropic,anthropic,langchain,crewai,spanrl_openai_agents"


def train_with_the_flaky_agent(tmp_path, tasks: list[dict], steps: int, rollout_timeout_s: float,
                               relaunch_attempts: int) -> tuple[dict, str]:
    """A real receiver and a runner of ``agents/flaky_agent.py`` (each task's ``behaviour`` says how
    it fails) around ``run_training`` on a tiny model; the summary and the runner's output."""
    model_dir = create_model_dir(tmp_path / "model", preset="tiny", seed=0)
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text("\n".join(json.dumps(t) for t in tasks) + "\n")
    (tmp_path / "markers").mkdir()
    db = tmp_path / "spanrl.db"
    grpc_port, http_port, bridge_port = free_port(), free_port(), free_port()
    receiver = subprocess.Popen(
        [sys.executable, "-m", "spanrl", "receive", "--db", str(db), "--grpc-port",
         str(grpc_port), "--http-port", str(http_port), "--grace-s", "0.3"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    runner = None
    try:
        wait_for_port(grpc_port, receiver, "spanrl receive")
        env = dict(os.environ, CALC_AGENT_DIR=os.path.join(REPO, "examples", "calc_agent"),
                   FLAKY_MARKER_DIR=str(tmp_path / "markers"),
                   # a plain OpenAI-SDK agent: the other instrumentors installed here (Anthropic,
                   # LangChain, CrewAI, Agents SDK) would add ~3 s of start-up to every attempt
                   OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=UNUSED_INSTRUMENTORS)
        runner = subprocess.Popen(
            [sys.executable, "-m", "spanrl", "run", "--command",
             json.dumps([sys.executable, os.path.join(HERE, "agents", "flaky_agent.py")]),
             "--bridge-url", f"http://127.0.0.1:{bridge_port}",
             "--otlp-endpoint", f"http://127.0.0.1:{grpc_port}", "--concurrency", "6"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        settings = TrainSettings(
            tasks=str(tasks_file), model=str(model_dir), output_dir=str(tmp_path / "run"),
            store=str(db), reward="spanrl.examples.calc_agent.reward:reward", group_size=2,
            tasks_per_step=3, steps=steps, rollout_timeout_s=rollout_timeout_s, assembly_wait_s=20.0,
            policy_port=0, bridge_port=bridge_port, device=TEST_DEVICE, checkpoint_every=0,
            relaunch_attempts=relaunch_attempts,
        )
        summary = run_training(settings, show_progress=False)
        runner_output, _ = runner.communicate(timeout=60)
    finally:
        for process in (runner, receiver):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    return summary, runner_output


def test_crashing_and_hanging_agent_processes_are_failed_rollouts(tmp_path):
    summary, runner_output = train_with_the_flaky_agent(tmp_path, [
        {"id": "fine", "question": "12+30", "answer": 42},
        {"id": "boom", "question": "1+1", "answer": 2, "behaviour": "crash"},
        {"id": "stuck", "question": "2+2", "answer": 4, "behaviour": "hang"},
    ], steps=2, rollout_timeout_s=20.0,
        relaunch_attempts=0)  # what is left out without relaunch (test_a_timed_out_member_is_relaunched)

    assert summary["steps"] == 2 and summary["policy_version"] == 2, summary
    rows = read_metrics(tmp_path / "run")
    for row in rows:
        assert row["rollout/count"] == 6
        assert row["rollout/left_out"] == {"failed": 2, "timeout": 2}, row
        assert row["rollout/used"] == 2 and row["actor/transitions"] >= 2
    assert "rollouts: failed 4, ok 4, timeout 4" in runner_output, runner_output[-2000:]


def test_a_timed_out_member_is_relaunched_and_its_group_trains_whole(tmp_path):
    """The agent hangs on the first attempt of ``once`` only: that attempt times out, is relaunched
    in the same group, and the step trains both tasks' whole groups; the agent's crash is not relaunched."""
    summary, runner_output = train_with_the_flaky_agent(tmp_path, [
        {"id": "fine", "question": "12+30", "answer": 42},
        {"id": "once", "question": "2+2", "answer": 4, "behaviour": "hang_once"},
        {"id": "boom", "question": "1+1", "answer": 2, "behaviour": "crash"},
    ], steps=1, rollout_timeout_s=30.0, relaunch_attempts=1)  # CI: six agents starting at once took > 15 s

    assert summary["steps"] == 1, summary
    (row,) = read_metrics(tmp_path / "run")
    assert row["rollout/count"] == 6
    assert row["rollout/relaunched"] == {"timeout": 1}, row
    assert row["rollout/left_out"] == {"failed": 2}, row  # the crashing agent's own failures
    assert row["rollout/used"] == 4, row  # fine and once: both groups whole
    assert "rollouts: failed 2, ok 4, timeout 1" in runner_output, runner_output[-2000:]


def test_a_taken_policy_port_is_a_clear_settings_error(tmp_path):
    import socket

    import pytest

    model_dir = create_model_dir(tmp_path / "model", preset="tiny", seed=0)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "a", "question": "1+1", "answer": 2}) + "\n")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        settings = TrainSettings(
            tasks=str(tasks), model=str(model_dir), output_dir=str(tmp_path / "run"),
            store=str(tmp_path / "spanrl.db"), reward="spanrl.examples.calc_agent.reward:reward",
            steps=1, policy_port=port, bridge_port=free_port(), device=TEST_DEVICE)
        with pytest.raises(UserError, match=f"policy server cannot listen on 127.0.0.1:{port} .policy_port."):
            run_training(settings, show_progress=False)
