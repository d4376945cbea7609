"""Rewards the user chose to trust (docs/trust.md), through the real receiver: spans from the
real OTel SDK, exported by its OTLP/gRPC exporter, stored, assembled and read back from the store."""

from __future__ import annotations

import time

import pytest
from opentelemetry import context as context_api

from spanrl.errors import SettingError
from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.settings import ReceiverSettings
from spanrl.otlp_receiver.store import SpanStore

LLM = {semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM}


def assembled(server, tracer_to, kit, emit):
    """Run ``emit(tracer)`` in an agent exporting over gRPC to ``server``; the rollout it made."""
    agent = tracer_to(f"127.0.0.1:{server.grpc_port}", "grpc")
    emit(agent.tracer)
    agent.provider.force_flush()
    store = SpanStore(server.settings.db)
    try:
        (rollout,) = kit.wait_for(lambda: store.completed_rollouts(0)[0], what="the assembled rollout")
    finally:
        store.close()
    return rollout


def one_call_with_rewards(*events, identity=None):
    """A rollout of one LLM call, then ``events`` ((name, attributes, timestamp or None) each) on
    a grader span after it."""

    def emit(tracer):
        attributes = identity or {semconv.ROLLOUT_ID: "r", semconv.TASK_ID: "t", semconv.ATTEMPT: 0}
        with tracer.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=attributes):
            with tracer.start_as_current_span("llm", attributes={
                    **LLM, semconv.LLM_PROMPT_TOKEN_IDS: [1, 2], semconv.llm_response_token_ids(0): [3]}):
                pass
            with tracer.start_as_current_span("grader") as grader:
                for name, event_attributes, timestamp in events:
                    grader.add_event(name, event_attributes, timestamp=timestamp)

    return emit


def reward(value, name="score", timestamp=None):
    return semconv.REWARD_EVENT, {semconv.REWARD_VALUE: value, semconv.REWARD_NAME: name}, timestamp


def test_values_outside_the_range_or_not_finite_are_rejected_and_counted(start_receiver, tracer_to, kit):
    server = start_receiver(reward_min=0.0, reward_max=1.0)  # reward_out_of_range: reject (the default)
    rollout = assembled(server, tracer_to, kit, one_call_with_rewards(
        reward(0.75), reward(250.0, "forged"), reward(-3.0, "negative"), reward(float("nan"), "nan"),
        reward(float("inf"), "inf")))
    assert [(r.name, r.value) for r in rollout.rewards] == [("score", 0.75)]
    assert rollout.total_reward == 0.75 and rollout.transitions[0].return_ == 0.75
    assert rollout.counters == {"rewards_rejected": 4}
    assert any("'forged' on span" in p and "= 250 is outside [0, 1]; rejected" in p for p in rollout.problems)
    assert any("'nan' on span" in p and "is not finite" in p for p in rollout.problems)


def test_clip_mode_clips_to_the_range_and_counts(start_receiver, tracer_to, kit):
    server = start_receiver(reward_min=-1.0, reward_max=1.0, reward_out_of_range="clip")
    rollout = assembled(server, tracer_to, kit, one_call_with_rewards(reward(250.0), reward(-7.5, "low")))
    assert [(r.name, r.value) for r in rollout.rewards] == [("score", 1.0), ("low", -1.0)]
    assert rollout.total_reward == 0.0
    assert rollout.counters == {"rewards_clipped": 2}
    assert any("= 250 is outside [-1, 1]; clipped to 1" in p for p in rollout.problems)


def test_a_replayed_reward_event_counts_once(start_receiver, tracer_to, kit):
    """The same event (same time) on the grader span twice and on a copy of the span sent
    later under a new span id counts once; an equal reward at another time is a new reward."""
    server = start_receiver()
    moment = time.time_ns()
    identity = {semconv.ROLLOUT_ID: "r", semconv.TASK_ID: "t", semconv.ATTEMPT: 0}
    emit_first = one_call_with_rewards(reward(1.0, "done", moment), reward(1.0, "done", moment),
                                       reward(1.0, "done", moment + 1), identity=identity)

    def emit(tracer):
        emit_first(tracer)
        replay = tracer.start_span("grader", context=context_api.Context(), attributes=identity)
        replay.add_event(*reward(1.0, "done", moment))
        replay.end()

    rollout = assembled(server, tracer_to, kit, emit)
    assert [r.value for r in rollout.rewards] == [1.0, 1.0]
    assert rollout.total_reward == 2.0
    assert rollout.counters == {"rewards_replayed": 2}
    assert any("2 reward event(s) repeated an earlier one" in p for p in rollout.problems)


@pytest.mark.parametrize("opted_in", [False, True])
def test_evaluation_events_count_only_when_the_user_opts_in(opted_in, start_receiver, tracer_to, kit):
    server = start_receiver(evaluation_rewards=opted_in)
    evaluation = (semconv.GENAI_EVALUATION_EVENT,
                  {semconv.GENAI_EVALUATION_SCORE: 0.5, semconv.GENAI_EVALUATION_NAME: "relevance"}, None)
    rollout = assembled(server, tracer_to, kit, one_call_with_rewards(reward(0.25), evaluation))
    if opted_in:
        assert [(r.name, r.source) for r in rollout.rewards] == [
            ("score", semconv.REWARD_EVENT), ("relevance", semconv.GENAI_EVALUATION_EVENT)]
        assert rollout.total_reward == 0.75 and rollout.counters == {}
    else:
        assert [r.name for r in rollout.rewards] == ["score"] and rollout.total_reward == 0.25
        assert rollout.counters == {"evaluations_ignored": 1}
        assert any("evaluation_rewards is off" in p for p in rollout.problems)


def test_the_endpoints_token_ids_win_over_the_agents_and_a_mismatch_is_counted(start_receiver, tracer_to, kit):
    """The agent's span claims ids the engine never sampled; the endpoint's record of the same
    call (same response id, its own trace) carries the real ones."""
    server = start_receiver()
    identity = {semconv.ROLLOUT_ID: "r", semconv.TASK_ID: "t", semconv.ATTEMPT: 0}

    def emit(tracer):
        with tracer.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=identity):
            with tracer.start_as_current_span("chat", attributes={
                    **identity, **LLM, semconv.GENAI_RESPONSE_ID: "chatcmpl-1",
                    semconv.LLM_PROMPT_TOKEN_IDS: [1, 2], semconv.llm_response_token_ids(0): [666, 666]}) as call:
                call.add_event(*reward(1.0)[:2])
        tracer.start_span("POST /v1/chat/completions", context=context_api.Context(), attributes={
            semconv.ROLLOUT_ID: "r", **LLM, semconv.LLM_SOURCE: semconv.LLM_SOURCE_ENDPOINT,
            semconv.GENAI_RESPONSE_ID: "chatcmpl-1", semconv.LLM_PROMPT_TOKEN_IDS: [1, 2],
            semconv.llm_response_token_ids(0): [3, 4], semconv.LLM_POLICY_VERSION: 2}).end()

    rollout = assembled(server, tracer_to, kit, emit)
    (transition,) = rollout.transitions
    assert (transition.prompt_token_ids, transition.response_token_ids) == ((1, 2), (3, 4))
    assert transition.policy_version == 2 and transition.reward == 1.0  # the reward follows the call
    assert rollout.counters == {"token_id_mismatches": 1}


def test_a_reward_range_that_cannot_hold_is_refused():
    with pytest.raises(SettingError, match="reward_min < reward_max"):
        ReceiverSettings(reward_min=1.0, reward_max=0.0)
    with pytest.raises(SettingError, match="reward_out_of_range must be reject or clip"):
        ReceiverSettings(reward_out_of_range="ignore")


def test_the_cli_flags_set_the_rules_and_inspect_shows_the_counts(receiver_process, tracer_to, kit, tmp_path,
                                                                   capsys):
    from spanrl.cli import main as spanrl_main

    db = tmp_path / "cli.db"
    process = receiver_process("--reward-min", "0", "--reward-max", "1", "--reward-out-of-range", "clip",
                               "--evaluation-rewards", db=db).start()
    printed = "".join(process.output)
    assert "reward_out_of_range = clip" in printed and "evaluation_rewards = True" in printed
    agent = tracer_to(f"127.0.0.1:{process.grpc_port}", "grpc")
    evaluation = (semconv.GENAI_EVALUATION_EVENT, {semconv.GENAI_EVALUATION_SCORE: 0.5}, None)
    one_call_with_rewards(reward(5.0), evaluation)(agent.tracer)
    agent.provider.force_flush()
    with SpanStore(db) as store:
        (rollout,) = kit.wait_for(lambda: store.completed_rollouts(0)[0], what="the assembled rollout")
    assert [r.value for r in rollout.rewards] == [1.0, 0.5] and rollout.counters == {"rewards_clipped": 1}
    assert process.terminate() == 0
    capsys.readouterr()
    assert spanrl_main(["inspect", "rollout", "r", "--db", str(db)]) == 0
    assert "counted: rewards_clipped 1" in capsys.readouterr().out
