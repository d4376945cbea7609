"""``POST /v1/chat/completions``: messages in, an assistant message (or its stream of chunks) out.

Included by ``app.create_app``. Parse the body (``protocol.ChatCompletionRequest``), render and
tokenize the messages (``chat_format``), hand the prompt to the engine (``serving``), build a
``ChatCompletionResponse`` or ``ChatCompletionChunk`` events. ``tools`` and the other fields
listed in ``protocol.IGNORED_CHAT_FIELDS`` are accepted and ignored (logged once) until tool
calling lands in ``chat_format``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from spanrl.trainer_bridge.torch_backend.engine.requests import GenerationRequest, GenerationResult
from spanrl.trainer_bridge.torch_backend.server import chat_format
from spanrl.trainer_bridge.torch_backend.server.errors import InvalidRequestError, error_body
from spanrl.trainer_bridge.torch_backend.server.logprobs import chat_logprobs
from spanrl.trainer_bridge.torch_backend.server.protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
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

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    engine = ServerState.of(request).engine
    body = await read_body(request, ChatCompletionRequest)
    check_model(engine, body.model)
    prompt_ids = encode_messages(engine, body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    top_logprobs = body.top_logprobs or 0
    params = sampling_params(body, max_tokens, body.logprobs or top_logprobs > 0, top_logprobs)
    response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        job, bridge = start_stream(engine, prompt_ids, params)
        version = await stream_version(engine, job, bridge)
        chunks = ChunkWriter(engine, body, job, response_id, created, version)
        return event_stream_response(chunks.events(bridge), version)
    job, waiter = start_completion(engine, prompt_ids, params)
    result = await wait_result(job, waiter)
    completion = build_completion(engine, body, result, response_id, created)
    return json_response(completion, result.policy_version)


def encode_messages(engine: ServedEngine, body: ChatCompletionRequest) -> list[int]:
    """The prompt ids of the request's messages (400 when the chat template rejects them)."""
    messages = [{"role": m.role, "content": chat_format.flatten_content(m.content)} for m in body.messages]
    try:
        return chat_format.encode_chat(engine.tokenizer, messages)
    except Exception as exc:
        raise InvalidRequestError(f"the messages cannot be rendered with the chat template: {exc}",
                                  param="messages") from exc


def build_completion(engine: ServedEngine, body: ChatCompletionRequest, result: GenerationResult,
                     response_id: str, created: int) -> ChatCompletionResponse:
    choices = []
    for choice in result.choices:
        output = chat_format.parse_assistant_output(choice.text)
        logprobs = None
        if body.logprobs or body.top_logprobs:
            logprobs = chat_logprobs(engine.tokenizer, choice.token_ids, choice.logprobs or [], choice.top_logprobs)
        choices.append(ChatCompletionChoice(
            index=choice.index, message=AssistantMessage(content=output.content), logprobs=logprobs,
            finish_reason=choice.finish_reason, token_ids=choice.token_ids if body.return_token_ids else None))
    completion_tokens = sum(len(c.token_ids) for c in result.choices)
    prompt_ids = result.prompt_token_ids
    return ChatCompletionResponse(
        id=response_id, created=created, model=engine.model_name, choices=choices,
        usage=Usage.of(len(prompt_ids), completion_tokens),
        prompt_token_ids=prompt_ids if body.return_token_ids else None,
        policy_version=result.policy_version)


class ChunkWriter:
    """The SSE events of one streamed chat completion: a first chunk with each choice's role
    (and the prompt's ids when asked for), one chunk per token, usage if asked for, ``[DONE]``."""

    def __init__(self, engine: ServedEngine, body: ChatCompletionRequest, job: GenerationRequest,
                 response_id: str, created: int, version: int):
        self.engine, self.body, self.job = engine, body, job
        self.response_id, self.created, self.version = response_id, created, version

    def chunk(self, choices: list[ChatCompletionChunkChoice], usage: Usage | None = None,
              prompt_token_ids: list[int] | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.engine.model_name,
                                   choices=choices, usage=usage, prompt_token_ids=prompt_token_ids,
                                   policy_version=self.version)

    async def events(self, bridge: StreamBridge) -> AsyncIterator[str]:
        body, job = self.body, self.job
        with_ids = body.return_token_ids
        try:
            yield sse(self.chunk(
                [ChatCompletionChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""),
                                           token_ids=[] if with_ids else None) for i in range(job.params.n)],
                prompt_token_ids=job.prompt_ids if with_ids else None))
            completion_tokens = 0
            async for event in token_events(bridge):
                completion_tokens += 1
                logprobs = None
                if job.params.logprobs:
                    logprobs = chat_logprobs(self.engine.tokenizer, [event.token_id], [event.logprob or 0.0],
                                             [event.top_logprobs] if event.top_logprobs else None)
                yield sse(self.chunk([ChatCompletionChunkChoice(
                    index=event.choice, delta=DeltaMessage(content=event.text), logprobs=logprobs,
                    finish_reason=event.finish_reason, token_ids=[event.token_id] if with_ids else None)]))
            if job.error is not None:
                yield sse(error_body(job.error))
            if body.stream_options and body.stream_options.include_usage:
                yield sse(self.chunk([], usage=Usage.of(len(job.prompt_ids), completion_tokens)))
            yield SSE_DONE
        finally:
            cancel_unfinished(job)  # the client went away


__all__ = ["router", "build_completion", "encode_messages", "ChunkWriter"]
