"""spanrl's own routes over the served policy: ``GET /spanrl/v1/policy`` (version, model, the
engine's counters), ``POST /spanrl/v1/weights`` (``{"path": HF dir, "version": N}``: load
those weights into the running engine, a hot swap between batches) and ``GET /health``.

Loading weights is the trainer's act, never an agent's: the route is off unless the server was
given a ``WeightsAdmin`` (``spanrl serve --admin-token T --weights-dir DIR``), and then takes
only that admin token (the agents' token gets 403), only model directories under its folder
(403 otherwise) and only versions above the serving one (409 otherwise; the engine checks that
again where the swap happens). ``spanrl train``'s own backends swap weights in memory and never
turn the route on, so no runner or agent is ever handed a credential for it.

Included by ``app.create_app``, which exempts this route from the agents' token check. The
engine's calls block (a disk read, or a round trip to the engine's process), so they run on a
worker thread, not on the event loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from spanrl.server_security import bearer_token_matches
from spanrl.trainer_bridge.torch_backend.server.errors import (
    AuthenticationError,
    ConflictError,
    PermissionDeniedError,
)
from spanrl.trainer_bridge.torch_backend.server.protocol import PolicyResponse, WeightsRequest, WeightsResponse
from spanrl.trainer_bridge.torch_backend.server.serving import ServerState, json_response, read_body

router = APIRouter()

HEALTH_PATH = "/health"
WEIGHTS_PATH = "/spanrl/v1/weights"


@dataclass(frozen=True)
class WeightsAdmin:
    """Who may load weights over HTTP, and from where: the trainer's bearer ``token`` (never the
    agents') and the folder (the run's output folder) whose model directories it may load."""

    token: str
    root: str

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("WeightsAdmin needs a token")
        object.__setattr__(self, "root", os.path.realpath(self.root))

    def allowed_dir(self, path: str) -> str:
        """``path`` resolved (symbolic links followed), if it lies under ``root``; else 403."""
        resolved = os.path.realpath(path)
        if os.path.commonpath([resolved, self.root]) != self.root:
            raise PermissionDeniedError(
                f"{path!r} is outside the folder this server loads weights from ({self.root}); write the "
                "model directory under it", param="path", code="path_not_allowed")
        return resolved


def check_weights_caller(state: ServerState, authorization: str | None) -> WeightsAdmin:
    """The server's ``WeightsAdmin`` if ``authorization`` carries its token: 403 when the route
    is off or the caller holds the agents' token, 401 for a missing or unknown token."""
    admin = state.weights_admin
    if admin is None:
        raise PermissionDeniedError(
            "loading weights over HTTP is off on this server: the trainer swaps them itself; a standalone "
            "`spanrl serve` turns it on with --admin-token and --weights-dir", code="weights_route_off")
    if bearer_token_matches(authorization, admin.token):
        return admin
    if state.api_token and bearer_token_matches(authorization, state.api_token):
        raise PermissionDeniedError("the agents' token may call the model but not load weights; this route "
                                    "takes the admin token", code="admin_token_required")
    raise AuthenticationError("missing or wrong admin token: send 'Authorization: Bearer <admin token>'",
                              code="invalid_api_key")


@router.get(HEALTH_PATH)
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/spanrl/v1/policy")
async def describe_policy(request: Request) -> Response:
    engine = ServerState.of(request).engine
    policy = PolicyResponse.model_validate(await run_in_threadpool(engine.describe))
    return json_response(policy, policy.version)


@router.post(WEIGHTS_PATH)
async def load_weights(request: Request) -> Response:
    state = ServerState.of(request)
    admin = check_weights_caller(state, request.headers.get("authorization"))
    body = await read_body(request, WeightsRequest)
    path = admin.allowed_dir(body.path)
    engine = state.engine
    if body.version <= engine.version:  # said at once; the engine checks again where it swaps
        raise ConflictError(f"version {body.version} is not above the serving version {engine.version}",
                            param="version", code="version_not_newer")
    await run_in_threadpool(engine.load_weights_from_dir, path, body.version)
    return json_response(WeightsResponse(version=engine.version, model=engine.model_name), engine.version)


__all__ = ["router", "HEALTH_PATH", "WEIGHTS_PATH", "WeightsAdmin", "check_weights_caller"]
