"""``spanrl proxy`` for real: the ``openai`` client over HTTP -> the proxy -> a real ``spanrl serve``
(a tiny model warm-started to call tools), its spans exported over OTLP/gRPC to a real ``spanrl
receive``. Chat, completions, Responses, streams and tools pass; each call is one transition with
the upstream's ids; prompt candidates replace the agents' instructions at every endpoint (proxy,
embedded server, verl gateway); upstream faults are 502/504 naming the upstream and a failed
rollout; upstream 4xx pass unchanged; keys reach neither a log nor a span."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from spanrl.child_processes import free_port
from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.span_tree import records_from_bodies
from spanrl.trainer_bridge.endpoint_prompts import PromptResourcesClient
from spanrl.trainer_bridge.endpoint_spans import SPANS_ENDPOINT_ENV
from spanrl.trainer_bridge.prompt_resources import PromptResources
from spanrl.trainer_bridge.relay.proxy import ProxySettings, start_proxy

from .conftest import TEST_DEVICE
from .proxy_support import (
    CITIES,
    FORCED,
    WEATHER,
    assembled,
    complete,
    make_teacher,
    running_receiver,
    silent_upstream,
    span_bodies,
    unused_port_url,
    wait_for_line,
)

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
WEATHER_QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
OTLP_VARIABLES = (SPANS_ENDPOINT_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


@pytest.fixture(scope="module", autouse=True)
def no_spans_from_the_upstreams():
    """Only the proxy's spans are tested: servers started here read no OTLP endpoint."""
    with pytest.MonkeyPatch.context() as patch:
        for name in OTLP_VARIABLES:
            patch.delenv(name, raising=False)
        yield


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return make_teacher(tmp_path_factory.mktemp("teacher"), TEST_DEVICE)


@pytest.fixture(scope="module")
def engine(teacher_dir):
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine

    engine = PolicyEngine.from_pretrained(teacher_dir, device=TEST_DEVICE, dtype="float32").start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def upstream(engine):
    """``spanrl serve`` of the teacher, as the proxy's upstream (its HTTP in a thread of this process)."""
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    handle = serve_in_thread(engine)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def receiver(tmp_path_factory):
    with running_receiver(tmp_path_factory.mktemp("receiver")) as info:
        yield info


@pytest.fixture
def proxy_for(receiver):
    """Starts proxies (``proxy_for(upstream_url, **settings)``) sending spans to ``receiver``; stopped after."""
    handles = []

    def start(upstream_url: str, **fields):
        fields.setdefault("spans_endpoint", receiver["grpc"])
        handle = start_proxy(ProxySettings(upstream=upstream_url, port=0, **fields))
        handles.append(handle)
        return handle

    yield start
    for handle in handles:
        handle.stop()


def agent(proxy, rollout_id: str | None = None, **headers) -> openai.OpenAI:
    if rollout_id:
        headers[semconv.ROLLOUT_ID_HEADER] = rollout_id
    return openai.OpenAI(base_url=proxy.url, api_key="unused", max_retries=0, default_headers=headers)


def message_tokens(messages: list[dict]) -> list[int]:
    return [token for message in messages for token in message["tokens"]]


def test_every_api_through_the_proxy_is_one_transition_with_the_upstreams_ids(proxy_for, upstream, engine,
                                                                              receiver):
    proxy = proxy_for(upstream.base_url, token_ids=True)
    api, model = agent(proxy, "proxy-apis"), engine.model_name
    served = []  # (prompt ids, response ids) of each call, as the agent got them

    chat = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0)
    assert chat.model_extra["prompt_token_ids"] == engine.encode_chat(QUESTION)  # asked by the proxy, not the agent
    served.append((chat.model_extra["prompt_token_ids"], chat.choices[0].model_extra["token_ids"]))

    prompt, ids, text = None, [], ""
    for chunk in api.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, stream=True):
        prompt = prompt or chunk.model_extra.get("prompt_token_ids")
        for choice in chunk.choices:
            ids += choice.model_extra.get("token_ids") or []
            text += choice.delta.content or ""
    assert ids and engine.tokenizer.decode(ids, skip_special_tokens=True) == text
    served.append((prompt, ids))

    completion = api.completions.create(model=model, prompt="12 + 30 =", max_tokens=5)
    choice = completion.choices[0].model_extra
    served.append((choice["prompt_token_ids"], choice["token_ids"]))

    tools = api.chat.completions.create(model=model, messages=WEATHER_QUESTION, tools=[WEATHER], tool_choice=FORCED,
                                        temperature=0, max_tokens=30)
    (call,) = tools.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    served.append((tools.model_extra["prompt_token_ids"], tools.choices[0].model_extra["token_ids"]))

    response = api.responses.create(model=model, input="What is 2 + 2?", instructions="Answer.", max_output_tokens=8)
    assert response.output_text is not None
    served.append((message_tokens(response.model_extra["input_messages"]),
                   message_tokens(response.model_extra["output_messages"])))
    events = list(api.responses.create(model=model, input="Weather in Paris?", max_output_tokens=8, stream=True))
    final = next(e for e in events if e.type == "response.completed").response.model_extra
    served.append((message_tokens(final["input_messages"]), message_tokens(final["output_messages"])))

    complete(receiver, "proxy-apis")
    rollout = assembled(receiver, "proxy-apis")
    assert [(list(t.prompt_token_ids), list(t.response_token_ids)) for t in rollout.transitions] == served
    assert all(not t.retokenized and t.policy_version == 0 for t in rollout.transitions)
    calls = [r for r in records_from_bodies(span_bodies(receiver, "proxy-apis"))
             if r.attributes.get(semconv.LLM_SOURCE) == semconv.LLM_SOURCE_ENDPOINT]
    assert len(calls) == len(served)  # one span per call, each with its text as well
    tool_span = next(r for r in calls if r.attributes.get("llm.tools.0.tool.json_schema"))
    assert tool_span.attributes["llm.input_messages.0.message.content"] == "Weather in Paris?"
    assert tool_span.attributes["llm.output_messages.0.message.tool_calls.0.tool_call.function.name"] == "get_weather"


@pytest.fixture(params=["proxy", "server", "gateway"])
def endpoint_with_prompts(request, tmp_path, proxy_for, upstream, teacher_dir):
    """An endpoint serving the prompts file below: (its base URL, the model name agents call)."""
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text("planner:\n  active: terse\n  candidates:\n    terse: Answer in one word.\n"
                       "    verbose: Explain every step.\n")
    if request.param == "proxy":
        yield proxy_for(upstream.base_url, token_ids=True, prompts=str(prompts)).url, upstream.engine.model_name
    elif request.param == "server":  # as `spanrl serve --prompts` runs it: HTTP in a child process
        from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine
        from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process

        engine = PolicyEngine.from_pretrained(teacher_dir, device=TEST_DEVICE, dtype="float32")
        handle = serve_in_process(engine, prompts=str(prompts))
        yield handle.base_url, engine.model_name
        handle.stop()
    else:
        from spanrl.trainer_bridge.verl_backend.gateway import GatewayConfig, start_gateway

        gateway = start_gateway(GatewayConfig(served_model_name="policy", prompts=str(prompts)), [upstream.url])
        yield gateway.url, "policy"
        gateway.stop()


def test_prompt_candidates_replace_the_agents_instructions_at_every_endpoint(endpoint_with_prompts, engine):
    base_url, model = endpoint_with_prompts
    own = [{"role": "system", "content": "You are the agent's own prompt."}, *QUESTION]
    planner = {"baggage": f"{semconv.AGENT_NAME}=planner"}

    def prompt_ids(rollout_id: str, headers: dict) -> list[int]:
        api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0,
                            default_headers={semconv.ROLLOUT_ID_HEADER: rollout_id, **headers})
        reply = api.chat.completions.create(model=model, messages=own, max_tokens=2,
                                            extra_body={"return_token_ids": True})
        return reply.model_extra["prompt_token_ids"]

    def seen(instructions: str) -> list[int]:
        return engine.encode_chat([{"role": "system", "content": instructions}, *QUESTION])

    assert prompt_ids("r-terse", planner) == seen("Answer in one word.")
    assert prompt_ids("r-other-agent", {}) == engine.encode_chat(own)  # no resource for it: its own prompt
    prompts = PromptResourcesClient(base_url)
    prompts.update("planner", rollouts={"r-verbose": "verbose"})
    assert prompt_ids("r-verbose", planner) == seen("Explain every step.")
    assert prompt_ids("r-terse-2", planner) == seen("Answer in one word.")
    assert prompts.resources() == {"planner": {"active": "terse", "assigned_rollouts": 1, "candidates": {
        "terse": "Answer in one word.", "verbose": "Explain every step."}}}
    refused = httpx.post(base_url.removesuffix("/v1") + "/spanrl/v1/prompts",
                         json={"resource": "planner", "active": "missing"})
    assert refused.status_code == 400 and "no candidate 'missing'" in refused.json()["error"]["message"]


def test_the_proxy_records_the_candidate_on_the_span_and_exports_the_prompts(proxy_for, upstream, engine, receiver,
                                                                            tmp_path):
    proxy = proxy_for(upstream.base_url, prompts="")
    PromptResourcesClient(proxy.url).update("writer", candidates={"plain": "Write plainly.", "rhyme": "Rhyme."},
                                            active="plain", rollouts={"r-prompt-span": "rhyme"})
    api = agent(proxy, "r-prompt-span", baggage=f"{semconv.AGENT_NAME}=writer")
    api.responses.create(model=engine.model_name, input="Say hi.", instructions="The agent's own.", max_output_tokens=4)
    complete(receiver, "r-prompt-span")
    rollout = assembled(receiver, "r-prompt-span")
    assert rollout.transitions == ()  # token_ids off: the proxy spans carry text only
    (span,) = [r for r in records_from_bodies(span_bodies(receiver, "r-prompt-span"))
               if r.attributes.get(semconv.LLM_SOURCE) == semconv.LLM_SOURCE_ENDPOINT]
    assert span.attributes[semconv.PROMPT_RESOURCE] == "writer"
    assert span.attributes[semconv.PROMPT_CANDIDATE] == "rhyme"
    assert span.attributes["llm.input_messages.0.message.content"] == "Rhyme."  # what the model saw

    out = tmp_path / "exported.yaml"
    done = subprocess.run([sys.executable, "-m", "spanrl", "prompts", "export", "--url", proxy.url, "--output",
                           str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert PromptResources.from_file(str(out)).snapshot()["writer"]["candidates"] == {"plain": "Write plainly.",
                                                                                      "rhyme": "Rhyme."}
    again = subprocess.run([sys.executable, "-m", "spanrl", "prompts", "export", "--url", proxy.url, "--output",
                            str(out)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists" in again.stderr


def test_an_upstream_that_is_down_is_a_502_naming_it_and_a_failed_rollout(proxy_for, receiver):
    down = unused_port_url()
    proxy = proxy_for(down)
    baggage = f"{semconv.ROLLOUT_ID}=r-down,{semconv.TASK_ID}=t-down"
    api = agent(proxy, baggage=baggage)
    for _ in range(2):  # the upstream stays the upstream: each request tries it again
        began = time.monotonic()
        with pytest.raises(openai.APIStatusError) as caught:
            api.chat.completions.create(model="gpt-4o-mini", messages=QUESTION)
        assert time.monotonic() - began < 10.0
        assert caught.value.status_code == 502 and down in caught.value.message
        assert caught.value.body["code"] == "upstream_unreachable"
    complete(receiver, "r-down")
    rollout = assembled(receiver, "r-down")
    assert rollout.status == "failed" and down in rollout.error and rollout.task_id == "t-down"


def test_an_upstream_that_does_not_answer_is_a_504_naming_it(proxy_for):
    with silent_upstream() as silent:
        proxy = proxy_for(silent, request_timeout_s=0.5)
        api = agent(proxy)
        for stream in (False, True):
            began = time.monotonic()
            with pytest.raises(openai.APIStatusError) as caught:
                api.chat.completions.create(model="gpt-4o-mini", messages=QUESTION, stream=stream)
            assert time.monotonic() - began < 5.0
            assert caught.value.status_code == 504 and silent in caught.value.message


def test_upstream_4xx_pass_through_unchanged(proxy_for, upstream):
    proxy = proxy_for(upstream.base_url)
    assert httpx.get(f"{proxy.url}/models").json() == httpx.get(f"{upstream.base_url}/models").json()
    for body in ({"model": "no-such-model", "messages": QUESTION},
                 {"model": upstream.engine.model_name, "messages": QUESTION, "n": "many"}):
        direct = httpx.post(f"{upstream.base_url}/chat/completions", json=body)
        relayed = httpx.post(f"{proxy.url}/chat/completions", json=body)
        assert 400 <= direct.status_code < 500
        assert (relayed.status_code, relayed.json()) == (direct.status_code, direct.json())


def test_with_upstream_model_any_name_is_sent_as_it_and_answered_as_asked(proxy_for, upstream, engine, receiver):
    """The proxy checks no model name; ``upstream_model`` replaces the agent's upstream, and the
    reply (each stream event too) and the call's span carry the name the agent asked for."""
    proxy = proxy_for(upstream.base_url, upstream_model=engine.model_name)
    api = agent(proxy, "r-any-name")
    assert api.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=2).model == "gpt-4o"
    events = list(api.chat.completions.create(model="triage", messages=QUESTION, max_tokens=2, stream=True))
    assert events and {event.model for event in events} == {"triage"}
    assert api.responses.create(model="writer", input="Say hi.", max_output_tokens=2).model == "writer"
    complete(receiver, "r-any-name")
    assembled(receiver, "r-any-name")
    asked = [r.attributes.get(semconv.GENAI_REQUEST_MODEL) for r in records_from_bodies(span_bodies(
        receiver, "r-any-name")) if r.attributes.get(semconv.LLM_SOURCE) == semconv.LLM_SOURCE_ENDPOINT]
    assert sorted(asked) == ["gpt-4o", "triage", "writer"]


def test_keys_reach_the_upstream_but_never_a_log_or_a_span(engine, receiver, tmp_path):
    """``spanrl proxy`` as users run it, logging everything: its own key goes upstream, the agents
    need the proxy's token; neither key is in its output or in the spans."""
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    upstream_key, proxy_token, agent_key = "sk-upstream-SECRET-7f3a", "proxy-token-SECRET-91c2", "sk-agent-SECRET-44d0"
    guarded = serve_in_thread(engine, api_token=upstream_key)  # a hosted API: only its key is served
    port = free_port()
    environment = {**os.environ, "OTEL_SPANRL_PROXY_UPSTREAM_API_KEY": upstream_key}
    process = subprocess.Popen(
        [sys.executable, "-m", "spanrl", "--log-level", "DEBUG", "proxy", "--upstream", guarded.base_url, "--port",
         str(port), "--token", proxy_token, "--spans-endpoint", receiver["grpc"], "--log-level", "debug"],
        env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = ""
    try:
        started = wait_for_line(process, "spanrl proxy: ready")
        base_url = f"http://127.0.0.1:{port}/v1"
        allowed = openai.OpenAI(base_url=base_url, api_key=proxy_token, max_retries=0,
                                default_headers={semconv.ROLLOUT_ID_HEADER: "r-keys"})
        assert allowed.chat.completions.create(model=engine.model_name, messages=QUESTION, max_tokens=2).choices
        refused = openai.OpenAI(base_url=base_url, api_key=agent_key, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            refused.chat.completions.create(model=engine.model_name, messages=QUESTION, max_tokens=2)
    finally:
        process.terminate()  # as a service manager stops it: the last call's span still leaves
        rest, _ = process.communicate(timeout=30)
        output = started + rest
        guarded.stop()
    assert process.returncode == 0 and "spanrl proxy: stopped" in output
    complete(receiver, "r-keys")
    problems = assembled(receiver, "r-keys").problems
    assert sum("no engine token ids" in problem for problem in problems) == 1  # the call, text only
    assert "upstream_api_key = ***" in output and "token = ***" in output
    spans = b"".join(span_bodies(receiver, "r-keys"))
    assert b"What is 2 + 2?" in spans
    for secret in (upstream_key, proxy_token, agent_key):
        assert secret not in output and secret.encode() not in spans


def test_without_its_own_key_the_proxy_passes_each_agents_key(proxy_for, engine):
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    guarded = serve_in_thread(engine, api_token="sk-agent-own-key")
    try:
        proxy = proxy_for(guarded.base_url, spans_endpoint="off")
        good = openai.OpenAI(base_url=proxy.url, api_key="sk-agent-own-key", max_retries=0)
        assert good.chat.completions.create(model=engine.model_name, messages=QUESTION, max_tokens=2).choices
        wrong = openai.OpenAI(base_url=proxy.url, api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as caught:  # the upstream's 401, as it answered
            wrong.chat.completions.create(model=engine.model_name, messages=QUESTION, max_tokens=2)
        assert caught.value.body["code"] == "invalid_api_key"
    finally:
        guarded.stop()


def test_a_student_learns_the_teachers_text_only_rollouts_recorded_by_the_proxy(proxy_for, upstream, engine,
                                                                               receiver, tmp_path):
    """Distill, then train: an uninstrumented agent calls the teacher through the proxy (no token ids:
    as a hosted model); ``spanrl sft --store`` re-tokenizes those calls with a student whose tokenizer
    differs and fine-tunes it; the student's loss on the teacher's calls falls."""
    from spanrl.otlp_receiver.store import SpanStore
    from spanrl.otlp_receiver.text_calls import chat_examples
    from spanrl.trainer_bridge.torch_backend import sft
    from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer

    proxy = proxy_for(upstream.base_url, token_ids=False)
    tasks = [{"id": f"distill-task-{i}", "city": city} for i, city in enumerate(CITIES)]
    for index, task in enumerate(tasks):
        rollout_id = f"distill-{index}"
        identity = f"{semconv.ROLLOUT_ID}={rollout_id},{semconv.TASK_ID}={task['id']},{semconv.ATTEMPT}=0"
        api = agent(proxy, baggage=identity)
        question = [{"role": "user", "content": f"Weather in {task['city']}?"}]
        first = api.chat.completions.create(model=engine.model_name, messages=question, tools=[WEATHER],
                                            tool_choice=FORCED, temperature=0, max_tokens=30)
        assert "token_ids" not in first.choices[0].model_extra  # text only, as from a hosted model
        call = first.choices[0].message.tool_calls[0]
        history = [*question, first.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": f"{10 + index} C"}]
        api.chat.completions.create(model=engine.model_name, messages=history, tools=[WEATHER], temperature=0,
                                    max_tokens=16)
        complete(receiver, rollout_id)
    rollouts = [assembled(receiver, f"distill-{i}") for i in range(len(tasks))]
    assert all(r.status == "ok" and r.transitions == () for r in rollouts)
    with SpanStore(receiver["db"]) as store:
        examples = [e for r in rollouts for e in chat_examples(store, r.rollout_id)]
    assert len(examples) == 2 * len(tasks)
    assert examples[0]["tools"] == [WEATHER] and examples[0]["messages"][-1]["tool_calls"][0]["function"]["name"] \
        == "get_weather"

    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(task) + "\n" for task in tasks))
    (tmp_path / "distill_reward.py").write_text("def score(task, variables):\n    return 1.0\n")
    (tmp_path / "other.txt").write_text("A student model learns from its teacher's traces. " * 40)
    student = create_model_dir(tmp_path / "student", preset="tiny", corpus_files=[tmp_path / "other.txt"], seed=1)
    student_tokenizer = TorchTrainer(str(student), TrainerConfig(device=TEST_DEVICE)).tokenizer
    assert student_tokenizer.encode("Weather in Paris?") != engine.tokenizer.encode("Weather in Paris?")

    learned = tmp_path / "learned"
    done = subprocess.run(
        [sys.executable, "-m", "spanrl", "sft", str(student), "--store", str(receiver["db"]), "--reward",
         "distill_reward:score", "--tasks", str(tmp_path / "tasks.jsonl"), "--python-path", str(tmp_path),
         "--output", str(learned), "--steps", "12", "--batch-size", "4", "--learning-rate", "5e-3", "--no-progress",
         "--device", TEST_DEVICE], capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"})  # one torch thread: steadier on a busy CI machine
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((learned / "warm_start.json").read_text())
    assert record["store"]["rollouts"] == len(tasks) and record["store"]["text_calls"] == len(examples)

    before = sft.sft_loss(TorchTrainer(str(student), TrainerConfig(device=TEST_DEVICE)), examples)
    after = sft.sft_loss(TorchTrainer(str(learned), TrainerConfig(device=TEST_DEVICE)), examples)
    assert after < 0.7 * before, (before, after)


def test_the_relay_and_the_proxy_import_neither_torch_nor_verl():
    code = ("import sys\n"
            "import spanrl.trainer_bridge.relay.proxy, spanrl.trainer_bridge.verl_backend.gateway\n"
            "import spanrl.trainer_bridge.prompts_cli, spanrl.otlp_receiver.text_calls\n"
            "print(sorted(name for name in ('torch', 'transformers', 'verl', 'vllm') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
