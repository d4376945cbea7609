"""Prompt resources (which candidate a call is served, how instructions are replaced, the prompts
file) and a call's text as span attributes (what the proxy records, what ``spanrl sft --store``
reads back): pure functions over real request and reply bodies, no server."""

from __future__ import annotations

import json

import pytest

from spanrl.otlp_receiver.call_text import from_attributes
from spanrl.otlp_receiver.text_calls import chat_example
from spanrl.trainer_bridge.endpoint_prompts import apply_update
from spanrl.trainer_bridge.endpoint_text import call_text_attributes
from spanrl.trainer_bridge.prompt_resources import PromptResourceError, PromptResources, substitute_instructions
from spanrl.trainer_bridge.prompts_cli import exported

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_a_call_takes_its_agents_resource_else_its_models_and_a_rollouts_assignment_wins():
    resources = PromptResources({
        "planner": {"active": "short", "candidates": {"short": "Plan briefly.", "long": "Plan in detail."}},
        "gpt-4o-mini": "Be terse.",
        "writer": {"candidates": {"french": "Answer in French."}},  # no active one: the agent's own prompt
    })
    assert resources.choose("planner", "gpt-4o-mini", None).text == "Plan briefly."
    assert resources.choose("someone", "gpt-4o-mini", "r1").text == "Be terse."  # by the requested model
    assert resources.choose(None, "other-model", "r1") is None
    assert resources.choose("writer", "other-model", "r1") is None
    resources.assign("writer", {"r1": "french"})
    assert resources.choose("writer", None, "r1").candidate == "french"
    assert resources.choose("writer", None, "r2") is None
    resources.assign("planner", {"r7": "long"})
    chosen = resources.choose("planner", None, "r7")
    assert (chosen.resource, chosen.candidate, chosen.text) == ("planner", "long", "Plan in detail.")
    assert resources.choose("planner", None, "r8").candidate == "short"
    resources.set_candidates("planner", {"short": "Plan briefly!"}, active="short")  # "long" is gone
    assert resources.choose("planner", None, "r7").text == "Plan briefly!"
    assert resources.snapshot()["writer"] == {"active": None, "candidates": {"french": "Answer in French."},
                                              "assigned_rollouts": 1}


@pytest.mark.parametrize(("spec", "message"), [
    ({"planner": {"active": "missing", "candidates": {"a": "x"}}}, "active 'missing' is not one of its candidates"),
    ({"planner": {"candidates": {}}}, "'candidates' must map"),
    ({"planner": {"candidates": {"a": 3}}}, "candidate 'a' must be a name with instructions as a string"),
    ({"planner": {"candidates": {"a": "x"}, "tone": "dry"}}, "unknown keys ['tone']"),
    ({"planner": ["x"]}, "expected instructions (a string) or a mapping"),
])
def test_bad_prompt_files_are_refused_naming_the_problem(tmp_path, spec, message):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(PromptResourceError) as caught:
        PromptResources.from_file(str(path))
    assert message in str(caught.value) and str(path) in str(caught.value)


def test_updates_name_what_is_wrong_and_keep_the_resources_as_they_were():
    resources = PromptResources({"planner": {"active": "a", "candidates": {"a": "A", "b": "B"}}})
    for update, message in [({"candidates": {"a": "x"}}, "'resource' must name"),
                            ({"resource": "nobody", "active": "a"}, "no prompt resource 'nobody'"),
                            ({"resource": "planner", "rollouts": {"r1": "zzz"}}, "has no candidate 'zzz'"),
                            ({"resource": "planner", "rollouts": {"": "a"}}, "a rollout id must be"),
                            ({"resource": "planner", "colour": 1}, "unknown keys ['colour']")]:
        with pytest.raises(PromptResourceError) as caught:
            apply_update(resources, update)
        assert message in str(caught.value)
    assert resources.snapshot()["planner"] == {"active": "a", "candidates": {"a": "A", "b": "B"},
                                               "assigned_rollouts": 0}
    apply_update(resources, {"resource": "planner", "active": "b", "rollouts": {"r1": "a"}})
    assert resources.choose("planner", None, "r2").text == "B" and resources.choose("planner", None, "r1").text == "A"
    apply_update(resources, {"resource": "planner", "remove": True})
    assert resources.empty


def test_instructions_are_replaced_where_each_api_keeps_them():
    chat = {"model": "m", "messages": [{"role": "developer", "content": "old"}, {"role": "user", "content": "hi"},
                                       {"role": "system", "content": "second"}]}
    replaced = substitute_instructions(chat, "/v1/chat/completions", "NEW")
    assert replaced["messages"] == [{"role": "developer", "content": "NEW"}, {"role": "user", "content": "hi"},
                                    {"role": "system", "content": "second"}]
    assert chat["messages"][0]["content"] == "old"  # the agent's body is not changed
    bare = substitute_instructions({"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions", "NEW")
    assert bare["messages"] == [{"role": "system", "content": "NEW"}, {"role": "user", "content": "hi"}]
    assert substitute_instructions({"input": "hi", "instructions": "old"}, "/v1/responses", "NEW") == {
        "input": "hi", "instructions": "NEW"}
    assert substitute_instructions({"input": "hi"}, "/v1/responses", "NEW") == {"input": "hi", "instructions": "NEW"}
    items = [{"role": "developer", "content": "old"}, {"role": "user", "content": "hi"}]
    assert substitute_instructions({"input": items}, "/v1/responses", "NEW")["input"][0] == {
        "role": "developer", "content": "NEW"}
    assert substitute_instructions({"prompt": "x"}, "/v1/completions", "NEW") is None


def test_a_streamed_chat_call_with_tool_calls_reads_back_as_a_chat_example():
    request = {"model": "m", "tools": [WEATHER], "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": "Weather in Paris?"}]}
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Let me check."}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_9", "type": "function", "function": {"name": "get_", "arguments": '{"ci'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"name": "weather", "arguments": 'ty": "Paris"}'}}]}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]
    attributes = call_text_attributes("/v1/chat/completions", request, chunks)
    assert all(isinstance(value, str) for value in attributes.values())
    example = chat_example(attributes)
    assert example == {"tools": [WEATHER], "messages": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_9", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    ]}


def test_a_responses_call_reads_back_as_chat_with_instructions_first():
    request = {"model": "m", "instructions": "Be brief.", "tools": [
        {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}], "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Paris?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "21 C"}]}
    final = {"type": "response.completed", "response": {"object": "response", "output": [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is 21 C."}]}]}}
    chat = from_attributes(call_text_attributes("/v1/responses", request, [{"type": "response.created"}, final]))
    assert chat.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "content": "21 C", "tool_call_id": "c1"}]
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert chat.reply == {"role": "assistant", "content": "It is 21 C."}


def test_a_call_without_a_reply_is_no_example():
    attributes = call_text_attributes("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, [])
    assert chat_example(attributes) is None


def test_export_writes_the_file_format_it_reads():
    snapshot = PromptResources({"planner": {"active": "a", "candidates": {"a": "A", "b": "B"}},
                                "writer": {"candidates": {"x": "X"}}}).snapshot()
    assert PromptResources(exported(snapshot, active_only=False)).snapshot() == snapshot
    assert exported(snapshot, active_only=True) == {"planner": "A"}
