"""The bridge's task API and dispatcher, over real HTTP with the runner's client."""

from __future__ import annotations

import json
import urllib.request

import pytest

from spanrl.bridge_protocol import Attempt
from spanrl.runner.bridge_client import BridgeClient, BridgeUnavailable, TrainingFinished
from spanrl.trainer_bridge.task_dispatch import TaskDispatcher


def test_claims_hand_out_each_attempt_once_and_finish_records_outcomes(bridge):
    dispatcher, api = bridge
    client = BridgeClient(api.url)
    assert client.claim() is None  # no round open yet: 204
    attempts = dispatcher.open_round(0, [("t1", {"q": 1}), ("t2", {"q": 2})], group_size=3)
    assert len(attempts) == 6 and len({a.rollout_id for a in attempts}) == 6
    claims = [client.claim() for _ in range(6)]
    assert client.claim() is None
    assert sorted((c.task_id, c.attempt) for c in claims) == sorted(
        (t, a) for t in ("t1", "t2") for a in range(3))
    assert claims[0].policy_base_url == "http://127.0.0.1:9/v1" and claims[0].model == "policy"
    for i, claim in enumerate(claims):
        client.finish(claim.rollout_id, "ok" if i % 2 else "failed", None if i % 2 else "boom")
    outcomes = dispatcher.wait_round(poll_s=0.01)
    assert sorted(o.status for o in outcomes.values()) == ["failed"] * 3 + ["ok"] * 3
    assert {o.error for o in outcomes.values() if o.status == "failed"} == {"boom"}


def test_a_claimed_attempt_without_report_is_lost_not_waited_for_forever():
    dispatcher = TaskDispatcher(rollout_timeout_s=-9.9)  # expires 0.1 s after the claim
    dispatcher.open_round(0, [("t", {})], group_size=2)
    first, second = dispatcher.claim(), dispatcher.claim()
    dispatcher.finish(first.rollout_id, "ok")
    outcomes = dispatcher.wait_round(poll_s=0.02)
    assert outcomes[first.rollout_id].status == "ok"
    assert outcomes[second.rollout_id].status == "lost"
    assert "no report" in outcomes[second.rollout_id].error


def test_finished_training_answers_410_and_the_client_raises(bridge):
    dispatcher, api = bridge
    dispatcher.close()
    with pytest.raises(TrainingFinished):
        BridgeClient(api.url).claim()


def _post(url: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(bridge):
    dispatcher, api = bridge
    status, body = _post(api.url + "/v1/finish", b"{not json")
    assert status == 400 and "not JSON" in body["error"]
    status, body = _post(api.url + "/v1/finish", json.dumps({"rollout_id": 5}).encode())
    assert status == 400 and "rollout_id" in body["error"]
    status, body = _post(api.url + "/v1/finish",
                         json.dumps({"rollout_id": "nope", "status": "ok"}).encode())
    assert status == 404 and "nope" in body["error"]
    dispatcher.open_round(0, [("t", {})], group_size=2)
    claim = BridgeClient(api.url).claim()
    status, body = _post(api.url + "/v1/finish",
                         json.dumps({"rollout_id": claim.rollout_id, "status": "great"}).encode())
    assert status == 400 and "status must be one of" in body["error"]
    status, body = _post(api.url + "/v1/nowhere", b"{}")
    assert status == 404
    assert BridgeClient(api.url).info().policy_version == 3


def test_a_negative_or_bogus_content_length_is_refused_at_once(bridge):
    import http.client

    _, api = bridge
    host, port = api.url.removeprefix("http://").split(":")
    for length in ("-1", "lots"):
        connection = http.client.HTTPConnection(host, int(port), timeout=5)
        connection.putrequest("POST", "/v1/finish")
        connection.putheader("Content-Length", length)
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == 400 and "Content-Length" in json.loads(response.read())["error"]
        connection.close()


def test_runner_may_not_report_lost():
    dispatcher = TaskDispatcher(rollout_timeout_s=5)
    (attempt,) = dispatcher.open_round(0, [("t", {})], group_size=1)
    with pytest.raises(ValueError, match="status must be one of"):
        dispatcher.finish(attempt.rollout_id, "lost")


def test_the_claim_answer_is_the_attempt_the_dispatcher_handed_out(bridge):
    dispatcher, api = bridge
    (attempt,) = dispatcher.open_round(4, [("t9", {"question": "2+2", "id": "t9"})], group_size=1)
    claimed = BridgeClient(api.url).claim()
    assert isinstance(claimed, Attempt) and isinstance(attempt, Attempt)
    assert Attempt.from_json(claimed.to_json()) == attempt  # same attempt on both sides
    assert (claimed.step, claimed.rollout_timeout_s, claimed.model) == (4, 2.0, "policy")


def test_an_off_protocol_answer_is_a_clear_client_error():
    """A server that answers a claim with a body missing the task: the runner says so."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotABridge(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            data = json.dumps({"rollout_id": "r", "task_id": "t", "attempt": 0}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):  # noqa: A002
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotABridge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(BridgeUnavailable, match="off-protocol.*'task'"):
            BridgeClient(f"http://127.0.0.1:{server.server_address[1]}").claim()
    finally:
        server.shutdown()
        server.server_close()
