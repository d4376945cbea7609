"""``GET /v1/models``: the one model this server serves, its context length, and per route the
request fields it implements and those it accepts but ignores (``protocol.REQUEST_FIELDS``,
``responses_protocol.RESPONSES_REQUEST_FIELDS``).

Included by ``app.create_app``. The header carries the serving policy version, which the
engine's side pushes to a front end in another process as weights are swapped in.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from spanrl.trainer_bridge.torch_backend.server.protocol import REQUEST_FIELDS, ModelCard, ModelList
from spanrl.trainer_bridge.torch_backend.server.responses_protocol import RESPONSES_REQUEST_FIELDS
from spanrl.trainer_bridge.torch_backend.server.serving import ServerState, json_response

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    engine = ServerState.of(request).engine
    card = ModelCard(id=engine.model_name, max_model_len=engine.context_length,
                     request_fields={**REQUEST_FIELDS, **RESPONSES_REQUEST_FIELDS})
    return json_response(ModelList(data=[card]), engine.version)


__all__ = ["router"]
