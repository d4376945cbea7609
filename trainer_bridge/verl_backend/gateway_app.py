"""The gateway's HTTP app: the relay's app (``relay/app.py``: generation routes, models, health,
prompts, errors) plus the gateway's stats route.

Built by ``gateway.GatewayHandle`` (the public API, documented in ``gateway.py``) on the
gateway's loop. What is the gateway's own is in ``gateway_state`` (the pause gate, the stats).
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from spanrl.trainer_bridge.prompt_resources import PromptResources
from spanrl.trainer_bridge.relay.app import HEALTH_PATH, create_relay_app
from spanrl.trainer_bridge.relay.rewrite import encode_json
from spanrl.trainer_bridge.relay.state import RelayState
from spanrl.trainer_bridge.verl_backend.gateway_state import GatewayState

STATS_PATH = "/spanrl/gateway/stats"


async def stats(request: Request) -> Response:
    state = RelayState.of(request)
    state.authorize(request)
    assert isinstance(state, GatewayState)
    return Response(encode_json(state.stats().to_dict()), media_type="application/json")


def create_app(state: RelayState, prompts: PromptResources | None = None) -> Starlette:
    """The gateway's app over its ``GatewayState``; ``prompts``: its prompt resources (None: from
    ``GatewayConfig.prompts``)."""
    assert isinstance(state, GatewayState)
    return create_relay_app(state, [Route(STATS_PATH, stats, methods=["GET"])], prompts)


__all__ = ["HEALTH_PATH", "STATS_PATH", "create_app"]
