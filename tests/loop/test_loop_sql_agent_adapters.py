"""The Text-to-SQL example trains one LoRA adapter per agent for two GRPO steps (issue 26's check).

As ``test_loop_sql_agent_training.py`` (a briefly warm-started local model; ``spanrl receive`` and
``spanrl run`` as child processes; the loop here with ``agents: [writer, rewriter]``), plus
``adapters: {writer, rewriter}``, each LangGraph node asking for its own model name
(``SQL_AGENT_MODEL_PER_NODE=1``), a checkpoint after each step, and the policy endpoint's own span
of every call sent to the receiver. The test reads what the run left: each adapter trained on
exactly its agent's transitions of the step, an adapter whose agent sent none in a step is bitwise
the same in the checkpoints before and after it (``planner``, an agent the graph does not have, in
every run; the rewriter when a step had no rewrite), the base never moved, and the checker (no
adapter) was served by the base model.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

from spanrl.bridge_protocol import VALIDATION_ROLLOUT_PREFIX
from spanrl.examples.sql_agent.pipeline import prepare_model, train
from spanrl.examples.task_pipeline import TrainingRun, WarmStart
from spanrl.instrumentation import semconv
from spanrl.otlp_receiver import trained_rewards
from spanrl.otlp_receiver.endpoint_spans import is_endpoint_span
from spanrl.otlp_receiver.span_tree import record_from_body
from spanrl.otlp_receiver.store import SpanStore
from spanrl.schema.metrics import read_metrics
from spanrl.trainer_bridge.torch_backend.config import TrainerConfig

TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")
# planner: an agent the graph does not have; its adapter gets no transition in any step
ADAPTERS = {"writer": {"agents": ["writer"]}, "rewriter": {"agents": ["rewriter"]}, "planner": {"agents": ["planner"]}}


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sql_adapters")
    warm = prepare_model(str(out / "model"), WarmStart(steps=30, batch_size=16, device=TEST_DEVICE), progress=False)
    train(TrainingRun(output_dir=str(out / "train"), model_dir=warm, air=True, steps=2, group_size=2,
                      tasks_per_step=3, concurrency=6, device=TEST_DEVICE, rollout_timeout_s=240.0,
                      runner_env={"SQL_AGENT_MODEL_PER_NODE": "1"}, endpoint_spans=True,
                      settings={"adapters": ADAPTERS, "val_tasks": "", "checkpoint_every": 1,
                                "trainer": TrainerConfig(keep_checkpoints=2)}), progress=False)
    return out / "train"


def adapter_tensors(checkpoint: Path, adapter: str) -> dict:
    return load_file(str(checkpoint / "adapters" / adapter / "adapter_model.safetensors"))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[key].equal(b[key]) for key in a)


@pytest.mark.timeout(900)
def test_each_adapter_trains_on_its_own_agents_transitions_only(adapter_run):
    rows = read_metrics(adapter_run / "run")
    assert [r["step"] for r in rows] == [1, 2]
    rollouts, _ = SpanStore(str(adapter_run / "spanrl.db")).completed_rollouts(since=0)
    agents_of = {r.rollout_id: {t.index: t.agent_name for t in r.transitions} for r in rollouts
                 if not r.rollout_id.startswith(VALIDATION_ROLLOUT_PREFIX)}
    trained = trained_rewards.load(str(adapter_run / "spanrl.db"))
    assert len(trained) == 6 * 2
    checkpoints = {step: adapter_run / "run" / "checkpoints" / f"step-{step:06d}" for step in (1, 2)}
    for step in (1, 2):
        counts = {"writer": 0, "rewriter": 0, "checker": 0, "planner": 0}
        for record in trained.values():
            if record.step == step and record.used:
                for index in record.returns:
                    counts[agents_of[record.rollout_id][index]] += 1
        assert counts["checker"] == 0  # agents: [writer, rewriter]
        assert counts["writer"] > 0 and counts["planner"] == 0  # every rollout starts with the writer
        for adapter in ADAPTERS:
            # the step's update trained each adapter on exactly its agent's transitions of the step
            assert rows[step - 1].get(f"actor/adapter/{adapter}/samples", 0) == counts[adapter], (step, adapter)
        if step == 2:  # an adapter whose agent sent nothing this step is bitwise the same after it
            for adapter in ADAPTERS:
                unchanged = same(adapter_tensors(checkpoints[1], adapter), adapter_tensors(checkpoints[2], adapter))
                assert unchanged == (counts[adapter] == 0), (adapter, counts)
    # the base is frozen: both checkpoints hold the warm start's weights
    warm = load_file(str(adapter_run.parent / "model" / "model-warm" / "model.safetensors"))
    for checkpoint in checkpoints.values():
        saved = load_file(str(checkpoint / "model.safetensors"))  # may add lm_head (tied to the embedding)
        assert all(saved[key].equal(value) for key, value in warm.items())


@pytest.mark.timeout(900)
def test_the_checker_is_served_by_the_base_and_each_trained_agent_by_its_adapter(adapter_run):
    store = SpanStore(str(adapter_run / "spanrl.db"))
    rollouts, _ = store.completed_rollouts(since=0)
    served: dict[str, set] = {}
    for rollout in rollouts:
        for stored in store.rollout_spans(rollout.rollout_id):
            record = record_from_body(stored.body)
            if is_endpoint_span(record):
                model = record.attributes[semconv.GENAI_REQUEST_MODEL]
                served.setdefault(model, set()).add(record.attributes.get(semconv.LLM_ADAPTER))
    # every node asked for its own name; the endpoint's span names the adapter (none: the base)
    assert served["writer"] == {"writer"} and served["checker"] == {None}
    assert served.get("rewriter", {"rewriter"}) == {"rewriter"}
    assert set(served) <= {"writer", "checker", "rewriter"}
