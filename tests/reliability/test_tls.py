"""TLS on the receiver's gRPC and HTTP ports: the real OTel exporters (Python and Node.js)
trust a self-signed certificate through OTEL_EXPORTER_OTLP_CERTIFICATE; plaintext is refused."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult

from spanrl.errors import SettingError
from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.settings import ReceiverSettings
from spanrl.otlp_receiver.store import SpanStore
from spanrl.otlp_receiver.tls import TlsSetupError, http_ssl_context


def _exporter(protocol: str, endpoint: str, insecure: bool | None = None, timeout: float = 10):
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=insecure, timeout=timeout)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=endpoint, timeout=timeout)


def _send_rollout(exporter, rollout_id: str) -> list:
    """One small rollout through ``exporter``; returns each export's result."""
    results: list = []

    class Recording(SimpleSpanProcessor):
        def on_end(self, span) -> None:
            results.append(exporter.export([span]))

    provider = TracerProvider(resource=Resource.create({"service.name": "tls-agent"}))
    provider.add_span_processor(Recording(exporter))
    tracer = provider.get_tracer("agent")
    identity = {semconv.ROLLOUT_ID: rollout_id, semconv.TASK_ID: "tls", semconv.ATTEMPT: 0}
    with tracer.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=identity) as root:
        with tracer.start_as_current_span("llm", attributes={
            **identity, semconv.LLM_PROMPT_TOKEN_IDS: [1, 2], semconv.llm_response_token_ids(0): [3]}):
            pass
        root.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 1.0})
    provider.shutdown()
    return results


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_python_exporter_over_tls_with_the_certificate_variable(protocol, start_receiver, self_signed,
                                                                monkeypatch, kit):
    cert, key = self_signed
    server = start_receiver(tls_cert=cert, tls_key=key)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", cert)
    # requests lets these override the exporter's certificate (docs/receiver.md says so)
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    endpoint = (f"https://127.0.0.1:{server.grpc_port}" if protocol == "grpc"
                else f"https://127.0.0.1:{server.http_port}/v1/traces")
    results = _send_rollout(_exporter(protocol, endpoint), f"tls-{protocol}")
    assert results == [SpanExportResult.SUCCESS] * 2
    with SpanStore(server.settings.db) as store:
        (rollout,) = kit.wait_for(lambda: store.completed_rollouts(0)[0], what="the TLS rollout")
    assert rollout.rollout_id == f"tls-{protocol}" and rollout.total_reward == 1.0
    assert [t.response_token_ids for t in rollout.transitions] == [(3,)]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_plaintext_clients_are_refused_on_tls_ports(protocol, start_receiver, self_signed, monkeypatch):
    cert, key = self_signed
    server = start_receiver(tls_cert=cert, tls_key=key)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_CERTIFICATE", raising=False)
    endpoint = (f"http://127.0.0.1:{server.grpc_port}" if protocol == "grpc"
                else f"http://127.0.0.1:{server.http_port}/v1/traces")
    results = _send_rollout(_exporter(protocol, endpoint, insecure=True, timeout=2), f"plain-{protocol}")
    assert results == [SpanExportResult.FAILURE] * 2
    with SpanStore(server.settings.db) as store:
        assert store.span_count() == 0


def test_a_plaintext_request_gets_no_http_answer_and_tls_still_serves(start_receiver, self_signed):
    cert, key = self_signed
    server = start_receiver(tls_cert=cert, tls_key=key)
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as plain:
        plain.sendall(b"GET /spanrl/v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = plain.recv(100)
    assert not answer.startswith(b"HTTP/")  # a TLS alert or nothing: never an answer in the clear
    context = ssl.create_default_context(cafile=cert)
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(b"GET /spanrl/v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert tls.recv(100).startswith(b"HTTP/1.1 200")


def test_a_client_that_never_handshakes_does_not_block_the_others(start_receiver, self_signed):
    cert, key = self_signed
    server = start_receiver(tls_cert=cert, tls_key=key)
    silent = socket.create_connection(("127.0.0.1", server.http_port), timeout=10)
    try:
        context = ssl.create_default_context(cafile=cert)
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=5) as raw:
            with context.wrap_socket(raw, server_hostname="localhost") as tls:
                tls.sendall(b"GET /spanrl/v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                assert tls.recv(100).startswith(b"HTTP/1.1 200")
    finally:
        silent.close()


@pytest.mark.parametrize("protocol", ["grpc", "http-json"])
def test_node_exporter_over_tls(protocol, node, start_receiver, self_signed, kit):
    cert, key = self_signed
    server = start_receiver(tls_cert=cert, tls_key=key)
    endpoint = (f"https://127.0.0.1:{server.grpc_port}" if protocol == "grpc"
                else f"https://127.0.0.1:{server.http_port}/v1/traces")
    # The Node gRPC exporter reads OTEL_EXPORTER_OTLP_CERTIFICATE; its HTTP exporter uses Node's
    # own trust store, which NODE_EXTRA_CA_CERTS extends.
    env = {**os.environ, "OTEL_EXPORTER_OTLP_CERTIFICATE": cert, "NODE_EXTRA_CA_CERTS": cert}
    result = subprocess.run([node, "send_rollout.js", protocol, endpoint, f"node-tls-{protocol}"],
                            cwd=kit.node_dir, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    with SpanStore(server.settings.db) as store:
        (rollout,) = kit.wait_for(lambda: store.completed_rollouts(0)[0], what="the node TLS rollout")
    assert rollout.rollout_id == f"node-tls-{protocol}" and rollout.total_reward == 0.75


def test_tls_settings_need_both_files_and_a_matching_pair(tmp_path, self_signed):
    cert, key = self_signed
    with pytest.raises(SettingError, match="both tls_cert and tls_key"):
        ReceiverSettings(tls_cert=cert)
    with pytest.raises(TlsSetupError, match="cannot read the TLS key"):
        http_ssl_context(cert, str(tmp_path / "missing.pem"))
    other = tmp_path / "other.pem"
    other.write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    with pytest.raises(TlsSetupError, match="do not load as a pair"):
        http_ssl_context(cert, str(other))


def test_spanrl_receive_with_a_bad_tls_setting_says_why_and_exits_2(tmp_path, self_signed):
    import sys

    cert, _ = self_signed
    base = [sys.executable, "-m", "spanrl", "receive", "--db", str(tmp_path / "x.db"), "--grpc-port", "0",
            "--http-port", "0"]
    only_cert = subprocess.run(base + ["--tls-cert", cert], capture_output=True, text=True, timeout=60)
    assert only_cert.returncode == 2 and "both tls_cert and tls_key" in only_cert.stderr
    missing_key = subprocess.run(base + ["--tls-cert", cert, "--tls-key", str(tmp_path / "none.pem")],
                                 capture_output=True, text=True, timeout=60)
    assert missing_key.returncode == 2 and "cannot read the TLS key" in missing_key.stderr, missing_key.stderr
