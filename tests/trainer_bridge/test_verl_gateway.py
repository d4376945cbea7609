"""The verl backend's gateway in front of two real upstreams (spanrl's embedded policy servers,
which speak vLLM's dialect), called with the real ``openai`` client over HTTP. The gateway in
front of a running vLLM server: tests/verl_backend/test_vllm_live.py (in `.venv-verl`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time

import httpx
import openai
import pytest
from starlette.datastructures import Headers

from spanrl.child_processes import free_port
from spanrl.trainer_bridge.relay import rewrite as relay_rewrite
from spanrl.trainer_bridge.relay.config import RelayConfig
from spanrl.trainer_bridge.relay.upstreams import rollout_key
from spanrl.trainer_bridge.verl_backend.gateway import GatewayConfig, start_gateway

TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")
SERVED = "policy-in-training"  # what the agents call; the upstreams serve the model as "tiny"
MESSAGES = [{"role": "user", "content": "What is 37 + 45?"}]


@pytest.fixture
def upstreams(tiny_model_dir):
    """Two embedded policy servers, each over its own engine, on free loopback ports."""
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    servers = []
    for _ in range(2):
        engine = PolicyEngine.from_pretrained(tiny_model_dir, device=TEST_DEVICE, dtype="float32")
        servers.append(serve_in_thread(engine))
    yield servers
    for server in servers:
        if server.thread.is_alive():
            server.stop()


@pytest.fixture
def start(upstreams):
    """Starts gateways over ``upstreams`` (``start(**config_fields)``), all stopped after the test."""
    handles = []

    def start_one(urls=None, **fields):
        handle = start_gateway(GatewayConfig(served_model_name=SERVED, **fields),
                               urls if urls is not None else [s.url for s in upstreams])
        handles.append(handle)
        return handle

    yield start_one
    for handle in handles:
        handle.stop()


def client(gateway, **kwargs):
    kwargs.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=gateway.url, api_key="unused", **kwargs)


def served_by(gateway, before):
    """The upstream URL whose request count grew since the ``before`` stats."""
    grown = [after.url for prior, after in zip(before.upstreams, gateway.stats().upstreams, strict=True)
             if after.requests > prior.requests]
    assert len(grown) == 1, grown
    return grown[0]


def test_chat_and_completions_carry_ids_logprobs_and_version_unasked(start, upstreams):
    gateway = start()
    gateway.set_policy_version(3)
    tokenizer = upstreams[0].engine.tokenizer
    raw = client(gateway).chat.completions.with_raw_response.create(model=SERVED, messages=MESSAGES, max_tokens=8)
    body = json.loads(raw.text)
    assert raw.headers["x-spanrl-policy-version"] == "3"
    assert body["policy_version"] == 3 and body["model"] == SERVED
    assert body["prompt_token_ids"] == upstreams[0].engine.encode_chat(MESSAGES)
    choice = body["choices"][0]
    assert 1 <= len(choice["token_ids"]) <= 8
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])

    raw = client(gateway).completions.with_raw_response.create(model=SERVED, prompt="12 + 30 =", max_tokens=6)
    body = json.loads(raw.text)
    assert raw.headers["x-spanrl-policy-version"] == "3" and body["policy_version"] == 3
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] and 1 <= len(choice["token_ids"]) <= 6
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]


def test_streams_pass_event_by_event_with_the_version_in_each(start, upstreams):
    gateway = start()
    gateway.set_policy_version(7)
    tokenizer = upstreams[0].engine.tokenizer
    # seeded: an unseeded sample of the untrained model may end at its first token (a fresh-clone
    # CI run drew one), which leaves no token events to check
    with client(gateway).chat.completions.with_streaming_response.create(
            model=SERVED, messages=MESSAGES, max_tokens=8, stream=True, seed=3) as raw:
        assert raw.headers["x-spanrl-policy-version"] == "7"
        chunks = [chunk.model_dump() for chunk in raw.parse()]
    assert len(chunks) >= 3  # the role chunk, one per token: relayed as events, not one blob
    assert {c["policy_version"] for c in chunks} == {7} and {c["model"] for c in chunks} == {SERVED}
    assert chunks[0]["prompt_token_ids"] == upstreams[0].engine.encode_chat(MESSAGES)
    ids = [i for c in chunks for choice in c["choices"] for i in choice["token_ids"]]
    text = "".join(choice["delta"].get("content") or "" for c in chunks for choice in c["choices"])
    assert 1 <= len(ids) <= 8 and tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all(choice["logprobs"] for c in chunks[1:] for choice in c["choices"])

    completion_chunks = [c.model_dump() for c in client(gateway).completions.create(
        model=SERVED, prompt="12 + 30 =", max_tokens=5, stream=True, seed=3)]
    assert completion_chunks and {c["policy_version"] for c in completion_chunks} == {7}
    assert all(choice["token_ids"] for c in completion_chunks for choice in c["choices"])


def _gateway_answers(gateway, path: str, body: dict, packed: bool) -> dict:
    from spanrl.instrumentation import semconv

    asked = {semconv.TOKEN_IDS_FORM_FIELD: semconv.TOKEN_IDS_FORM_PACKED} if packed else {}
    reply = httpx.post(f"{gateway.url}{path.removeprefix('/v1')}", json={**body, **asked}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_gateway_packs_vllms_id_lists_when_the_agent_asks(start, upstreams, private_tracing):
    """Its upstreams answer lists; for a request with ``"spanrl_token_ids": "packed"`` (what spanrl's
    instrumentation sends) the gateway packs them, and an instrumented agent records the ids."""
    from spanrl.instrumentation import semconv
    from spanrl.instrumentation.packed_values import unpack_token_ids, unpacked_attributes

    gateway = start()
    chat = {"model": SERVED, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    lists, packed = (_gateway_answers(gateway, "/v1/chat/completions", chat, p) for p in (False, True))
    assert unpack_token_ids(packed["prompt_token_ids"]) == lists["prompt_token_ids"]
    assert unpack_token_ids(packed["choices"][0]["token_ids"]) == lists["choices"][0]["token_ids"]
    completion = {"model": SERVED, "prompt": "12 + 30 =", "max_tokens": 6, "temperature": 0}
    lists_c, packed_c = (_gateway_answers(gateway, "/v1/completions", completion, p) for p in (False, True))
    assert unpack_token_ids(packed_c["choices"][0]["prompt_token_ids"]) == lists_c["choices"][0]["prompt_token_ids"]
    assert unpack_token_ids(packed_c["choices"][0]["token_ids"]) == lists_c["choices"][0]["token_ids"]

    stream = list(client(gateway).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=8,
                                                          temperature=0, stream=True))
    reply = client(gateway).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=8, temperature=0)
    assert "token_ids" not in (reply.choices[0].model_extra or {}) and stream  # taken out for the agent
    spans = [unpacked_attributes(s.attributes) for s in private_tracing.exporter.get_finished_spans()
             if s.attributes.get("openinference.span.kind") == "LLM"]
    assert len(spans) == 2
    for span in spans:  # the stream's (prompt ids packed, per-token ids lists) and the body's
        assert span[semconv.LLM_PROMPT_TOKEN_IDS] == tuple(lists["prompt_token_ids"])
        assert span[semconv.llm_response_token_ids(0)] == tuple(lists["choices"][0]["token_ids"])


def test_a_rollout_sticks_to_one_upstream(start):
    gateway = start()
    chat = client(gateway).chat.completions

    def call(headers):
        before = gateway.stats()
        chat.create(model=SERVED, messages=MESSAGES, max_tokens=2, extra_headers=headers)
        return served_by(gateway, before)

    first = {rollout: call({"x-spanrl-rollout-id": rollout}) for rollout in ("r-a", "r-b")}
    assert first["r-a"] != first["r-b"]  # new rollouts go to the least loaded upstream
    for _ in range(3):
        for rollout in ("r-a", "r-b"):
            assert call({"x-spanrl-rollout-id": rollout}) == first[rollout]
            assert call({"baggage": f"other=1,spanrl.rollout.id={rollout};prop=x"}) == first[rollout]
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    by_trace = call({"traceparent": trace})
    assert all(call({"traceparent": trace.replace("00f067aa", f"0000000{i}")}) == by_trace for i in range(3))
    stats = json.loads(httpx.get(gateway.url.removesuffix("/v1") + "/spanrl/gateway/stats").text)
    assert sum(u["requests"] for u in stats["upstreams"]) == 2 + 12 + 4
    assert sum(u["rollouts"] for u in stats["upstreams"]) == 3


def test_rollout_key_sources():
    assert rollout_key(Headers({"x-spanrl-rollout-id": "a", "baggage": "spanrl.rollout.id=b"})) == "rollout:a"
    assert rollout_key(Headers({"baggage": "spanrl.rollout.id=r%201"})) == "rollout:r 1"
    assert rollout_key(Headers({"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01"})) is None
    assert rollout_key(Headers({"traceparent": "garbage"})) is None
    assert rollout_key(Headers({})) is None


def test_sixteen_agents_through_a_pause_and_resume_all_succeed(start):
    gateway = start(pause_wait_s=1.0, retry_after_s=0.2)
    replies, drained = [], []

    async def agent(aclient, index):
        for turn in range(3):
            raw = await aclient.chat.completions.with_raw_response.create(
                model=SERVED, messages=[{"role": "user", "content": f"What is {index} + {turn}?"}], max_tokens=6,
                extra_headers={"x-spanrl-rollout-id": f"rollout-{index}"})
            replies.append((int(raw.headers["x-spanrl-policy-version"]), json.loads(raw.text)))

    async def weight_sync():
        while len(replies) < 8:
            await asyncio.sleep(0.01)
        drained.append(await asyncio.to_thread(gateway.pause, 30.0))
        assert gateway.stats().in_flight == 0
        await asyncio.sleep(1.5)  # longer than pause_wait_s: some agents get 503 and retry
        gateway.set_policy_version(1)
        await asyncio.to_thread(gateway.resume)

    async def run():
        async with openai.AsyncOpenAI(base_url=gateway.url, api_key="unused") as aclient:  # default retries
            await asyncio.gather(weight_sync(), *(agent(aclient, i) for i in range(16)))

    asyncio.run(run())
    assert drained == [True]
    assert len(replies) == 48
    assert all(version == body["policy_version"] for version, body in replies)
    assert {version for version, _ in replies} == {0, 1}
    assert all(body["choices"][0]["token_ids"] for _, body in replies)
    stats = gateway.stats()
    assert stats.rejected_while_paused >= 1  # the 503 + Retry-After path was taken, and retried
    assert not stats.paused and stats.in_flight == 0


def test_a_paused_request_gets_503_with_retry_after(start):
    gateway = start(pause_wait_s=0.3, retry_after_s=2.0)
    assert gateway.pause(5.0)
    began = time.monotonic()
    with pytest.raises(openai.APIStatusError) as caught:
        client(gateway).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2)
    assert 0.3 <= time.monotonic() - began < 5.0
    assert caught.value.status_code == 503
    assert caught.value.response.headers["retry-after"] == "2"
    assert caught.value.body["code"] == "gateway_paused"
    assert httpx.get(gateway.url.removesuffix("/v1") + "/health").json()["paused"] is True
    gateway.resume()
    assert client(gateway).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2).choices


def test_a_killed_upstream_fails_clearly_and_the_other_keeps_serving(start, upstreams):
    gateway = start(health_check_interval_s=60.0)
    chat = client(gateway).chat.completions
    before = gateway.stats()
    chat.create(model=SERVED, messages=MESSAGES, max_tokens=2, extra_headers={"x-spanrl-rollout-id": "doomed"})
    doomed_url = served_by(gateway, before)
    victim = next(s for s in upstreams if s.url == doomed_url)
    victim.stop()

    began = time.monotonic()
    with pytest.raises(openai.APIStatusError) as caught:
        chat.create(model=SERVED, messages=MESSAGES, max_tokens=2, extra_headers={"x-spanrl-rollout-id": "doomed"})
    assert time.monotonic() - began < 10.0
    assert caught.value.status_code == 502 and doomed_url in caught.value.message
    down = {u.url: u for u in gateway.stats().upstreams}
    assert not down[doomed_url].up and down[doomed_url].down_reason
    for rollout in ("doomed", "fresh-1", "fresh-2"):
        before = gateway.stats()
        chat.create(model=SERVED, messages=MESSAGES, max_tokens=2, extra_headers={"x-spanrl-rollout-id": rollout})
        assert served_by(gateway, before) != doomed_url


def test_a_silent_upstream_times_out_and_none_up_is_a_503(start):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts connections, never answers
    try:
        url = f"127.0.0.1:{silent.getsockname()[1]}"
        gateway = start(urls=[url], request_timeout_s=0.5)
        began = time.monotonic()
        with pytest.raises(openai.APIStatusError) as caught:
            client(gateway).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2)
        assert time.monotonic() - began < 5.0
        assert caught.value.status_code == 503 and url in caught.value.message
        assert caught.value.response.headers["retry-after"]
        assert httpx.get(gateway.url.removesuffix("/v1") + "/health").status_code == 503
    finally:
        silent.close()


def test_temperature_override_samples_at_the_trainers_temperature(start, upstreams, monkeypatch, caplog):
    monkeypatch.setattr(relay_rewrite, "_TEMPERATURE_OVERRIDE_WARNING", relay_rewrite._OnceFlag())
    gateway = start(temperature=0.7, urls=[upstreams[0].url])
    direct = openai.OpenAI(base_url=upstreams[0].base_url, api_key="unused", max_retries=0)
    model = upstreams[0].engine.model_name

    def ids(reply):
        return reply.model_dump()["choices"][0]["token_ids"]

    expected = ids(direct.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, seed=123,
                                                  temperature=0.7, extra_body={"return_token_ids": True}))
    with caplog.at_level(logging.WARNING, logger=relay_rewrite.__name__):
        for asked in (1.5, 0.2):
            via_gateway = client(gateway).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=12,
                                                                  seed=123, temperature=asked)
            assert ids(via_gateway) == expected
    assert len([r for r in caplog.records if "temperature" in r.getMessage()]) == 1


def test_models_health_and_openai_style_errors(start):
    gateway = start()
    gateway.set_policy_version(2)
    raw = client(gateway).models.with_raw_response.list()
    assert [m.id for m in raw.parse().data] == [SERVED] and raw.headers["x-spanrl-policy-version"] == "2"
    root = gateway.url.removesuffix("/v1")
    assert httpx.get(f"{root}/health").json() == {"status": "ok", "upstreams_up": 2, "paused": False}
    missing = httpx.post(f"{root}/v1/embeddings", json={"model": SERVED, "input": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    # any name by default, echoed back (agents hard-code theirs); listed names only when told
    assert client(gateway).chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2).model == "gpt-4o"
    events = list(client(gateway).chat.completions.create(model="triage", messages=MESSAGES, max_tokens=2,
                                                          stream=True))
    assert {event.model for event in events} == {"triage"}
    strict = start(model_names=("critic",))
    assert [m.id for m in client(strict).models.list().data] == [SERVED, "critic"]
    assert client(strict).chat.completions.create(model="critic", messages=MESSAGES, max_tokens=2).model == "critic"
    with pytest.raises(openai.NotFoundError) as caught:
        client(strict).chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert SERVED in caught.value.message
    before = gateway.stats()  # /v1/responses goes upstream whether or not the upstream has it
    reply = httpx.post(f"{root}/v1/responses", json={"model": SERVED, "input": "hi", "max_output_tokens": 2})
    served_by(gateway, before)
    assert reply.status_code == 404 or reply.json()["policy_version"] == 2
    bad = httpx.post(f"{root}/v1/chat/completions", content=b"{not json")
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_stop_releases_the_port_and_threads(start):
    gateway = start()
    port = gateway.port
    gateway.stop()
    assert not any(t.name == "spanrl-gateway" and t.is_alive() for t in threading.enumerate())
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # free again


def test_upstreams_join_by_set_upstreams_and_come_back_when_healthy(start, upstreams, tiny_model_dir):
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    late_port = free_port()  # a port nothing listens on yet
    late_url = f"http://127.0.0.1:{late_port}"
    gateway = start(urls=[upstreams[0].url, late_url], health_check_interval_s=0.2)
    chat = client(gateway).chat.completions
    for rollout in ("a", "b"):  # the late one is tried, found down, and left out
        before = gateway.stats()
        chat.create(model=SERVED, messages=MESSAGES, max_tokens=2, extra_headers={"x-spanrl-rollout-id": rollout})
        assert served_by(gateway, before) == upstreams[0].url
    assert not {u.url: u for u in gateway.stats().upstreams}[late_url].up

    late = serve_in_thread(PolicyEngine.from_pretrained(tiny_model_dir, device=TEST_DEVICE, dtype="float32"),
                           port=late_port)
    try:
        deadline = time.monotonic() + 10.0
        while not {u.url: u for u in gateway.stats().upstreams}[late_url].up:
            assert time.monotonic() < deadline, "the health check did not bring the upstream back"
            time.sleep(0.1)
        before = gateway.stats()
        chat.create(model=SERVED, messages=MESSAGES, max_tokens=2, extra_headers={"x-spanrl-rollout-id": "c"})
        assert served_by(gateway, before) == late_url  # the least loaded for a new rollout
    finally:
        late.stop()

    gateway.set_upstreams([upstreams[0].url, upstreams[1].url + "/v1"])
    assert [u.url for u in gateway.stats().upstreams] == [upstreams[0].url, upstreams[1].url]
    before = gateway.stats()
    chat.create(model=SERVED, messages=MESSAGES, max_tokens=2, extra_headers={"x-spanrl-rollout-id": "d"})
    assert served_by(gateway, before) == upstreams[1].url


def send_json(handler, body: dict) -> None:
    """A stdlib ``BaseHTTPRequestHandler``'s 200 answer with ``body`` as JSON."""
    data = json.dumps(body).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class SlowStreamingUpstream:
    """An OpenAI-compatible upstream whose chat stream sends one chunk every 50 ms for 20 s, on
    a free loopback port: long enough that an agent leaving mid-stream is certainly early.
    ``disconnected`` is set when the gateway closed the stream (its write failed)."""

    def __init__(self) -> None:
        import http.server
        import threading

        upstream = self
        self.disconnected = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test output clean
                pass

            def do_GET(self):
                send_json(self, {"object": "list", "data": [{"id": "slow", "object": "model"}]})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    for i in range(400):
                        chunk = {"id": "c", "object": "chat.completion.chunk", "model": "slow",
                                 "choices": [{"index": 0, "delta": {"content": f"{i} "}, "finish_reason": None}]}
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                        time.sleep(0.05)
                except (BrokenPipeError, ConnectionResetError):
                    upstream.disconnected.set()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_an_agent_leaving_mid_stream_frees_its_place(start):
    upstream = SlowStreamingUpstream()
    try:
        gateway = start(urls=[upstream.url])
        body = {"model": SERVED, "messages": MESSAGES, "stream": True}
        with httpx.stream("POST", f"{gateway.url}/chat/completions", json=body) as reply:
            # Keep the line iterator: a discarded one, once garbage-collected, closes the connection
            # (httpcore closes a stream whose iterator is closed early), and the agent has left early.
            lines = reply.iter_lines()
            first = next(lines)
            assert first.startswith("data: ")
            assert gateway.stats().in_flight == 1  # the stream holds its place while it lasts
        deadline = time.monotonic() + 2.0  # the stream had 20 s to go
        while gateway.stats().in_flight:  # the gateway notices the agent went away and gives its place back
            assert time.monotonic() < deadline, gateway.stats()
            time.sleep(0.02)
        assert upstream.disconnected.wait(5.0)  # and stops reading the upstream's stream
        assert gateway.pause(5.0)  # nothing left to wait for
        gateway.resume()
    finally:
        upstream.stop()


def test_a_verl_runs_policy_token_is_enforced_by_its_gateway(upstreams, tiny_model_dir):
    """``backend: verl`` with ``policy_token`` set: the gateway the backend starts (its config built
    from the train settings, as ``start_backend`` builds it) refuses agents without the token."""
    from spanrl.trainer_bridge.train_settings import TrainSettings
    from spanrl.trainer_bridge.verl_backend.backend import gateway_config

    settings = TrainSettings(tasks="tasks.jsonl", model=tiny_model_dir, backend="verl", policy_token="s3cret",
                             policy_port=0, policy_model_name=SERVED)
    config = gateway_config(settings.backend_run())
    assert config.api_token == "s3cret" and config.served_model_name == SERVED
    gateway = start_gateway(config, [s.url for s in upstreams])
    try:
        root = gateway.url.removesuffix("/v1")
        for key in ("unused", "s3cret-not"):
            agent = openai.OpenAI(base_url=gateway.url, api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                agent.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2)
            with pytest.raises(openai.AuthenticationError):
                agent.models.list()
        unkeyed = httpx.post(f"{root}/v1/chat/completions", json={"model": SERVED, "messages": MESSAGES})
        assert unkeyed.status_code == 401
        agent = openai.OpenAI(base_url=gateway.url, api_key="s3cret", max_retries=0)
        reply = agent.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
        assert reply.model == "gpt-4o" and reply.choices[0].message.content is not None
        assert [m.id for m in agent.models.list().data] == [SERVED]
    finally:
        gateway.stop()


def test_the_relays_settings_print_without_their_secrets():
    # settings end up in logs and tracebacks: the agents' token and the replicas' key stay out
    config = GatewayConfig(served_model_name="policy", api_token="agents-secret-1",
                           upstream_api_key="replicas-secret-2")
    assert "secret" not in repr(config) and "secret" not in str(config), repr(config)
    assert config.api_token == "agents-secret-1"
    relay = RelayConfig(name="proxy", api_token="agents-secret-1", upstream_api_key="upstream-secret-2",
                        upstream_headers=(("x-api-key", "upstream-secret-3"),))
    assert "secret" not in repr(relay), repr(relay)


def test_the_gateway_reuses_an_upstreams_idle_connection_only_while_the_upstream_keeps_it():
    """vLLM's server (uvicorn) closes a connection idle for 5 s; a request the gateway sent on one
    as it closed would fail. The gateway reuses a connection idle for a moment, and opens a new
    one once it has been idle for longer than ``IDLE_CONNECTION_REUSE_S`` (3 s)."""
    import http.server

    from spanrl.server_connections import IDLE_CONNECTION_REUSE_S

    asked_on = []  # the gateway's end of the connection each request came on

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn

        def log_message(self, *args):
            pass

        def do_GET(self):  # the gateway's health probe
            send_json(self, {"object": "list", "data": [{"id": "counted", "object": "model"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            asked_on.append(self.client_address)
            send_json(self, {"id": "c", "object": "chat.completion", "created": 0, "model": "counted",
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": "82"}}]})

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    gateway = None
    try:  # only this upstream: the fixture's two policy servers would load models for nothing
        gateway = start_gateway(GatewayConfig(served_model_name=SERVED), [f"http://127.0.0.1:{upstream.server_address[1]}"])
        agent = client(gateway)

        def ask() -> None:
            assert agent.chat.completions.create(model=SERVED, messages=MESSAGES).choices[0].message.content == "82"

        ask()
        ask()
        assert asked_on[0] == asked_on[1]  # a connection idle for a moment is reused
        time.sleep(IDLE_CONNECTION_REUSE_S + 0.5)
        ask()
        assert asked_on[2] != asked_on[1]  # one idle for longer is not
    finally:
        if gateway is not None:
            gateway.stop()
        upstream.shutdown()
        upstream.server_close()
