"""The runner <-> bridge payloads (``spanrl.bridge_protocol``): round trips through JSON, and a
bad payload is refused with an error that names the field."""

from __future__ import annotations

import json

import pytest

from spanrl.bridge_protocol import (
    Attempt,
    BridgeInfo,
    BridgeProtocolError,
    ClaimedAttempt,
    FinishRequest,
)

ATTEMPT = Attempt("s3-t1-a2-0f0f", "t1", 2, {"question": "7*6", "answer": 42}, 3)
CLAIMED = ClaimedAttempt.of(ATTEMPT, 30.0, "http://127.0.0.1:8000/v1", "policy")


@pytest.mark.parametrize("payload", [
    ATTEMPT, CLAIMED, FinishRequest("r1", "failed", "agent exited with code 1"), FinishRequest("r1", "ok"),
    BridgeInfo("http://127.0.0.1:8000/v1", "policy", 7, 12.5),
])
def test_every_payload_survives_a_trip_through_json_text(payload):
    text = json.dumps(payload.to_json())
    assert type(payload).from_json(json.loads(text)) == payload


def test_the_claim_answer_carries_the_attempt_and_how_to_run_it():
    body = CLAIMED.to_json()
    assert body == {"rollout_id": "s3-t1-a2-0f0f", "task_id": "t1", "attempt": 2,
                    "task": {"question": "7*6", "answer": 42}, "step": 3, "rollout_timeout_s": 30.0,
                    "policy_base_url": "http://127.0.0.1:8000/v1", "model": "policy"}
    assert Attempt.from_json(body) == ATTEMPT


@pytest.mark.parametrize(("cls", "payload", "message"), [
    (Attempt, [1, 2], "must be a JSON object, got list"),
    (Attempt, {**ATTEMPT.to_json(), "rollout_id": ""}, "'rollout_id'"),
    (Attempt, {**ATTEMPT.to_json(), "attempt": "2"}, "integer field 'attempt'"),
    (Attempt, {**ATTEMPT.to_json(), "attempt": True}, "integer field 'attempt'"),
    (Attempt, {**ATTEMPT.to_json(), "task": "7*6"}, "'task'"),
    (Attempt, {k: v for k, v in ATTEMPT.to_json().items() if k != "step"}, "'step'"),
    (ClaimedAttempt, {**CLAIMED.to_json(), "rollout_timeout_s": None}, "number field 'rollout_timeout_s'"),
    (ClaimedAttempt, ATTEMPT.to_json(), "'rollout_timeout_s'"),
    (FinishRequest, {"rollout_id": 5, "status": "ok"}, "'rollout_id'"),
    (FinishRequest, {"rollout_id": "r", "status": "lost"}, "status must be one of"),
    (FinishRequest, {"rollout_id": "r", "status": "failed", "error": {"code": 1}}, "'error'"),
    (BridgeInfo, {"policy_base_url": "u", "model": "m", "policy_version": 1.5, "rollout_timeout_s": 1},
     "'policy_version'"),
])
def test_a_bad_payload_is_refused_naming_the_field(cls, payload, message):
    with pytest.raises(BridgeProtocolError, match=message):
        cls.from_json(payload)


def test_a_runner_cannot_build_a_report_the_bridge_would_refuse():
    with pytest.raises(BridgeProtocolError, match="status must be one of"):
        FinishRequest("r", "great")
