"""Fixtures for the receiver tests: real servers on free ports, real OTel SDK tracers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from openinference.semconv.trace import OpenInferenceSpanKindValues
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.otlp_decode import decode_request
from spanrl.otlp_receiver.server import ReceiverServer
from spanrl.otlp_receiver.settings import ReceiverSettings
from spanrl.otlp_receiver.span_tree import records_from_bodies

REPO = Path(__file__).resolve().parents[2]


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def rollout_attrs(rollout_id: str, task_id: str = "task-1", attempt: int = 0) -> dict:
    return {semconv.ROLLOUT_ID: rollout_id, semconv.TASK_ID: task_id, semconv.ATTEMPT: attempt}


def emit_agent_rollout(tracer, rollout_id: str, calls: int = 2, reward: float | None = 1.0,
                       base_token: int = 10, tool_error: bool = False, task_id: str = "task-1"):
    """A small agent rollout with the real SDK: root, LLM calls with token ids, a tool, a reward."""
    identity = rollout_attrs(rollout_id, task_id)
    with tracer.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=identity) as root:
        for i in range(calls):
            with tracer.start_as_current_span(
                f"llm-{i}",
                attributes={
                    **identity,
                    semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM,
                    semconv.LLM_PROMPT_TOKEN_IDS: [base_token + i, base_token + i + 1, 0],
                    semconv.llm_response_token_ids(0): [base_token + 100 + i, 2],
                    semconv.llm_response_logprobs(0): [-0.5, -0.25],
                    semconv.LLM_POLICY_VERSION: 3,
                    semconv.GENAI_RESPONSE_ID: f"resp-{rollout_id}-{i}",
                },
            ):
                pass
            with tracer.start_as_current_span(
                f"tool-{i}",
                attributes={**identity, semconv.OPENINFERENCE_SPAN_KIND: OpenInferenceSpanKindValues.TOOL.value},
            ) as tool:
                if tool_error and i == 0:
                    tool.set_status(Status(StatusCode.ERROR, "tool failed"))
        root.set_attribute(semconv.variable("answer"), "42")
        if reward is not None:
            root.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: reward})


@pytest.fixture
def memory_tracer():
    """A private TracerProvider that keeps finished spans in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "receiver-tests"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield SimpleNamespace(tracer=provider.get_tracer("tests"), exporter=exporter, provider=provider)
    provider.shutdown()


@pytest.fixture
def to_records():
    """Finished SDK spans -> OTLP protobuf (the exporter's own encoder) -> assembly records."""

    def convert(spans):
        request = encode_spans(spans)
        decoded = decode_request(request)
        assert decoded.rejected == 0, decoded.reasons
        return records_from_bodies(row.body for row in decoded.rows)

    return convert


@pytest.fixture
def start_receiver(tmp_path):
    """Start in-process receivers on free ports; all are stopped at teardown."""
    started = []

    def start(**overrides) -> ReceiverServer:
        settings = ReceiverSettings(
            grpc_port=0, http_port=0, db=str(tmp_path / "spanrl.db"), grace_s=0.2,
            poll_s=0.05, idle_timeout_s=0,
        )
        server = ReceiverServer(replace(settings, **overrides)).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def tracer_to():
    """A real SDK TracerProvider exporting through the real OTLP exporter (grpc or http)."""
    providers = []

    def make(endpoint: str, protocol: str = "grpc", headers=None, resource_attrs=None):
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True, headers=headers, timeout=10)
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint, headers=headers, timeout=10)
        provider = TracerProvider(resource=Resource.create(resource_attrs or {"service.name": "agent"}))
        processor = SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
        providers.append(provider)
        return SimpleNamespace(tracer=provider.get_tracer("agent"), provider=provider, exporter=exporter)

    yield make
    for provider in providers:
        provider.shutdown()


class ReceiverProcess:
    """``spanrl receive`` as a subprocess (the real CLI)."""

    def __init__(self, db: Path, *extra: str, env: dict | None = None) -> None:
        self.db = db
        self.extra = extra
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.grpc_port = 0
        self.http_port = 0
        self.output: list[str] = []

    def start(self, grpc_port: int = 0, http_port: int = 0) -> ReceiverProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spanrl", "receive", "--db", str(self.db), "--grpc-port", str(grpc_port),
             "--http-port", str(http_port), "--grace-s", "0.2", "--poll-s", "0.05", *self.extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError("spanrl receive exited early:\n" + "".join(self.output))
            self.output.append(line)
            match = re.search(r"ready, OTLP/gRPC [\d.]+:(\d+), OTLP/HTTP https?://[\d.]+:(\d+)", line)
            if match:
                self.grpc_port, self.http_port = int(match.group(1)), int(match.group(2))
                break
        else:
            raise AssertionError("spanrl receive did not get ready:\n" + "".join(self.output))
        import threading

        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=20)


@pytest.fixture
def receiver_process(tmp_path):
    made: list[ReceiverProcess] = []

    def make(*extra: str, db: Path | None = None, env: dict | None = None) -> ReceiverProcess:
        process = ReceiverProcess(db or tmp_path / "spanrl.db", *extra, env=env)
        made.append(process)
        return process

    yield make
    for process in made:
        process.kill()


@pytest.fixture
def kit():
    return SimpleNamespace(wait_for=wait_for, emit_agent_rollout=emit_agent_rollout, rollout_attrs=rollout_attrs)
