"""``val_reward_fn``: held-out rollouts are scored by their own reward function, training rollouts by
``reward``. Spans from the real SDK, assembled by the receiver's code, saved in a real store and
collected by the real training loop, with the retrieval QA example's two rewards: the graded
``chain_reward`` to train on, exact match (``reward``) to validate on."""

from __future__ import annotations

import json

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spanrl.bridge_protocol import Attempt
from spanrl.errors import SettingError
from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.assembly import AssemblyOptions, assemble_rollout
from spanrl.otlp_receiver.otlp_decode import decode_request
from spanrl.otlp_receiver.span_tree import records_from_bodies
from spanrl.trainer_bridge.task_dispatch import Outcome
from spanrl.trainer_bridge.train_settings import TrainSettings
from spanrl.trainer_bridge.training_loop import TrainingLoop

REWARDS = "spanrl.examples.retrieval_qa.reward"
TASK = {"id": "qa-0", "question": "In which country is Rilvo Foods based?", "answer": "Hulix",
        "kind": "company_country", "hops": ["Rilvo Foods", "Losat"]}
LLM = {semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM, semconv.LLM_PROMPT_TOKEN_IDS: [1],
       semconv.llm_response_token_ids(0): [2]}


def _rollout(rollout_id: str, answer: str):
    """A rollout of one LLM call whose agent answered ``answer`` (the runner's variable ``output``)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("test").start_as_current_span(
            semconv.ROLLOUT_SPAN_NAME, attributes={semconv.variable("output"): answer}):
        with provider.get_tracer("test").start_as_current_span("llm", attributes=LLM):
            pass
    provider.shutdown()
    records = records_from_bodies(row.body for row in decode_request(encode_spans(exporter.get_finished_spans())).rows)
    return assemble_rollout(rollout_id, records, "rollout_span", AssemblyOptions())


def _scores(loop: TrainingLoop, answers: dict[str, str], held_out: bool) -> dict[str, float]:
    attempts = [Attempt(rollout_id, TASK["id"], 0, TASK, 0) for rollout_id in answers]
    report = loop.collect(attempts, {a.rollout_id: Outcome("ok") for a in attempts}, held_out=held_out)
    return {item.attempt.rollout_id: item.score for item in report.scored}


def _loop(tmp_path, **settings) -> TrainingLoop:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(TASK) + "\n")
    return TrainingLoop(TrainSettings(tasks=str(tasks), model="unused-by-the-loop", store=str(tmp_path / "s.db"),
                                      assembly_wait_s=5.0, **settings))


def test_training_rollouts_get_the_graded_reward_and_held_out_ones_exact_match(tmp_path):
    loop = _loop(tmp_path, reward=f"{REWARDS}:chain_reward", val_reward_fn=f"{REWARDS}:reward")
    answers = {"right": "Hulix", "one short": "Losat", "the subject": "Rilvo Foods", "wrong": "Dorfi"}
    for rollout_id, answer in answers.items():
        loop.store.save_assembled(_rollout(rollout_id, answer))
    trained = _scores(loop, answers, held_out=False)
    for rollout_id, answer in answers.items():
        loop.store.save_assembled(_rollout(f"v-{rollout_id}", answer))
    held_out = _scores(loop, {f"v-{rollout_id}": answer for rollout_id, answer in answers.items()}, held_out=True)
    assert trained == {"right": 1.0, "one short": 0.25, "the subject": 0.0, "wrong": 0.0}
    assert held_out == {"v-right": 1.0, "v-one short": 0.0, "v-the subject": 0.0, "v-wrong": 0.0}


def test_without_val_reward_fn_held_out_rollouts_are_scored_by_reward(tmp_path):
    loop = _loop(tmp_path, reward=f"{REWARDS}:chain_reward")
    loop.store.save_assembled(_rollout("v-short", "Losat"))
    assert _scores(loop, {"v-short": "Losat"}, held_out=True) == {"v-short": 0.25}


def test_a_val_reward_fn_that_is_not_a_function_or_events_is_refused(tmp_path):
    with pytest.raises(SettingError, match="val_reward_fn must be 'events' or 'module:function', got 'exact'"):
        _loop(tmp_path, reward=f"{REWARDS}:reward", val_reward_fn="exact")
