"""The retrieval QA example trains for two GRPO steps through real processes, validating after each.

A local model warm-started briefly on the example's demonstrations; ``spanrl receive`` and
``spanrl run`` with the Agents SDK agent (its default Responses model, the ``search`` tool) are
child processes; the training loop runs here, scoring three held-out questions greedily after each
step. The test reads what the run left: metrics.jsonl, the receiver's store and what the trainer
recorded it trained each rollout with.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from spanrl.bridge_protocol import VALIDATION_ROLLOUT_PREFIX
from spanrl.examples.retrieval_qa.agent import AGENT_NAME, INSTRUCTIONS
from spanrl.examples.retrieval_qa.demonstrations import tool_schema
from spanrl.examples.retrieval_qa.pipeline import TASK
from spanrl.examples.retrieval_qa.reward import exact_match
from spanrl.examples.task_pipeline import TrainingRun, WarmStart, prepare_model, train
from spanrl.otlp_receiver import trained_rewards
from spanrl.otlp_receiver.store import SpanStore
from spanrl.schema import metrics as keys
from spanrl.trainer_bridge.torch_backend.server.chat_format import encode_chat

TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")
VALIDATION_TASKS = 3


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("retrieval_qa")
    warm = prepare_model(TASK, str(out / "model"), WarmStart(steps=20, batch_size=8, device=TEST_DEVICE),
                         progress=False)
    val = out / "val.jsonl"
    val.write_text("\n".join(Path(TASK.val_tasks).read_text().splitlines()[:VALIDATION_TASKS]) + "\n")
    summary = train(TASK, TrainingRun(output_dir=str(out / "train"), model_dir=warm, steps=2, group_size=2,
                                      tasks_per_step=2, val_every=1, concurrency=4, device=TEST_DEVICE,
                                      rollout_timeout_s=240.0, val_tasks=str(val)), progress=False)
    return out, summary


@pytest.mark.timeout(900)
def test_held_out_questions_are_scored_after_every_step_and_never_trained_on(trained_run):
    out, summary = trained_run
    rows = keys.read_metrics(out / "train" / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row[keys.VAL_ROLLOUTS] == VALIDATION_TASKS and row[keys.VAL_ROLLOUTS_SCORED] == VALIDATION_TASKS
        assert 0.0 <= row[keys.VAL_REWARD] <= 1.0
    assert sorted(summary["accuracy"]) == [1, 2]
    db = str(out / "train" / "spanrl.db")
    rollouts, _ = SpanStore(db).completed_rollouts(since=0)
    validation = [r for r in rollouts if r.rollout_id.startswith(VALIDATION_ROLLOUT_PREFIX)]
    assert sorted(r.rollout_id.split("-")[0] for r in validation) == ["v1"] * 3 + ["v2"] * 3
    trained = trained_rewards.load(db)
    assert len(trained) == 8 and not any(r.rollout_id in trained for r in validation)


@pytest.mark.timeout(900)
def test_every_call_is_the_researchers_and_its_reward_is_the_exact_match(trained_run):
    out, _ = trained_run
    db = str(out / "train" / "spanrl.db")
    tokenizer = AutoTokenizer.from_pretrained(str(out / "model" / "model-warm"))
    questions = {json.loads(line)["id"]: json.loads(line) for line in Path(TASK.train_tasks).read_text().splitlines()}
    rollouts, _ = SpanStore(db).completed_rollouts(since=0)
    trained = trained_rewards.load(db)
    for rollout in rollouts:
        if rollout.rollout_id not in trained:
            continue
        task = questions[rollout.task_id]
        assert {t.agent_name for t in rollout.transitions} == {AGENT_NAME}
        # the warm start's demonstrations render to exactly the prompt the policy served the first call
        first = rollout.transitions[0]
        messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": task["question"]}]
        assert list(first.prompt_token_ids) == encode_chat(tokenizer, messages, [tool_schema()])
        assert trained[rollout.rollout_id].reward == exact_match(str(rollout.variables.get("output", "")),
                                                                 task["answer"])


@pytest.mark.timeout(900)
def test_the_agents_clients_are_closed_in_their_own_rollouts_loop(trained_run):
    """Each rollout runs in an event loop of its own; a client left to the garbage collector would be
    closed from another rollout's loop and log a traceback each time (thousands in a long run)."""
    out, _ = trained_run
    log = (out / "train" / "runner.log").read_text()
    assert "runner finished" in log
    assert "Task exception was never retrieved" not in log and "Event loop is closed" not in log
