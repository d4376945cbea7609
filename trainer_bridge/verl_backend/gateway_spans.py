"""The verl gateway's LLM span per generation request (``trainer_bridge/endpoint_spans.py``).

``gateway_app.create_app`` adds ``GatewaySpanMiddleware`` when spans are configured
(``GatewayConfig.spans_endpoint``, else the environment as ``spanrl serve`` reads it). The gateway
asks every upstream for token ids and logprobs, so the replies it relays carry them: each
successful JSON reply and each stream event passes ``gateway_rewrite.rewrite_reply``, which hands
it to ``observe_reply``; once the response is sent the middleware gives the call to
``EndpointSpans``, whose thread reads those replies with the agent side's ``LLMSpanRecorder``.
Without a call in progress (spans off, another route) ``observe_reply`` is one context-variable read.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Any

from spanrl.trainer_bridge.endpoint_spans import GENERATING_PATHS, EndpointSpans, ServedCall, served_call_for

_current: ContextVar[ServedCall | None] = ContextVar("spanrl_gateway_call", default=None)


def observe_reply(data: Any) -> None:
    """A successful reply body (or one stream event's data) the current call is sending."""
    call = _current.get()
    if call is not None and isinstance(data, dict):
        call.replies.append(data)


def note_request_model(name: str) -> None:
    """The model name the current call asked for (``gen_ai.request.model`` on its span)."""
    call = _current.get()
    if call is not None:
        call.request_model = name


class GatewaySpanMiddleware:
    """ASGI middleware: one ``ServedCall`` per generating request, handed to ``spans`` when done."""

    def __init__(self, app: Any, spans: EndpointSpans) -> None:
        self.app = app
        self.spans = spans

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        call = served_call_for(scope, "gateway")
        if call is None:
            await self.app(scope, receive, send)
            return
        status = 500

        async def watched_send(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                content_type = dict(message.get("headers") or ()).get(b"content-type", b"")
                call.streaming = content_type.startswith(b"text/event-stream")
            await send(message)

        token = _current.set(call)
        try:
            await self.app(scope, receive, watched_send)
        finally:
            _current.reset(token)
            if status < 400 and call.replies:
                call.end_ns = time.time_ns()
                self.spans.submit(call)


__all__ = ["GatewaySpanMiddleware", "GENERATING_PATHS", "note_request_model", "observe_reply"]
