"""``/v1/responses``: OpenAI's Responses API (what the OpenAI Agents SDK calls by default).

Included by ``app.create_app``. ``POST /v1/responses`` turns ``instructions`` + the stored
conversation of ``previous_response_id`` + ``input`` into chat messages (``responses_input``),
renders and tokenizes them (``chat_format``), hands the prompt to the engine (``serving``) and
answers with a response object, or with the event sequence the ``openai`` client parses
(``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` per token,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``,
``response.completed``; with tools, a ``function_call`` item per call after the message: see
docs/policy.md, Tool calling). As vLLM does on this route: ``enable_response_messages`` returns the
prompt's and the reply's ids (``input_messages`` / ``output_messages``), ``include:
["message.output_text.logprobs"]`` the logprobs, and a reply cut by ``max_output_tokens`` ends
with ``response.completed`` whose status is ``incomplete``. ``text.format``, strict function tools
and a forced call become a grammar the engine decodes under (``structured_output.reply_grammar``).
With ``store`` (the default) the conversation is kept (``response_store``) for follow-ups and
``GET /v1/responses/{id}``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response

from spanrl.trainer_bridge.torch_backend.engine.requests import GenerationRequest, SamplingParams
from spanrl.trainer_bridge.torch_backend.server import chat_format
from spanrl.trainer_bridge.torch_backend.server.adapter_routing import request_adapter
from spanrl.trainer_bridge.torch_backend.server.errors import InvalidRequestError, NotFoundError, as_api_error
from spanrl.trainer_bridge.torch_backend.server.logprobs import TopRow, chat_logprobs
from spanrl.trainer_bridge.torch_backend.server.response_store import ResponseStore, StoredResponse
from spanrl.trainer_bridge.torch_backend.server.responses_input import (
    Message,
    input_messages,
    instructions_messages,
)
from spanrl.trainer_bridge.torch_backend.server.responses_protocol import (
    IncompleteDetails,
    OutputFunctionCall,
    OutputLogprob,
    OutputMessage,
    OutputText,
    RawMessageTokens,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
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
    StructuredOutputError,
    reply_grammar,
    responses_answer_format,
)
from spanrl.trainer_bridge.torch_backend.server.tool_calls import (
    CallDelta,
    ParsedReply,
    StreamPiece,
    ToolCallStream,
    ToolChoiceError,
    ToolSetup,
    tool_setup,
)

router = APIRouter()
OutputItem = OutputMessage | OutputFunctionCall


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    state = ServerState.of(request)
    engine = state.engine
    body = await read_body(request, ResponsesRequest)
    ignored = body.ignored_fields()
    if ignored:
        state.ignored_fields.note(request.url.path, ignored)
    check_model(state, body.model)
    conversation = previous_conversation(state.response_store, body.previous_response_id)
    conversation += input_messages(body.input)
    if not conversation:
        raise InvalidRequestError("input: the request has no message to answer", param="input")
    setup = response_tool_setup(body)
    turn = ResponseTurn(engine, state.response_store, body, conversation, setup)
    params = sampling_params(body)
    params.grammar = response_grammar(body, setup)
    params.adapter = request_adapter(engine, body.model, request.headers)
    if body.stream:
        job, bridge = start_stream(engine, turn.prompt_ids, params)
        version = await stream_version(engine, job, bridge)
        return event_stream_response(turn.events(job, bridge, version, params), version)
    job, waiter = start_completion(engine, turn.prompt_ids, params)
    result = await wait_result(job, waiter)
    choice = result.choices[0]
    reply = chat_format.parse_assistant_output(choice.text, turn.setup)
    logprobs = turn.logprobs(choice.token_ids, choice.logprobs, choice.top_logprobs) if body.wants_logprobs else None
    response = turn.finish(reply, choice.token_ids, logprobs, choice.finish_reason, result.policy_version, params,
                           sampled_text=choice.text)
    return json_response(response, result.policy_version)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    state = ServerState.of(request)
    stored = _stored(state.response_store, response_id, "response_id")
    return json_response(stored.body, stored.body.policy_version)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    state = ServerState.of(request)
    if not state.response_store.delete(response_id):
        _stored(state.response_store, response_id, "response_id")  # raises the 404
    body = json.dumps({"id": response_id, "object": "response.deleted", "deleted": True})
    return Response(body, media_type="application/json")


def previous_conversation(store: ResponseStore, previous_response_id: str | None) -> list[Message]:
    """The messages of the conversation ``previous_response_id`` ended (404 for an unknown id)."""
    if previous_response_id is None:
        return []
    return list(_stored(store, previous_response_id, "previous_response_id").messages)


def _stored(store: ResponseStore, response_id: str, param: str) -> StoredResponse:
    stored = store.get(response_id)
    if stored is None:
        raise NotFoundError(f"no stored response with id {response_id!r}: it was never made, made with "
                            "store=false, deleted, or dropped from the server's bounded store", param=param,
                            code="previous_response_not_found" if param == "previous_response_id" else None)
    return stored


def response_tool_setup(body: ResponsesRequest) -> ToolSetup:
    """The request's function tools in the chat-completions form the template renders, and what
    its tool_choice asks for (400 naming the field)."""
    tools = []
    strict = set()
    for index, tool in enumerate(body.tools or ()):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise InvalidRequestError(f"tools[{index}]: this server offers function tools only, "
                                      "{\"type\": \"function\", \"name\": ..., \"parameters\": ...}",
                                      param=f"tools[{index}]")
        function = {key: value for key, value in tool.items() if key not in ("type", "strict")}
        tools.append({"type": "function", "function": function})
        if tool.get("strict") is not False:  # the Responses API's function tools are strict by default
            strict.add(tool["name"])
    try:
        return tool_setup(tools, body.tool_choice, body.parallel_tool_calls, strict=frozenset(strict))
    except ToolChoiceError as exc:
        raise InvalidRequestError(str(exc), param="tool_choice") from exc


def response_grammar(body: ResponsesRequest, setup: ToolSetup) -> str | None:
    """The grammar the reply must follow (``text.format``, strict tools, a forced call), or None."""
    try:
        return reply_grammar(responses_answer_format(body.text), setup)
    except StructuredOutputError as exc:
        raise InvalidRequestError(str(exc), param=exc.param) from exc


def sampling_params(body: ResponsesRequest) -> SamplingParams:
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    top_k = body.top_k if body.top_k is not None else 0
    return SamplingParams(
        max_tokens=body.max_output_tokens,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=0 if top_k == -1 else top_k, n=1, stop=stops, seed=body.seed,
        logprobs=body.wants_logprobs, top_logprobs=body.top_logprobs or 0,
    )


class ResponseTurn:
    """One call: its prompt, the response object at each stage, and storing it when done."""

    def __init__(self, engine: ServedEngine, store: ResponseStore, body: ResponsesRequest,
                 conversation: list[Message], setup: ToolSetup | None = None):
        self.engine, self.store, self.body, self.conversation = engine, store, body, conversation
        self.setup = setup or ToolSetup()
        self.response_id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        try:
            self.prompt_text = chat_format.render_chat(
                engine.tokenizer, instructions_messages(body.instructions) + conversation, self.setup.tools)
        except Exception as exc:
            raise InvalidRequestError(f"the input cannot be rendered with the chat template: {exc}",
                                      param="input") from exc
        self.prompt_text += self.setup.forced_prefix  # the opening of a call tool_choice asks for
        self.prompt_ids = chat_format.encode_text(engine.tokenizer, self.prompt_text)

    def response(self, status: Any, version: int, params: SamplingParams, output: list[OutputItem] | None = None,
                 **fields: Any) -> ResponsesResponse:
        body = self.body
        tool_fields: dict[str, Any] = {"tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
                                       "parallel_tool_calls": body.parallel_tool_calls is not False}
        if body.text and isinstance(body.text.get("format"), dict):  # echoed, as OpenAI does
            tool_fields["text"] = {"format": body.text["format"]}
        return ResponsesResponse(**tool_fields,
            id=self.response_id, created_at=self.created_at, status=status, instructions=body.instructions,
            max_output_tokens=body.max_output_tokens, metadata=body.metadata, model=body.model,
            output=output or [], previous_response_id=body.previous_response_id, store=body.store,
            temperature=params.temperature, top_p=params.top_p, top_logprobs=body.top_logprobs,
            policy_version=version, **fields)

    def logprobs(self, token_ids: list[int], logprobs: list[float] | None,
                 top: list[list[tuple[int, float]]] | list[TopRow] | None) -> list[OutputLogprob]:
        entries = chat_logprobs(self.engine.tokenizer, token_ids, logprobs or [], top).content
        return [OutputLogprob.model_validate(entry.model_dump()) for entry in entries]

    def message(self, text: str, logprobs: list[OutputLogprob] | None, status: Any) -> OutputMessage:
        return OutputMessage(id=self.message_id, status=status, content=[OutputText(text=text, logprobs=logprobs)])

    def finish(self, reply: ParsedReply, token_ids: list[int], logprobs: list[OutputLogprob] | None,
               finish_reason: str | None, version: int, params: SamplingParams,
               sampled_text: str | None = None, with_message: bool = False) -> ResponsesResponse:
        """The finished response (stored when asked to): ``status`` incomplete when cut by length;
        a message item for the reply's content (or for an empty reply; always ``with_message``, as
        a stream opened one, and with logprobs, which its text part carries for every sampled
        token), a ``function_call`` item per call."""
        incomplete = finish_reason == "length"
        status: Literal["incomplete", "completed"] = "incomplete" if incomplete else "completed"
        extras: dict[str, Any] = {}
        if self.body.enable_response_messages:
            extras["input_messages"] = [RawMessageTokens(message=self.prompt_text,
                                                         tokens=self.body.id_list(self.prompt_ids))]
            output_text = sampled_text if sampled_text is not None else reply.content or ""
            extras["output_messages"] = [RawMessageTokens(message=output_text, tokens=self.body.id_list(token_ids))]
        output: list[OutputItem] = []
        if reply.content or not reply.tool_calls or with_message or logprobs is not None:
            output.append(self.message(reply.content or "", logprobs, status))
        output += [OutputFunctionCall(id=function_call_item_id(call.id), call_id=call.id, name=call.name,
                                      arguments=call.arguments, status=status) for call in reply.tool_calls]
        response = self.response(
            status, version, params, output=output, usage=ResponseUsage.of(len(self.prompt_ids), len(token_ids)),
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None, **extras)
        if self.body.store:
            answer = chat_format.chat_message("assistant", reply.content, reply.tool_calls)
            self.store.put(self.response_id, StoredResponse(messages=(*self.conversation, answer), body=response))
        return response

    async def events(self, job: GenerationRequest, bridge: StreamBridge, version: int,
                     params: SamplingParams) -> AsyncIterator[str]:
        """The server-sent events of a streamed response, ending with ``response.completed``."""
        sequence = _Sequence()
        place = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        try:
            started = self.response("in_progress", version, params)
            yield sequence.event("response.created", response=started)
            yield sequence.event("response.in_progress", response=started)
            yield sequence.event("response.output_item.added", output_index=0,
                                 item=OutputMessage(id=self.message_id, status="in_progress", content=[]))
            yield sequence.event("response.content_part.added", **place,
                                 part=OutputText(text="", logprobs=[] if self.body.wants_logprobs else None))
            token_ids: list[int] = []
            texts: list[str] = []
            logprobs: list[OutputLogprob] = []
            finish_reason = None
            splitter = ToolCallStream(self.setup.parallel) if self.setup.parses_calls else None
            if splitter is not None:
                splitter.feed(self.setup.forced_prefix)
            said: list[str] = []  # the content streamed
            async for token in token_events(bridge):
                token_ids.append(token.token_id)
                texts.append(token.text)
                finish_reason = token.finish_reason or finish_reason
                step: list[OutputLogprob] = []
                if self.body.wants_logprobs:
                    step = self.logprobs([token.token_id], [token.logprob or 0.0],
                                         [token.top_logprobs] if token.top_logprobs else None)
                    logprobs.extend(step)
                piece = StreamPiece(token.text) if splitter is None else splitter.feed(token.text)
                said.append(piece.content)
                if splitter is None or piece.content or step:
                    yield sequence.event("response.output_text.delta", **place, delta=piece.content, logprobs=step)
                for event in self._call_events(sequence, splitter, piece.calls):
                    yield event
            if job.error is not None:
                error = as_api_error(job.error)
                yield sequence.event("error", code=error.code or error.error_type, message=error.message,
                                     param=error.param)
                return
            if splitter is not None:
                last = splitter.finish()
                said.append(last.content)
                if last.content:
                    yield sequence.event("response.output_text.delta", **place, delta=last.content, logprobs=[])
                for event in self._call_events(sequence, splitter, last.calls):
                    yield event
            content = "".join(said)
            reply = ParsedReply(content or None, tuple(splitter.calls)) if splitter and splitter.calls \
                else ParsedReply(content)
            kept_logprobs = logprobs if self.body.wants_logprobs else None
            done = self.finish(reply, token_ids, kept_logprobs, finish_reason, version, params,
                               sampled_text="".join(texts), with_message=True)
            message = done.output[0]
            assert isinstance(message, OutputMessage)
            yield sequence.event("response.output_text.done", **place, text=message.content[0].text, logprobs=logprobs)
            yield sequence.event("response.content_part.done", **place, part=message.content[0])
            yield sequence.event("response.output_item.done", output_index=0, item=message)
            for index, call in enumerate(done.output[1:], start=1):
                assert isinstance(call, OutputFunctionCall)
                yield sequence.event("response.function_call_arguments.done", output_index=index, item_id=call.id,
                                     arguments=call.arguments)
                yield sequence.event("response.output_item.done", output_index=index, item=call)
            yield sequence.event("response.completed", response=done)
        finally:
            cancel_unfinished(job)  # the client went away


    @staticmethod
    def _call_events(sequence: _Sequence, splitter: ToolCallStream | None,
                     pieces: tuple[CallDelta, ...]) -> list[str]:
        """The events of streamed call pieces: a ``function_call`` item opens at a call's first
        piece (after the message item: output index 1 + the call's), then its arguments' deltas."""
        events = []
        for piece in pieces:
            assert splitter is not None
            call = splitter.calls[piece.index]
            item_id = function_call_item_id(call.id)
            if piece.id is not None:
                item = OutputFunctionCall(id=item_id, call_id=call.id, name=call.name, arguments="",
                                          status="in_progress")
                events.append(sequence.event("response.output_item.added", output_index=1 + piece.index, item=item))
            if piece.arguments:
                events.append(sequence.event("response.function_call_arguments.delta", output_index=1 + piece.index,
                                             item_id=item_id, delta=piece.arguments))
        return events


def function_call_item_id(call_id: str) -> str:
    """The ``id`` of the ``function_call`` output item of call ``call_...``."""
    return f"fc_{call_id.removeprefix('call_')}"


class _Sequence:
    """Numbers a stream's events and writes each as ``event: <type>`` + ``data: <json>``."""

    def __init__(self) -> None:
        self.next = 0

    def event(self, event_type: str, **fields: Any) -> str:
        data = {"type": event_type, "sequence_number": self.next}
        self.next += 1
        parts = [json.dumps(data)[:-1]]
        for key, value in fields.items():
            encoded = value.to_json() if hasattr(value, "to_json") else _dumps(value)
            parts.append(f", {json.dumps(key)}: {encoded}")
        return f"event: {event_type}\ndata: {''.join(parts)}}}\n\n"


def _dumps(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(item.to_json() if hasattr(item, "to_json") else json.dumps(item) for item in value) + "]"
    return json.dumps(value)


__all__ = ["router", "ResponseTurn", "previous_conversation", "sampling_params"]
