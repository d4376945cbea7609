"""Fixtures of the end-to-end tests: the embedded policy server (recording the requests its
engine served) and a real ``spanrl receive`` process, both on free loopback ports."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from spanrl.child_processes import free_port, wait_for_port
from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine
from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir
from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

# where models run in these tests: cpu, or cuda on a GPU machine (docs/gpu.md)
TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")


class RecordingPolicyEngine(PolicyEngine):
    """The real engine; it also keeps every request it served, to compare ids with the store."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.jobs = []

    def submit(self, prompt_ids, params, **kwargs):
        job = super().submit(prompt_ids, params, **kwargs)
        self.jobs.append(job)
        return job


@pytest.fixture
def policy_server(tmp_path):
    model_dir = create_model_dir(tmp_path / "model", preset="tiny", seed=0)
    engine = RecordingPolicyEngine.from_pretrained(model_dir, device=TEST_DEVICE, model_name="policy")
    server = serve_in_thread(engine, port=free_port())
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def receiver(tmp_path):
    """``spanrl receive`` on free ports: {"db", "grpc", "http"}."""
    db = tmp_path / "spanrl.db"
    grpc_port, http_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "spanrl", "receive", "--db", str(db), "--grpc-port", str(grpc_port),
         "--http-port", str(http_port), "--grace-s", "0.3"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_port(grpc_port, process, "spanrl receive")
        wait_for_port(http_port, process, "spanrl receive")
        yield {"db": db, "grpc": f"http://127.0.0.1:{grpc_port}", "http": f"http://127.0.0.1:{http_port}"}
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
