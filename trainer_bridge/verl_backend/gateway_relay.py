"""How the gateway talks to an upstream: choosing it (with its model name), sending a request,
and relaying its reply (JSON, or server-sent events one by one) back; and the health check that
brings an upstream out of rotation back.

Called by the routes in ``gateway_app.py``, on the gateway's loop. A connection failure takes the
upstream out of rotation (``UpstreamPool.mark_down``) and answers 502 naming it; no answer within
``request_timeout_s`` answers 504; an upstream's 5xx answers 502 (503 with ``Retry-After`` when it
said 503); its 4xx (the agent's request at fault) pass through as they are.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from spanrl.instrumentation import semconv
from spanrl.trainer_bridge.verl_backend.gateway_rewrite import (
    encode_json,
    rewrite_reply,
    rewrite_sse_event,
    sse_error_event,
)
from spanrl.trainer_bridge.verl_backend.gateway_state import GatewayError, GatewayState, Lease
from spanrl.trainer_bridge.verl_backend.gateway_upstreams import NoUpstreamError, Upstream

logger = logging.getLogger(__name__)


def unreachable(upstream: Upstream, exc: BaseException) -> GatewayError:
    # the exception's text goes to the log, not to the agent: only its kind is said
    logger.warning("gateway: the upstream %s cannot be reached: %s: %s", upstream.url, type(exc).__name__, exc)
    return GatewayError(502, f"the upstream {upstream.url} cannot be reached ({type(exc).__name__}); it is out of "
                             "rotation until its /health answers", "upstream_unreachable")


def timed_out(state: GatewayState, upstream: Upstream) -> GatewayError:
    return GatewayError(504, f"the upstream {upstream.url} did not answer within {state.config.request_timeout_s} s "
                             "(GatewayConfig.request_timeout_s)", "upstream_timeout")


async def fetch_model_name(state: GatewayState, upstream: Upstream) -> str:
    """The name the upstream serves its model under (the first entry of its ``/v1/models``)."""
    reply = await state.client.get(f"{upstream.url}/v1/models", timeout=state.probe_timeout_s)
    reply.raise_for_status()
    return str(reply.json()["data"][0]["id"])


async def acquire_upstream(state: GatewayState, key: str | None, lease: Lease) -> Upstream:
    """The upstream for this request, its model name known; one that cannot say it goes out of rotation."""
    while True:
        try:
            upstream = state.pool.pick(key)
        except NoUpstreamError as exc:
            raise GatewayError(503, str(exc), "no_upstream", retry_after_s=state.config.retry_after_s) from exc
        upstream.in_flight += 1
        if upstream.model is not None:
            lease.upstream = upstream
            return upstream
        try:
            upstream.model = await fetch_model_name(state, upstream)
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            upstream.in_flight -= 1
            state.pool.mark_down(upstream, f"GET /v1/models failed: {type(exc).__name__}: {exc}")
            continue
        lease.upstream = upstream
        return upstream


def relay_reply(state: GatewayState, upstream: Upstream, reply: httpx.Response, version: int) -> Response:
    """An upstream's complete reply as the agent gets it (a 5xx is named as the upstream's)."""
    headers = {semconv.POLICY_VERSION_HEADER: str(version)}
    if reply.status_code >= 500:
        upstream.failures += 1
        detail = _error_message(reply)
        retry = state.config.retry_after_s if reply.status_code == 503 else None
        raise GatewayError(503 if retry else 502, f"the upstream {upstream.url} answered {reply.status_code}: "
                                                  f"{detail}", "upstream_error", retry_after_s=retry)
    if reply.status_code >= 400:  # the agent's request is at fault: its error passes through as it is
        return Response(reply.content, reply.status_code, headers=headers,
                        media_type=reply.headers.get("content-type", "application/json"))
    try:
        data = reply.json()
    except ValueError as exc:
        upstream.failures += 1
        raise GatewayError(502, f"the upstream {upstream.url} answered with a body that is not JSON",
                           "upstream_error") from exc
    return Response(encode_json(rewrite_reply(data, state.config.served_model_name, version)),
                    headers=headers, media_type="application/json")


def _error_message(reply: httpx.Response) -> str:
    try:
        return str(reply.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return reply.text[:500] or reply.reason_phrase


async def forward(state: GatewayState, upstream: Upstream, path: str, payload: dict[str, Any],
                  version: int) -> Response:
    """Send a non-streaming request and relay its reply, within ``request_timeout_s`` in all."""
    try:
        reply = await asyncio.wait_for(state.client.post(f"{upstream.url}{path}", json=payload),
                                       state.config.request_timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
        upstream.failures += 1
        if isinstance(exc, httpx.ConnectTimeout):
            state.pool.mark_down(upstream, "connect timed out")
        raise timed_out(state, upstream) from exc
    except httpx.TransportError as exc:
        upstream.failures += 1
        state.pool.mark_down(upstream, f"{type(exc).__name__}: {exc}")
        raise unreachable(upstream, exc) from exc
    return relay_reply(state, upstream, reply, version)


class RelayedStream(StreamingResponse):
    """A streamed reply whose upstream connection and lease are given back however it ends
    (finished, failed, or the agent went away)."""

    def __init__(self, events: AsyncIterator[bytes], upstream_reply: httpx.Response, on_close: Callable[[], None],
                 headers: dict[str, str]):
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events, self._upstream_reply, self._on_close = events, upstream_reply, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
            await self._upstream_reply.aclose()


async def open_stream(state: GatewayState, upstream: Upstream, path: str, payload: dict[str, Any],
                      version: int, lease: Lease) -> Response:
    """Send a streaming request; once its events start, relay them one by one. Waiting for the
    upstream (its first byte, or the next event) is bounded by ``request_timeout_s`` each time."""
    request = state.client.build_request("POST", f"{upstream.url}{path}", json=payload)
    try:
        reply = await asyncio.wait_for(state.client.send(request, stream=True), state.config.request_timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
        upstream.failures += 1
        raise timed_out(state, upstream) from exc
    except httpx.TransportError as exc:
        upstream.failures += 1
        state.pool.mark_down(upstream, f"{type(exc).__name__}: {exc}")
        raise unreachable(upstream, exc) from exc
    if reply.status_code >= 400 or "text/event-stream" not in reply.headers.get("content-type", ""):
        try:
            await reply.aread()
        finally:
            await reply.aclose()
        return relay_reply(state, upstream, reply, version)
    headers = {semconv.POLICY_VERSION_HEADER: str(version), "cache-control": "no-cache"}
    return RelayedStream(relay_events(state, upstream, reply, version), reply, lease.release, headers)


async def relay_events(state: GatewayState, upstream: Upstream, reply: httpx.Response,
                       version: int) -> AsyncIterator[bytes]:
    served = state.config.served_model_name
    lines: list[str] = []
    try:
        async for line in reply.aiter_lines():
            if line:
                lines.append(line)
            elif lines:
                yield rewrite_sse_event(lines, served, version)
                lines = []
        if lines:
            yield rewrite_sse_event(lines, served, version)
    except httpx.TimeoutException:
        upstream.failures += 1
        yield sse_error_event(timed_out(state, upstream).body())
    except httpx.TransportError as exc:
        upstream.failures += 1
        state.pool.mark_down(upstream, f"{type(exc).__name__} mid-stream: {exc}")
        yield sse_error_event(unreachable(upstream, exc).body())


async def watch_upstreams(state: GatewayState, interval_s: float) -> None:
    """Bring an upstream out of rotation back once its ``/health`` and ``/v1/models`` answer."""
    while True:
        await asyncio.sleep(interval_s)
        for upstream in [u for u in state.pool.upstreams if not u.up]:
            try:
                (await state.client.get(f"{upstream.url}/health", timeout=state.probe_timeout_s)).raise_for_status()
                upstream.model = await fetch_model_name(state, upstream)
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                continue
            state.pool.mark_up(upstream)


__all__ = ["RelayedStream", "acquire_upstream", "fetch_model_name", "forward", "open_stream", "relay_events",
           "relay_reply", "timed_out", "unreachable", "watch_upstreams"]
