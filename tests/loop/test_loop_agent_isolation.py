"""What an agent is given, and what it is not: hidden task fields reach the reward function but
never the agent (its environment, stdin, spans); the runner's and trainer's settings variables
(the bridge token among them) never reach it either. Real parts: the training loop's dispatcher
behind the real bridge API (with a token), the real receiver over gRPC, and `spanrl run` as the
user runs it, on a command agent and on an in-process agent."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from spanrl.errors import UserError
from spanrl.otlp_receiver.server import ReceiverServer
from spanrl.otlp_receiver.settings import ReceiverSettings
from spanrl.trainer_bridge.bridge_api import BridgeAPI, PolicyInfo
from spanrl.trainer_bridge.train_settings import TrainSettings
from spanrl.trainer_bridge.training_loop import TrainingLoop

AGENTS_DIR = Path(__file__).resolve().parent / "agents"
GOLD = "gold-4242"
TASK = {"id": "q1", "question": "What is the secret?", "answer": GOLD}
BRIDGE_TOKEN = "bridge-secret-token"


@pytest.fixture
def trainer_side(tmp_path):
    """A receiver, and a training loop whose dispatcher hides ``answer``, served by the bridge API."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(TASK) + "\n")
    store = str(tmp_path / "spanrl.db")
    receiver = ReceiverServer(ReceiverSettings(grpc_port=0, http_port=0, db=store, grace_s=0.2, poll_s=0.05,
                                               idle_timeout_s=0)).start()
    loop = TrainingLoop(TrainSettings(tasks=str(tasks), model="unused-by-the-loop", store=store,
                                      reward="gold_reward:reward", python_path=[str(AGENTS_DIR)],
                                      hidden_task_fields=["answer"], rollout_timeout_s=60))
    api = BridgeAPI(loop.dispatcher, PolicyInfo("http://127.0.0.1:9/v1", "policy"), lambda: 0, port=0,
                    token=BRIDGE_TOKEN).start()
    try:
        yield loop, api, receiver
    finally:
        loop.dispatcher.close()
        api.stop()
        receiver.stop()


def run_one_round(loop, api, receiver, tmp_path, agent_settings: dict):
    """One round of one attempt, run by `spanrl run` (its settings from the environment, as a
    user's shell would hold them); the attempt (as the trainer keeps it), the reward the loop's
    reward call gives its assembled rollout, that rollout, and the runner's output."""
    attempts = loop.dispatcher.open_round(0, loop.next_tasks(1), group_size=1)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"concurrency": 1, "bridge_wait_s": 20, **agent_settings}))
    env = {**os.environ, "OTEL_SPANRL_RUN_BRIDGE_URL": api.url, "OTEL_SPANRL_RUN_BRIDGE_TOKEN": BRIDGE_TOKEN,
           "OTEL_SPANRL_TRAIN_BRIDGE_TOKEN": BRIDGE_TOKEN, "OTEL_SPANRL_RECEIVER_TOKEN": "agents-may-send-spans",
           "OTEL_SPANRL_RUN_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.grpc_port}"}
    runner = subprocess.Popen([sys.executable, "-m", "spanrl", "run", str(config)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        outcomes = loop.dispatcher.wait_round(poll_s=0.05)
        loop.dispatcher.close()  # the runner hears "training finished" and exits
        output, _ = runner.communicate(timeout=60)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.communicate()
    assert runner.returncode == 0, output
    assert [o.status for o in outcomes.values()] == ["ok"], (outcomes, output)
    report = loop.collect(attempts, outcomes)
    assert report.left_out == {"no_transitions": 1}  # the agent made no LLM call: nothing to train
    (attempt,) = attempts
    rollout = loop.store.assembled_rollout(attempt.rollout_id)
    return attempt, loop.scorer.score(attempt, rollout), rollout, output


def stored_span_bodies(store: str) -> list[bytes]:
    with sqlite3.connect(store) as db:
        return [bytes(row[0]) for row in db.execute("SELECT body FROM spans")]


def test_a_command_agent_sees_neither_the_hidden_answer_nor_the_runners_settings(trainer_side, tmp_path):
    loop, api, receiver = trainer_side
    peek = tmp_path / "peek.json"
    attempt, score, rollout, runner_output = run_one_round(loop, api, receiver, tmp_path, {
        "command": [sys.executable, str(AGENTS_DIR / "peek_agent.py")], "wrap_command": False,
        "env": {"PEEK_OUT": str(peek)}})
    seen = json.loads(peek.read_text())
    visible = {"id": "q1", "question": "What is the secret?"}
    assert json.loads(seen["stdin"]) == visible and json.loads(seen["environ"]["SPANRL_TASK"]) == visible
    assert GOLD not in json.dumps(seen)
    assert not [k for k in seen["environ"] if k.startswith(("OTEL_SPANRL_RUN_", "OTEL_SPANRL_TRAIN_"))]
    assert BRIDGE_TOKEN not in json.dumps(seen["environ"])
    assert seen["environ"]["OTEL_SPANRL_RECEIVER_TOKEN"] == "agents-may-send-spans"  # the agent side's own
    # the agent echoed its task as its output, which the runner records in the rollout's span
    assert json.loads(rollout.variables["output"]) == visible
    assert attempt.task == TASK and score == 1.0  # the reward function got the answer; the output lacks it
    bodies = stored_span_bodies(loop.settings.store)
    assert any(b"What is the secret?" in body for body in bodies)
    assert not any(GOLD.encode() in body for body in bodies)
    assert BRIDGE_TOKEN not in runner_output


def test_an_in_process_agent_finds_no_runner_settings_in_its_environment(trainer_side, tmp_path):
    loop, api, receiver = trainer_side
    _, score, rollout, _ = run_one_round(loop, api, receiver, tmp_path, {
        "agent": "peek_agent:solve", "python_path": [str(AGENTS_DIR)]})
    seen = json.loads(rollout.variables["output"])
    assert seen["task"] == {"id": "q1", "question": "What is the secret?"}
    assert "OTEL_SPANRL_RECEIVER_TOKEN" in seen["spanrl_variables"]  # the agent side's own
    assert not [k for k in seen["spanrl_variables"] if k.startswith(("OTEL_SPANRL_RUN_", "OTEL_SPANRL_TRAIN_"))]
    assert score == 1.0


def test_hidden_fields_that_no_task_has_or_the_task_id_are_refused(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(TASK) + "\n")
    for hidden, message in ((["answr"], r"names \['answr'\], which no task in .* has"),
                            (["id"], "cannot hide")):
        with pytest.raises(UserError, match=message):
            TrainingLoop(TrainSettings(tasks=str(tasks), model="m", store=str(tmp_path / "s.db"),
                                       hidden_task_fields=hidden))
