"""A relay's state on its event loop: its config, the upstream pool, the HTTP client to the
upstreams, the policy version, a request's lease, and the error type every route raises.

Created by the front end (``verl_backend/gateway.py`` makes a ``GatewayState``, its subclass with
a pause gate; ``proxy.py`` a plain ``RelayState``) on the relay's loop; read by ``app.py`` (routes)
and ``forwarding.py`` (talking to upstreams) as ``app.state.relay``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import httpx
from starlette.requests import Request

from spanrl.server_connections import IDLE_CONNECTION_REUSE_S
from spanrl.server_security import agent_token_matches
from spanrl.trainer_bridge.relay.config import RelayConfig
from spanrl.trainer_bridge.relay.rewrite import MESSAGES_PATH, anthropic_error_body, error_body
from spanrl.trainer_bridge.relay.upstreams import Upstream, UpstreamPool

PROBE_TIMEOUT_S = 5.0  # a health or model probe of an upstream (or request_timeout_s when shorter)
# request headers an agent sends that go upstream as they are (OpenAI's account headers, Anthropic's
# API version and beta features)
PASSED_REQUEST_HEADERS = ("openai-organization", "openai-project", "anthropic-version", "anthropic-beta")
API_KEY_HEADER = "x-api-key"  # how Anthropic's clients send their key


class RelayError(Exception):
    """A request the relay answers with an OpenAI-style error (``retry_after_s``: sent as
    ``Retry-After``, which the ``openai`` client waits before it retries). ``upstream_failure``:
    the upstream failed the call (unreachable, too slow, 5xx), which the call's span records."""

    def __init__(self, status: int, message: str, code: str, error_type: str = "server_error",
                 retry_after_s: float | None = None, upstream_failure: bool = False):
        super().__init__(message)
        self.status, self.message, self.code, self.error_type = status, message, code, error_type
        self.retry_after_s = retry_after_s
        self.upstream_failure = upstream_failure

    def body(self, path: str = "") -> dict[str, Any]:
        """Its body: OpenAI's ``{"error": {message, type, param, code}}``, or Anthropic's on ``/v1/messages``."""
        if path == MESSAGES_PATH:
            return anthropic_error_body(self.status, self.message)
        return error_body(self.message, self.error_type, self.code)


class Lease:
    """A request's place on its upstream (and in a gateway's pause gate), given back exactly once."""

    def __init__(self, on_release: Callable[[], None] | None = None):
        self.upstream: Upstream | None = None
        self._on_release = on_release
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            if self._on_release is not None:
                self._on_release()
            if self.upstream is not None:
                self.upstream.in_flight -= 1


class RelayState:
    """What a relay's routes share (``app.state.relay``)."""

    def __init__(self, config: RelayConfig, upstream_urls: Iterable[str], base_urls: bool = False):
        self.config = config
        self.pool = UpstreamPool(upstream_urls, base_urls=base_urls)
        # set from the trainer's thread (an int store is atomic); None: replies are not stamped
        self.policy_version: int | None = 0 if config.stamp_policy_version else None
        self.probe_timeout_s = min(PROBE_TIMEOUT_S, config.request_timeout_s)
        timeout = httpx.Timeout(config.request_timeout_s, connect=min(config.request_timeout_s, 10.0))
        # an idle connection is reused only while the upstream surely keeps it (server_connections)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256,
                              keepalive_expiry=IDLE_CONNECTION_REUSE_S)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)

    @staticmethod
    def of(request: Request) -> RelayState:
        return request.app.state.relay

    async def admit(self) -> Lease:
        """A generating request's lease, once it may go upstream (a gateway waits while paused)."""
        return Lease()

    def health_details(self) -> dict[str, Any]:
        """What ``GET /health`` adds to the count of upstreams up."""
        return {}

    def authorize(self, request: Request) -> None:
        token = self.config.api_token
        if token and not agent_token_matches(request.headers.get("authorization"), request.headers.get(API_KEY_HEADER),
                                             token):
            raise RelayError(401, "missing or wrong bearer token", "invalid_api_key", "authentication_error")

    def upstream_headers(self, request: Request | None) -> dict[str, str]:
        """The headers a request sends upstream: the relay's key, or the agent's own where it passes."""
        headers = dict(self.config.upstream_headers)
        if self.config.upstream_api_key:
            headers["authorization"] = f"Bearer {self.config.upstream_api_key}"
            if request is not None and request.url.path == MESSAGES_PATH:
                headers[API_KEY_HEADER] = self.config.upstream_api_key  # as Anthropic's API takes it
        elif request is not None and self.config.pass_agent_key and not self.config.api_token:
            for name in ("authorization", API_KEY_HEADER):
                agent_key = request.headers.get(name)
                if agent_key:
                    headers[name] = agent_key
        if request is not None:
            for name in PASSED_REQUEST_HEADERS:
                value = request.headers.get(name)
                if value:
                    headers[name] = value
        return headers


__all__ = ["API_KEY_HEADER", "Lease", "PASSED_REQUEST_HEADERS", "PROBE_TIMEOUT_S", "RelayError", "RelayState"]
