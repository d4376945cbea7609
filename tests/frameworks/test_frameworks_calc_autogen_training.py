"""The AutoGen calculator example trains for two GRPO steps with its agent in ``.venv-autogen``.

``spanrl run`` runs from ``.venv-autogen`` (AutoGen's own venv, as a user's agent environment) and
calls the AutoGen agent in its process; ``spanrl receive`` and the training loop run here, in the
main environment; three held-out problems are scored greedily after each step. It trains with
``advantage_level: transition``, so each solver call is trained on the reward function's value plus
its own call's AIR penalties. The test reads metrics.jsonl, the receiver's store and what the
trainer recorded it trained each rollout and each call with. The warm start is short but fast
(60 steps at 3e-3): enough for the model to call the calculator, with numbers it mostly makes up,
which the AIR rule catches.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from spanrl.bridge_protocol import VALIDATION_ROLLOUT_PREFIX
from spanrl.examples.calc_autogen.demonstrations import SYSTEM_PROMPT, TOOL_SCHEMA
from spanrl.examples.calc_autogen.pipeline import TASK
from spanrl.examples.calc_autogen.reward import number_match
from spanrl.examples.task_pipeline import TrainingRun, WarmStart, prepare_model, train
from spanrl.otlp_receiver import trained_rewards
from spanrl.otlp_receiver.store import SpanStore
from spanrl.schema import metrics as keys
from spanrl.trainer_bridge.torch_backend.server.chat_format import encode_chat

TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")
VALIDATION_TASKS = 3


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("calc_autogen")
    warm = prepare_model(TASK, str(out / "model"),
                         WarmStart(steps=60, batch_size=8, learning_rate=3e-3, device=TEST_DEVICE), progress=False)
    val = out / "val.jsonl"
    val.write_text("\n".join(Path(TASK.val_tasks).read_text().splitlines()[:VALIDATION_TASKS]) + "\n")
    summary = train(TASK, TrainingRun(output_dir=str(out / "train"), model_dir=warm, steps=2, group_size=2,
                                      tasks_per_step=2, val_every=1, concurrency=4, device=TEST_DEVICE,
                                      rollout_timeout_s=240.0, val_tasks=str(val),
                                      settings={"advantage_level": "transition"}), progress=False)
    return out, summary


@pytest.mark.timeout(900)
def test_held_out_problems_are_scored_after_every_step_and_never_trained_on(trained_run):
    out, summary = trained_run
    rows = keys.read_metrics(out / "train" / "run")
    assert [r["step"] for r in rows] == [1, 2] and [r[keys.POLICY_VERSION] for r in rows] == [1, 2]
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
def test_every_call_is_the_solvers_and_the_warm_start_taught_the_prompt_autogen_sends(trained_run):
    out, _ = trained_run
    db = str(out / "train" / "spanrl.db")
    tokenizer = AutoTokenizer.from_pretrained(str(out / "model" / "model-warm"))
    problems = {json.loads(line)["id"]: json.loads(line) for line in Path(TASK.train_tasks).read_text().splitlines()}
    rollouts, _ = SpanStore(db).completed_rollouts(since=0)
    trained = trained_rewards.load(db)
    assert trained
    penalised_calls = 0
    for rollout in rollouts:
        if rollout.rollout_id not in trained:
            continue
        task = problems[rollout.task_id]
        # named by AutoGen's own invoke_agent span, with no code in the agent
        assert {t.agent_name for t in rollout.transitions} == {"solver"}
        # demonstrations.TOOL_SCHEMA is the tool exactly as autogen-ext sent it
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]
        assert list(rollout.transitions[0].prompt_token_ids) == encode_chat(tokenizer, messages, [TOOL_SCHEMA])
        # the reward function's value plus the AIR rule's penalties (air_rules.yaml), each on the
        # solver call whose calculator expression used a number it was never given
        air = [r for r in rollout.rewards if r.source == "air:ungrounded_number"]
        assert {r.call_span_id for r in air} <= {t.span_id for t in rollout.transitions}
        assert all(r.call_span_id == r.span_id and r.value == -0.3 for r in air)
        outcome = number_match(str(rollout.variables.get("output", "")), task["answer"])
        assert trained[rollout.rollout_id].reward == pytest.approx(outcome - 0.3 * len(air))
        # ... and each call trained on the outcome plus only its own call's penalty
        for transition in rollout.transitions:
            own = sum(r.value for r in air if r.call_span_id == transition.span_id)
            assert trained[rollout.rollout_id].returns[transition.index] == pytest.approx(outcome + own)
        penalised_calls += len(air)
    # the warm model makes numbers up in about half its rollouts (3-8 of 8 in 6 runs): there was something to check
    assert penalised_calls > 0
