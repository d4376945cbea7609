"""Tool calling on the embedded policy server, through the real ``openai`` client over HTTP.

A tiny model is created with tool-call demonstrations in its tokenizer's corpus and warm-started
(SFT) on one of them, so that, forced to call ``get_weather``, it writes valid JSON arguments:
what comes back is then the model's own output, parsed. The server runs as ``spanrl serve``
runs it (the HTTP front end in a child process) and in a thread.
"""

from __future__ import annotations

import json

import openai
import pytest

from spanrl.trainer_bridge.torch_backend.server import chat_format
from spanrl.trainer_bridge.torch_backend.server.tool_calls import tool_setup

from .conftest import TEST_DEVICE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}
IDS = {"return_token_ids": True}


def weather_demo(city: str, degrees: int) -> dict:
    return {"tools": [WEATHER], "messages": [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": f"{degrees} C"},
        {"role": "assistant", "content": f"It is {degrees} C in {city}."}]}


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """A tiny model warm-started on a tool-calling demonstration (the same SFT ``spanrl sft`` runs)."""
    import torch

    from spanrl.trainer_bridge.torch_backend import sft
    from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer

    folder = tmp_path_factory.mktemp("tools")
    corpus = folder / "demonstrations.jsonl"
    corpus.write_text("".join(json.dumps(weather_demo(city, n)) + "\n"
                              for n, city in enumerate(["Paris", "Rome", "Oslo"] * 10)))
    model_dir = create_model_dir(folder / "init", preset="tiny", corpus_files=[corpus], seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = TorchTrainer(str(model_dir), TrainerConfig(device=TEST_DEVICE, seed=0))
        examples = sft.load_chat_jsonl(corpus)[:1]  # Paris
        stats = sft.sft_on_examples(trainer, examples, 150, batch_size=1, lr=5e-3, progress=False)
        assert stats["loss_last"] < 0.05, stats
        trainer.save_checkpoint(str(folder / "warm"))
    finally:
        torch.set_num_threads(threads)
    return folder / "warm"


@pytest.fixture(scope="module")
def tool_engine(tool_model_dir):
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine

    engine = PolicyEngine.from_pretrained(tool_model_dir, device=TEST_DEVICE, dtype="float32").start()
    yield engine
    engine.stop()


@pytest.fixture(params=["api_process", "in_thread"])
def tool_server(tool_engine, request):
    from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    serve = serve_in_process if request.param == "api_process" else serve_in_thread
    handle = serve(tool_engine, "127.0.0.1", 0)
    yield handle
    handle.stop()


def client(handle) -> openai.OpenAI:
    return openai.OpenAI(base_url=handle.base_url, api_key="unused", max_retries=0)


def test_a_forced_call_comes_back_as_tool_calls_and_the_next_turn_extends_its_ids(tool_server, tool_engine):
    api = client(tool_server)
    first = api.chat.completions.create(model=tool_engine.model_name, messages=QUESTION, tools=[WEATHER],
                                        tool_choice=FORCED, temperature=0, max_tokens=30, extra_body=IDS)
    choice = first.choices[0]
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    prompt_ids, response_ids = first.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    # the prompt ends with the call's opening the server wrote; the response is only what was sampled
    assert tool_engine.tokenizer.decode(prompt_ids).endswith('<tool_call>\n{"name": "get_weather", "arguments":')
    sampled = tool_engine.tokenizer.decode(response_ids, skip_special_tokens=True)
    assert sampled.strip().startswith(call.function.arguments)

    history = [*QUESTION, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    second = api.chat.completions.create(model=tool_engine.model_name, messages=history, tools=[WEATHER],
                                         temperature=0, max_tokens=12, extra_body=IDS)
    second_prompt = second.model_extra["prompt_token_ids"]
    assert second_prompt[:len(prompt_ids) + len(response_ids)] == prompt_ids + response_ids
    assert "<tool_response>\n18 C\n</tool_response>" in tool_engine.tokenizer.decode(second_prompt)


def test_a_streamed_forced_call_is_an_id_and_name_then_argument_fragments(tool_server, tool_engine):
    api = client(tool_server)
    whole = api.chat.completions.create(model=tool_engine.model_name, messages=QUESTION, tools=[WEATHER],
                                        tool_choice=FORCED, temperature=0, max_tokens=30, extra_body=IDS)
    stream = api.chat.completions.create(model=tool_engine.model_name, messages=QUESTION, tools=[WEATHER],
                                         tool_choice=FORCED, temperature=0, max_tokens=30, stream=True,
                                         extra_body=IDS)
    pieces, ids, finish = [], [], None
    for chunk in stream:
        for choice in chunk.choices:
            ids += choice.model_extra.get("token_ids") or []
            pieces += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "get_weather"
    assert all(p.id is None and p.function.name is None for p in pieces[1:]) and len(pieces) > 2
    arguments = "".join(p.function.arguments or "" for p in pieces)
    assert arguments == whole.choices[0].message.tool_calls[0].function.arguments
    assert json.loads(arguments) == {"city": "Paris"}
    assert ids == whole.choices[0].model_extra["token_ids"] and finish == "tool_calls"


def test_the_responses_api_returns_function_call_items(tool_server, tool_engine):
    api = client(tool_server)
    tool = {"type": "function", **WEATHER["function"]}
    response = api.responses.create(model=tool_engine.model_name, input="Weather in Paris?", tools=[tool],
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                    max_output_tokens=30, extra_body={"enable_response_messages": True})
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    prompt_ids = response.model_extra["input_messages"][0]["tokens"]
    output_ids = response.model_extra["output_messages"][0]["tokens"]

    follow_up = api.responses.create(
        model=tool_engine.model_name, previous_response_id=response.id, tools=[tool], max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C"}],
        extra_body={"enable_response_messages": True})
    second_prompt = follow_up.model_extra["input_messages"][0]["tokens"]
    assert second_prompt[:len(prompt_ids) + len(output_ids)] == prompt_ids + output_ids

    stream = api.responses.create(model=tool_engine.model_name, input="Weather in Paris?", tools=[tool],
                                  tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                  max_output_tokens=30, stream=True)
    events = list(stream)
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(d.name, d.arguments) for d in done] == [("get_weather", calls[0].arguments)]
    assert [a.id for a in added] == [d.id for d in done] and len(fragments) > 1
    assert "".join(fragments) == calls[0].arguments
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ""
    assert events[-1].type == "response.completed" and events[-1].response.output[1].call_id == done[0].call_id


def test_malformed_calls_come_back_as_content_never_an_error(server, engine):
    """A forced call cut short (max_tokens) is no valid call: its text is the content. (Forced
    calls decode under the tool's schema, so only the budget can cut one: structured outputs.)"""
    api = client(server)
    reply = api.chat.completions.create(model=engine.model_name, messages=QUESTION, tools=[WEATHER, CLOCK],
                                        tool_choice=FORCED, temperature=0, max_tokens=3)
    content, calls = reply.choices[0].message.content, reply.choices[0].message.tool_calls
    assert calls is None and reply.choices[0].finish_reason == "length"
    assert content.startswith('<tool_call>\n{"name": "get_weather", "arguments":')
    hermes = 'Sure <tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>'  # not an object
    assert chat_format.parse_assistant_output(hermes, tool_setup([WEATHER], "auto", None)).tool_calls == ()


def test_tool_choice_none_offers_no_tools_and_bad_choices_are_400(server, engine):
    api = client(server)
    plain = api.chat.completions.create(model=engine.model_name, messages=QUESTION, max_tokens=1, extra_body=IDS)
    unoffered = api.chat.completions.create(model=engine.model_name, messages=QUESTION, max_tokens=1,
                                            tools=[WEATHER], tool_choice="none", extra_body=IDS)
    offered = api.chat.completions.create(model=engine.model_name, messages=QUESTION, max_tokens=1,
                                          tools=[WEATHER], extra_body=IDS)
    assert unoffered.model_extra["prompt_token_ids"] == plain.model_extra["prompt_token_ids"]
    assert offered.model_extra["prompt_token_ids"] == engine.encode_text(
        chat_format.render_chat(engine.tokenizer, QUESTION, [WEATHER]))
    for tools, choice in (([WEATHER], {"type": "function", "function": {"name": "nope"}}), ([], "required"),
                          ([WEATHER], "sometimes")):
        with pytest.raises(openai.BadRequestError) as caught:
            api.chat.completions.create(model=engine.model_name, messages=QUESTION, max_tokens=1, tools=tools,
                                        tool_choice=choice)
        assert caught.value.body["param"] == "tool_choice"
