"""A foreign client: the Node.js OTel SDK (gRPC exporter and the JSON HTTP exporter, from npm)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from spanrl.otlp_receiver.store import SpanStore

NODE_DIR = Path(__file__).resolve().parents[1] / "node"


@pytest.fixture(scope="module")
def node():
    executable = shutil.which("node")
    assert executable, "node is not installed: the Node.js client tests need Node.js >= 18"
    assert (NODE_DIR / "node_modules" / "@opentelemetry" / "sdk-trace").is_dir(), (
        f"the Node.js OTel packages are missing: run `npm install` in {NODE_DIR} (.ci/run does)"
    )
    return executable


@pytest.mark.parametrize(
    "protocol,compression", [("grpc", "none"), ("http-json", "none"), ("grpc", "gzip"), ("http-json", "gzip")]
)
def test_node_sdk_rollout_arrives_intact(protocol, compression, node, start_receiver, kit):
    server = start_receiver()
    endpoint = (
        f"http://127.0.0.1:{server.grpc_port}" if protocol == "grpc"
        else f"http://127.0.0.1:{server.http_port}/v1/traces"
    )
    rollout_id = f"node-{protocol}-{compression}"
    result = subprocess.run(
        [node, "send_rollout.js", protocol, endpoint, rollout_id, compression],
        cwd=NODE_DIR, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    with SpanStore(server.settings.db) as store:
        (rollout,) = kit.wait_for(lambda: store.completed_rollouts(0)[0], what="node rollout")
    assert rollout.rollout_id == rollout_id
    assert (rollout.task_id, rollout.attempt) == ("node-task", 1)
    assert [t.prompt_token_ids for t in rollout.transitions] == [(100, 2147483647, 0, 7), (101, 2147483647, 0, 7)]
    assert [t.response_token_ids for t in rollout.transitions] == [(200, 1), (201, 1)]
    assert rollout.transitions[0].response_logprobs == (-0.125, -1.5)
    assert rollout.transitions[1].policy_version == 4
    assert rollout.total_reward == 0.75 and rollout.rewards[0].name == "judge"
    assert [t.reward for t in rollout.transitions] == [0.0, 0.75]
    assert rollout.variables == {"language": "javascript"}
    assert rollout.problems == ()
