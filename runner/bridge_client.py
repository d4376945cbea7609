"""The runner's client of the bridge API (``spanrl.trainer_bridge.bridge_api``). Stdlib only.

Speaks the protocol of ``spanrl.bridge_protocol``; ``runner.py`` calls it from every worker.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

from spanrl import bridge_protocol as protocol
from spanrl.bridge_protocol import BridgeInfo, BridgeProtocolError, ClaimedAttempt, FinishRequest

_Payload = TypeVar("_Payload")


class BridgeUnavailable(Exception):
    """The bridge could not be reached (not started yet, or gone), or answered off-protocol."""


class TrainingFinished(Exception):
    """The bridge says training is over: the runner exits."""


class BridgeClient:
    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
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
            return exc.code, payload
        except json.JSONDecodeError as exc:
            raise BridgeUnavailable(f"the bridge at {self.url} answered {path} with non-JSON: {exc}") from exc
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise BridgeUnavailable(f"cannot reach the bridge at {self.url}: {reason}") from exc

    def info(self) -> BridgeInfo:
        status, payload = self._call("GET", protocol.INFO_PATH)
        if status != 200:
            raise BridgeUnavailable(f"bridge at {self.url} answered {status} to {protocol.INFO_PATH}: {payload}")
        return self._parse(BridgeInfo.from_json, payload, protocol.INFO_PATH)

    def claim(self) -> ClaimedAttempt | None:
        """The next attempt to run, or None when there is none right now."""
        status, payload = self._call("POST", protocol.CLAIM_PATH, {})
        if status == protocol.NOTHING_TO_CLAIM:
            return None
        if status == protocol.TRAINING_FINISHED:
            raise TrainingFinished()
        if status != 200:
            raise BridgeUnavailable(f"bridge answered {status} to a claim: {payload}")
        return self._parse(ClaimedAttempt.from_json, payload, protocol.CLAIM_PATH)

    def finish(self, rollout_id: str, status: str, error: str | None = None) -> None:
        request = FinishRequest(rollout_id, status, error)
        code, payload = self._call("POST", protocol.FINISH_PATH, request.to_json())
        if code not in (200, 404):  # 404: the round already closed; nothing to do
            raise BridgeUnavailable(f"bridge answered {code} to finish: {payload}")

    def _parse(self, parse: Callable[[Any], _Payload], payload: Any, path: str) -> _Payload:
        try:
            return parse(payload)
        except BridgeProtocolError as exc:
            # a bridge of another spanrl version, or not a bridge at all
            raise BridgeUnavailable(f"the bridge at {self.url} answered {path} off-protocol: {exc}") from exc
