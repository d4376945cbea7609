"""The gateway's state on its event loop: the pause gate, the upstream pool, the HTTP client
to the upstreams, the policy version, and the error type every route raises.

Created by ``gateway.GatewayHandle`` on the gateway's loop; read by ``gateway_app`` (routes) and
``gateway_relay`` (talking to upstreams). ``GatewayStats`` is what ``GatewayHandle.stats()``
and ``GET /spanrl/gateway/stats`` report.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import httpx
from starlette.requests import Request

from spanrl.trainer_bridge.verl_backend.gateway_rewrite import error_body
from spanrl.trainer_bridge.verl_backend.gateway_upstreams import Upstream, UpstreamPool, UpstreamStats

if TYPE_CHECKING:
    from spanrl.trainer_bridge.verl_backend.gateway import GatewayConfig

PROBE_TIMEOUT_S = 5.0  # a health or model probe of an upstream (or request_timeout_s when shorter)


class GatewayError(Exception):
    """A request the gateway answers with an OpenAI-style error (``retry_after_s``: sent as
    ``Retry-After``, which the ``openai`` client waits before it retries)."""

    def __init__(self, status: int, message: str, code: str, error_type: str = "server_error",
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.error_type = status, message, code, error_type
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        """Its OpenAI-style body: ``{"error": {message, type, param, code}}``."""
        return error_body(self.message, self.error_type, self.code)


@dataclass(frozen=True)
class GatewayStats:
    """The gateway's state (``GatewayHandle.stats()``, ``GET /spanrl/gateway/stats``)."""

    paused: bool
    policy_version: int
    in_flight: int
    waited_for_pause: int  # requests that arrived while paused and waited
    rejected_while_paused: int  # of those, how many were answered 503 after ``pause_wait_s``
    upstreams: tuple[UpstreamStats, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PauseGate:
    """Holds new requests while paused and counts those in flight, so that ``pause`` can wait
    until none is left (the weights change only between requests)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self.in_flight = 0
        self.waited = 0
        self.rejected = 0

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def enter(self, wait_s: float) -> bool:
        """Admit a request (True), waiting up to ``wait_s`` while paused; False if still paused."""
        if self.paused:
            self.waited += 1
            deadline = asyncio.get_running_loop().time() + wait_s
            while self.paused:  # a pause right after a resume holds the request again
                try:
                    await asyncio.wait_for(self._open.wait(), max(0.0, deadline - asyncio.get_running_loop().time()))
                except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
                    self.rejected += 1
                    return False
        self.in_flight += 1
        self._drained.clear()
        return True

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._drained.set()

    async def pause(self, timeout_s: float) -> bool:
        """Close the gate; True once no request is in flight, False after ``timeout_s``."""
        self._open.clear()
        try:
            await asyncio.wait_for(self._drained.wait(), timeout_s)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            return False
        return True

    def resume(self) -> None:
        self._open.set()


class GatewayState:
    """The app's state (``app.state.gateway``): config, upstreams, pause gate, HTTP client."""

    def __init__(self, config: GatewayConfig, upstream_urls: list[str]):
        self.config = config
        self.pool = UpstreamPool(upstream_urls)
        self.gate = PauseGate()
        self.policy_version = 0  # set from the trainer's thread; an int store is atomic
        self.probe_timeout_s = min(PROBE_TIMEOUT_S, config.request_timeout_s)
        timeout = httpx.Timeout(config.request_timeout_s, connect=min(config.request_timeout_s, 10.0))
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        # the replicas' API key goes on every call to them (relayed requests and probes); the
        # agents' own headers are never relayed
        upstream_key = config.upstream_api_key
        headers = {"Authorization": f"Bearer {upstream_key}"} if upstream_key else None
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers)

    @staticmethod
    def of(request: Request) -> GatewayState:
        return request.app.state.gateway

    def stats(self) -> GatewayStats:
        return GatewayStats(self.gate.paused, self.policy_version, self.gate.in_flight, self.gate.waited,
                            self.gate.rejected, tuple(u.stats() for u in self.pool.upstreams))


class Lease:
    """A request's place in the gate and on its upstream, given back exactly once."""

    def __init__(self, gate: PauseGate):
        self.gate = gate
        self.upstream: Upstream | None = None
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.gate.leave()
            if self.upstream is not None:
                self.upstream.in_flight -= 1


__all__ = ["GatewayError", "GatewayState", "GatewayStats", "Lease", "PROBE_TIMEOUT_S", "PauseGate"]
