"""``POST /v1/completions``: a text prompt (or prompt token ids) in, its continuations out.

Included by ``app.create_app``. Parse the body (``protocol.CompletionRequest``), tokenize the
prompt (``chat_format.encode_text``) unless it is ids already, hand it to the engine
(``serving``), build a ``CompletionResponse`` (streamed: one per token, as OpenAI does).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

from fastapi import APIRouter, Request
from fastapi.responses import Response

from spanrl.trainer_bridge.torch_backend.engine.requests import (
    EngineError,
    GenerationRequest,
    GenerationResult,
)
from spanrl.trainer_bridge.torch_backend.server import chat_format
from spanrl.trainer_bridge.torch_backend.server.adapter_routing import request_adapter
from spanrl.trainer_bridge.torch_backend.server.errors import InvalidRequestError, error_body
from spanrl.trainer_bridge.torch_backend.server.logprobs import completion_logprobs
from spanrl.trainer_bridge.torch_backend.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
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

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    state = ServerState.of(request)
    engine = state.engine
    body = await read_body(request, CompletionRequest)
    check_model(state, body.model)
    if body.echo:
        raise InvalidRequestError("echo is not supported by this server", param="echo")
    if isinstance(body.prompt, str):
        prompt_ids = chat_format.encode_text(engine.tokenizer, body.prompt)
    else:
        prompt_ids = list(body.prompt)
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    params = sampling_params(body, max_tokens, body.logprobs is not None, body.logprobs or 0)
    params.adapter = request_adapter(engine, body.model, request.headers)
    response_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        with _prompt_is_the_param():
            job, bridge = start_stream(engine, prompt_ids, params)
        version = await stream_version(engine, job, bridge)
        writer = CompletionChunkWriter(engine, body, job, response_id, created, version)
        return event_stream_response(writer.events(bridge), version)
    with _prompt_is_the_param():
        job, waiter = start_completion(engine, prompt_ids, params)
    result = await wait_result(job, waiter)
    return json_response(build_completion(engine, body, result, response_id, created), result.policy_version)


@contextmanager
def _prompt_is_the_param() -> Iterator[None]:
    """The engine speaks of chats (``messages``); this endpoint's request has a ``prompt``."""
    try:
        yield
    except EngineError as exc:
        if exc.param == "messages":
            exc.param = "prompt"
        raise


def build_completion(engine: ServedEngine, body: CompletionRequest, result: GenerationResult,
                     response_id: str, created: int) -> CompletionResponse:
    with_ids = body.return_token_ids
    choices = []
    for choice in result.choices:
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(engine.tokenizer, choice.token_ids, choice.logprobs or [],
                                           choice.top_logprobs)
        choices.append(CompletionChoice(
            index=choice.index, text=choice.text, logprobs=logprobs, finish_reason=choice.finish_reason,
            prompt_token_ids=body.id_list(result.prompt_token_ids) if with_ids else None,
            token_ids=body.id_list(choice.token_ids) if with_ids else None))
    completion_tokens = sum(len(c.token_ids) for c in result.choices)
    return CompletionResponse(id=response_id, created=created, model=body.model, choices=choices,
                              usage=Usage.of(len(result.prompt_token_ids), completion_tokens),
                              policy_version=result.policy_version)


class CompletionChunkWriter:
    """The SSE events of one streamed completion: one chunk per token (a choice's first one
    carries the prompt's ids when asked for), usage if asked for, ``[DONE]``."""

    def __init__(self, engine: ServedEngine, body: CompletionRequest, job: GenerationRequest,
                 response_id: str, created: int, version: int):
        self.engine, self.body, self.job = engine, body, job
        self.response_id, self.created, self.version = response_id, created, version

    def chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.body.model,
                                  choices=choices, usage=usage, policy_version=self.version)

    async def events(self, bridge: StreamBridge) -> AsyncIterator[str]:
        body, job = self.body, self.job
        with_ids = body.return_token_ids
        started: set[int] = set()  # choices whose first token was sent
        completion_tokens = 0
        try:
            async for event in token_events(bridge):
                completion_tokens += 1
                logprobs = None
                if job.params.logprobs:
                    logprobs = completion_logprobs(self.engine.tokenizer, [event.token_id], [event.logprob or 0.0],
                                                   [event.top_logprobs] if event.top_logprobs else None)
                first = event.choice not in started
                started.add(event.choice)
                yield sse(self.chunk([CompletionChoice(
                    index=event.choice, text=event.text, logprobs=logprobs, finish_reason=event.finish_reason,
                    prompt_token_ids=body.id_list(job.prompt_ids) if with_ids and first else None,
                    token_ids=[event.token_id] if with_ids else None)]))
            if job.error is not None:
                yield sse(error_body(job.error))
            if body.stream_options and body.stream_options.include_usage:
                yield sse(self.chunk([], usage=Usage.of(len(job.prompt_ids), completion_tokens)))
            yield SSE_DONE
        finally:
            cancel_unfinished(job)  # the client went away


__all__ = ["router", "build_completion", "CompletionChunkWriter", "DEFAULT_MAX_TOKENS"]
