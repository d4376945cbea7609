"""The gateway's HTTP app (Starlette): its routes and the one place a failure becomes an
OpenAI-style error response.

Built by ``gateway.GatewayHandle`` (the public API, documented in ``gateway.py``), which runs it
with uvicorn on a loop of its own; everything here runs on that loop. Routes: ``POST
/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``; ``GET /v1/models``, ``/health``,
``/spanrl/gateway/stats``. The state they share is in ``gateway_state``, talking to upstreams in
``gateway_relay``, body changes in ``gateway_rewrite``, upstream choice in ``gateway_upstreams``.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from spanrl.bridge_protocol import is_validation_rollout
from spanrl.instrumentation import semconv
from spanrl.trainer_bridge.endpoint_spans import EndpointSpans
from spanrl.trainer_bridge.verl_backend.gateway_relay import (
    RelayedStream,
    acquire_upstream,
    forward,
    open_stream,
    unreachable,
)
from spanrl.trainer_bridge.verl_backend.gateway_rewrite import (
    GENERATION_PATHS,
    answer_as,
    encode_json,
    rewrite_request,
)
from spanrl.trainer_bridge.verl_backend.gateway_spans import GatewaySpanMiddleware
from spanrl.trainer_bridge.verl_backend.gateway_state import GatewayError, GatewayState, Lease
from spanrl.trainer_bridge.verl_backend.gateway_upstreams import NoUpstreamError, rollout_key

logger = logging.getLogger(__name__)

HEALTH_PATH = "/health"
STATS_PATH = "/spanrl/gateway/stats"
ROUTES = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "GET /v1/models",
          f"GET {HEALTH_PATH}", f"GET {STATS_PATH}")


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
    names = state.config.names
    if not names.accepts(body.get("model")):
        raise GatewayError(404, names.not_found(body.get("model")), "model_not_found", "invalid_request_error")
    answer_as(str(body["model"]))  # replies carry the name the agent asked for
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
        if state.config.validation_temperature is not None and is_validation_rollout(
                request.headers.get(semconv.ROLLOUT_ID_HEADER, "")):
            payload["temperature"] = state.config.validation_temperature  # not trained on: any temperature
        if body.get("stream"):
            response = await open_stream(state, upstream, request.url.path, payload, version, lease)
            streamed = isinstance(response, RelayedStream)
            return response
        return await forward(state, upstream, request.url.path, payload, version)
    finally:
        if not streamed:
            lease.release()


async def list_models(request: Request) -> Response:
    """The upstream's model card under each listed name (so ``max_model_len`` and the like pass)."""
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
        raise unreachable(upstream, exc) from exc
    upstream.model = str(card["id"])
    card.pop("root", None)  # the upstream's checkpoint path means nothing to an agent
    cards = [{**card, "id": name} for name in state.config.names.names]
    return Response(encode_json({"object": "list", "data": cards}), media_type="application/json",
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
    return Response(encode_json(error.body()), error.status, headers=headers, media_type="application/json")


def create_app(state: GatewayState) -> Starlette:
    routes = [Route(path, generate, methods=["POST"]) for path in GENERATION_PATHS]
    routes += [Route("/v1/models", list_models, methods=["GET"]), Route(HEALTH_PATH, health, methods=["GET"]),
               Route(STATS_PATH, stats, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={Exception: handle_error, HTTPException: handle_error,
                                                       GatewayError: handle_error})
    app.state.gateway = state
    app.state.endpoint_spans = spans = EndpointSpans.from_environment(state.config.spans_endpoint)
    if spans is not None:
        app.add_middleware(GatewaySpanMiddleware, spans=spans)
    return app


__all__ = ["HEALTH_PATH", "ROUTES", "STATS_PATH", "create_app", "handle_error"]
