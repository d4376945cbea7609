"""Tool calls in text: parsing a reply, streaming it, rendering tools and calls with spanrl's chat
template (jinja and the Python renderer agree), SFT on tool demonstrations, and the span
recorder on a tool-calling response of the real server."""

from __future__ import annotations

import json

import pytest

from spanrl.trainer_bridge.torch_backend.server import chat_format
from spanrl.trainer_bridge.torch_backend.server.tool_calls import (
    ToolCallStream,
    forced_prefix,
    parse_tool_calls,
    tool_setup,
)

from .test_trainer_bridge_tools import CLOCK, QUESTION, WEATHER, weather_demo

TWO_CALLS = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}'
             '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_a_reply_is_parsed_into_content_and_calls_with_the_arguments_as_written():
    reply = parse_tool_calls(TWO_CALLS)
    assert reply.content == "Let me look."
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [
        ("get_weather", '{"city": "Paris", "n": [1, {"a": "}"}]}'), ("get_time", "{}")]
    assert len({c.id for c in reply.tool_calls}) == 2 and all(c.id.startswith("call_") for c in reply.tool_calls)
    unclosed = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"x":1}}')
    assert unclosed.content is None and unclosed.tool_calls[0].arguments == '{"x":1}'


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',      # unbalanced
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"name": "f", "arguments": "x"}\n</tool_call>',           # arguments not an object
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><tool_call>{"oops"</tool_call>',
])
def test_a_malformed_call_leaves_the_whole_reply_as_content(text):
    reply = parse_tool_calls(text)
    assert reply.content == text and reply.tool_calls == ()


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_streaming_gives_the_same_content_and_calls_in_any_chunking(step):
    stream = ToolCallStream()
    pieces = [stream.feed(TWO_CALLS[i:i + step]) for i in range(0, len(TWO_CALLS), step)] + [stream.finish()]
    content = "".join(p.content for p in pieces)
    deltas = [d for p in pieces for d in p.calls]
    heads = [d for d in deltas if d.id]
    arguments = ["".join(d.arguments for d in deltas if d.index == i) for i in range(2)]
    assert content == "Let me look."
    assert [(h.index, h.name) for h in heads] == [(0, "get_weather"), (1, "get_time")]
    assert arguments == [c.arguments for c in parse_tool_calls(TWO_CALLS).tool_calls]
    assert [c.arguments for c in stream.calls] == arguments


def test_a_stream_whose_call_never_forms_gives_its_text_back_as_content():
    stream = ToolCallStream()
    text = "hi <tool_call>\nnot a call"
    said = stream.feed(text).content + stream.finish().content
    assert said == text and not stream.calls


def test_tool_choice_becomes_what_the_prompt_offers_and_the_forced_opening():
    assert tool_setup([WEATHER], "none", None).tools == ()
    assert tool_setup([WEATHER, CLOCK], "auto", None).forced_prefix == ""
    named = tool_setup([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_time"}}, False)
    assert named.forced_prefix == forced_prefix("get_time") and not named.parallel
    assert tool_setup([WEATHER], "required", None).forced_prefix == forced_prefix("get_weather")
    assert tool_setup([WEATHER, CLOCK], "required", None).forced_prefix.endswith('{"name": "')


def test_the_python_renderer_and_the_jinja_template_agree_on_tool_conversations(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    demo = weather_demo("Rome", 17)
    two = {"role": "assistant", "content": "Both.", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
    conversations = [demo["messages"], [{"role": "system", "content": "Be brief."}, *QUESTION, two,
                                        {"role": "tool", "content": "3 C"}, {"role": "tool", "content": "noon"}]]
    for messages in conversations:
        for tools in (None, [WEATHER, CLOCK]):
            for upto in range(1, len(messages) + 1):
                for generation_prompt in (True, False):
                    python = chat_format.render_chatml(messages[:upto], tools, generation_prompt)
                    jinja = tokenizer.apply_chat_template(messages[:upto], tools=tools, tokenize=False,
                                                          add_generation_prompt=generation_prompt)
                    assert python == jinja
    rendered = chat_format.render_chatml(conversations[1], [WEATHER])
    assert ('<|im_start|>assistant\nBoth.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>') in rendered
    assert "<|im_start|>user\n<tool_response>\n3 C\n</tool_response>\n<tool_response>\nnoon\n</tool_response>" \
           "<|im_end|>" in rendered
    assert rendered.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and json.dumps(WEATHER) in rendered


def test_sft_learns_the_calls_and_answers_of_a_tool_demonstration(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from spanrl.trainer_bridge.torch_backend import sft

    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps(weather_demo("Oslo", 3)) + "\n")
    (example,) = sft.load_chat_jsonl(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids, mask = sft.encode_example(tokenizer, example)
    learned = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert learned == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
                       "It is 3 C in Oslo.<|im_end|>")
    assert ids == tokenizer.encode(chat_format.render_chat(tokenizer, example["messages"], [WEATHER],
                                                           add_generation_prompt=False))


def test_the_span_recorder_makes_one_call_with_the_ids_of_a_tool_calling_reply(server, engine):
    """The raw body and stream of a tool-calling reply, fed to ``LLMSpanRecorder`` as the
    instrumentor feeds them: one LLM span with the prompt's and the response's exact ids."""
    import httpx
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from spanrl.instrumentation import semconv
    from spanrl.instrumentation.llm_span_recorder import LLMSpanRecorder
    from spanrl.instrumentation.packed_values import unpacked_attributes

    provider, exporter = TracerProvider(), InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    request = {"model": engine.model_name, "messages": QUESTION, "tools": [WEATHER], "max_tokens": 8, "temperature": 0,
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "return_token_ids": True}
    body = httpx.post(f"{server.base_url}/chat/completions", json=request, timeout=60).json()
    with tracer.start_as_current_span("llm") as span:
        LLMSpanRecorder(span, streaming=False).observe(body)
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json={**request, "stream": True},
                      timeout=60) as streamed, tracer.start_as_current_span("llm") as span:
        recorder = LLMSpanRecorder(span, streaming=True)
        for line in streamed.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                recorder.observe(json.loads(line[len("data: "):]))
    spans = exporter.get_finished_spans()
    assert len(spans) == 2
    for finished in spans:
        attributes = unpacked_attributes(finished.attributes)
        assert list(attributes[semconv.LLM_PROMPT_TOKEN_IDS]) == body["prompt_token_ids"]
        assert list(attributes[semconv.llm_response_token_ids(0)]) == body["choices"][0]["token_ids"]
    provider.shutdown()
