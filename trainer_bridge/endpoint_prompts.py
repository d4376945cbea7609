"""Prompt resources at the policy endpoints: the one place a request's instructions are replaced,
the routes that show and change the candidates, and a client for those routes.

``install_prompt_resources(app, resources, api_token)`` is called by every endpoint's app factory
(``spanrl serve``'s ``torch_backend/server/app.py``, the relay's ``relay/app.py`` for the verl
gateway and ``spanrl proxy``). It adds:

- ``PromptMiddleware`` (ASGI): on ``POST /v1/chat/completions``, ``/v1/responses`` and
  ``/v1/messages`` (Anthropic's ``system``), reads the
  body, asks ``PromptResources.choose`` for the call's agent (W3C baggage), model and rollout
  (baggage or ``x-spanrl-rollout-id``), and hands the route the body with the candidate's
  instructions (``prompt_resources.substitute_instructions``). The call's span, when one is
  recorded, gets ``spanrl.prompt.resource`` and ``spanrl.prompt.candidate``. With no resources it
  passes requests through untouched.
- ``GET /spanrl/v1/prompts``: ``{"resources": {name: {"active", "candidates", "assigned_rollouts"}}}``.
- ``POST /spanrl/v1/prompts``: ``{"resource": name, "candidates"?: {...}, "active"?: name | null,
  "rollouts"?: {rollout id: candidate}, "remove"?: true}``; answers the resource as it is then.
  What an optimizer (APO) calls to serve candidates per rollout, in any endpoint's process.

Both routes need ``Authorization: Bearer <token>`` when the endpoint has a token; errors are
OpenAI-style bodies (400 naming what is wrong, 401).
"""

from __future__ import annotations

import json
import logging
import secrets
import urllib.error
import urllib.request
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from spanrl.errors import UserError
from spanrl.instrumentation import semconv
from spanrl.trainer_bridge.endpoint_spans import call_origin, serving_call
from spanrl.trainer_bridge.prompt_resources import (
    CHAT_PATH,
    MESSAGES_PATH,
    RESPONSES_PATH,
    PromptResourceError,
    PromptResources,
    substitute_instructions,
)

logger = logging.getLogger(__name__)

PROMPTS_PATH = "/spanrl/v1/prompts"
SUBSTITUTING_PATHS = frozenset({CHAT_PATH, RESPONSES_PATH, MESSAGES_PATH})


class PromptMiddleware:
    """ASGI middleware: a generation request's instructions as the prompt resources say."""

    def __init__(self, app: Any, resources: PromptResources) -> None:
        self.app = app
        self.resources = resources

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in SUBSTITUTING_PATHS
                or self.resources.empty):
            await self.app(scope, receive, send)
            return
        try:
            body, ended = await _read_body(receive)
        except Exception as exc:  # noqa: BLE001 - e.g. a body limit: raised again where the route reads
            failure = exc

            async def failing_receive() -> Any:
                raise failure

            await self.app(scope, failing_receive, send)
            return
        if ended is None:
            body = self._substituted(scope, body)
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        delivered = False

        async def replayed_receive() -> Any:
            nonlocal delivered
            if not delivered:
                delivered = True
                return ended or {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replayed_receive, send)

    def _substituted(self, scope: Any, body: bytes) -> bytes:
        """``body`` with the chosen candidate's instructions; unchanged when none is chosen or the
        body is not a JSON object (the route answers that)."""
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return body
        if not isinstance(data, dict):
            return body
        served = serving_call()
        if served is not None:
            identity = served.origin.attributes
        else:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            identity = call_origin(headers).attributes
        rollout_id, agent = identity.get(semconv.ROLLOUT_ID), identity.get(semconv.AGENT_NAME)
        model = data.get("model")
        choice = self.resources.choose(agent if isinstance(agent, str) else None,
                                       model if isinstance(model, str) else None,
                                       rollout_id if isinstance(rollout_id, str) else None)
        if choice is None:
            return body
        substituted = substitute_instructions(data, scope["path"], choice.text)
        if substituted is None:
            return body
        if served is not None:
            served.attributes[semconv.PROMPT_RESOURCE] = choice.resource
            served.attributes[semconv.PROMPT_CANDIDATE] = choice.candidate
        return json.dumps(substituted).encode()


async def _read_body(receive: Any) -> tuple[bytes, dict[str, Any] | None]:
    """The whole request body, and the message that ended it early (a disconnect), if one did."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), message
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), None


def _error(status: int, message: str, code: str, error_type: str = "invalid_request_error") -> Response:
    return JSONResponse({"error": {"message": message, "type": error_type, "param": None, "code": code}}, status)


def _authorized(request: Request) -> bool:
    token = request.app.state.prompt_token
    return not token or secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {token}")


async def list_prompts(request: Request) -> Response:
    if not _authorized(request):
        return _error(401, "missing or wrong bearer token", "invalid_api_key", "authentication_error")
    return JSONResponse({"resources": request.app.state.prompt_resources.snapshot()})


async def update_prompts(request: Request) -> Response:
    if not _authorized(request):
        return _error(401, "missing or wrong bearer token", "invalid_api_key", "authentication_error")
    resources: PromptResources = request.app.state.prompt_resources
    try:
        update = json.loads(await request.body())
        if not isinstance(update, dict):
            raise PromptResourceError("the body must be a JSON object")
        name = apply_update(resources, update)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return _error(400, f"the request body is not valid JSON: {exc}", "invalid_json")
    except PromptResourceError as exc:
        return _error(400, str(exc), "invalid_prompt_resource")
    logger.info("prompt resource %r updated: %s", name, sorted(k for k in update if k != "resource"))
    return JSONResponse({"resource": name, **resources.snapshot().get(name, {"removed": True})})


def apply_update(resources: PromptResources, update: dict[str, Any]) -> str:
    """Apply one ``POST /spanrl/v1/prompts`` body; returns the resource's name."""
    name = update.get("resource")
    if not isinstance(name, str) or not name:
        raise PromptResourceError("'resource' must name the prompt resource (an agent or model name)")
    unknown = sorted(set(update) - {"resource", "candidates", "active", "rollouts", "remove"})
    if unknown:
        raise PromptResourceError(f"unknown keys {unknown}; an update takes resource, candidates, active, "
                                  "rollouts, remove")
    if update.get("remove"):
        resources.remove(name)
        return name
    if "candidates" in update:
        resources.set_candidates(name, update["candidates"], update.get("active"))
    elif "active" in update:
        resources.set_active(name, update["active"])
    rollouts = update.get("rollouts")
    if rollouts is not None:
        if not isinstance(rollouts, dict):
            raise PromptResourceError("'rollouts' must map rollout ids to candidate names")
        resources.assign(name, rollouts)
    return name


def install_prompt_resources(app: Any, resources: PromptResources, api_token: str | None) -> None:
    """Add the middleware and the two routes to a Starlette (or FastAPI) ``app``. Call it before
    adding the app's other middleware, so that they wrap it (a span middleware must)."""
    app.state.prompt_resources = resources
    app.state.prompt_token = api_token
    app.add_middleware(PromptMiddleware, resources=resources)
    app.add_route(PROMPTS_PATH, list_prompts, methods=["GET"])
    app.add_route(PROMPTS_PATH, update_prompts, methods=["POST"])


class PromptResourcesClient:
    """``GET`` / ``POST /spanrl/v1/prompts`` of an endpoint (``url``: its root or its ``/v1`` base URL)."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/").removesuffix("/v1") + PROMPTS_PATH
        self.token, self.timeout_s = token, timeout_s

    def resources(self) -> dict[str, Any]:
        return self._call(None)["resources"]

    def update(self, resource: str, **fields: Any) -> dict[str, Any]:
        """``fields``: ``candidates``, ``active``, ``rollouts``, ``remove`` (see the module docstring)."""
        return self._call({"resource": resource, **fields})

    def _call(self, body: dict[str, Any] | None) -> dict[str, Any]:
        headers = {"content-type": "application/json"}
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url, data=data, headers=headers, method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            raise UserError(f"{self.url} answered {exc.code}: {_error_text(exc)}") from exc
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise UserError(f"cannot reach {self.url}: {reason}; is the endpoint running?") from exc


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read())["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return exc.reason


__all__ = ["PROMPTS_PATH", "PromptMiddleware", "PromptResourcesClient", "apply_update", "install_prompt_resources"]
