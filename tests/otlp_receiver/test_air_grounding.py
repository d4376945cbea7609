"""AIR's grounding rule (``when: {ungrounded_numbers: true}``): an LLM call whose tool arguments
use a number none of its input messages holds is penalised on that call, and only then. Spans from
the real OTel SDK with OpenInference's message keys, as the agents' instrumentation writes them."""

from __future__ import annotations

import json

import pytest

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.air import AirRuleError, load_rules
from spanrl.otlp_receiver.air_grounding import ungrounded_numbers
from spanrl.otlp_receiver.assembly import AssemblyOptions, assemble_rollout

LLM = {semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM}
QUESTION = "A farm has 38 rows of 16 trees. 42 trees are cut down and 27 are planted. How many trees are there now?"


def call_text(messages: list[tuple[str, str]], expression: str | None) -> dict:
    """A call's OpenInference attributes: its input ``messages`` (role, content) and, when
    ``expression`` is given, one calculator call in its reply."""
    attributes = {}
    for i, (role, content) in enumerate(messages):
        attributes[f"llm.input_messages.{i}.message.role"] = role
        attributes[f"llm.input_messages.{i}.message.content"] = content
    if expression is not None:
        prefix = "llm.output_messages.0.message.tool_calls.0.tool_call"
        attributes[f"{prefix}.function.name"] = "calculator"
        attributes[f"{prefix}.function.arguments"] = json.dumps({"expression": expression})
    return attributes


def test_numbers_are_grounded_in_the_question_and_earlier_results():
    asked = [("user", QUESTION)]
    assert ungrounded_numbers(call_text(asked, "38*16")) == []
    assert ungrounded_numbers(call_text(asked, "608-22")) == ["608", "22"]
    after_one = [*asked, ("tool", "608")]
    assert ungrounded_numbers(call_text(after_one, "608-42")) == []
    assert ungrounded_numbers(call_text(after_one, "608.0-42")) == []  # the same number written otherwise
    assert ungrounded_numbers(call_text(after_one, "(608-22)+27")) == ["22"]
    assert ungrounded_numbers(call_text([("tool", "-53")], "53+1")) == ["1"]  # signs are not compared
    assert ungrounded_numbers(call_text([("user", "room x2, id call_8c3")], "2+3+8")) == ["2", "3", "8"]
    assert ungrounded_numbers(call_text(asked, None)) == []  # no tool call: nothing to judge
    assert ungrounded_numbers({"llm.output_messages.0.message.content": "7"}) is None  # no input text


def test_the_rule_penalises_the_call_that_used_an_unseen_number(memory_tracer, to_records, tmp_path):
    rules = tmp_path / "air.yaml"
    rules.write_text("rules:\n  - name: ungrounded_number\n    reward: -0.3\n"
                     "    when: {span_kind: LLM, ungrounded_numbers: true}\n")
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
        turns = [([("user", QUESTION)], "38*16"), ([("user", QUESTION), ("tool", "608")], "608-22"),
                 ([("user", QUESTION), ("tool", "608"), ("tool", "586")], "586+27"),
                 ([("user", QUESTION), ("tool", "608"), ("tool", "586"), ("tool", "613")], None)]
        for n, (messages, expression) in enumerate(turns):
            attributes = {**LLM, semconv.LLM_PROMPT_TOKEN_IDS: [n], semconv.llm_response_token_ids(0): [n],
                          **call_text(messages, expression)}
            with t.start_as_current_span(f"llm-{n}", attributes=attributes):
                pass
    records = to_records(memory_tracer.exporter.get_finished_spans())
    rollout = assemble_rollout("r", records, "explicit", AssemblyOptions(air_rules=load_rules(str(rules))))
    assert [t.reward for t in rollout.transitions] == [0.0, -0.3, 0.0, 0.0]  # only the wrong copy
    assert [r.source for r in rollout.rewards] == ["air:ungrounded_number"]
    assert rollout.total_reward == pytest.approx(-0.3)
    plain = assemble_rollout("r", records, "explicit", AssemblyOptions(air_rules=load_rules("default")))
    assert plain.total_reward is None  # the default rule (errors) does not judge arguments


def test_a_rule_asking_for_grounding_must_say_true_or_false(tmp_path):
    rules = tmp_path / "air.yaml"
    rules.write_text("rules:\n  - name: g\n    reward: -1\n    when: {ungrounded_numbers: 'yes'}\n")
    with pytest.raises(AirRuleError, match="'ungrounded_numbers' must be true or false, got 'yes'"):
        load_rules(str(rules))
