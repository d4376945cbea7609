"""The runner's client of the bridge API (``spanrl.trainer_bridge.bridge_api``). Stdlib only."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass


class BridgeUnavailable(Exception):
    """The bridge could not be reached (not started yet, or gone)."""


class TrainingFinished(Exception):
    """The bridge says training is over: the runner exits."""


@dataclass(frozen=True)
class Claim:
    rollout_id: str
    task_id: str
    attempt: int
    task: dict
    rollout_timeout_s: float
    policy_base_url: str
    model: str


class BridgeClient:
    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict | None]:
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
                payload = {"error": raw.decode(errors="replace")}
            return exc.code, payload
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            raise BridgeUnavailable(f"cannot reach the bridge at {self.url}: {exc}") from exc

    def info(self) -> dict:
        status, payload = self._call("GET", "/v1/info")
        if status != 200 or payload is None:
            raise BridgeUnavailable(f"bridge at {self.url} answered {status} to /v1/info")
        return payload

    def claim(self) -> Claim | None:
        status, payload = self._call("POST", "/v1/claim", {})
        if status == 204:
            return None
        if status == 410:
            raise TrainingFinished()
        if status != 200 or payload is None:
            raise BridgeUnavailable(f"bridge answered {status} to a claim: {payload}")
        return Claim(
            rollout_id=payload["rollout_id"],
            task_id=str(payload["task_id"]),
            attempt=int(payload["attempt"]),
            task=payload["task"],
            rollout_timeout_s=float(payload["rollout_timeout_s"]),
            policy_base_url=payload["policy_base_url"],
            model=payload["model"],
        )

    def finish(self, rollout_id: str, status: str, error: str | None = None) -> None:
        code, payload = self._call(
            "POST", "/v1/finish", {"rollout_id": rollout_id, "status": status, "error": error}
        )
        if code not in (200, 404):  # 404: the round already closed; nothing to do
            raise BridgeUnavailable(f"bridge answered {code} to finish: {payload}")
