"""A relay's LLM span per generation request (``trainer_bridge/endpoint_spans.py``).

``app.create_relay_app`` adds ``RelaySpanMiddleware`` when spans are configured
(``RelayConfig.spans_endpoint``, else the environment as ``spanrl serve`` reads it). Each
successful JSON reply and each stream event passes ``rewrite.rewrite_reply``, which hands it to
``observe_reply``; with ``record_text`` the route hands the request it sent upstream to
``observe_request``; a failure of the upstream (unreachable, too slow, 5xx, or cut off mid-stream)
reaches ``observe_failure``. Once the response is sent the middleware gives the call to
``EndpointSpans``, whose thread builds the span: the replies' token ids (when the upstream returned
them) and the text, or the failure as the span's ERROR status, so a rollout of an uninstrumented
agent whose call failed is a failed rollout. A refused request (4xx) makes no span. Without a call
in progress (spans off, another route) the ``observe_*`` functions are one context-variable read.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Any

from spanrl.instrumentation import semconv
from spanrl.trainer_bridge.endpoint_spans import EndpointSpans, served_call_for, serving, serving_call

_record_text: ContextVar[bool] = ContextVar("spanrl_relay_record_text", default=False)


def observe_reply(data: Any) -> None:
    """A successful reply body (or one stream event's data) the current call is sending."""
    call = serving_call()
    if call is not None and isinstance(data, dict):
        call.replies.append(data)


def note_request_model(name: str) -> None:
    """The model name the current call asked for (``gen_ai.request.model`` on its span)."""
    call = serving_call()
    if call is not None:
        call.request_model = name


def note_adapter(name: str) -> None:
    """The LoRA adapter the current call is served by (``spanrl.llm.adapter`` on its span)."""
    call = serving_call()
    if call is not None:
        call.attributes[semconv.LLM_ADAPTER] = name


def observe_request(payload: dict[str, Any]) -> None:
    """The body the current call sent upstream (kept for the span's text when the relay records it)."""
    call = serving_call()
    if call is not None and _record_text.get():
        call.request = payload


def observe_failure(message: str) -> None:
    """The upstream failed the current call: its span ends with ERROR and this description."""
    call = serving_call()
    if call is not None and call.error is None:
        call.error = message


class RelaySpanMiddleware:
    """ASGI middleware: one ``ServedCall`` per generating request, handed to ``spans`` when done."""

    def __init__(self, app: Any, spans: EndpointSpans, name: str = "relay", record_text: bool = False) -> None:
        self.app = app
        self.spans = spans
        self.name = name
        self.record_text = record_text

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        call = served_call_for(scope, self.name)
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

        text_token = _record_text.set(self.record_text)
        try:
            with serving(call):
                await self.app(scope, receive, watched_send)
        finally:
            _record_text.reset(text_token)
            if call.error is not None or (status < 400 and call.replies):
                call.end_ns = time.time_ns()
                self.spans.submit(call)


__all__ = ["RelaySpanMiddleware", "note_request_model", "observe_failure", "observe_reply", "observe_request"]
