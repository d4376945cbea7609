"""``trust_agent_rewards: false``: an agent's own reward events do not count, only the rewards
the receiver's AIR rules derive (and a trainer-side reward function). Spans from the real SDK,
assembled by the receiver's code with the default AIR rule, scored by the real training loop."""

from __future__ import annotations

import json
import time

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

from spanrl.bridge_protocol import Attempt
from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.air import load_rules
from spanrl.otlp_receiver.assembly import AssemblyOptions, assemble_rollout
from spanrl.otlp_receiver.otlp_decode import decode_request
from spanrl.otlp_receiver.span_tree import records_from_bodies
from spanrl.schema import metrics as keys
from spanrl.trainer_bridge.task_dispatch import Outcome
from spanrl.trainer_bridge.train_settings import TrainSettings
from spanrl.trainer_bridge.training_loop import StepUpdate, TrainingLoop, step_row

LLM = {semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM, semconv.LLM_PROMPT_TOKEN_IDS: [1],
       semconv.llm_response_token_ids(0): [2]}
ATTEMPT = Attempt("r", "t", 0, {"id": "t"}, 0)


def _rollout(tool_fails: bool, agent_reward: float = 5.0, options: AssemblyOptions | None = None):
    """A rollout whose agent awards itself ``agent_reward``; its tool fails when ``tool_fails``."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span(semconv.ROLLOUT_SPAN_NAME) as root:
        with tracer.start_as_current_span("llm", attributes=LLM):
            pass
        with tracer.start_as_current_span("tool") as tool:
            if tool_fails:
                tool.set_status(Status(StatusCode.ERROR, "boom"))
        root.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: agent_reward})
    provider.shutdown()
    decoded = decode_request(encode_spans(exporter.get_finished_spans()))
    records = records_from_bodies(row.body for row in decoded.rows)
    return assemble_rollout("r", records, "rollout_span", options or AssemblyOptions(air_rules=load_rules("default")))


def _loop(tmp_path, trust: bool) -> TrainingLoop:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t"}) + "\n")
    return TrainingLoop(TrainSettings(tasks=str(tasks), model="unused-by-the-loop", store=str(tmp_path / "s.db"),
                                      trust_agent_rewards=trust))


def test_agent_rewards_count_only_when_trusted(tmp_path):
    failing, clean = _rollout(tool_fails=True), _rollout(tool_fails=False)
    assert failing.total_reward == 4.9  # 5.0 from the agent, -0.1 from the AIR rule tool_error
    trusting, distrusting = _loop(tmp_path, True), _loop(tmp_path, False)
    assert trusting.scorer.score(ATTEMPT, failing) == 4.9
    assert distrusting.scorer.score(ATTEMPT, failing) == -0.1  # only the rule's reward
    assert trusting.scorer.score(ATTEMPT, clean) == 5.0
    assert distrusting.scorer.score(ATTEMPT, clean) is None  # nothing trustworthy: left out as no_reward


def test_what_the_receiver_counted_reaches_the_step_metrics(tmp_path):
    """A reward outside the receiver's range is rejected there; the step's metrics row says so."""
    rollout = _rollout(tool_fails=False, agent_reward=500.0)
    assert rollout.counters == {"rewards_rejected": 1} and rollout.total_reward is None
    loop = _loop(tmp_path, True)
    loop.store.save_assembled(rollout)
    report = loop.collect([ATTEMPT], {ATTEMPT.rollout_id: Outcome("ok")})
    assert report.left_out == {"no_reward": 1}
    assert report.receiver_counters == {"rewards_rejected": 1}
    row = step_row(0, 0, [ATTEMPT], report, StepUpdate([], set(), 0, {}), 1.0, time.monotonic())
    assert row[keys.RECEIVER_COUNTERS] == {"rewards_rejected": 1}


def test_a_reward_function_adds_the_air_rewards_when_training_but_not_when_held_out(tmp_path):
    """With ``reward: module:function`` the receiver's AIR rewards still count for training (the
    intermediate rewards the rules give the calls that earned them); a held-out rollout (validation,
    ``spanrl eval``) is scored by the function alone, its outcome."""
    (tmp_path / "fixed_reward.py").write_text("def reward(task, variables):\n    return 1.0\n")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t"}) + "\n")
    loop = TrainingLoop(TrainSettings(tasks=str(tasks), model="unused-by-the-loop", store=str(tmp_path / "s.db"),
                                      reward="fixed_reward:reward", python_path=[str(tmp_path)]))
    failing, clean = _rollout(tool_fails=True), _rollout(tool_fails=False)
    trained = loop.scorer.scored(ATTEMPT, failing)
    assert trained.score == 0.9  # the function's 1.0 and tool_error's -0.1; the agent's own 5.0 not
    assert trained.reward_source == "reward function fixed_reward:reward + AIR rules"
    held_out = loop.scorer.scored(ATTEMPT, failing, held_out=True)
    assert (held_out.score, held_out.reward_source) == (1.0, "reward function fixed_reward:reward")
    assert loop.scorer.scored(ATTEMPT, clean).score == 1.0  # no rule matched: the function's value


def _two_call_rollout(first_tool_fails: bool):
    """Two LLM calls, each followed by a tool; the first call's tool fails when ``first_tool_fails``."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
        for call in range(2):
            with tracer.start_as_current_span("llm", attributes=LLM):
                pass
            with tracer.start_as_current_span("tool") as tool:
                if call == 0 and first_tool_fails:
                    tool.set_status(Status(StatusCode.ERROR, "boom"))
    provider.shutdown()
    decoded = decode_request(encode_spans(exporter.get_finished_spans()))
    records = records_from_bodies(row.body for row in decoded.rows)
    return assemble_rollout("r", records, "rollout_span", AssemblyOptions(air_rules=load_rules("default")))


def test_with_transition_advantages_a_reward_functions_air_reaches_only_the_call_that_earned_it(tmp_path):
    """``advantage_level: transition`` with a reward function: each call's return is the
    function's value plus its own call's AIR rewards, and the GRPO samples carry those returns;
    at ``rollout`` level every call keeps the rollout's score."""
    from spanrl.trainer_bridge.samples import training_samples

    (tmp_path / "fixed_reward.py").write_text("def reward(task, variables):\n    return 1.0\n")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t"}) + "\n")

    def loop_at(level: str) -> TrainingLoop:
        return TrainingLoop(TrainSettings(
            tasks=str(tasks), model="unused-by-the-loop", store=str(tmp_path / f"{level}.db"),
            reward="fixed_reward:reward", python_path=[str(tmp_path)], advantage_level=level))

    failing = _two_call_rollout(first_tool_fails=True)
    air_calls = [r.call_span_id for r in failing.rewards if r.source.startswith("air:")]
    assert air_calls == [failing.transitions[0].span_id]  # tool_error judges the call before the tool
    per_call, per_rollout = loop_at("transition"), loop_at("rollout")
    assert per_call.transition_returns and not per_rollout.transition_returns
    trained = per_call.scorer.scored(ATTEMPT, failing)
    assert trained.score == 0.9  # the rollout's score is unchanged: 1.0 - 0.1
    assert [t.return_ for t in trained.transitions] == [0.9, 1.0]
    held_out = per_call.scorer.scored(ATTEMPT, failing, held_out=True)
    assert [t.return_ for t in held_out.transitions] == [t.return_ for t in failing.transitions]
    assert per_rollout.scorer.scored(ATTEMPT, failing).transitions == failing.transitions

    other = Attempt("r2", "t", 1, {"id": "t"}, 0)
    clean = per_call.scorer.scored(other, _two_call_rollout(first_tool_fails=False))
    samples, _ = training_samples([trained, clean], "transition", True,
                                  transition_returns=per_call.transition_returns)
    by_turn = {(s.rollout_id, s.turn_index): s.advantage for s in samples}
    # the failing call alone is below the group's mean; the same rollout's second call is not
    assert by_turn[("r", 0)] < 0 < by_turn[("r", 1)]
    assert by_turn[("r", 1)] == by_turn[("r2", 0)] == by_turn[("r2", 1)]
