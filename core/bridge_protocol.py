"""The runner <-> trainer-bridge protocol, defined once: routes, JSON keys and payloads.

The bridge serves it (``spanrl.trainer_bridge.bridge_api`` over ``task_dispatch``); the runner
calls it (``spanrl.runner.bridge_client``). Every payload is a frozen dataclass with
``to_json`` (a JSON-ready dict) and ``from_json`` (checks every field and raises
``BridgeProtocolError`` naming the one that is wrong). Stdlib only: runners import it without
torch. docs/interfaces.md describes the same exchange.

    GET  /v1/info    -> 200 BridgeInfo
    POST /v1/claim   ClaimRequest -> 200 ClaimedAttempt (the same one again for a repeated claim_id)
                          204 nothing to run right now (Retry-After: seconds)
                          410 training finished: the runner exits
    POST /v1/finish  FinishRequest -> 200 {"ok": true} (also when repeated: the first report counts)
                                      | 400 bad request | 404 not in the open round
    any route        -> 401 without the bridge's bearer token, when it has one
    any error        -> {"error": "what went wrong"}
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

# --- Routes and status codes -----------------------------------------------------------------
INFO_PATH = "/v1/info"
CLAIM_PATH = "/v1/claim"
FINISH_PATH = "/v1/finish"
NOTHING_TO_CLAIM = 204  # answer to a claim when no attempt is waiting; retry after RETRY_AFTER_S
TRAINING_FINISHED = 410  # answer to a claim once training ended: the runner exits
RETRY_AFTER_S = 0.2

# --- JSON keys -------------------------------------------------------------------------------
ROLLOUT_ID = "rollout_id"
TASK_ID = "task_id"
ATTEMPT = "attempt"
TASK = "task"
STEP = "step"
ROLLOUT_TIMEOUT_S = "rollout_timeout_s"
POLICY_BASE_URL = "policy_base_url"
MODEL = "model"
POLICY_VERSION = "policy_version"
STATUS = "status"
CLAIM_ID = "claim_id"
ERROR = "error"  # in a finish request (why the attempt failed) and in every error answer
OK = "ok"

# --- Rollout ids the bridge hands out: <prefix><step>-<task>-a<attempt>-<hex> -------------------
# The prefix tells a training round's rollouts from a validation round's (scored, never trained
# on); the policy endpoint reads it from x-spanrl-rollout-id to sample validation greedily.
TRAINING_ROLLOUT_PREFIX = "s"
VALIDATION_ROLLOUT_PREFIX = "v"
# `spanrl eval`'s sampled rounds (pass@k): held out like validation, but sampled at the agent's own
# temperature (an endpoint pins only validation rollouts' temperature)
EVAL_ROLLOUT_PREFIX = "e"


def new_rollout_id(prefix: str, step: int, task_id: str, attempt: int) -> str:
    """A fresh rollout id of ``attempt`` of task ``task_id`` in round ``step``."""
    return f"{prefix}{step}-{task_id}-a{attempt}-{uuid.uuid4().hex[:8]}"


def is_validation_rollout(rollout_id: str) -> bool:
    """Whether ``rollout_id`` was handed out for a validation round."""
    return rollout_id.startswith(VALIDATION_ROLLOUT_PREFIX) and rollout_id[1:2].isdigit()


def is_held_out_rollout(rollout_id: str) -> bool:
    """Whether ``rollout_id`` was handed out only to be scored (validation or ``spanrl eval``): never learned."""
    return (is_validation_rollout(rollout_id)
            or (rollout_id.startswith(EVAL_ROLLOUT_PREFIX) and rollout_id[1:2].isdigit()))


# --- How an attempt ended, as a runner reports it ---------------------------------------------
STATUS_OK = "ok"
STATUS_FAILED = "failed"
STATUS_TIMEOUT = "timeout"
REPORTABLE_STATUSES = (STATUS_OK, STATUS_FAILED, STATUS_TIMEOUT)


class TrainingFinished(Exception):
    """Training ended: the bridge refuses new claims (``TRAINING_FINISHED``) and runners exit."""


class BridgeProtocolError(ValueError):
    """A payload does not follow the runner <-> bridge protocol; the message names the field."""


def _object(payload: Any, what: str) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise BridgeProtocolError(f"{what} must be a JSON object, got {type(payload).__name__}")
    return payload


def _string(payload: dict[str, Any], key: str, what: str, may_be_empty: bool = False) -> str:
    value = payload.get(key)
    if not isinstance(value, str) or not (value or may_be_empty):
        raise BridgeProtocolError(f"{what} needs a non-empty string field {key!r}, got {value!r}")
    return value


def _int(payload: dict[str, Any], key: str, what: str) -> int:
    value = payload.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BridgeProtocolError(f"{what} needs an integer field {key!r}, got {value!r}")
    return value


def _number(payload: dict[str, Any], key: str, what: str) -> float:
    value = payload.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BridgeProtocolError(f"{what} needs a number field {key!r}, got {value!r}")
    return float(value)


def _task(payload: dict[str, Any], what: str) -> dict[str, Any]:
    value = payload.get(TASK)
    if not isinstance(value, dict):
        raise BridgeProtocolError(f"{what} needs a JSON object field {TASK!r} (the task), got {value!r}")
    return value


@dataclass(frozen=True)
class Attempt:
    """One run of one task: a single rollout of a GRPO group, handed out by the bridge."""

    rollout_id: str
    task_id: str
    attempt: int  # 0 .. group size - 1
    task: dict[str, Any]  # the dataset row, given to the agent as it is
    step: int  # the training step whose round this attempt belongs to

    def to_json(self) -> dict[str, Any]:
        return {ROLLOUT_ID: self.rollout_id, TASK_ID: self.task_id, ATTEMPT: self.attempt,
                TASK: self.task, STEP: self.step}

    @classmethod
    def from_json(cls, payload: Any) -> Attempt:
        what = "an attempt"
        body = _object(payload, what)
        return cls(_string(body, ROLLOUT_ID, what), _string(body, TASK_ID, what, may_be_empty=True),
                   _int(body, ATTEMPT, what), _task(body, what), _int(body, STEP, what))


@dataclass(frozen=True)
class ClaimedAttempt(Attempt):
    """An attempt as a runner claims it (200 to ``POST /v1/claim``): the attempt and how to run
    it, so a runner needs nothing else to start the agent."""

    rollout_timeout_s: float
    policy_base_url: str
    model: str

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), ROLLOUT_TIMEOUT_S: self.rollout_timeout_s,
                POLICY_BASE_URL: self.policy_base_url, MODEL: self.model}

    @classmethod
    def from_json(cls, payload: Any) -> ClaimedAttempt:
        what = "a claim answer"
        attempt = Attempt.from_json(payload)
        return cls.of(attempt, _number(payload, ROLLOUT_TIMEOUT_S, what),
                      _string(payload, POLICY_BASE_URL, what), _string(payload, MODEL, what))

    @classmethod
    def of(cls, attempt: Attempt, rollout_timeout_s: float, policy_base_url: str, model: str) -> ClaimedAttempt:
        return cls(attempt.rollout_id, attempt.task_id, attempt.attempt, attempt.task, attempt.step,
                   rollout_timeout_s, policy_base_url, model)


@dataclass(frozen=True)
class ClaimRequest:
    """Body of ``POST /v1/claim``. ``claim_id`` (chosen by the runner, optional) makes a claim
    safe to retry: a claim repeated with the same id gets the attempt the first one got, so an
    answer lost on the way never strands an attempt."""

    claim_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {} if self.claim_id is None else {CLAIM_ID: self.claim_id}

    @classmethod
    def from_json(cls, payload: Any) -> ClaimRequest:
        what = "a claim request"
        body = _object(payload, what)
        if body.get(CLAIM_ID) is None:
            return cls()
        return cls(_string(body, CLAIM_ID, what))


@dataclass(frozen=True)
class FinishRequest:
    """Body of ``POST /v1/finish``: how a runner's attempt ended."""

    rollout_id: str
    status: str  # one of REPORTABLE_STATUSES ("lost" is the bridge's own verdict, never reported)
    error: str | None = None

    def __post_init__(self) -> None:
        if self.status not in REPORTABLE_STATUSES:
            raise BridgeProtocolError(f"status must be one of {REPORTABLE_STATUSES}, got {self.status!r}")

    def to_json(self) -> dict[str, Any]:
        return {ROLLOUT_ID: self.rollout_id, STATUS: self.status, ERROR: self.error}

    @classmethod
    def from_json(cls, payload: Any) -> FinishRequest:
        what = "a finish request"
        body = _object(payload, what)
        error = body.get(ERROR)
        if error is not None and not isinstance(error, str):
            raise BridgeProtocolError(f"{what}: {ERROR!r} must be a string or null, got {error!r}")
        return cls(_string(body, ROLLOUT_ID, what), _string(body, STATUS, what), error)


@dataclass(frozen=True)
class BridgeInfo:
    """Answer to ``GET /v1/info``: where the policy is and which version it serves now."""

    policy_base_url: str
    model: str
    policy_version: int
    rollout_timeout_s: float

    def to_json(self) -> dict[str, Any]:
        return {POLICY_BASE_URL: self.policy_base_url, MODEL: self.model,
                POLICY_VERSION: self.policy_version, ROLLOUT_TIMEOUT_S: self.rollout_timeout_s}

    @classmethod
    def from_json(cls, payload: Any) -> BridgeInfo:
        what = "the bridge info"
        body = _object(payload, what)
        return cls(_string(body, POLICY_BASE_URL, what), _string(body, MODEL, what),
                   _int(body, POLICY_VERSION, what), _number(body, ROLLOUT_TIMEOUT_S, what))


def error_body(message: str) -> dict[str, str]:
    """The JSON body of every error answer."""
    return {ERROR: message}
