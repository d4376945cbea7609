"""``GET /spanrl/v1/stats``: the receiver's ingest counters (what the overload figures read),
behind the token when one is set."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult
from reliability_faults import _MemoryAgent


def _stats(port: int, token: str | None) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/spanrl/v1/stats", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


def test_stats_count_what_was_stored_and_need_the_token(start_receiver):
    server = start_receiver(token="s3cret", max_pending_mb=64)
    with pytest.raises(urllib.error.HTTPError) as refused:
        _stats(server.http_port, None)
    assert refused.value.code == 401
    before = _stats(server.http_port, "s3cret")
    assert set(before.pop("feedback").values()) == {0}  # late feedback: tests/otlp_receiver/test_receiver_feedback.py
    assert before == {"accepted_spans": 0, "rejected_spans": 0, "committed_spans": 0, "new_spans": 0,
                      "commits": 0, "overloaded_requests": 0, "pending_bytes": 0}
    agent = _MemoryAgent()
    spans = agent.rollout_spans("stats-1", calls=2)
    exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{server.grpc_port}", insecure=True, timeout=10,
                                headers={"authorization": "Bearer s3cret"})
    assert exporter.export(spans) == SpanExportResult.SUCCESS
    assert exporter.export(spans) == SpanExportResult.SUCCESS  # a retry: acknowledged, nothing new committed
    exporter.shutdown()
    agent.provider.shutdown()
    after = _stats(server.http_port, "s3cret")
    assert after["accepted_spans"] == after["committed_spans"] == 2 * len(spans)
    assert after["new_spans"] == len(spans)
    assert after["commits"] == 2 and after["rejected_spans"] == 0 and after["pending_bytes"] == 0
