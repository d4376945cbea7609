"""The policy server and the verl gateway shrug off bad input and bad clients, over real HTTP in
front of a real (tiny) model: JSON nested past Python's recursion limit is a 400, an
``Authorization`` header that is not ASCII a 401, a full engine queue a 503 with Retry-After,
connections past the cap a 503, a body over the gateway's limit a 413, and no exception text
ever reaches a response; both speak HTTPS from ``tls_cert``/``tls_key``; the gateway sends the
upstreams their own key. The policy server's tests share one server (and one engine)."""

from __future__ import annotations

import logging
import ssl
import threading

import httpx
import pytest
import torch

from spanrl.trainer_bridge.torch_backend.engine.requests import SamplingParams
from spanrl.trainer_bridge.verl_backend.gateway import GatewayConfig, start_gateway

DEEP_JSON = b"[" * 100_000 + b"]" * 100_000
NOT_ASCII = "Bearer caf\u00e9".encode("latin-1")
TOKEN = "agent-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHAT = {"messages": [{"role": "user", "content": "1+1?"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def shared_engine(tiny_model_dir):
    """One engine for the module: one sequence per batch, one request waiting at most."""
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = PolicyEngine.from_pretrained(tiny_model_dir, device="cpu", dtype="float32", max_batch_size=1,
                                          max_queued_requests=1).start()
    yield engine
    engine.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def policy_server(shared_engine):
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    handle = serve_in_thread(shared_engine, "127.0.0.1", 0, api_token=TOKEN)
    yield handle
    handle.stop()


def chat(url: str, headers=None, **more) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", **CHAT, **more},
                      headers=AUTH if headers is None else headers, timeout=120)


def test_deep_json_is_400_and_an_odd_token_401(policy_server, shared_engine):
    url = policy_server.url
    deep = httpx.post(f"{url}/v1/chat/completions", content=DEEP_JSON, headers=AUTH)
    assert deep.status_code == 400 and deep.json()["error"]["code"] == "nested_too_deeply"
    assert chat(url, headers={"Authorization": NOT_ASCII}).status_code == 401
    assert chat(url, model=shared_engine.model_name).status_code == 200


def test_a_full_engine_queue_answers_503_with_retry_after(policy_server, shared_engine):
    engine = shared_engine
    started = threading.Event()
    # greedy: the tiny model's continuation of "CALC" runs 400+ tokens without eos, whatever ran before
    # (sampled, it could end within a few tokens and free the slot)
    endless = engine.submit(engine.encode_text("CALC"),
                            SamplingParams(max_tokens=engine.context_length - 8, temperature=0.0),
                            on_start=lambda version: started.set())
    try:
        assert started.wait(120)  # decoding: the one batch slot is taken
        waiting = engine.submit(engine.encode_text("CALC"), SamplingParams(max_tokens=1))  # the one queue place
        refused = chat(policy_server.url, model=engine.model_name)
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["retry-after"]) >= 1 and "retry" in refused.json()["error"]["message"]
    finally:
        endless.cancel()
    assert waiting.wait(120).choices  # the waiting one is served once the slot frees
    assert chat(policy_server.url, model=engine.model_name).status_code == 200


def test_connections_past_the_cap_get_503(shared_engine):
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    # uvicorn counts the connection asking, too: 2 lets one connection in and refuses a second
    handle = serve_in_thread(shared_engine, "127.0.0.1", 0, max_concurrency=2)
    try:
        with httpx.Client(timeout=120) as first, httpx.Client(timeout=120) as second:
            body = {"model": shared_engine.model_name, **CHAT, "max_tokens": 64, "stream": True}
            with first.stream("POST", f"{handle.url}/v1/chat/completions", json=body) as held:
                assert held.status_code == 200  # its connection and task are open while we read nothing
                crowded = second.get(f"{handle.url}/v1/models")
                assert crowded.status_code == 503
            assert second.get(f"{handle.url}/v1/models").status_code == 200
    finally:
        handle.stop()


def test_an_unexpected_failure_keeps_its_text_out_of_the_answer(caplog):
    from spanrl.trainer_bridge.torch_backend.engine.wire import ErrorInfo
    from spanrl.trainer_bridge.torch_backend.server.errors import error_response

    with caplog.at_level(logging.ERROR):
        response = error_response(RuntimeError("secret internals at /home/x"))
    assert response.status_code == 500 and b"secret internals" not in response.body
    assert "secret internals" in caplog.text  # logged with its traceback
    across = ErrorInfo.of(KeyError("secret internals")).to_exception()  # a failure in the engine's process
    assert across.status == 500 and "secret internals" not in across.message


def test_the_ignored_field_log_is_bounded(caplog):
    from spanrl.trainer_bridge.torch_backend.server.serving import IgnoredFieldLog

    log = IgnoredFieldLog(max_names=3)
    with caplog.at_level(logging.WARNING, logger="spanrl.trainer_bridge.torch_backend.server.serving"):
        log.note("/v1/chat/completions", [f"made_up_{n}" for n in range(5)])
        log.note("/v1/chat/completions", [f"other_{n}" for n in range(50)])
    lines = [r.getMessage() for r in caplog.records]
    assert sum("is not implemented" in line for line in lines) == 3
    assert sum("and more request fields" in line for line in lines) == 1
    assert len(lines) == 4


def test_the_policy_server_speaks_https(shared_engine, self_signed):
    import openai

    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    cert, key = self_signed
    handle = serve_in_thread(shared_engine, "127.0.0.1", 0, api_token=TOKEN, tls_cert=cert, tls_key=key)
    try:
        assert handle.url.startswith("https://")
        client = openai.OpenAI(base_url=handle.base_url, api_key=TOKEN, max_retries=0,
                               http_client=httpx.Client(verify=ssl.create_default_context(cafile=cert)))
        assert client.chat.completions.create(model=shared_engine.model_name, **CHAT).choices
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port
            httpx.get(handle.url.replace("https://", "http://") + "/health")
    finally:
        handle.stop()


# --- the verl gateway, in front of spanrl's server (vLLM's dialect) as its upstream --------------

@pytest.fixture(scope="module")
def upstream(shared_engine):
    """The upstream requires its own key, as verl's vLLM replicas do (VLLM_API_KEY)."""
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    handle = serve_in_thread(shared_engine, "127.0.0.1", 0, api_token="replica-key")
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def gateway(upstream):
    handle = start_gateway(GatewayConfig(served_model_name="policy", api_token=TOKEN, upstream_api_key="replica-key",
                                         max_body_bytes=4096), [upstream.url])
    yield handle
    handle.stop()


def test_the_gateway_sends_the_upstreams_their_key_and_takes_only_the_agents_token(gateway):
    base = gateway.url.removesuffix("/v1")
    assert chat(base, model="policy").status_code == 200  # relayed with the replica's key
    assert chat(base, model="policy", headers={"Authorization": "Bearer replica-key"}).status_code == 401
    assert chat(base, model="policy", headers={"Authorization": NOT_ASCII}).status_code == 401
    assert httpx.get(f"{base}/v1/models", headers=AUTH).json()["data"][0]["id"] == "policy"


def test_the_gateway_refuses_large_and_deep_bodies(gateway):
    base = gateway.url.removesuffix("/v1")
    url = f"{base}/v1/chat/completions"
    big = {"model": "policy", "messages": [{"role": "user", "content": "x" * 8192}]}
    declared = httpx.post(url, json=big, headers=AUTH)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the size shows while it streams in
        yield b'{"model": "policy", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 1024

    streamed = httpx.post(url, content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert streamed.status_code == 413
    deep = httpx.post(url, content=b"[" * 2000 + b"]" * 2000, headers=AUTH)  # under the size limit, too deep
    assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"]
    assert chat(base, model="policy").status_code == 200


def test_the_gateway_speaks_https(upstream, self_signed):
    cert, key = self_signed
    with start_gateway(GatewayConfig(served_model_name="policy", upstream_api_key="replica-key", tls_cert=cert,
                                     tls_key=key), [upstream.url]) as handle:
        assert handle.url.startswith("https://")
        reply = httpx.post(f"{handle.url}/chat/completions", json={"model": "policy", **CHAT},
                           verify=ssl.create_default_context(cafile=cert), timeout=120)
        assert reply.status_code == 200
