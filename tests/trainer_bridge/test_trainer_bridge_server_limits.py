"""The policy server refuses request bodies over its limit (413, OpenAI-style error body), declared
up front or streamed in chunks, and keeps serving. A real server on a free port, real HTTP."""

from __future__ import annotations

import httpx
import pytest

from spanrl.trainer_bridge.torch_backend.server import app as server_app


@pytest.mark.parametrize("mode", ["api_process", "in_thread"])
def test_a_body_over_the_limit_is_refused_and_the_server_goes_on(engine, mode):
    from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    limit = server_app.MAX_BODY_BYTES
    serve = serve_in_process if mode == "api_process" else serve_in_thread
    handle = serve(engine, "127.0.0.1", 0)
    try:
        url = f"{handle.url}/v1/chat/completions"
        big = b'{"messages": [{"role": "user", "content": "' + b"x" * limit + b'"}]}'
        declared = httpx.post(url, content=big, headers={"Content-Type": "application/json"}, timeout=60)
        assert declared.status_code == 413
        assert declared.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the size shows only while it streams in
            for start in range(0, len(big), 1 << 20):
                yield big[start:start + (1 << 20)]

        streamed = httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"}, timeout=60)
        assert streamed.status_code == 413 and "exceeds the limit" in streamed.json()["error"]["message"]
        ok = httpx.post(url, json={"model": engine.model_name, "max_tokens": 2,
                                   "messages": [{"role": "user", "content": "1+1"}]}, timeout=60)
        assert ok.status_code == 200
    finally:
        handle.stop()


def test_a_connection_idle_longer_than_the_agents_clients_keep_theirs_still_serves(engine):
    """httpx (the OpenAI and Anthropic SDKs) reuses a connection idle for up to 5 s, which was
    uvicorn's limit too: a call sent as the server closed the connection failed (an agent with
    ``max_retries=0`` lost a rollout in CI). The policy server, both ways it runs, and ``spanrl
    proxy`` in front of it keep an idle connection past the clients' limit: a request on one idle
    for 6 s is answered on that same connection."""
    import http.client
    import time
    from urllib.parse import urlsplit

    from spanrl.trainer_bridge.relay.proxy import ProxySettings, start_proxy
    from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process
    from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

    handles = [serve_in_process(engine, "127.0.0.1", 0), serve_in_thread(engine, "127.0.0.1", 0)]
    handles.append(start_proxy(ProxySettings(upstream=handles[0].url + "/v1", port=0, spans_endpoint="off")))
    try:
        connections = []
        for handle in handles:
            url = urlsplit(handle.url)
            connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
            connection.request("GET", "/v1/models")
            first = connection.getresponse()
            assert first.status == 200 and b"data" in first.read()
            connections.append((connection, connection.sock))
        time.sleep(6.0)  # past httpx's keep-alive expiry and uvicorn's default timeout_keep_alive
        for connection, sock in connections:
            connection.request("GET", "/v1/models")  # http.client reconnects only when its socket is gone
            again = connection.getresponse()
            assert again.status == 200 and b"data" in again.read()
            assert connection.sock is sock
            connection.close()
    finally:
        for handle in reversed(handles):
            handle.stop()
