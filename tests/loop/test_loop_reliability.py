"""Runner <-> bridge under load and faults, the bridge's bearer token, and a run that trains on
nothing stopping with the reason. Real HTTP servers and clients on free ports throughout."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from spanrl.child_processes import free_port as _free_port
from spanrl.errors import UserError
from spanrl.runner.bridge_client import BridgeClient, BridgeRefused
from spanrl.runner.runner import Runner
from spanrl.runner.settings import RunnerSettings
from spanrl.schema.metrics import read_metrics
from spanrl.trainer_bridge.bridge_api import BridgeAPI, PolicyInfo
from spanrl.trainer_bridge.task_dispatch import TaskDispatcher

AGENTS_DIR = os.path.join(os.path.dirname(__file__), "agents")
TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")
POLICY = PolicyInfo("http://127.0.0.1:9/v1", "policy")


def test_256_concurrent_runners_claim_and_report_without_a_reset(bridge):
    """Every worker claims and reports at the same instant, then reports again: nothing is
    reset, nothing is lost, every attempt is counted once."""
    dispatcher, api = bridge
    clients = 256
    attempts = dispatcher.open_round(0, [(f"t{i}", {}) for i in range(clients // 2)], group_size=2)
    start_claims, start_reports = threading.Barrier(clients), threading.Barrier(clients)
    failures: list[str] = []
    claimed: list[str] = []
    retries: list[int] = []

    def runner_worker() -> None:
        client = BridgeClient(api.url, retry_for_s=0.0)  # no retry may hide a reset here
        start_claims.wait()
        try:
            claim = client.claim()
            assert claim is not None
            claimed.append(claim.rollout_id)
        except Exception as exc:  # noqa: BLE001 - collected and asserted on below
            failures.append(f"claim: {exc!r}")
            claim = None
        start_reports.wait(timeout=60)
        if claim is None:
            return
        try:
            client.finish(claim.rollout_id, "ok")
            client.finish(claim.rollout_id, "failed", "a repeated report")  # the first one counts
        except Exception as exc:  # noqa: BLE001
            failures.append(f"finish: {exc!r}")
        retries.append(client.retries)

    threads = [threading.Thread(target=runner_worker) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert failures == []
    assert sorted(claimed) == sorted(a.rollout_id for a in attempts)  # each handed out once
    outcomes = dispatcher.wait_round(poll_s=0.01)
    assert len(outcomes) == clients and {o.status for o in outcomes.values()} == {"ok"}


def test_a_repeated_claim_id_gets_the_same_attempt(bridge):
    dispatcher, api = bridge
    dispatcher.open_round(0, [("t", {})], group_size=2)

    def claim(claim_id: str) -> dict:
        request = urllib.request.Request(api.url + "/v1/claim", data=json.dumps({"claim_id": claim_id}).encode(),
                                         method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    first = claim("c-1")
    assert claim("c-1") == first  # the answer to the first was lost: the retry gets it again
    assert claim("c-2")["rollout_id"] != first["rollout_id"]


def test_a_report_survives_the_bridge_being_down_for_a_while():
    """The bridge's port refuses connections, then the bridge comes up: the report arrives."""
    dispatcher = TaskDispatcher(rollout_timeout_s=30.0)
    dispatcher.open_round(0, [("t", {})], group_size=1)
    attempt = dispatcher.claim()
    port = _free_port()
    client = BridgeClient(f"http://127.0.0.1:{port}", retry_for_s=20.0)
    reported = threading.Thread(target=client.finish, args=(attempt.rollout_id, "ok"))
    reported.start()
    deadline = time.monotonic() + 20
    while client.retries < 2:  # refused twice: the bridge is down, and the client keeps trying
        assert reported.is_alive() and time.monotonic() < deadline, "the client did not retry the refused report"
        time.sleep(0.01)
    api = BridgeAPI(dispatcher, POLICY, lambda: 0, port=port).start()
    try:
        reported.join(timeout=30)
        assert not reported.is_alive()
        assert client.retries >= 2
        assert dispatcher.wait_round(poll_s=0.01)[attempt.rollout_id].status == "ok"
    finally:
        dispatcher.close()
        api.stop()


def test_5xx_answers_are_retried_and_4xx_are_not():
    """A real server that answers 503 twice, then 200: the client retries; a 400 is final."""
    answers = [503, 503, 200]
    seen: list[str] = []

    class Flaky(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802 - stdlib name
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append(self.path)
            status = answers.pop(0) if answers else 400
            body = b'{"ok": true}' if status == 200 else b'{"error": "busy"}'
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # noqa: A002
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = BridgeClient(f"http://127.0.0.1:{server.server_address[1]}", retry_for_s=10.0)
        client.finish("r1", "ok")
        assert (len(seen), client.retries) == (3, 2)
        with pytest.raises(Exception, match="answered 400"):
            client.finish("r1", "ok")
        assert len(seen) == 4  # not retried
    finally:
        server.shutdown()
        server.server_close()


def test_the_bridge_token_is_required_when_set():
    dispatcher = TaskDispatcher(rollout_timeout_s=30.0)
    api = BridgeAPI(dispatcher, POLICY, lambda: 0, port=0, token="s3cret").start()
    try:
        for client in (BridgeClient(api.url), BridgeClient(api.url, token="wrong")):
            with pytest.raises(BridgeRefused, match="bridge_token"):
                client.info()
            with pytest.raises(BridgeRefused):
                client.claim()
        assert BridgeClient(api.url, token="s3cret").info().model == "policy"
        settings = RunnerSettings(agent="flaky_agent:solve", bridge_url=api.url, python_path=[AGENTS_DIR],
                                  bridge_wait_s=5)
        with pytest.raises(UserError, match="refused the runner"):  # exit 2 with the reason
            Runner(settings).run()
    finally:
        dispatcher.close()
        api.stop()


def test_a_run_that_trains_on_nothing_stops_with_the_reason(tmp_path, tracer_provider):
    """The agents' spans never reach the receiver (it runs, but they export elsewhere): every
    rollout of every step stays unassembled. After ``max_empty_steps`` such steps training stops
    with an error naming the cause."""
    from spanrl.otlp_receiver.store_lock import ReceiverLock
    from spanrl.trainer_bridge.empty_steps import NothingToTrain
    from spanrl.trainer_bridge.session import run_training
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir
    from spanrl.trainer_bridge.train_settings import TrainSettings

    model_dir = create_model_dir(tmp_path / "model", preset="tiny", seed=0)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps({"id": f"t{i}"}) for i in range(2)) + "\n")
    bridge_port = _free_port()
    settings = TrainSettings(
        tasks=str(tasks), model=str(model_dir), output_dir=str(tmp_path / "run"), store=str(tmp_path / "x.db"),
        group_size=2, tasks_per_step=2, steps=6, max_empty_steps=2, assembly_wait_s=0.3,
        rollout_timeout_s=10.0, policy_port=0, bridge_port=bridge_port, device=TEST_DEVICE, checkpoint_every=0,
    )
    runner = Runner(RunnerSettings(agent="flaky_agent:solve", bridge_url=f"http://127.0.0.1:{bridge_port}",
                                   concurrency=4, python_path=[AGENTS_DIR], bridge_wait_s=60),
                    tracer_provider=tracer_provider)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    receiver = ReceiverLock(settings.store).acquire()  # what a running receiver holds on its store
    try:
        with pytest.raises(NothingToTrain) as raised:
            run_training(settings, show_progress=False)
    finally:
        receiver.release()
        runner.stop()
        thread.join(timeout=30)
    message = str(raised.value)
    assert message.startswith("stopped: 2 steps in a row trained on nothing (max_empty_steps); the last: "
                              "step 2 trained on nothing: 4 rollouts (unassembled 4)")
    assert "is `spanrl receive` running" in message
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2 and rows[-1]["actor/transitions"] == 0


def test_the_runner_gives_agents_the_policy_token(monkeypatch):
    from spanrl.bridge_protocol import BridgeInfo

    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_MODEL"):  # restored after the test
        monkeypatch.setenv(name, "before")
    settings = RunnerSettings(agent="flaky_agent:solve", python_path=[AGENTS_DIR], policy_token="p0licy")
    Runner(settings).point_agents_at_policy(BridgeInfo("http://127.0.0.1:9/v1", "policy", 0, 10.0))
    assert os.environ["OPENAI_API_KEY"] == "p0licy"  # what the openai client sends as its bearer token
