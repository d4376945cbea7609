"""The embedded policy server, called with the real `openai` client over HTTP."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch

MESSAGES = [{"role": "user", "content": "What is 37 + 45?"}]


def client(server, **kwargs):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, **kwargs)


def test_chat_n_token_ids_logprobs_match_a_forward_pass(server, engine, forward_logprobs):
    raw = client(server).chat.completions.with_raw_response.create(
        model=engine.model_name, messages=MESSAGES, n=3, max_tokens=12, logprobs=True,
        extra_body={"return_token_ids": True, "top_k": 0})
    assert raw.headers["x-spanrl-policy-version"] == "0"
    body = json.loads(raw.text)
    reply = raw.parse()
    assert body["policy_version"] == 0
    assert body["prompt_token_ids"] == engine.encode_chat(MESSAGES)
    assert len(reply.choices) == 3
    for choice, raw_choice in zip(reply.choices, body["choices"], strict=True):
        ids = raw_choice["token_ids"]
        assert 1 <= len(ids) <= 12
        assert engine.tokenizer.decode(ids, skip_special_tokens=True) == choice.message.content
        if choice.finish_reason == "stop":
            assert ids[-1] in engine.eos_ids  # <|im_end|>, or <|endoftext|> as Qwen also stops on
        served = torch.tensor([entry.logprob for entry in choice.logprobs.content])
        expected = forward_logprobs(engine.model, body["prompt_token_ids"], ids)
        assert torch.allclose(served, expected, atol=1e-4), (served, expected)
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])


def test_streaming_chunks_concatenate_to_ids_and_text(server, engine):
    stream = client(server).chat.completions.create(
        model=engine.model_name, messages=MESSAGES, n=2, max_tokens=10, stream=True, logprobs=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
    ids = {0: [], 1: []}
    text = {0: "", 1: ""}
    finish = {}
    prompt_ids = None
    versions = set()
    usage = None
    for chunk in stream:
        data = chunk.model_dump()
        versions.add(data["policy_version"])
        if data.get("prompt_token_ids") is not None:
            assert prompt_ids is None
            prompt_ids = data["prompt_token_ids"]
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in data["choices"]:
            ids[choice["index"]].extend(choice["token_ids"])
            text[choice["index"]] += choice["delta"].get("content") or ""
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
    assert prompt_ids == engine.encode_chat(MESSAGES)
    assert versions == {0}
    assert set(finish) == {0, 1}
    for index in (0, 1):
        assert 1 <= len(ids[index]) <= 10
        assert engine.tokenizer.decode(ids[index], skip_special_tokens=True) == text[index]
    assert usage.completion_tokens == len(ids[0]) + len(ids[1])


def test_async_client_concurrent_requests_share_batches(server, engine):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as aclient:
            calls = [aclient.chat.completions.create(
                model=engine.model_name, messages=[{"role": "user", "content": f"What is {i} + 1?"}],
                max_tokens=16, extra_body={"return_token_ids": True}) for i in range(12)]
            return await asyncio.gather(*calls)

    replies = asyncio.run(run())
    assert len(replies) == 12
    for reply in replies:
        ids = reply.model_dump()["choices"][0]["token_ids"]
        assert engine.tokenizer.decode(ids, skip_special_tokens=True) == reply.choices[0].message.content
    # concurrent requests were decoded together, not one after another
    assert engine.stats.max_rows_in_batch > 1
    assert engine.stats.batches < 12


def test_concurrent_requests_joining_one_batch_each_match_a_forward_pass(server, engine, forward_logprobs):
    """Requests of different lengths and settings arrive while others decode (continuous
    batching): every response is still exactly what a forward pass of its own tokens says."""
    async def one(aclient, i: int):
        raw = await aclient.chat.completions.with_raw_response.create(
            model=engine.model_name, messages=[{"role": "user", "content": f"What is {i} + {i * 7}?" * (1 + i % 3)}],
            max_tokens=4 + 3 * (i % 5), n=1 + i % 2, logprobs=True, temperature=[1.0, 0.0, 0.7][i % 3],
            stream=False, extra_body={"return_token_ids": True})
        return json.loads(raw.text)

    async def run():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(14)))

    bodies = asyncio.run(run())
    assert engine.stats.max_rows_in_batch > 1
    for body in bodies:
        for choice in body["choices"]:
            served = torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]])
            expected = forward_logprobs(engine.model, body["prompt_token_ids"], choice["token_ids"])
            assert torch.allclose(served, expected, atol=1e-4)


def test_completions_endpoint_with_logprobs_seed_and_stop(server, engine, forward_logprobs):
    api = client(server)
    first = api.completions.create(model=engine.model_name, prompt="CALC 12+", max_tokens=8, seed=7,
                                   logprobs=2, extra_body={"return_token_ids": True, "top_k": 0})
    again = api.completions.create(model=engine.model_name, prompt="CALC 12+", max_tokens=8, seed=7,
                                   logprobs=2, extra_body={"return_token_ids": True})
    data, data_again = first.model_dump(), again.model_dump()
    choice = data["choices"][0]
    assert choice["prompt_token_ids"] == engine.encode_text("CALC 12+")
    assert choice["token_ids"] == data_again["choices"][0]["token_ids"]  # same seed, same sample
    expected = forward_logprobs(engine.model, choice["prompt_token_ids"], choice["token_ids"])
    assert torch.allclose(torch.tensor(choice["logprobs"]["token_logprobs"]), expected, atol=1e-4)
    # the two most likely tokens at each step, keyed by their text as OpenAI does (two byte
    # tokens that both print as U+FFFD share one key)
    ids = torch.tensor([choice["prompt_token_ids"] + choice["token_ids"]], device=engine.model.device)
    with torch.no_grad():
        logprobs = torch.log_softmax(engine.model(ids).logits[0].float().cpu(), dim=-1)
    for position, served_top in enumerate(choice["logprobs"]["top_logprobs"]):
        values, indices = logprobs[len(choice["prompt_token_ids"]) - 1 + position].topk(2)
        expected_top = {engine.tokenizer.decode([int(t)]): float(v) for v, t in zip(values, indices, strict=True)}
        assert served_top.keys() == expected_top.keys()
        assert all(abs(served_top[k] - expected_top[k]) < 1e-4 for k in expected_top)
    # a stop string cuts the text before it and ends the choice with finish_reason "stop"
    stop_at = engine.tokenizer.decode(choice["token_ids"][2:4], skip_special_tokens=True)
    if stop_at:
        stopped = api.completions.create(model=engine.model_name, prompt="CALC 12+", max_tokens=8, seed=7,
                                         stop=[stop_at]).choices[0]
        assert stop_at not in stopped.text and stopped.finish_reason == "stop"


def test_error_bodies_and_models(server, engine):
    url = server.url
    cases = [
        ("{not json", 400, None),
        (json.dumps({"model": "nope", "messages": MESSAGES}), 404, "model"),
        (json.dumps({"model": engine.model_name, "messages": []}), 422, "messages"),
        (json.dumps({"model": engine.model_name, "messages": "hi"}), 422, "messages"),
        (json.dumps({"model": engine.model_name, "messages": MESSAGES, "temperature": -1}), 400, "temperature"),
        (json.dumps({"model": engine.model_name, "messages": MESSAGES, "n": 0}), 400, "n"),
        (json.dumps({"model": engine.model_name, "messages": MESSAGES, "max_tokens": 100000}), 400, "max_tokens"),
        (json.dumps({"model": engine.model_name,
                     "messages": [{"role": "user", "content": "9 " * engine.context_length}]}), 400, "messages"),
    ]
    for body, status, param in cases:
        response = httpx.post(f"{url}/v1/chat/completions", content=body,
                              headers={"content-type": "application/json"})
        assert response.status_code == status, (body[:60], response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"]
        assert error["param"] == param
        if param in ("messages", "max_tokens") and status == 400:  # over the context: the numbers, how to raise it
            assert str(engine.context_length) in error["message"] and "--context-length" in error["message"]
    for body, param in [({"prompt": "7 " * engine.context_length}, "prompt"), ({"prompt": [1, 2, 10**6]}, "prompt"),
                        ({"prompt": "x", "echo": True}, "echo")]:
        response = httpx.post(f"{url}/v1/completions", json={"model": engine.model_name, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    missing = httpx.get(f"{url}/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="other", messages=MESSAGES)
    models = client(server).models.list()
    assert [m.id for m in models.data] == [engine.model_name]
    # the server still serves after all that
    assert client(server).chat.completions.create(model=engine.model_name, messages=MESSAGES, max_tokens=2)


@pytest.mark.parametrize("mode", ["api_process", "in_thread"])
def test_bearer_token(engine, mode):
    from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    serve = serve_in_process if mode == "api_process" else serve_in_thread
    handle = serve(engine, "127.0.0.1", 0, api_token="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=handle.base_url, api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=handle.base_url, api_key="s3cret", max_retries=0)
        assert ok.chat.completions.create(model=engine.model_name, messages=MESSAGES, max_tokens=2)
        assert httpx.get(f"{handle.url}/spanrl/v1/policy").status_code == 401
    finally:
        handle.stop()


def test_every_route_answers_typed_bodies_the_openai_client_parses(server, engine):
    """Each route's body parses into the openai client's own types; vLLM's extras appear only
    when asked for (``return_token_ids``), spanrl's ``policy_version`` always."""
    api = client(server)
    plain = api.chat.completions.with_raw_response.create(model=engine.model_name, messages=MESSAGES, max_tokens=3)
    reply = plain.parse()
    assert isinstance(reply, openai.types.chat.ChatCompletion)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-") and reply.model == engine.model_name
    assert reply.choices[0].message.role == "assistant" and isinstance(reply.choices[0].message.content, str)
    assert reply.usage.prompt_tokens == len(engine.encode_chat(MESSAGES))
    body = json.loads(plain.text)
    assert body["policy_version"] == 0 and plain.headers["x-spanrl-policy-version"] == "0"
    assert "prompt_token_ids" not in body and "token_ids" not in body["choices"][0]
    assert body["choices"][0]["logprobs"] is None  # OpenAI's own optional fields stay, as null

    # content parts are flattened to the same prompt as a plain string
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 37 "}, {"type": "text", "text": "+ 45?"}]}]
    with_parts = api.chat.completions.create(model=engine.model_name, messages=parts, max_tokens=2,
                                             extra_body={"return_token_ids": True})
    assert with_parts.model_dump()["prompt_token_ids"] == engine.encode_chat(MESSAGES)

    chunks = list(api.chat.completions.create(model=engine.model_name, messages=MESSAGES, max_tokens=4, stream=True))
    assert all(isinstance(c, openai.types.chat.ChatCompletionChunk) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.model_extra["policy_version"] == 0 for c in chunks)
    assert "token_ids" not in (chunks[1].choices[0].model_extra or {})
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")

    completion = api.completions.create(model=engine.model_name, prompt="CALC 12+", max_tokens=3,
                                        extra_body={"return_token_ids": True})
    assert isinstance(completion, openai.types.Completion)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    # the random model may sample eos: the finish reason must say which way the reply ended
    sampled = completion.choices[0].model_extra["token_ids"]
    assert completion.usage.completion_tokens == len(sampled)
    ended_on_eos = sampled[-1] in engine.eos_ids
    assert completion.choices[0].finish_reason == ("stop" if ended_on_eos else "length")
    assert ended_on_eos or len(sampled) == 3
    assert completion.model_extra["policy_version"] == 0

    streamed = list(api.completions.create(model=engine.model_name, prompt="CALC 12+", max_tokens=5, n=2, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"return_token_ids": True}))
    assert all(isinstance(c, openai.types.Completion) for c in streamed)
    ids: dict[int, list[int]] = {0: [], 1: []}
    text = {0: "", 1: ""}
    prompts = {}
    for chunk in streamed:
        for choice in chunk.choices:
            extra = choice.model_extra
            ids[choice.index].extend(extra["token_ids"])
            text[choice.index] += choice.text
            if "prompt_token_ids" in extra:
                assert choice.index not in prompts  # only on a choice's first chunk
                prompts[choice.index] = extra["prompt_token_ids"]
    assert prompts == {0: engine.encode_text("CALC 12+"), 1: engine.encode_text("CALC 12+")}
    for index in (0, 1):  # 5 tokens each, or fewer ending on eos (the random model may sample it)
        assert len(ids[index]) == 5 or (0 < len(ids[index]) < 5 and ids[index][-1] in engine.eos_ids), ids
        assert engine.tokenizer.decode(ids[index], skip_special_tokens=True) == text[index]
    assert streamed[-1].usage.completion_tokens == len(ids[0]) + len(ids[1]) and streamed[-1].choices == []

    models = api.models.list()
    assert isinstance(models.data[0], openai.types.Model)
    assert (models.data[0].id, models.data[0].owned_by) == (engine.model_name, "spanrl")
    fields = models.data[0].model_extra["request_fields"]
    assert "frequency_penalty" in fields["/v1/chat/completions"]["ignored"]
    assert {"messages", "return_token_ids", "top_k", "tools", "tool_choice"} <= set(
        fields["/v1/chat/completions"]["implemented"])
    assert "prompt" in fields["/v1/completions"]["implemented"]


@pytest.mark.parametrize(("request_fields", "exception", "status", "param"), [
    ({"model": "nope"}, openai.NotFoundError, 404, "model"),
    ({"temperature": -1}, openai.BadRequestError, 400, "temperature"),
    ({"messages": []}, openai.UnprocessableEntityError, 422, "messages"),
    ({"max_tokens": 100000}, openai.BadRequestError, 400, "max_tokens"),
])
def test_errors_become_the_openai_clients_exceptions(server, engine, request_fields, exception, status, param):
    arguments = {"model": engine.model_name, "messages": MESSAGES, "max_tokens": 2, **request_fields}
    with pytest.raises(exception) as raised:
        client(server).chat.completions.create(**arguments)
    assert raised.value.status_code == status
    assert raised.value.body["param"] == param and raised.value.body["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client(server).completions.create(model=engine.model_name, prompt="x", max_tokens=2, echo=True)
    assert raised.value.body["param"] == "echo"


@pytest.mark.parametrize("mode", ["api_process", "in_thread"])
def test_unsupported_fields_are_served_and_logged_once(engine, mode, caplog, capfd):
    """An agent that sends fields the server does not implement (``frequency_penalty``) still gets
    a 200; the server says once per field that it ignores it (in the front end's own process when
    that is a child). ``tools`` are implemented: not logged, and a reply without a call is text."""
    from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]
    serve = serve_in_process if mode == "api_process" else serve_in_thread
    handle = serve(engine, "127.0.0.1", 0)
    try:
        api = client(handle)
        for _ in range(3):
            raw = api.chat.completions.with_raw_response.create(
                model=engine.model_name, messages=MESSAGES, max_tokens=3, tools=tools, tool_choice="auto",
                parallel_tool_calls=False, frequency_penalty=0.5)
            assert raw.status_code == 200
            message = raw.parse().choices[0].message
            assert isinstance(message.content, str) and not message.tool_calls
        completion = api.completions.create(model=engine.model_name, prompt="CALC", max_tokens=2, user="me")
        assert completion.choices[0].text is not None
    finally:
        handle.stop()
    if mode == "api_process":
        logged = capfd.readouterr().err
    else:
        logged = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    for field in ("frequency_penalty", "user"):
        assert logged.count(f"field {field!r}") == 1, (field, logged)
    for field in ("tools", "tool_choice", "parallel_tool_calls"):
        assert f"field {field!r}" not in logged, (field, logged)
