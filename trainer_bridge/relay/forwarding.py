"""How a relay talks to an upstream: choosing it (with its model name), sending a request, and
relaying its reply (JSON, or server-sent events one by one) back; and the health check that
brings an upstream out of rotation back.

Called by the routes in ``app.py``, on the relay's loop. A connection failure answers 502 naming
the upstream (and, with ``rotate_out_on_failure``, takes it out of rotation:
``UpstreamPool.mark_down``); no answer within ``request_timeout_s`` answers 504; an upstream's 5xx
answers 502 (503 with ``Retry-After`` when it said 503); its 4xx (the agent's request at fault)
pass through as they are, with the headers that tell a client when to retry.
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
from spanrl.trainer_bridge.relay import spans
from spanrl.trainer_bridge.relay.rewrite import (
    MESSAGES_PATH,
    encode_json,
    rewrite_reply,
    rewrite_sse_event,
    sse_error_event,
)
from spanrl.trainer_bridge.relay.state import Lease, RelayError, RelayState
from spanrl.trainer_bridge.relay.upstreams import NoUpstreamError, Upstream, display_url

logger = logging.getLogger(__name__)

# headers of an upstream's 4xx that a client acts on (when to retry, which request it was)
PASSED_ERROR_HEADERS = ("retry-after", "retry-after-ms", "x-request-id")
PASSED_ERROR_HEADER_PREFIX = "x-ratelimit-"


def unreachable(state: RelayState, upstream: Upstream, exc: BaseException) -> RelayError:
    # the exception's text goes to the log, not to the agent: only its kind is said
    logger.warning("%s: the upstream %s cannot be reached: %s: %s", state.config.name, display_url(upstream.url),
                   type(exc).__name__, exc)
    reason = type(exc).__name__
    after = "; it is out of rotation until its /health answers" if state.config.rotate_out_on_failure else ""
    return RelayError(502, f"the upstream {display_url(upstream.url)} cannot be reached ({reason}){after}",
                      "upstream_unreachable", upstream_failure=True)


def timed_out(state: RelayState, upstream: Upstream) -> RelayError:
    return RelayError(504, f"the upstream {display_url(upstream.url)} did not answer within "
                           f"{state.config.request_timeout_s} s (the {state.config.name}'s request timeout)",
                      "upstream_timeout", upstream_failure=True)


async def fetch_model_name(state: RelayState, upstream: Upstream) -> str:
    """The name the upstream serves its model under (the first entry of its ``/v1/models``)."""
    reply = await state.client.get(f"{upstream.base_url}/models", timeout=state.probe_timeout_s,
                                   headers=state.upstream_headers(None))
    reply.raise_for_status()
    return str(reply.json()["data"][0]["id"])


async def acquire_upstream(state: RelayState, key: str | None, lease: Lease) -> Upstream:
    """The upstream for this request, its model name known when the relay maps a served name;
    one that cannot say its name goes out of rotation."""
    while True:
        try:
            upstream = state.pool.pick(key)
        except NoUpstreamError as exc:
            raise RelayError(503, str(exc), "no_upstream", retry_after_s=state.config.retry_after_s) from exc
        upstream.in_flight += 1
        if upstream.model is not None or state.config.served_model_name is None:
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


def _version_headers(version: int | None) -> dict[str, str]:
    return {} if version is None else {semconv.POLICY_VERSION_HEADER: str(version)}


def relay_reply(state: RelayState, upstream: Upstream, reply: httpx.Response, version: int | None) -> Response:
    """An upstream's complete reply as the agent gets it (a 5xx is named as the upstream's)."""
    headers = _version_headers(version)
    if reply.status_code >= 500:
        upstream.failures += 1
        detail = _error_message(reply)
        retry = state.config.retry_after_s if reply.status_code == 503 else None
        raise RelayError(503 if retry else 502, f"the upstream {display_url(upstream.url)} answered "
                                                f"{reply.status_code}: {detail}", "upstream_error",
                         retry_after_s=retry, upstream_failure=True)
    if reply.status_code >= 400:  # the agent's request is at fault: its error passes through as it is
        for name, value in reply.headers.items():
            if name in PASSED_ERROR_HEADERS or name.startswith(PASSED_ERROR_HEADER_PREFIX):
                headers[name] = value
        return Response(reply.content, reply.status_code, headers=headers,
                        media_type=reply.headers.get("content-type", "application/json"))
    try:
        data = reply.json()
    except ValueError as exc:
        upstream.failures += 1
        raise RelayError(502, f"the upstream {display_url(upstream.url)} answered with a body that is not JSON",
                         "upstream_error", upstream_failure=True) from exc
    return Response(encode_json(rewrite_reply(data, state.config.served_model_name, version)),
                    headers=headers, media_type="application/json")


def _error_message(reply: httpx.Response) -> str:
    try:
        return str(reply.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return reply.text[:500] or reply.reason_phrase


def _transport_failure(state: RelayState, upstream: Upstream, exc: Exception) -> RelayError:
    """The error for a request that got no answer (and the upstream's rotation, when it rotates)."""
    upstream.failures += 1
    if isinstance(exc, (asyncio.TimeoutError, httpx.TimeoutException)):
        if isinstance(exc, httpx.ConnectTimeout) and state.config.rotate_out_on_failure:
            state.pool.mark_down(upstream, "connect timed out")
        return timed_out(state, upstream)
    if state.config.rotate_out_on_failure:
        state.pool.mark_down(upstream, f"{type(exc).__name__}: {exc}")
    return unreachable(state, upstream, exc)


async def forward(state: RelayState, upstream: Upstream, request: httpx.Request, version: int | None) -> Response:
    """Send a non-streaming request and relay its reply, within ``request_timeout_s`` in all."""
    try:
        reply = await asyncio.wait_for(state.client.send(request), state.config.request_timeout_s)
    except (asyncio.TimeoutError, httpx.TransportError) as exc:
        raise _transport_failure(state, upstream, exc) from exc
    return relay_reply(state, upstream, reply, version)


def build_request(state: RelayState, upstream: Upstream, path: str, payload: dict[str, Any] | None,
                  headers: dict[str, str]) -> httpx.Request:
    """The upstream request for an OpenAI route ``path`` (``/v1/...``): a POST of ``payload``, or a GET."""
    url = f"{upstream.base_url}{path.removeprefix('/v1')}"
    if payload is None:
        return state.client.build_request("GET", url, headers=headers)
    return state.client.build_request("POST", url, json=payload, headers=headers)


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


async def open_stream(state: RelayState, upstream: Upstream, request: httpx.Request, version: int | None,
                      lease: Lease) -> Response:
    """Send a streaming request; once its events start, relay them one by one. Waiting for the
    upstream (its first byte, or the next event) is bounded by ``request_timeout_s`` each time."""
    try:
        reply = await asyncio.wait_for(state.client.send(request, stream=True), state.config.request_timeout_s)
    except (asyncio.TimeoutError, httpx.TransportError) as exc:
        raise _transport_failure(state, upstream, exc) from exc
    if reply.status_code >= 400 or "text/event-stream" not in reply.headers.get("content-type", ""):
        try:
            await reply.aread()
        finally:
            await reply.aclose()
        return relay_reply(state, upstream, reply, version)
    headers = {**_version_headers(version), "cache-control": "no-cache"}
    return RelayedStream(relay_events(state, upstream, reply, version), reply, lease.release, headers)


async def relay_events(state: RelayState, upstream: Upstream, reply: httpx.Response,
                       version: int | None) -> AsyncIterator[bytes]:
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
    except (httpx.TimeoutException, httpx.TransportError) as exc:
        error = _transport_failure(state, upstream, exc)
        spans.observe_failure(f"mid-stream: {error.message}")
        anthropic = reply.request.url.path.rstrip("/").endswith("/messages")
        yield sse_error_event(error.body(MESSAGES_PATH if anthropic else ""))


async def watch_upstreams(state: RelayState, interval_s: float) -> None:
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


__all__ = ["PASSED_ERROR_HEADERS", "RelayedStream", "acquire_upstream", "build_request", "fetch_model_name",
           "forward", "open_stream", "relay_events", "relay_reply", "timed_out", "unreachable", "watch_upstreams"]
