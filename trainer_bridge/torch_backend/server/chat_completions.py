"""``POST /v1/chat/completions``: messages in, an assistant message (or its stream of chunks) out.

Included by ``app.create_app``. Parse the body (``protocol.ChatCompletionRequest``), render and
tokenize the messages (``chat_format``), hand the prompt to the engine (``serving``), build a
``ChatCompletionResponse`` or ``ChatCompletionChunk`` events. Tools: ``tools`` are rendered into
the prompt by the chat template, a ``tool_choice`` that names a function (or ``required``) is
steered by the opening of a call written at the end of the prompt (``tool_calls.tool_setup``),
and the reply's calls are parsed into ``tool_calls`` (streamed as ``ToolCallStream`` deltas).
``response_format``, strict tools and forced calls become a grammar the engine decodes under
(``structured_output.reply_grammar``). The fields listed in ``protocol.IGNORED_CHAT_FIELDS``
are accepted and ignored (logged once).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from spanrl.trainer_bridge.torch_backend.engine.requests import GenerationRequest, GenerationResult
from spanrl.trainer_bridge.torch_backend.server import chat_format
from spanrl.trainer_bridge.torch_backend.server.adapter_routing import request_adapter
from spanrl.trainer_bridge.torch_backend.server.errors import InvalidRequestError, error_body
from spanrl.trainer_bridge.torch_backend.server.logprobs import chat_logprobs
from spanrl.trainer_bridge.torch_backend.server.protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    ToolCallFunction,
    ToolCallOut,
    Usage,
)
from spanrl.trainer_bridge.torch_backend.server.serving import (
    SSE_DONE,
    ServedEngine,
    ServerState,
    StreamBridge,
    cancel_unfinished,
    check_model,
    event_stream_response,
    json_response,
    read_body,
    sampling_params,
    sse,
    start_completion,
    start_stream,
    stream_version,
    token_events,
    wait_result,
)
from spanrl.trainer_bridge.torch_backend.server.structured_output import (
    StructuredOutputError,
    chat_answer_format,
    reply_grammar,
)
from spanrl.trainer_bridge.torch_backend.server.tool_calls import (
    CallDelta,
    ParsedReply,
    ToolCallStream,
    ToolChoiceError,
    ToolSetup,
    tool_name,
    tool_setup,
)

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    state = ServerState.of(request)
    engine = state.engine
    body = await read_body(request, ChatCompletionRequest)
    check_model(state, body.model)
    setup = request_tool_setup(body)
    grammar = request_grammar(body, setup)
    prompt_ids = encode_messages(engine, body, setup)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    top_logprobs = body.top_logprobs or 0
    params = sampling_params(body, max_tokens, body.logprobs or top_logprobs > 0, top_logprobs)
    params.grammar = grammar
    params.adapter = request_adapter(engine, body.model, request.headers)
    response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        job, bridge = start_stream(engine, prompt_ids, params)
        version = await stream_version(engine, job, bridge)
        chunks = ChunkWriter(engine, body, job, response_id, created, version, setup)
        return event_stream_response(chunks.events(bridge), version)
    job, waiter = start_completion(engine, prompt_ids, params)
    result = await wait_result(job, waiter)
    completion = build_completion(engine, body, result, response_id, created, setup)
    return json_response(completion, result.policy_version)


def request_tool_setup(body: ChatCompletionRequest) -> ToolSetup:
    """The request's tools and tool_choice, checked (400 naming the field)."""
    for index, tool in enumerate(body.tools or ()):
        if tool.get("type", "function") != "function" or tool_name(tool) is None:
            raise InvalidRequestError(f"tools[{index}]: a tool is {{\"type\": \"function\", \"function\": "
                                      "{\"name\": ..., \"parameters\": ...}}", param=f"tools[{index}]")
    try:
        return tool_setup(body.tools, body.tool_choice, body.parallel_tool_calls)
    except ToolChoiceError as exc:
        raise InvalidRequestError(str(exc), param="tool_choice") from exc


def request_grammar(body: ChatCompletionRequest, setup: ToolSetup) -> str | None:
    """The grammar the reply must follow (``response_format``, strict tools, a forced call), or
    None; 400 naming the field for a format or schema that cannot be enforced."""
    try:
        return reply_grammar(chat_answer_format(body.response_format), setup)
    except StructuredOutputError as exc:
        raise InvalidRequestError(str(exc), param=exc.param) from exc


def request_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages in the form ``chat_format.render_chat`` takes."""
    rendered = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role, "content": chat_format.flatten_content(message.content)}
        if message.tool_calls:
            entry["tool_calls"] = [{"id": call.id, "type": "function",
                                    "function": {"name": call.function.name, "arguments": call.function.arguments}}
                                   for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        rendered.append(entry)
    return rendered


def encode_messages(engine: ServedEngine, body: ChatCompletionRequest, setup: ToolSetup | None = None) -> list[int]:
    """The prompt ids of the request's messages, its tools and the forced opening of a call
    (400 when the chat template rejects them)."""
    setup = setup or ToolSetup()
    try:
        text = chat_format.render_chat(engine.tokenizer, request_messages(body.messages), setup.tools)
    except Exception as exc:
        raise InvalidRequestError(f"the messages cannot be rendered with the chat template: {exc}",
                                  param="messages") from exc
    return chat_format.encode_text(engine.tokenizer, text + setup.forced_prefix)


def assistant_message(reply: ParsedReply) -> AssistantMessage:
    calls = [ToolCallOut(id=c.id, function=ToolCallFunction(name=c.name, arguments=c.arguments))
             for c in reply.tool_calls]
    return AssistantMessage(content=reply.content, tool_calls=calls or None)


def finish_reason_of(finish_reason: str | None, called: bool) -> str | None:
    """``tool_calls`` for a reply that ended on its own after calling tools (as OpenAI says)."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def build_completion(engine: ServedEngine, body: ChatCompletionRequest, result: GenerationResult,
                     response_id: str, created: int, setup: ToolSetup | None = None) -> ChatCompletionResponse:
    choices = []
    for choice in result.choices:
        output = chat_format.parse_assistant_output(choice.text, setup)
        logprobs = None
        if body.logprobs or body.top_logprobs:
            logprobs = chat_logprobs(engine.tokenizer, choice.token_ids, choice.logprobs or [], choice.top_logprobs)
        choices.append(ChatCompletionChoice(
            index=choice.index, message=assistant_message(output), logprobs=logprobs,
            finish_reason=finish_reason_of(choice.finish_reason, bool(output.tool_calls)),
            token_ids=body.id_list(choice.token_ids) if body.return_token_ids else None))
    completion_tokens = sum(len(c.token_ids) for c in result.choices)
    prompt_ids = result.prompt_token_ids
    return ChatCompletionResponse(
        id=response_id, created=created, model=body.model, choices=choices,
        usage=Usage.of(len(prompt_ids), completion_tokens),
        prompt_token_ids=body.id_list(prompt_ids) if body.return_token_ids else None,
        policy_version=result.policy_version)


class ChunkWriter:
    """The SSE events of one streamed chat completion: a first chunk with each choice's role
    (and the prompt's ids when asked for), one chunk per token, usage if asked for, ``[DONE]``.
    With tools, each choice's text goes through a ``ToolCallStream``: a token's chunk carries the
    content and call pieces it completed (maybe none: its id is still in ``token_ids``)."""

    def __init__(self, engine: ServedEngine, body: ChatCompletionRequest, job: GenerationRequest,
                 response_id: str, created: int, version: int, setup: ToolSetup | None = None):
        self.engine, self.body, self.job = engine, body, job
        self.response_id, self.created, self.version = response_id, created, version
        self.setup = setup or ToolSetup()
        self.streams: dict[int, ToolCallStream] = {}

    def delta(self, choice: int, text: str, finished: bool) -> tuple[DeltaMessage, bool]:
        """The delta of a choice's next text, and whether that choice has called a tool so far."""
        if not self.setup.parses_calls:
            return DeltaMessage(content=text), False
        stream = self.streams.get(choice)
        if stream is None:
            stream = self.streams[choice] = ToolCallStream(self.setup.parallel)
            stream.feed(self.setup.forced_prefix)
        piece = stream.feed(text)
        content, calls = piece.content, list(piece.calls)
        if finished:
            last = stream.finish()
            content, calls = content + last.content, calls + list(last.calls)
        tool_calls = delta_tool_calls(calls)
        return DeltaMessage(content=content if content or not tool_calls else None,
                            tool_calls=tool_calls or None), bool(stream.calls)

    def chunk(self, choices: list[ChatCompletionChunkChoice], usage: Usage | None = None,
              prompt_token_ids: list[int] | str | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.body.model,
                                   choices=choices, usage=usage, prompt_token_ids=prompt_token_ids,
                                   policy_version=self.version)

    async def events(self, bridge: StreamBridge) -> AsyncIterator[str]:
        body, job = self.body, self.job
        with_ids = body.return_token_ids
        try:
            yield sse(self.chunk(
                [ChatCompletionChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""),
                                           token_ids=[] if with_ids else None) for i in range(job.params.n)],
                prompt_token_ids=body.id_list(job.prompt_ids) if with_ids else None))
            completion_tokens = 0
            async for event in token_events(bridge):
                completion_tokens += 1
                logprobs = None
                if job.params.logprobs:
                    logprobs = chat_logprobs(self.engine.tokenizer, [event.token_id], [event.logprob or 0.0],
                                             [event.top_logprobs] if event.top_logprobs else None)
                delta, called = self.delta(event.choice, event.text, event.finish_reason is not None)
                yield sse(self.chunk([ChatCompletionChunkChoice(
                    index=event.choice, delta=delta, logprobs=logprobs,
                    finish_reason=finish_reason_of(event.finish_reason, called),
                    token_ids=[event.token_id] if with_ids else None)]))
            if job.error is not None:
                yield sse(error_body(job.error))
            if body.stream_options and body.stream_options.include_usage:
                yield sse(self.chunk([], usage=Usage.of(len(job.prompt_ids), completion_tokens)))
            yield SSE_DONE
        finally:
            cancel_unfinished(job)  # the client went away


def delta_tool_calls(pieces: Sequence[CallDelta]) -> list[DeltaToolCall]:
    """Call pieces as the chunk's ``tool_calls``: one entry per call, its fragments joined."""
    merged: dict[int, DeltaToolCall] = {}
    for piece in pieces:
        entry = merged.get(piece.index)
        if entry is None:
            merged[piece.index] = DeltaToolCall(
                index=piece.index, id=piece.id, type="function" if piece.id else None,
                function=DeltaFunction(name=piece.name, arguments=piece.arguments))
        else:
            entry.function.arguments = (entry.function.arguments or "") + piece.arguments
    return list(merged.values())


__all__ = ["router", "assistant_message", "build_completion", "delta_tool_calls", "encode_messages",
           "finish_reason_of", "request_grammar", "request_messages", "request_tool_setup", "ChunkWriter"]
