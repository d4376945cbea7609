"""Any model name: the embedded server and the verl gateway answer the names they list, or any
name with ``*``; a reply carries the name its request asked for, ``/v1/models`` lists the names,
and the endpoint's span records the requested name as ``gen_ai.request.model``. Real HTTP, the
real ``openai`` client."""

from __future__ import annotations

import openai
import pytest

from spanrl.instrumentation import semconv
from spanrl.trainer_bridge.model_names import ServedModelNames

MESSAGES = [{"role": "user", "content": "What is 37 + 45?"}]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def test_the_name_rule():
    strict = ServedModelNames.of(["a", "b", "a"], default="dir")
    assert strict.names == ("a", "b") and strict.accepts("b") and not strict.accepts("c")
    assert "'a', 'b'" in strict.not_found("c") and "--served-model-name" in strict.not_found("c")
    anything = ServedModelNames.of(["*"], default="dir")
    assert anything.names == ("dir",) and anything.accepts("gpt-4o") and not anything.accepts(None)
    assert ServedModelNames.of([], default="dir") == ServedModelNames(("dir",))


@pytest.mark.parametrize("mode", ["api_process", "in_thread"])
def test_a_server_given_star_answers_any_name_and_echoes_it(engine, mode):
    from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    serve = serve_in_process if mode == "api_process" else serve_in_thread
    handle = serve(engine, "127.0.0.1", 0, model_names=["policy", "*"])
    try:
        api = client(handle.base_url)
        assert api.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, max_tokens=2).model == "gpt-4o-mini"
        chunks = list(api.chat.completions.create(model="triage-agent", messages=MESSAGES, max_tokens=2, stream=True))
        assert {chunk.model for chunk in chunks} == {"triage-agent"}
        assert api.completions.create(model="o3", prompt="CALC", max_tokens=2).model == "o3"
        assert api.responses.create(model="gpt-4.1", input="hi", max_output_tokens=2).model == "gpt-4.1"
        assert [card.id for card in api.models.list().data] == ["policy"]
    finally:
        handle.stop()


def test_a_server_with_listed_names_answers_those_only(engine):
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    handle = serve_in_thread(engine, "127.0.0.1", 0, model_names=["writer", "critic"])
    try:
        api = client(handle.base_url)
        assert [card.id for card in api.models.list().data] == ["writer", "critic"]
        assert api.chat.completions.create(model="critic", messages=MESSAGES, max_tokens=2).model == "critic"
        with pytest.raises(openai.NotFoundError) as caught:
            api.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
        assert caught.value.body["code"] == "model_not_found" and "'writer', 'critic'" in caught.value.message
    finally:
        handle.stop()


def test_the_endpoint_span_records_the_requested_name(engine):
    from .span_capture import serving_with_span_capture

    engine.start()
    with serving_with_span_capture(engine, model_names=["*"]) as (base_url, exported):
        client(base_url).chat.completions.create(model="planner", messages=MESSAGES, max_tokens=2)
    (span,) = exported.get_finished_spans()
    assert span.attributes[semconv.GENAI_REQUEST_MODEL] == "planner"
    assert span.attributes[semconv.LLM_SOURCE] == semconv.LLM_SOURCE_ENDPOINT


def test_spanrl_serve_and_train_settings_take_lists_and_star(monkeypatch):
    import argparse

    from spanrl.trainer_bridge import train_settings
    from spanrl.trainer_bridge.torch_backend import serve_cli

    def parse(argv):
        parser = argparse.ArgumentParser()
        serve_cli.add_parser(parser.add_subparsers())
        return serve_cli.SETTINGS.from_args(parser.parse_args(["serve", *argv]))

    monkeypatch.delenv("OTEL_SPANRL_SERVE_SERVED_MODEL_NAME", raising=False)
    assert parse(["m"]).served_model_name == []
    assert parse(["m", "--served-model-name", "a", "--served-model-name", "*"]).served_model_name == ["a", "*"]
    monkeypatch.setenv("OTEL_SPANRL_SERVE_SERVED_MODEL_NAME", "gpt-4o,gpt-4o-mini")
    assert parse(["m"]).served_model_name == ["gpt-4o", "gpt-4o-mini"]
    defaults = {f.name: f for f in train_settings.TrainSettings.__dataclass_fields__.values()}
    assert defaults["policy_model_names"].default_factory() == ["*"]  # spanrl train answers any name
