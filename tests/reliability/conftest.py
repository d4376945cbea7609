"""Fixtures for the reliability suite: in-process receivers on free ports and the Node.js SDK
directory of ``tests/node`` (the self-signed TLS certificate is ``tests/conftest.py``'s)."""

from __future__ import annotations

import shutil
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from spanrl.child_processes import free_port
from spanrl.otlp_receiver.server import ReceiverServer
from spanrl.otlp_receiver.settings import ReceiverSettings

sys.path.insert(0, str(Path(__file__).parent))  # the suite's plain modules, shared with bench/reliability.py
from reliability_harness import ReceiverProcess, wait_for  # noqa: E402

NODE_DIR = Path(__file__).resolve().parents[1] / "node"


@pytest.fixture
def start_receiver(tmp_path):
    """Start in-process receivers on free ports (stopped at teardown)."""
    started: list[ReceiverServer] = []

    def start(**overrides) -> ReceiverServer:
        settings = ReceiverSettings(grpc_port=0, http_port=0, db=str(tmp_path / "spanrl.db"), grace_s=0.2,
                                    poll_s=0.05, idle_timeout_s=0)
        server = ReceiverServer(replace(settings, **overrides)).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def node():
    executable = shutil.which("node")
    assert executable, "node is not installed: the Node.js client tests need Node.js >= 18"
    assert (NODE_DIR / "node_modules" / "@opentelemetry" / "sdk-trace").is_dir(), (
        f"the Node.js OTel packages are missing: run `npm install` in {NODE_DIR} (.ci/run does)"
    )
    return executable


@pytest.fixture
def kit():
    return SimpleNamespace(wait_for=wait_for, node_dir=NODE_DIR, free_port=free_port)


@pytest.fixture
def receiver_process(tmp_path):
    made: list[ReceiverProcess] = []

    def make(*extra: str, db: Path | None = None, file_size_limit: int | None = None) -> ReceiverProcess:
        process = ReceiverProcess(db or tmp_path / "spanrl.db", *extra, file_size_limit=file_size_limit)
        made.append(process)
        return process

    yield make
    for process in made:
        process.kill()


