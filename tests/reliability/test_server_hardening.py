"""The receiver and the bridge shrug off bad input and bad clients, over real sockets: JSON nested
past Python's recursion limit is a 400, an ``Authorization`` header that is not ASCII a 401, a
client that goes silent loses its connection (others are still served), a failure of ours never
puts its text in a response; the bridge serves HTTPS to the runner's own client; pending
completions of unknown rollouts are bounded; the store is its owner's only; a server bound
beyond loopback without a token or TLS says so once; the start-up print masks credentials."""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import stat
import subprocess
import sys

import httpx
import pytest

from spanrl.otlp_receiver.store import SpanStore
from spanrl.server_security import bearer_token_matches, warn_if_exposed

DEEP_JSON = b"[" * 100_000 + b"]" * 100_000
NOT_ASCII = "Bearer caf\u00e9".encode("latin-1")  # what a client may send; http servers decode it as latin-1


@pytest.fixture
def bridge():
    """A started bridge API with a token and a short read timeout (and an open round)."""
    from spanrl.trainer_bridge.bridge_api import BridgeAPI, PolicyInfo
    from spanrl.trainer_bridge.task_dispatch import TaskDispatcher

    started = []

    def start(**options):
        dispatcher = TaskDispatcher(rollout_timeout_s=30.0)
        dispatcher.open_round(0, [("t0", {"q": 0})], group_size=1)
        api = BridgeAPI(dispatcher, PolicyInfo("http://127.0.0.1:9/v1", "policy"), options.pop("version", lambda: 1),
                        port=0, **{"token": "runner-token", "read_timeout_s": 0.5, **options}).start()
        started.append((api, dispatcher))
        return api

    yield start
    for api, dispatcher in started:
        dispatcher.close()
        api.stop()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def left_hanging(port: int, partial: bytes) -> bytes:
    """Send ``partial`` (an unfinished request, or nothing) and wait for the server to close
    the connection; returns what it sent before closing."""
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.settimeout(60)  # a bound for a broken server, not a timing
        connection.sendall(partial)
        received = b""
        while chunk := connection.recv(4096):
            received += chunk
        return received


def test_the_bridge_answers_bad_input_with_4xx(bridge):
    api = bridge()
    url, auth = api.url, {"Authorization": "Bearer runner-token"}
    deep = httpx.post(f"{url}/v1/claim", content=DEEP_JSON, headers=auth)
    assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]
    odd = httpx.post(f"{url}/v1/claim", json={"claim_id": "c"}, headers={"Authorization": NOT_ASCII})
    assert odd.status_code == 401
    assert httpx.post(f"{url}/v1/claim", json={"claim_id": "c"}, headers=auth).status_code == 200


def test_a_failure_of_the_bridge_keeps_its_text_out_of_the_answer(bridge, caplog):
    def broken_version() -> int:
        raise RuntimeError("secret internals")

    api = bridge(version=broken_version)
    with caplog.at_level(logging.ERROR, logger="spanrl.trainer_bridge.bridge_api"):
        reply = httpx.get(f"{api.url}/v1/info", headers={"Authorization": "Bearer runner-token"})
    assert reply.status_code == 500
    assert "secret internals" not in reply.text and "log" in reply.json()["error"]
    assert "secret internals" in caplog.text  # said where the operator looks


def test_a_silent_client_loses_its_connection_to_the_bridge(bridge):
    api = bridge()
    port = port_of(api.url)
    # mid-body: the headers promise 100 bytes, one comes
    assert left_hanging(port, b"POST /v1/claim HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                              b"Authorization: Bearer runner-token\r\n\r\n{") == b""
    assert left_hanging(port, b"") == b""  # connected, never asked anything
    reply = httpx.post(f"{api.url}/v1/claim", json={"claim_id": "c"}, headers={"Authorization": "Bearer runner-token"})
    assert reply.status_code == 200  # the others are served


def test_the_bridge_serves_https_to_the_runners_client(bridge, self_signed, monkeypatch):
    from spanrl.runner.bridge_client import BridgeClient

    cert, key = self_signed
    api = bridge(tls_cert=cert, tls_key=key)
    assert api.url.startswith("https://")
    monkeypatch.setenv("SSL_CERT_FILE", cert)  # how a runner trusts a self-signed certificate
    info = BridgeClient(api.url.replace("127.0.0.1", "localhost"), token="runner-token").info()
    assert info.model == "policy"
    # plain HTTP on the TLS port is refused, and the server goes on
    with pytest.raises(httpx.HTTPError):
        httpx.get(api.url.replace("https://", "http://") + "/v1/info")
    trusted = ssl.create_default_context(cafile=cert)
    assert httpx.get(f"{api.url}/v1/info", verify=trusted, headers={"Authorization": "Bearer runner-token"}).is_success


def test_the_receiver_answers_deep_json_and_odd_tokens_with_4xx(start_receiver):
    receiver = start_receiver(token="agent-token", read_timeout_s=0.5)
    url = f"http://127.0.0.1:{receiver.http_port}/v1/traces"
    json_type = {"Content-Type": "application/json"}
    deep = httpx.post(url, content=DEEP_JSON, headers={**json_type, "Authorization": "Bearer agent-token"})
    assert deep.status_code == 400 and "nested too deeply" in deep.json()["message"]
    odd = httpx.post(url, content=b"{}", headers={**json_type, "Authorization": NOT_ASCII})
    assert odd.status_code == 401
    # a silent client is dropped, mid-body or between requests; the others are served
    port = receiver.http_port
    assert left_hanging(port, b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 100\r\nAuthorization: Bearer agent-token\r\n\r\n{") == b""
    assert left_hanging(port, b"") == b""
    assert httpx.post(url, content=b"{}", headers={**json_type, "Authorization": "Bearer agent-token"}).is_success


def test_pending_completions_of_unknown_rollouts_are_bounded(tmp_path, monkeypatch):
    from spanrl.otlp_receiver import store as store_module

    monkeypatch.setattr(store_module, "MAX_PENDING_COMPLETIONS", 5)  # the bound, made small to reach it
    with SpanStore(tmp_path / "spanrl.db") as store:
        for n in range(8):
            assert store.complete_rollout(f"nobody-{n}", now=1000.0 + n) == store_module.COMPLETION_PENDING
        kept = [row[0] for row in store._db.execute("SELECT rollout_id FROM pending_completions ORDER BY requested_at")]
    assert kept == [f"nobody-{n}" for n in range(3, 8)]  # the newest five


def test_the_store_and_its_lock_are_their_owners_only(start_receiver, tmp_path):
    receiver = start_receiver(db=str(tmp_path / "private.db"))
    reply = httpx.post(f"http://127.0.0.1:{receiver.http_port}/spanrl/v1/rollouts/r1/complete")
    assert reply.status_code == 202  # a write: the WAL and shared-memory files exist now
    from spanrl.otlp_receiver.store_lock import lock_path

    for path in [tmp_path / f"private.db{suffix}" for suffix in ("", "-wal", "-shm")] + [
            lock_path(tmp_path / "private.db")]:
        assert path.exists(), path
        assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0, (path, oct(os.stat(path).st_mode))


def test_bearer_tokens_compare_as_bytes():
    assert bearer_token_matches("Bearer s3cret", "s3cret")
    assert bearer_token_matches(" Bearer s3cret ", "s3cret")
    assert not bearer_token_matches("Bearer caf\u00e9", "s3cret")  # not a TypeError
    assert not bearer_token_matches("Bearer \u4e2d", "s3cret")
    assert bearer_token_matches("Bearer caf\u00c3\u00a9", "caf\u00e9")  # UTF-8 bytes read as latin-1
    assert not bearer_token_matches(None, "s3cret")


def test_a_server_beyond_loopback_without_a_token_or_tls_warns_once(caplog, bridge, self_signed):
    log = logging.getLogger("test.exposure")
    with caplog.at_level(logging.WARNING):
        assert warn_if_exposed("x", "127.0.0.1", token=False, tls=False, logger=log) is None
        assert warn_if_exposed("x", "localhost", token=False, tls=False, logger=log) is None
        assert "without a token" in warn_if_exposed("x", "0.0.0.0", token=False, tls=False, logger=log)
        assert "plain HTTP" in warn_if_exposed("x", "::", token=True, tls=False, logger=log)
        assert warn_if_exposed("x", "10.1.2.3", token=True, tls=True, logger=log) is None
    caplog.clear()
    from spanrl.trainer_bridge.bridge_api import BridgeAPI, PolicyInfo
    from spanrl.trainer_bridge.task_dispatch import TaskDispatcher

    with caplog.at_level(logging.WARNING, logger="spanrl.trainer_bridge.bridge_api"):
        exposed = BridgeAPI(TaskDispatcher(rollout_timeout_s=1.0), PolicyInfo("http://x/v1", "p"), lambda: 0,
                            host="0.0.0.0", port=0)  # never started: the warning comes as it binds
        exposed.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "task API" in warnings[0] and "without a token" in warnings[0]


def test_the_start_up_print_masks_credentials_in_urls_and_command_arguments(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "spanrl", "run", "--bridge-url", "http://runner:hunter2@127.0.0.1:8100",
         "--command", json.dumps(["python", "agent.py", "--api-key", "sk-one", "--auth-token=sk-two", "--max-tokens",
                                  "64"]),
         "--otlp-endpoint", "http://127.0.0.1:4317/?token=sk-three", "--print-settings"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    printed = run.stdout
    for secret in ("hunter2", "sk-one", "sk-two", "sk-three"):
        assert secret not in printed
    assert "runner:***@127.0.0.1" in printed and "--max-tokens" in printed and "64" in printed
