"""A relay's HTTP app (Starlette): the routes every relay serves and the one place a failure
becomes an error response (OpenAI's shape; Anthropic's on ``/v1/messages``).

``create_relay_app(state, extra_routes)`` is called by the verl gateway (``gateway_app.py``, which
adds its stats route) and by ``spanrl proxy`` (``proxy.py``); it runs with uvicorn on a loop of its
own (``server_thread.py``). Routes: ``POST /v1/chat/completions``, ``/v1/completions``,
``/v1/responses`` and Anthropic's ``/v1/messages`` (relayed to an upstream that speaks it, streamed or
not; its errors in Anthropic's shape); ``GET /v1/models`` (a relay with a
served name answers the upstream's card under each of its names, else the upstream's list
passes); ``GET /health``; ``GET`` and
``POST /spanrl/v1/prompts`` (``endpoint_prompts.py``). Middleware: the prompt resources (the
agent's instructions replaced, when a candidate is set) inside the span middleware (one LLM span
per generation request, when spans are configured).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from spanrl.instrumentation import semconv
from spanrl.trainer_bridge.adapter_specs import choose_adapter, names_an_adapter
from spanrl.trainer_bridge.endpoint_prompts import PROMPTS_PATH, install_prompt_resources
from spanrl.trainer_bridge.endpoint_spans import EndpointSpans, call_agent
from spanrl.trainer_bridge.prompt_resources import PromptResources
from spanrl.trainer_bridge.relay import spans
from spanrl.trainer_bridge.relay.forwarding import (
    RelayedStream,
    acquire_upstream,
    build_request,
    forward,
    open_stream,
    unreachable,
)
from spanrl.trainer_bridge.relay.packed_replies import note_id_form
from spanrl.trainer_bridge.relay.rewrite import GENERATION_PATHS, answer_as, encode_json, rewrite_request
from spanrl.trainer_bridge.relay.spans import RelaySpanMiddleware
from spanrl.trainer_bridge.relay.state import Lease, RelayError, RelayState
from spanrl.trainer_bridge.relay.upstreams import NoUpstreamError, rollout_key

logger = logging.getLogger(__name__)

HEALTH_PATH = "/health"
MODELS_PATH = "/v1/models"


async def read_limited_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is known to exceed ``limit`` bytes (declared in
    ``Content-Length`` or while a chunked body streams in)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RelayError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                         "request_too_large", "invalid_request_error")
    parts, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RelayError(413, f"request body of {size} bytes or more exceeds the limit of {limit} bytes",
                                 "request_too_large", "invalid_request_error")
            parts.append(chunk)
    except ClientDisconnect as exc:  # the client left mid-body: its doing, not the relay's error
        raise RelayError(400, "the client went away before its request body arrived", "client_disconnected",
                         "invalid_request_error") from exc
    return b"".join(parts)


async def read_json_object(request: Request) -> dict[str, Any]:
    raw = await read_limited_body(request, RelayState.of(request).config.max_body_bytes)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RelayError(400, f"the request body is not valid JSON: {exc}", "invalid_json",
                         "invalid_request_error") from exc
    except RecursionError as exc:  # nested deeper than Python recurses
        raise RelayError(400, "the request body is nested too deeply", "invalid_json",
                         "invalid_request_error") from exc
    if not isinstance(body, dict):
        raise RelayError(400, "the request body must be a JSON object", "invalid_json", "invalid_request_error")
    return body


async def generate(request: Request) -> Response:
    """``POST`` of a generating route: admitted (a gateway holds it while paused), then relayed."""
    state = RelayState.of(request)
    state.authorize(request)
    body = await read_json_object(request)
    names = state.config.names
    adapters = dict(state.config.adapters)
    if names is not None:
        if not names.accepts(body.get("model")) and not names_an_adapter(adapters, body.get("model")):
            raise RelayError(404, names.not_found(body.get("model")), "model_not_found", "invalid_request_error")
        answer_as(str(body["model"]))  # replies carry the name the agent asked for
    elif state.config.upstream_model and isinstance(body.get("model"), str):
        answer_as(body["model"])  # the proxy sends its own name upstream; the agent gets its own back
    try:
        note_id_form(request.headers, body)  # replies pack their ids when the agent's instrumentation asked
    except ValueError as exc:
        raise RelayError(400, str(exc), "invalid_value", "invalid_request_error") from None
    lease = await state.admit()
    streamed = False
    try:
        version = state.policy_version
        upstream = await acquire_upstream(state, rollout_key(request.headers), lease)
        upstream.requests += 1
        adapter = request_adapter(adapters, body.get("model"), request.headers) if adapters else None
        payload = rewrite_request(body, request.url.path, state.config, adapter or upstream.model,
                                  request.headers.get(semconv.ROLLOUT_ID_HEADER, ""))
        spans.observe_request(payload)
        upstream_request = build_request(state, upstream, request.url.path, payload, state.upstream_headers(request))
        if body.get("stream"):
            response = await open_stream(state, upstream, upstream_request, version, lease)
            streamed = isinstance(response, RelayedStream)
            return response
        return await forward(state, upstream, upstream_request, version)
    finally:
        if not streamed:
            lease.release()


def request_adapter(adapters: dict[str, tuple[str, ...]], model: object, headers: Any) -> str | None:
    """The upstream adapter that serves this call (``adapter_specs.choose_adapter``: by the model
    name, then the caller's agent), noted on its span; None: the base model."""
    adapter = choose_adapter(adapters, model, call_agent({key.lower(): value for key, value in headers.items()}))
    if adapter is not None:
        spans.note_adapter(adapter)
    return adapter


async def list_models(request: Request) -> Response:
    """With a served name: the upstream's model card under each listed name (so ``max_model_len``
    and the like pass); without: the upstream's own list, as it answers."""
    state = RelayState.of(request)
    state.authorize(request)
    try:
        upstream = state.pool.pick(None)
    except NoUpstreamError as exc:
        raise RelayError(503, str(exc), "no_upstream", retry_after_s=state.config.retry_after_s) from exc
    if state.config.served_model_name is None:
        lease = Lease()
        upstream.in_flight += 1
        lease.upstream = upstream
        try:
            upstream_request = build_request(state, upstream, MODELS_PATH, None, state.upstream_headers(request))
            return await forward(state, upstream, upstream_request, state.policy_version)
        finally:
            lease.release()
    try:
        reply = await state.client.get(f"{upstream.base_url}/models", timeout=state.probe_timeout_s,
                                       headers=state.upstream_headers(None))
        reply.raise_for_status()
        card = dict(reply.json()["data"][0])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        state.pool.mark_down(upstream, f"GET /v1/models failed: {type(exc).__name__}: {exc}")
        raise unreachable(state, upstream, exc) from exc
    upstream.model = str(card["id"])
    card.pop("root", None)  # the upstream's checkpoint path means nothing to an agent
    names = state.config.names
    assert names is not None
    cards = [{**card, "id": name} for name in (*names.names, *dict(state.config.adapters))]
    headers = {} if state.policy_version is None else {semconv.POLICY_VERSION_HEADER: str(state.policy_version)}
    return Response(encode_json({"object": "list", "data": cards}), media_type="application/json", headers=headers)


async def health(request: Request) -> Response:
    """200 while some upstream is in rotation (503 otherwise)."""
    state = RelayState.of(request)
    up = sum(1 for u in state.pool.upstreams if u.up)
    body = {"status": "ok" if up else "no upstream is up", "upstreams_up": up, **state.health_details()}
    return Response(encode_json(body), 200 if up else 503, media_type="application/json")


async def handle_error(request: Request, exc: Exception) -> Response:
    """The one place a failure becomes an OpenAI-style error response."""
    name = RelayState.of(request).config.name
    if isinstance(exc, HTTPException):  # an unknown route or a wrong method
        what = "no route" if exc.status_code == 404 else str(exc.detail).lower()
        routes = ", ".join(request.app.state.route_names)
        error = RelayError(exc.status_code, f"{what}: {request.method} {request.url.path} (the {name} serves "
                           f"{routes})", "not_found" if exc.status_code == 404 else "method_not_allowed",
                           "invalid_request_error")
    elif isinstance(exc, RelayError):
        error = exc
    elif isinstance(exc, RecursionError):  # a body nested deeply enough to break re-encoding it
        error = RelayError(400, "the request body is nested too deeply", "invalid_json", "invalid_request_error")
    else:  # its text stays in the log: no exception text in a response body
        logger.error("%s: unexpected error", name, exc_info=exc)
        error = RelayError(500, f"internal {name} error (its details are in the {name}'s log)", "internal_error")
    if error.upstream_failure:
        spans.observe_failure(error.message)
    headers = {}
    if error.retry_after_s is not None:
        headers["retry-after"] = str(max(1, math.ceil(error.retry_after_s)))
        headers["retry-after-ms"] = str(round(error.retry_after_s * 1000))  # honoured by the openai client
    return Response(encode_json(error.body(request.url.path)), error.status, headers=headers,
                    media_type="application/json")


def route_names(routes: Sequence[BaseRoute]) -> list[str]:
    return [f"{method} {route.path}" for route in routes if isinstance(route, Route)
            for method in sorted(route.methods or ()) if method != "HEAD"]


def create_relay_app(state: RelayState, extra_routes: Sequence[Route] = (),
                     prompts: PromptResources | None = None) -> Starlette:
    """The relay's app over ``state`` (``app.state.relay``), with ``extra_routes`` (a gateway's stats)."""
    routes: list[Route] = [Route(path, generate, methods=["POST"]) for path in GENERATION_PATHS]
    routes += [Route(MODELS_PATH, list_models, methods=["GET"]), Route(HEALTH_PATH, health, methods=["GET"]),
               *extra_routes]
    app = Starlette(routes=routes, exception_handlers={Exception: handle_error, HTTPException: handle_error,
                                                       RelayError: handle_error})
    app.state.relay = state
    if prompts is None:
        prompts = PromptResources.from_file(state.config.prompts) if state.config.prompts else PromptResources()
    install_prompt_resources(app, prompts, state.config.api_token)
    app.state.route_names = [*route_names(routes), f"GET {PROMPTS_PATH}", f"POST {PROMPTS_PATH}"]
    app.state.endpoint_spans = endpoint_spans = EndpointSpans.from_environment(state.config.spans_endpoint)
    if endpoint_spans is not None:
        app.add_middleware(RelaySpanMiddleware, spans=endpoint_spans, name=state.config.name,
                           record_text=state.config.record_text)
    return app


__all__ = ["HEALTH_PATH", "MODELS_PATH", "create_relay_app", "handle_error", "read_json_object"]
