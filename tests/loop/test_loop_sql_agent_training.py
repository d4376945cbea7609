"""The Text-to-SQL example trains for two GRPO steps through real processes, with AIR on.

A local model warm-started briefly on the example's demonstrations; ``spanrl receive`` with the
example's ``air_rules.yaml`` and ``spanrl run`` with the LangGraph agent are child processes; the
training loop runs here with ``agents: [writer, rewriter]``. The test reads what the run left: the
receiver's store (transitions named by LangGraph's nodes, AIR rewards), what the trainer recorded
it trained each rollout with, and metrics.jsonl.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from spanrl.bridge_protocol import VALIDATION_ROLLOUT_PREFIX
from spanrl.examples.sql_agent.pipeline import VALIDATION_TASKS, prepare_model, train
from spanrl.examples.task_pipeline import TrainingRun, WarmStart
from spanrl.otlp_receiver import trained_rewards
from spanrl.otlp_receiver.span_tree import record_from_body
from spanrl.otlp_receiver.store import SpanStore
from spanrl.schema import metrics as keys
from spanrl.schema.metrics import read_metrics

TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")
HELD_OUT = 3  # validation questions scored after each step


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sql_agent")
    warm = prepare_model(str(out / "model"), WarmStart(steps=30, batch_size=16, device=TEST_DEVICE), progress=False)
    val = out / "val.jsonl"
    val.write_text("\n".join(VALIDATION_TASKS.read_text().splitlines()[:HELD_OUT]) + "\n")
    summary = train(TrainingRun(output_dir=str(out / "train"), model_dir=warm, air=True, steps=2, group_size=2,
                                tasks_per_step=3, val_every=1, concurrency=6, device=TEST_DEVICE,
                                rollout_timeout_s=240.0, val_tasks=str(val)), progress=False)
    (out / "train" / "accuracy.json").write_text(json.dumps(summary["accuracy"]))
    return out / "train"


@pytest.mark.timeout(900)
def test_only_writer_and_rewriter_calls_reach_the_update(trained_run):
    rows = read_metrics(trained_run / "run")
    assert [r["step"] for r in rows] == [1, 2] and [r["actor/policy_version"] for r in rows] == [1, 2]
    rollouts, _ = SpanStore(str(trained_run / "spanrl.db")).completed_rollouts(since=0)
    trained = trained_rewards.load(str(trained_run / "spanrl.db"))
    rollouts = [r for r in rollouts if not r.rollout_id.startswith(VALIDATION_ROLLOUT_PREFIX)]
    assert len(rollouts) == 12 and len(trained) == 12
    seen_agents: set = set()
    trained_agents: set = set()
    for rollout in rollouts:
        names = {t.index: t.agent_name for t in rollout.transitions}
        seen_agents |= set(names.values())
        # every call of the graph is a transition named by its LangGraph node
        assert set(names.values()) <= {"writer", "checker", "rewriter"}, (names, rollout.problems)
        record = trained[rollout.rollout_id]
        trained_agents |= {names[index] for index in record.returns}
        assert {names[index] for index in record.returns} <= {"writer", "rewriter"}
        # every call of the selected agents was trained on, with its own return
        selected = {i for i, name in names.items() if name in ("writer", "rewriter")}
        assert set(record.returns) == selected
        for transition in rollout.transitions:
            if transition.index in record.returns:
                assert record.returns[transition.index] == pytest.approx(transition.return_)
    assert "checker" in seen_agents and trained_agents == {"writer", "rewriter"}
    # the update saw exactly those transitions (one sample per trained call)
    for step in (1, 2):
        trained_this_step = [r for r in trained.values() if r.step == step and r.used]
        assert rows[step - 1]["actor/transitions"] == sum(len(r.returns) for r in trained_this_step)


@pytest.mark.timeout(900)
def test_held_out_accuracy_is_the_execution_match_of_each_validation_round(trained_run):
    """Validation after each step: its rollouts are scored (val_reward: execution match plus AIR
    penalties) but never trained on; held-out accuracy counts the execution match alone."""
    rows = keys.read_metrics(trained_run / "run")
    assert [r[keys.VAL_ROLLOUTS] for r in rows] == [HELD_OUT, HELD_OUT]
    rollouts, _ = SpanStore(str(trained_run / "spanrl.db")).completed_rollouts(since=0)
    trained = trained_rewards.load(str(trained_run / "spanrl.db"))
    accuracy = {int(k): v for k, v in json.loads((trained_run / "accuracy.json").read_text()).items()}
    assert sorted(accuracy) == [1, 2]
    for step in (1, 2):
        held_out = [r for r in rollouts if r.rollout_id.startswith(f"{VALIDATION_ROLLOUT_PREFIX}{step}-")]
        assert len(held_out) == HELD_OUT and not any(r.rollout_id in trained for r in held_out)
        matches = [sum(w.value for w in r.rewards if w.name == "execution_match") for r in held_out]
        assert accuracy[step] == pytest.approx(sum(matches) / HELD_OUT)
        assert rows[step - 1][keys.VAL_REWARD] == pytest.approx(sum(r.total_reward for r in held_out) / HELD_OUT)


@pytest.mark.timeout(900)
def test_sql_errors_are_intermediate_rewards_on_the_call_that_wrote_the_query(trained_run):
    rollouts, _ = SpanStore(str(trained_run / "spanrl.db")).completed_rollouts(since=0)
    tokenizer = AutoTokenizer.from_pretrained(str(trained_run.parent / "model" / "model-warm"))
    errors = 0
    for rollout in rollouts:
        by_span = {t.span_id: t for t in rollout.transitions}
        air = [r for r in rollout.rewards if r.source == "air:sql_error"]
        execution = [r for r in rollout.rewards if r.source == "spanrl.reward"]
        assert [r.name for r in execution] == ["execution_match"]
        for reward in air:
            errors += 1
            assert reward.value == pytest.approx(-0.3)
            call = by_span[reward.call_span_id]
            assert call.agent_name in ("writer", "rewriter")  # the checker writes no query
        # a call's reward is its own AIR penalties (plus the execution match on the last call), and
        # its return (credit: discounted, gamma 1) is its reward plus every later call's
        for transition in rollout.transitions:
            own = sum(r.value for r in rollout.rewards if r.call_span_id == transition.span_id)
            assert transition.reward == pytest.approx(own)
            later = sum(t.reward for t in rollout.transitions if t.index >= transition.index)
            assert transition.return_ == pytest.approx(later)
        # the query each failing run_sql ran is the text the call it is charged to wrote
        for reward in air:
            written = tokenizer.decode(by_span[reward.call_span_id].response_token_ids, skip_special_tokens=True)
            failing_query = _tool_query(rollout, reward.span_id, trained_run)
            assert failing_query.strip() in written or json.dumps(failing_query)[1:-1] in written, (
                failing_query, written)
    assert errors > 0, "a briefly warm-started model writes failing SQL; no AIR reward was seen"


def _tool_query(rollout, span_id: str, run_dir: Path) -> str:
    """The ``query`` argument the ``run_sql`` tool span ``span_id`` recorded (openinference's
    ``input.value``), read from the receiver's store."""
    store = SpanStore(str(run_dir / "spanrl.db"))
    for stored in store.rollout_spans(rollout.rollout_id):
        record = record_from_body(stored.body)
        if record.key == span_id:
            assert record.name == "run_sql" and record.status_error
            value = str(record.attributes["input.value"])
            try:
                parsed = json.loads(value)
            except ValueError:
                return value
            return str(parsed.get("query", value)) if isinstance(parsed, dict) else value
    raise AssertionError(f"no span {span_id} in rollout {rollout.rollout_id}")


@pytest.mark.timeout(900)
def test_the_writer_is_served_the_prompt_its_demonstrations_taught(trained_run):
    """The warm start's writer examples render (with the run_sql tool) to exactly the prompt ids
    the policy served the writer's first call, so the warm start taught the calls the agent makes."""
    from spanrl.examples.sql_agent.agent import WRITER_PROMPT
    from spanrl.examples.sql_agent.demonstrations import tool_schema
    from spanrl.examples.sql_agent.pipeline import TRAIN_TASKS
    from spanrl.schema.tasks import load_tasks
    from spanrl.trainer_bridge.torch_backend.server.chat_format import encode_chat

    questions = {task_id: task["question"] for task_id, task in load_tasks(str(TRAIN_TASKS))}
    tokenizer = AutoTokenizer.from_pretrained(str(trained_run.parent / "model" / "model-warm"))
    rollouts, _ = SpanStore(str(trained_run / "spanrl.db")).completed_rollouts(since=0)
    for rollout in rollouts:
        if rollout.rollout_id.startswith(VALIDATION_ROLLOUT_PREFIX):
            continue
        first = rollout.transitions[0]
        assert first.agent_name == "writer"
        messages = [{"role": "system", "content": WRITER_PROMPT},
                    {"role": "user", "content": questions[rollout.task_id]}]
        assert list(first.prompt_token_ids) == encode_chat(tokenizer, messages, [tool_schema()])
