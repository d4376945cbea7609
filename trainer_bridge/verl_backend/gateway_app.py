"""The gateway's HTTP app (Starlette): its routes, the pause gate, and relaying a request to an
upstream and its reply (JSON or a stream of server-sent events) back.

Built by ``gateway.start_gateway`` (the public API, documented there), which runs it with
uvicorn on a loop of its own; everything here runs on that loop. Routes: ``POST
/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``; ``GET /v1/models``, ``/health``,
``/spanrl/gateway/stats``. Body changes live in ``gateway_rewrite``, upstream choice in
``gateway_upstreams``. Every failure becomes an OpenAI-style error body in ``handle_error``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from spanrl.instrumentation import semconv
from spanrl.trainer_bridge.verl_backend.gateway_rewrite import (
    GENERATION_PATHS,
    encode_json,
    error_body,
    rewrite_reply,
    rewrite_request,
    rewrite_sse_event,
    sse_error_event,
)
from spanrl.trainer_bridge.verl_backend.gateway_upstreams import (
    NoUpstreamError,
    Upstream,
    UpstreamPool,
    UpstreamStats,
    rollout_key,
)

if TYPE_CHECKING:
    from spanrl.trainer_bridge.verl_backend.gateway import GatewayConfig

logger = logging.getLogger(__name__)

HEALTH_PATH = "/health"
STATS_PATH = "/spanrl/gateway/stats"
PROBE_TIMEOUT_S = 5.0  # a health or model probe of an upstream (or request_timeout_s when shorter)
ROUTES = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "GET /v1/models",
          f"GET {HEALTH_PATH}", f"GET {STATS_PATH}")


class GatewayError(Exception):
    """A request the gateway answers with an OpenAI-style error (``retry_after_s``: sent as
    ``Retry-After``, which the ``openai`` client waits before it retries)."""

    def __init__(self, status: int, message: str, code: str, error_type: str = "server_error",
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.error_type = status, message, code, error_type
        self.retry_after_s = retry_after_s


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
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)

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


# --- upstream contact ---------------------------------------------------------------------------------------

def _unreachable(upstream: Upstream, exc: BaseException) -> GatewayError:
    reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return GatewayError(502, f"the upstream {upstream.url} cannot be reached ({reason}); it is out of rotation "
                             "until its /health answers", "upstream_unreachable")


def _timed_out(state: GatewayState, upstream: Upstream) -> GatewayError:
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
        raise _timed_out(state, upstream) from exc
    except httpx.TransportError as exc:
        upstream.failures += 1
        state.pool.mark_down(upstream, f"{type(exc).__name__}: {exc}")
        raise _unreachable(upstream, exc) from exc
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
        raise _timed_out(state, upstream) from exc
    except httpx.TransportError as exc:
        upstream.failures += 1
        state.pool.mark_down(upstream, f"{type(exc).__name__}: {exc}")
        raise _unreachable(upstream, exc) from exc
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
        yield sse_error_event(_body_of(_timed_out(state, upstream)))
    except httpx.TransportError as exc:
        upstream.failures += 1
        state.pool.mark_down(upstream, f"{type(exc).__name__} mid-stream: {exc}")
        yield sse_error_event(_body_of(_unreachable(upstream, exc)))


# --- routes -------------------------------------------------------------------------------------------------

def authorize(state: GatewayState, request: Request) -> None:
    token = state.config.api_token
    if token and not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {token}"):
        raise GatewayError(401, "missing or wrong bearer token", "invalid_api_key", "authentication_error")


async def read_json_object(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GatewayError(400, f"the request body is not valid JSON: {exc}", "invalid_json",
                           "invalid_request_error") from exc
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object", "invalid_json", "invalid_request_error")
    return body


async def generate(request: Request) -> Response:
    """``POST`` of a generating route: held while paused, then relayed to the rollout's upstream."""
    state = GatewayState.of(request)
    authorize(state, request)
    body = await read_json_object(request)
    served = state.config.served_model_name
    if body.get("model") != served:
        raise GatewayError(404, f"the model {body.get('model')!r} does not exist; this gateway serves {served!r}",
                           "model_not_found", "invalid_request_error")
    if not await state.gate.enter(state.config.pause_wait_s):
        raise GatewayError(503, f"the policy is being updated and the gateway is paused; retry in "
                                f"{state.config.retry_after_s} s", "gateway_paused",
                           retry_after_s=state.config.retry_after_s)
    lease = Lease(state.gate)
    streamed = False
    try:
        version = state.policy_version
        upstream = await acquire_upstream(state, rollout_key(request.headers), lease)
        assert upstream.model is not None
        upstream.requests += 1
        payload = rewrite_request(body, request.url.path, upstream.model, state.config.temperature)
        if body.get("stream"):
            response = await open_stream(state, upstream, request.url.path, payload, version, lease)
            streamed = isinstance(response, RelayedStream)
            return response
        return await forward(state, upstream, request.url.path, payload, version)
    finally:
        if not streamed:
            lease.release()


async def list_models(request: Request) -> Response:
    """The upstream's model card under the served name (so ``max_model_len`` and the like pass)."""
    state = GatewayState.of(request)
    authorize(state, request)
    try:
        upstream = state.pool.pick(None)
    except NoUpstreamError as exc:
        raise GatewayError(503, str(exc), "no_upstream", retry_after_s=state.config.retry_after_s) from exc
    try:
        reply = await state.client.get(f"{upstream.url}/v1/models", timeout=state.probe_timeout_s)
        reply.raise_for_status()
        card = dict(reply.json()["data"][0])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        state.pool.mark_down(upstream, f"GET /v1/models failed: {type(exc).__name__}: {exc}")
        raise _unreachable(upstream, exc) from exc
    upstream.model = str(card["id"])
    card["id"] = state.config.served_model_name
    card.pop("root", None)  # the upstream's checkpoint path means nothing to an agent
    return Response(encode_json({"object": "list", "data": [card]}), media_type="application/json",
                    headers={semconv.POLICY_VERSION_HEADER: str(state.policy_version)})


async def health(request: Request) -> Response:
    """200 while some upstream is up (503 otherwise), paused or not."""
    state = GatewayState.of(request)
    up = sum(1 for u in state.pool.upstreams if u.up)
    body = {"status": "ok" if up else "no upstream is up", "upstreams_up": up, "paused": state.gate.paused}
    return Response(encode_json(body), 200 if up else 503, media_type="application/json")


async def stats(request: Request) -> Response:
    state = GatewayState.of(request)
    authorize(state, request)
    return Response(encode_json(state.stats().to_dict()), media_type="application/json")


def _body_of(error: GatewayError) -> dict[str, Any]:
    return error_body(error.message, error.error_type, error.code)


async def handle_error(request: Request, exc: Exception) -> Response:
    """The one place a failure becomes an OpenAI-style error response."""
    if isinstance(exc, HTTPException):  # an unknown route or a wrong method
        what = "no route" if exc.status_code == 404 else str(exc.detail).lower()
        error = GatewayError(exc.status_code, f"{what}: {request.method} {request.url.path} (the gateway serves "
                             f"{', '.join(ROUTES)})", "not_found" if exc.status_code == 404 else
                             "method_not_allowed", "invalid_request_error")
    elif isinstance(exc, GatewayError):
        error = exc
    else:
        logger.error("gateway: unexpected error", exc_info=exc)
        error = GatewayError(500, f"internal gateway error: {type(exc).__name__}: {exc}", "internal_error")
    headers = {}
    if error.retry_after_s is not None:
        headers["retry-after"] = str(max(1, math.ceil(error.retry_after_s)))
        headers["retry-after-ms"] = str(round(error.retry_after_s * 1000))  # honoured by the openai client
    return Response(encode_json(_body_of(error)), error.status, headers=headers, media_type="application/json")


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


def create_app(state: GatewayState) -> Starlette:
    routes = [Route(path, generate, methods=["POST"]) for path in GENERATION_PATHS]
    routes += [Route("/v1/models", list_models, methods=["GET"]), Route(HEALTH_PATH, health, methods=["GET"]),
               Route(STATS_PATH, stats, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={Exception: handle_error, HTTPException: handle_error,
                                                       GatewayError: handle_error})
    app.state.gateway = state
    return app


__all__ = ["GatewayError", "GatewayState", "GatewayStats", "HEALTH_PATH", "PauseGate", "STATS_PATH", "create_app",
           "watch_upstreams"]
