"""The runner's client of the bridge API (``spanrl.trainer_bridge.bridge_api``). Stdlib only.

Speaks the protocol of ``spanrl.bridge_protocol``; ``runner.py`` calls it from every worker.
Claims and reports survive transient faults: a connection error, a timeout or a 5xx answer is
retried with exponential backoff (plus jitter) for up to ``retry_for_s``. Both are safe to
repeat: a claim carries a claim id, so a retried claim gets the same attempt, and the bridge
counts a repeated report once.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from spanrl import bridge_protocol as protocol
from spanrl.bridge_protocol import (
    BridgeInfo,
    BridgeProtocolError,
    ClaimedAttempt,
    ClaimRequest,
    FinishRequest,
    TrainingFinished,
)
from spanrl.errors import UserError

logger = logging.getLogger(__name__)

_Payload = TypeVar("_Payload")
RETRYABLE_STATUSES = (500, 502, 503, 504)
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 2.0


class BridgeUnavailable(Exception):
    """The bridge could not be reached (not started yet, or gone), or answered off-protocol."""


class BridgeRefused(UserError):
    """The bridge refused the runner's bearer token (401)."""


class BridgeClient:
    def __init__(self, url: str, timeout_s: float = 10.0, retry_for_s: float = 30.0,
                 token: str | None = None, stop: threading.Event | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retry_for_s = retry_for_s
        self.token = token or None
        self.stop = stop or threading.Event()  # once set, a failing call is not retried any more
        self.retries = 0  # calls repeated after a transient fault (for tests and logs)

    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
                return response.status, (json.loads(raw) if raw else None)
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                payload = json.loads(raw) if raw else None
            except json.JSONDecodeError:
                payload = protocol.error_body(raw.decode(errors="replace"))
            if exc.code == 401:
                raise BridgeRefused(f"the bridge at {self.url} refused the runner: {payload}") from exc
            return exc.code, payload
        except json.JSONDecodeError as exc:
            raise BridgeUnavailable(f"the bridge at {self.url} answered {path} with non-JSON: {exc}") from exc
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise BridgeUnavailable(f"cannot reach the bridge at {self.url}: {reason}") from exc

    def _call_retrying(self, method: str, path: str, body: dict | None = None) -> tuple[int, Any]:
        """``_call``, repeated on connection errors, timeouts and 5xx answers for up to
        ``retry_for_s``; the last failure is raised as ``BridgeUnavailable``."""
        deadline = time.monotonic() + self.retry_for_s
        backoff = FIRST_BACKOFF_S
        while True:
            try:
                status, payload = self._call(method, path, body)
                if status not in RETRYABLE_STATUSES:
                    return status, payload
                failure = BridgeUnavailable(f"the bridge at {self.url} answered {status} to {path}: {payload}")
            except BridgeUnavailable as exc:
                failure = exc
            pause = backoff * random.uniform(0.5, 1.5)
            if time.monotonic() + pause > deadline or self.stop.is_set():
                raise failure
            logger.debug("%s; retrying %s in %.2f s", failure, path, pause)
            self.retries += 1
            if self.stop.wait(pause):
                raise failure
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def info(self) -> BridgeInfo:
        status, payload = self._call("GET", protocol.INFO_PATH)
        if status != 200:
            raise BridgeUnavailable(f"bridge at {self.url} answered {status} to {protocol.INFO_PATH}: {payload}")
        return self._parse(BridgeInfo.from_json, payload, protocol.INFO_PATH)

    def claim(self) -> ClaimedAttempt | None:
        """The next attempt to run, or None when there is none right now."""
        request = ClaimRequest(uuid.uuid4().hex)  # one id for this claim and its retries
        status, payload = self._call_retrying("POST", protocol.CLAIM_PATH, request.to_json())
        if status == protocol.NOTHING_TO_CLAIM:
            return None
        if status == protocol.TRAINING_FINISHED:
            raise TrainingFinished()
        if status != 200:
            raise BridgeUnavailable(f"bridge answered {status} to a claim: {payload}")
        return self._parse(ClaimedAttempt.from_json, payload, protocol.CLAIM_PATH)

    def finish(self, rollout_id: str, status: str, error: str | None = None) -> None:
        request = FinishRequest(rollout_id, status, error)
        code, payload = self._call_retrying("POST", protocol.FINISH_PATH, request.to_json())
        if code not in (200, 404):  # 404: the round already closed; nothing to do
            raise BridgeUnavailable(f"bridge answered {code} to finish: {payload}")

    def _parse(self, parse: Callable[[Any], _Payload], payload: Any, path: str) -> _Payload:
        try:
            return parse(payload)
        except BridgeProtocolError as exc:
            # a bridge of another spanrl version, or not a bridge at all
            raise BridgeUnavailable(f"the bridge at {self.url} answered {path} off-protocol: {exc}") from exc
