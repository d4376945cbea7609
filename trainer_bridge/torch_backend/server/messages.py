"""``POST /v1/messages``: Anthropic's Messages API (what the ``anthropic`` client and coding agents
pointed at a base URL call), served through the chat path.

Included by ``app.create_app``. The body (``messages_protocol.MessagesRequest``) becomes chat
messages, tools and a tool choice (``messages_translation``), rendered and tokenized as
``/v1/chat/completions`` renders them (``chat_format``), steered and constrained the same way
(``tool_calls.tool_setup``, ``structured_output.reply_grammar``); the engine's reply becomes a
``Message`` (``msg_...`` id, ``text`` / ``tool_use`` blocks, ``stop_reason``, ``usage``), or, with
``stream: true``, Anthropic's event sequence: ``message_start``, per block ``content_block_start``,
``content_block_delta`` (``text_delta`` / ``input_json_delta``) and ``content_block_stop``, then
``message_delta`` (``stop_reason``, ``usage.output_tokens``) and ``message_stop``; a failure mid-way
is an ``error`` event. Errors are Anthropic-shaped (``errors.error_response``); a body that does
not fit (no ``max_tokens``, a bad role) is a 400 naming the field.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from spanrl.trainer_bridge.torch_backend.engine.requests import GenerationRequest, GenerationResult
from spanrl.trainer_bridge.torch_backend.server import chat_format
from spanrl.trainer_bridge.torch_backend.server.adapter_routing import request_adapter
from spanrl.trainer_bridge.torch_backend.server.errors import InvalidRequestError, anthropic_error_body, as_api_error
from spanrl.trainer_bridge.torch_backend.server.messages_protocol import (
    MESSAGES_PATH,
    Message,
    MessagesRequest,
    MessageUsage,
)
from spanrl.trainer_bridge.torch_backend.server.messages_translation import (
    chat_messages,
    content_blocks,
    matched_stop,
    request_tool_setup,
    sampling_params,
    stop_reason,
    unread_block_types,
)
from spanrl.trainer_bridge.torch_backend.server.serving import (
    ServedEngine,
    ServerState,
    StreamBridge,
    cancel_unfinished,
    check_model,
    event_stream_response,
    json_response,
    read_body,
    start_completion,
    start_stream,
    stream_version,
    token_events,
    wait_result,
)
from spanrl.trainer_bridge.torch_backend.server.structured_output import (
    AnswerFormat,
    StructuredOutputError,
    reply_grammar,
)
from spanrl.trainer_bridge.torch_backend.server.tool_calls import CallDelta, ToolCallStream, ToolSetup

router = APIRouter()


@router.post(MESSAGES_PATH)
async def create_message(request: Request) -> Response:
    state = ServerState.of(request)
    engine = state.engine
    body = await read_messages_request(request)
    check_model(state, body.model)
    messages, prefill = chat_messages(body)
    setup = request_tool_setup(body)
    params = sampling_params(body)
    params.adapter = request_adapter(engine, body.model, request.headers)
    try:
        params.grammar = reply_grammar(AnswerFormat(), setup)
    except StructuredOutputError as exc:
        raise InvalidRequestError(str(exc), param="tools") from exc
    prompt_ids = encode_prompt(engine, messages, setup, prefill)
    message_id = f"msg_{uuid.uuid4().hex}"
    if body.stream:
        job, bridge = start_stream(engine, prompt_ids, params)
        version = await stream_version(engine, job, bridge)
        writer = MessageEvents(engine, body, job, message_id, version, setup)
        return event_stream_response(writer.events(bridge), version)
    job, waiter = start_completion(engine, prompt_ids, params)
    result = await wait_result(job, waiter)
    return json_response(build_message(engine, body, result, message_id, setup), result.policy_version)


async def read_messages_request(request: Request) -> MessagesRequest:
    """The body as a ``MessagesRequest``: a 400 naming the field when it does not fit (as
    Anthropic's API answers); its ignored fields and unread block types are logged once."""
    try:
        body = await read_body(request, MessagesRequest)
    except ValidationError as exc:
        error = as_api_error(exc)
        raise InvalidRequestError(error.message, param=error.param) from exc
    ignored = body.ignored_fields() + unread_block_types(body)
    if ignored:
        ServerState.of(request).ignored_fields.note(request.url.path, ignored)
    return body


def encode_prompt(engine: ServedEngine, messages: list[dict[str, Any]], setup: ToolSetup, prefill: str) -> list[int]:
    """The prompt ids: the chat rendered with its tools, then the prefill and a forced call's opening."""
    try:
        text = chat_format.render_chat(engine.tokenizer, messages, setup.tools)
    except Exception as exc:
        raise InvalidRequestError(f"the messages cannot be rendered with the chat template: {exc}",
                                  param="messages") from exc
    return chat_format.encode_text(engine.tokenizer, text + prefill + setup.forced_prefix)


def build_message(engine: ServedEngine, body: MessagesRequest, result: GenerationResult, message_id: str,
                  setup: ToolSetup) -> Message:
    choice = result.choices[0]
    reply = chat_format.parse_assistant_output(choice.text, setup)
    stop = None
    if choice.finish_reason == "stop" and not reply.tool_calls:
        stop = matched_stop(engine.tokenizer, choice.token_ids, choice.text, tuple(body.stop_sequences or ()))
    with_ids = body.return_token_ids
    return Message(id=message_id, model=body.model, content=content_blocks(reply),
                   stop_reason=stop_reason(choice.finish_reason, bool(reply.tool_calls), stop), stop_sequence=stop,
                   usage=MessageUsage(input_tokens=len(result.prompt_token_ids), output_tokens=len(choice.token_ids)),
                   prompt_token_ids=body.id_list(result.prompt_token_ids) if with_ids else None,
                   token_ids=body.id_list(choice.token_ids) if with_ids else None, policy_version=result.policy_version)


def sse_event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


class MessageEvents:
    """The server-sent events of one streamed message. Text opens a ``text`` block; with tools,
    the reply goes through a ``ToolCallStream`` and each call opens a ``tool_use`` block whose
    arguments stream as ``input_json_delta`` pieces."""

    def __init__(self, engine: ServedEngine, body: MessagesRequest, job: GenerationRequest, message_id: str,
                 version: int, setup: ToolSetup) -> None:
        self.engine, self.body, self.job, self.message_id, self.version = engine, body, job, message_id, version
        self.calls: ToolCallStream | None = None
        if setup.parses_calls:
            self.calls = ToolCallStream(setup.parallel)
            self.calls.feed(setup.forced_prefix)
        self.block = -1  # index of the open block, -1 before the first
        self.block_open: str | None = None  # "text" | "tool_use" while a block is open
        self.token_ids: list[int] = []
        self.text = ""

    def start(self) -> str:
        message = Message(id=self.message_id, model=self.body.model, content=[],
                          usage=MessageUsage(input_tokens=len(self.job.prompt_ids), output_tokens=0),
                          prompt_token_ids=(self.body.id_list(self.job.prompt_ids) if self.body.return_token_ids
                                            else None),
                          token_ids=None, policy_version=self.version)
        return sse_event("message_start", {"type": "message_start", "message": message.model_dump(by_alias=True)})

    def _open(self, block: dict[str, Any]) -> list[str]:
        events = self._close()
        self.block += 1
        self.block_open = block["type"]
        events.append(sse_event("content_block_start", {"type": "content_block_start", "index": self.block,
                                                        "content_block": block}))
        return events

    def _close(self) -> list[str]:
        if self.block_open is None:
            return []
        self.block_open = None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": self.block})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.block, "delta": delta})

    def pieces(self, text: str, finished: bool) -> list[str]:
        """The events the reply's next text makes."""
        content = text
        calls: tuple[CallDelta, ...] = ()
        if self.calls is not None:
            piece = self.calls.feed(text)
            content, calls = piece.content, piece.calls
            if finished:
                last = self.calls.finish()
                content, calls = content + last.content, calls + last.calls
        events: list[str] = []
        if content:
            if self.block_open != "text":
                events += self._open({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": content}))
        for call in calls:
            events += self._call_events(call)
        return events

    def _call_events(self, call: CallDelta) -> list[str]:
        events: list[str] = []
        if call.id is not None:
            events += self._open({"type": "tool_use", "id": call.id.replace("call_", "toolu_", 1),
                                  "name": call.name, "input": {}})
        if call.arguments:
            events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return events

    def finish(self, finish_reason: str | None) -> list[str]:
        called = self.calls is not None and bool(self.calls.calls)
        stop = None
        if finish_reason == "stop" and not called:
            stop = matched_stop(self.engine.tokenizer, self.token_ids, self.text, tuple(self.body.stop_sequences or ()))
        reason = stop_reason(finish_reason, called, stop)
        delta: dict[str, Any] = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop},
                                 "usage": {"output_tokens": len(self.token_ids)}}
        if self.body.return_token_ids:
            delta["token_ids"] = self.body.id_list(self.token_ids)
        return [*self._close(), sse_event("message_delta", delta), sse_event("message_stop", {"type": "message_stop"})]

    async def events(self, bridge: StreamBridge) -> AsyncIterator[str]:
        try:
            yield self.start()
            finish_reason = None
            async for event in token_events(bridge):
                self.token_ids.append(event.token_id)
                self.text += event.text
                for piece in self.pieces(event.text, event.finish_reason is not None):
                    yield piece
                finish_reason = event.finish_reason or finish_reason
            if self.job.error is not None:
                yield sse_event("error", anthropic_error_body(self.job.error).model_dump())
                return
            for piece in self.finish(finish_reason):
                yield piece
        finally:
            cancel_unfinished(self.job)  # the client went away


__all__ = ["MessageEvents", "build_message", "create_message", "encode_prompt", "read_messages_request", "router"]
