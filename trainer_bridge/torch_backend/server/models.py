"""``GET /v1/models``: the names this server's one model answers to (``model_names.py``; the
first is its own) and its per-agent LoRA adapters' names (``adapter_routing.py``), its context
length, and per route the request fields it implements and
those it accepts but ignores (``protocol.REQUEST_FIELDS``, ``responses_protocol.RESPONSES_REQUEST_FIELDS``,
``messages_protocol.MESSAGES_REQUEST_FIELDS``).

Included by ``app.create_app``. The header carries the serving policy version, which the
engine's side pushes to a front end in another process as weights are swapped in.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from spanrl.trainer_bridge.torch_backend.server.adapter_routing import engine_adapters
from spanrl.trainer_bridge.torch_backend.server.messages_protocol import MESSAGES_REQUEST_FIELDS
from spanrl.trainer_bridge.torch_backend.server.protocol import REQUEST_FIELDS, ModelCard, ModelList
from spanrl.trainer_bridge.torch_backend.server.responses_protocol import RESPONSES_REQUEST_FIELDS
from spanrl.trainer_bridge.torch_backend.server.serving import ServerState, json_response

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = ServerState.of(request)
    engine = state.engine
    fields = {**REQUEST_FIELDS, **RESPONSES_REQUEST_FIELDS, **MESSAGES_REQUEST_FIELDS}
    cards = [ModelCard(id=name, max_model_len=engine.context_length, request_fields=fields)
             for name in [*state.served_names().names, *engine_adapters(engine)]]
    return json_response(ModelList(data=cards), engine.version)


__all__ = ["router"]
