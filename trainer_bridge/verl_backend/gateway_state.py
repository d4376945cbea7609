"""The gateway's own state on top of the relay's: the pause gate that holds agents' requests while
verl syncs weights, and the counters ``GatewayHandle.stats()`` reports.

``GatewayState`` is the relay state (``relay/state.py``) of the gateway's app: ``admit`` waits at
the gate (503 with ``Retry-After`` after ``pause_wait_s``), ``health_details`` adds ``paused``.
Created by ``gateway.GatewayHandle`` on the gateway's loop; read by ``gateway_app`` (its stats route).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from spanrl.trainer_bridge.relay.state import Lease, RelayError, RelayState
from spanrl.trainer_bridge.relay.upstreams import UpstreamStats

if TYPE_CHECKING:
    from spanrl.trainer_bridge.verl_backend.gateway import GatewayConfig


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


class GatewayState(RelayState):
    """The relay state of the gateway's app, with its pause gate."""

    def __init__(self, config: GatewayConfig, upstream_urls: list[str]):
        super().__init__(config.relay_config(), upstream_urls)
        self.gateway_config = config
        self.gate = PauseGate()

    async def admit(self) -> Lease:
        if not await self.gate.enter(self.gateway_config.pause_wait_s):
            retry = self.config.retry_after_s
            raise RelayError(503, f"the policy is being updated and the gateway is paused; retry in {retry} s",
                             "gateway_paused", retry_after_s=retry)
        return Lease(self.gate.leave)

    def health_details(self) -> dict[str, Any]:
        return {"paused": self.gate.paused}

    def stats(self) -> GatewayStats:
        return GatewayStats(self.gate.paused, self.policy_version or 0, self.gate.in_flight, self.gate.waited,
                            self.gate.rejected, tuple(u.stats() for u in self.pool.upstreams))


__all__ = ["GatewayState", "GatewayStats", "PauseGate"]
