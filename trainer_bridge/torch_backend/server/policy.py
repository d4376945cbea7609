"""spanrl's own routes over the served policy: ``GET /spanrl/v1/policy`` (version, model, the
engine's counters) and ``POST /spanrl/v1/weights`` (``{"path": HF dir, "version": N}``: load
those weights into the running engine, a hot swap between batches), and ``GET /health``.

Included by ``app.create_app``. The engine's calls block (a disk read, or a round trip to the
engine's process), so they run on a worker thread, not on the event loop.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from spanrl.trainer_bridge.torch_backend.server.protocol import PolicyResponse, WeightsRequest, WeightsResponse
from spanrl.trainer_bridge.torch_backend.server.serving import ServerState, json_response, read_body

router = APIRouter()

HEALTH_PATH = "/health"


@router.get(HEALTH_PATH)
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/spanrl/v1/policy")
async def describe_policy(request: Request) -> Response:
    engine = ServerState.of(request).engine
    policy = PolicyResponse.model_validate(await run_in_threadpool(engine.describe))
    return json_response(policy, policy.version)


@router.post("/spanrl/v1/weights")
async def load_weights(request: Request) -> Response:
    engine = ServerState.of(request).engine
    body = await read_body(request, WeightsRequest)
    await run_in_threadpool(engine.load_weights_from_dir, body.path, body.version)
    return json_response(WeightsResponse(version=engine.version, model=engine.model_name), engine.version)


__all__ = ["router", "HEALTH_PATH"]
