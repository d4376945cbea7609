"""Structured outputs on the embedded policy server: a random-weight model answers strict
``json_schema`` / ``json_object`` chat requests, Responses ``text.format`` and a forced strict
tool call with output that parses and validates, for 50 seeds each, streamed and not, through
the real ``openai`` client, in batches shared with free requests.

One server per module (the HTTP front end in its own process, as ``spanrl serve`` runs it) on a
``spanrl model init`` tiny model with random weights: such a model never writes valid JSON by
chance, so every valid answer here is the grammar's doing (engine/grammar.py).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic
import pytest
import torch

from .conftest import TEST_DEVICE

SEEDS = range(50)
# room for the bounded answers below: a random model's characters are often several byte tokens
MAX_TOKENS = 128
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": 0, "maximum": 999},
        "unit": {"type": "string", "enum": ["cm", "kg", "s"]},
        "note": {"type": "string", "maxLength": 6},
        "sure": {"type": "boolean"},
    },
    "required": ["answer", "unit", "note", "sure"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city", "strict": True,
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 6}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
QUESTION = [{"role": "user", "content": "How tall is the tower?"}]


class Answer(pydantic.BaseModel):
    """A typed output, as an Agents SDK agent's ``output_type`` declares one."""

    answer: int = pydantic.Field(ge=0, le=999)
    unit: str = pydantic.Field(max_length=4)
    sure: bool


@pytest.fixture(scope="module")
def random_model_dir(tmp_path_factory):
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir

    return create_model_dir(tmp_path_factory.mktemp("structured") / "tiny", preset="tiny", seed=0)


@pytest.fixture(scope="module")
def random_engine(random_model_dir):
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = PolicyEngine.from_pretrained(random_model_dir, device=TEST_DEVICE, dtype="float32").start()
    yield engine
    engine.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def random_server(random_engine):
    from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process

    handle = serve_in_process(random_engine, "127.0.0.1", 0, model_names=["*"])
    yield handle
    handle.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def run_together(calls) -> list:
    """Every call at once from its own thread, so the engine batches them together."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def chat_text(api: openai.OpenAI, seed: int, stream: bool, **fields) -> tuple[str, str]:
    """The reply's content and finish reason, streamed or not."""
    if not stream:
        choice = api.chat.completions.create(model="anything", messages=QUESTION, seed=seed, **fields).choices[0]
        return choice.message.content or "", choice.finish_reason
    text, finish = "", ""
    for chunk in api.chat.completions.create(model="anything", messages=QUESTION, seed=seed, stream=True, **fields):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def free_calls(api: openai.OpenAI, count: int) -> list:
    return [lambda seed=seed: chat_text(api, seed, False, max_tokens=24) for seed in range(count)]


@pytest.mark.parametrize("stream", [False, True])
def test_strict_json_schema_answers_validate_for_every_seed(random_server, stream):
    api = client(random_server)
    calls = [lambda seed=seed: chat_text(api, seed, stream, response_format=RESPONSE_FORMAT, max_tokens=MAX_TOKENS)
             for seed in SEEDS]
    *answers, = run_together(calls + free_calls(api, 8))
    for text, finish in answers[:len(SEEDS)]:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), ANSWER_SCHEMA)
    free_texts = [text for text, _ in answers[len(SEEDS):]]
    assert not any(_parses(text) for text in free_texts)  # the free rows of the batch were not constrained


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_answers_are_json_objects_for_every_seed(random_server, stream):
    """Any object: keys and strings have no length bound, so the answers use the default budget
    (the rest of the context), as an agent that sets no max_tokens gets."""
    api = client(random_server)
    calls = [lambda seed=seed: chat_text(api, seed, stream, response_format={"type": "json_object"})
             for seed in SEEDS]
    for text, finish in run_together(calls):
        assert finish == "stop" and isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("stream", [False, True])
def test_responses_text_format_answers_validate_for_every_seed(random_server, stream):
    api = client(random_server)
    text_format = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}

    def respond(seed: int) -> str:
        fields = dict(model="gpt-4o", input="How tall?", text=text_format, max_output_tokens=MAX_TOKENS,
                      extra_body={"seed": seed})  # vLLM's extra on this route
        if not stream:
            response = api.responses.create(**fields)
            assert response.status == "completed" and response.text.format.type == "json_schema"
            return response.output_text
        done = [event.response for event in api.responses.create(stream=True, **fields)
                if event.type == "response.completed"]
        assert done and done[0].status == "completed"
        return done[0].output_text

    for text in run_together([lambda seed=seed: respond(seed) for seed in SEEDS] + free_calls(api, 4))[:len(SEEDS)]:
        jsonschema.validate(json.loads(text), ANSWER_SCHEMA)


def test_responses_parse_fills_a_pydantic_output_type(random_server):
    """``responses.parse(text_format=Model)``: the strict schema the SDK derives from a pydantic
    model (what an Agents SDK ``output_type`` sends), parsed back into the model by the client."""
    api = client(random_server)
    parsed = run_together([lambda seed=seed: api.responses.parse(
        model="gpt-4o", input="How tall?", text_format=Answer, max_output_tokens=MAX_TOKENS,
        extra_body={"seed": seed}).output_parsed
        for seed in range(10)])
    assert all(isinstance(answer, Answer) for answer in parsed)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_strict_tool_call_has_schema_true_arguments_for_every_seed(random_server, stream):
    api = client(random_server)
    forced = {"type": "function", "function": {"name": "get_weather"}}

    def call(seed: int) -> tuple[str, str, str]:
        fields = dict(model="agent-model", messages=QUESTION, tools=[WEATHER, CLOCK], tool_choice=forced,
                      max_tokens=MAX_TOKENS, seed=seed)
        if not stream:
            choice = api.chat.completions.create(**fields).choices[0]
            (tool_call,) = choice.message.tool_calls
            return tool_call.function.name, tool_call.function.arguments, choice.finish_reason
        name, arguments, finish = "", "", ""
        for chunk in api.chat.completions.create(stream=True, **fields):
            for choice in chunk.choices:
                for piece in choice.delta.tool_calls or ():
                    name += piece.function.name or ""
                    arguments += piece.function.arguments or ""
                finish = choice.finish_reason or finish
        return name, arguments, finish

    for name, arguments, finish in run_together([lambda seed=seed: call(seed) for seed in SEEDS]
                                                + free_calls(api, 4))[:len(SEEDS)]:
        assert name == "get_weather" and finish == "tool_calls"
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_a_typed_answer_with_tools_is_the_answer_or_schema_true_calls(random_server):
    """``response_format`` with strict tools and ``tool_choice: auto`` (a typed-output agent with
    tools): each reply is either the schema's JSON or calls whose arguments fit their tool."""
    api = client(random_server)

    def reply(seed: int):
        return api.chat.completions.create(model="x", messages=QUESTION, tools=[WEATHER], parallel_tool_calls=False,
                                           seed=seed, max_tokens=MAX_TOKENS,
                                           response_format=RESPONSE_FORMAT).choices[0].message

    kinds = set()
    for message in run_together([lambda seed=seed: reply(seed) for seed in range(20)]):
        if message.tool_calls:
            kinds.add("call")
            for call in message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        else:
            kinds.add("answer")
            jsonschema.validate(json.loads(message.content), ANSWER_SCHEMA)
    assert kinds == {"call", "answer"}  # a random model takes both ways over 20 seeds


def test_a_schema_that_cannot_be_enforced_is_a_400_naming_the_field(random_server):
    api = client(random_server)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strange"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model="x", messages=QUESTION, response_format=bad_schema)
    assert caught.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model="x", messages=QUESTION, response_format={"type": "yaml"})
    assert caught.value.body["param"] == "response_format.type" and "yaml" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        api.responses.create(model="x", input="hi", text={"format": {"type": "json_schema", "name": "x",
                                                                      "schema": {"type": "strange"}}})
    assert caught.value.body["param"] == "text.format.schema"


def test_free_rows_sample_the_same_tokens_with_or_without_constrained_rows_in_their_batch(random_engine):
    """A mixed batch: constrained rows are masked, free rows are not touched (same seeded tokens
    as when they run alone), and all of them were admitted in one prefill pass."""
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import SamplingParams
    from spanrl.trainer_bridge.torch_backend.server.structured_output import chat_answer_format, reply_grammar
    from spanrl.trainer_bridge.torch_backend.server.tool_calls import ToolSetup

    grammar = reply_grammar(chat_answer_format(RESPONSE_FORMAT), ToolSetup())
    prompt = random_engine.encode_chat(QUESTION)
    alone = [random_engine.generate(prompt, SamplingParams(max_tokens=16, seed=seed)).choices[0].token_ids
             for seed in range(4)]
    batches_before = random_engine.stats.batches
    random_engine.batch_wait_s = 0.0
    mixed = [random_engine.submit(prompt, SamplingParams(max_tokens=16, seed=seed)) for seed in range(4)]
    constrained = [random_engine.submit(prompt, SamplingParams(max_tokens=MAX_TOKENS, seed=seed, grammar=grammar))
                   for seed in range(4)]
    assert [job.wait(120).choices[0].token_ids for job in mixed] == alone
    for job in constrained:
        jsonschema.validate(json.loads(job.wait(120).choices[0].text), ANSWER_SCHEMA)
    assert random_engine.stats.batches - batches_before <= 2  # joined the same running batch


def test_constrained_logprobs_are_the_trainers_so_the_importance_ratio_starts_at_one(random_engine,
                                                                                       random_model_dir):
    """Under a mask the engine returns the raw model's logprobs (docs/policy.md): exactly what the
    trainer recomputes, so a GRPO step on the engine's old logprobs starts at ratio 1 (no clipping,
    no KL between old and new). Renormalized (masked) logprobs would be larger: ppo_kl far from 0."""
    from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import SamplingParams
    from spanrl.trainer_bridge.torch_backend.server.structured_output import chat_answer_format, reply_grammar
    from spanrl.trainer_bridge.torch_backend.server.tool_calls import ToolSetup
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer, TrainingSample

    grammar = reply_grammar(chat_answer_format(RESPONSE_FORMAT), ToolSetup())
    prompt = random_engine.encode_chat(QUESTION)
    choices = [random_engine.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, seed=seed, grammar=grammar,
                                                             logprobs=True)).choices[0] for seed in range(4)]
    trainer = TorchTrainer(str(random_model_dir), TrainerConfig(device=TEST_DEVICE, seed=0, learning_rate=1e-3))
    samples = [TrainingSample(prompt, choice.token_ids, 1.0 if i % 2 else -1.0, old_logprobs=choice.logprobs)
               for i, choice in enumerate(choices)]
    stats = trainer.grpo_step(samples)
    assert abs(stats["ppo_kl"]) < 1e-4 and stats["pg_clipfrac"] == 0.0, stats


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
