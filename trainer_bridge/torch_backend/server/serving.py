"""What the generating routes share: the engine they serve, parsing a body, sampling parameters,
handing a request to the engine and waiting for it (or for its tokens), and the response forms.

Used by ``chat_completions.py``, ``completions.py`` and ``responses.py``, as
vLLM's routes share ``serving_engine.py``. The engine is a ``PolicyEngine`` in this process or
a ``RemoteEngine`` (``engine/link.py``) in the torch-free front end; both call a request's
callbacks from their own thread, which ``StreamBridge`` / ``CompletionWaiter`` hand to the loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from spanrl.bridge_protocol import is_validation_rollout
from spanrl.instrumentation import semconv
from spanrl.trainer_bridge.model_names import ServedModelNames
from spanrl.trainer_bridge.torch_backend.engine.requests import (
    EngineLimits,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    TokenEvent,
)
from spanrl.trainer_bridge.torch_backend.server import call_spans
from spanrl.trainer_bridge.torch_backend.server.adapter_routing import is_adapter_model
from spanrl.trainer_bridge.torch_backend.server.errors import InvalidRequestError, NotFoundError
from spanrl.trainer_bridge.torch_backend.server.protocol import ResponseModel, SamplingRequest
from spanrl.trainer_bridge.torch_backend.server.response_store import ResponseStore
from spanrl.trainer_bridge.torch_backend.server.token_id_form import TokenIdForm

if TYPE_CHECKING:
    from spanrl.trainer_bridge.torch_backend.server.policy import WeightsAdmin

logger = logging.getLogger(__name__)

BodyT = TypeVar("BodyT", bound=BaseModel)


class ServedEngine(Protocol):
    """What the server uses of an engine (``PolicyEngine`` or the front end's ``RemoteEngine``)."""

    @property
    def model_name(self) -> str: ...

    @property
    def version(self) -> int: ...

    @property
    def context_length(self) -> int: ...

    @property
    def limits(self) -> EngineLimits: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def adapters(self) -> dict[str, tuple[str, ...]]: ...

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_token: Any = None, on_start: Any = None,
               on_done: Any = None, text_deltas: bool = True) -> GenerationRequest: ...

    def describe(self) -> dict: ...

    def load_weights_from_dir(self, model_dir: str, version: int) -> None: ...


class IgnoredFieldLog:
    """Logs a warning the first time a request carries a field this server ignores, once per
    field name per server (so a tool-calling agent's ``tools`` is said once, not per call).

    At most ``max_names`` names are remembered (clients choose the names: an unbounded set would
    grow with every made-up field); past them, one line says more are ignored, then nothing."""

    def __init__(self, max_names: int = 256) -> None:
        self.max_names = max_names
        self._seen: set[str] = set()
        self._said_more = False
        self._lock = threading.Lock()

    def note(self, route: str, names: Iterable[str]) -> None:
        with self._lock:
            new = [name for name in names if name not in self._seen]
            room = max(self.max_names - len(self._seen), 0)
            new, beyond = new[:room], len(new) > room
            self._seen.update(new)
            say_more, self._said_more = beyond and not self._said_more, self._said_more or beyond
        for name in new:
            logger.warning("%s: the request field %r is not implemented by this server and is ignored "
                           "(said once; the supported fields are listed in GET /v1/models)", route, name)
        if say_more:
            logger.warning("%s: and more request fields are ignored (%d named above; further ones are not "
                           "logged)", route, self.max_names)


@dataclass
class ServerState:
    """The app's state (``app.state.server``), set up by ``app.create_app``."""

    engine: ServedEngine
    ignored_fields: IgnoredFieldLog = field(default_factory=IgnoredFieldLog)
    response_store: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's state
    # the temperature validation rollouts are sampled at (``spanrl train``'s val_temperature; 0:
    # greedy), whatever the agent asked for; None: the agent's own
    validation_temperature: float | None = None
    api_token: str | None = None  # the agents' bearer token (None: no check)
    weights_admin: WeightsAdmin | None = None  # who may load weights (policy.py); None: the route is off
    model_names: ServedModelNames | None = None  # None: only the engine's own name

    def served_names(self) -> ServedModelNames:
        return self.model_names or ServedModelNames((self.engine.model_name,))

    @staticmethod
    def of(request: Request) -> ServerState:
        return request.app.state.server


async def read_body(request: Request, body_type: type[BodyT]) -> BodyT:
    """The request's JSON body validated as ``body_type`` (400 for bad JSON, 422 for a body
    that does not fit); its ignored fields are logged once."""
    try:
        raw = await request.body()
    except ClientDisconnect as exc:  # the client's doing (it left mid-body): no server error, no traceback
        raise InvalidRequestError("the client went away before its request body arrived",
                                  code="client_disconnected") from exc
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # nested deeper than Python recurses
        raise InvalidRequestError("the request body is nested too deeply", code="nested_too_deeply") from exc
    try:
        body = body_type.model_validate(data)
    except RecursionError as exc:
        raise InvalidRequestError("the request body is nested too deeply", code="nested_too_deeply") from exc
    pin_validation_temperature(request, body)
    if isinstance(body, TokenIdForm):
        body.read_id_form(request.headers)
    if isinstance(body, SamplingRequest):
        ignored = body.ignored_fields()
        if ignored:
            ServerState.of(request).ignored_fields.note(request.url.path, ignored)
    return body


def pin_validation_temperature(request: Request, body: Any) -> None:
    """A validation rollout's request (its ``x-spanrl-rollout-id`` names a validation round) is
    sampled at the server's ``validation_temperature`` when one is set."""
    temperature = ServerState.of(request).validation_temperature
    if temperature is None or not hasattr(body, "temperature"):
        return
    if is_validation_rollout(request.headers.get(semconv.ROLLOUT_ID_HEADER, "")):
        body.temperature = temperature


def check_model(state: ServerState, name: str) -> None:
    """404 for a model name the server does not answer to; the name goes on the call's span."""
    names = state.served_names()
    if not names.accepts(name) and not is_adapter_model(state.engine, name):  # adapters: adapter_routing.py
        raise NotFoundError(names.not_found(name), param="model", code="model_not_found")
    call_spans.note_request_model(name)


def version_headers(version: int) -> dict[str, str]:
    return {semconv.POLICY_VERSION_HEADER: str(version)}


def json_response(body: ResponseModel, version: int) -> Response:
    """A typed body with the serving version's header."""
    call_spans.note_response(body)
    return Response(body.to_json(), media_type="application/json", headers=version_headers(version))


def sampling_params(body: SamplingRequest, max_tokens: int | None, logprobs: bool,
                    top_logprobs: int) -> SamplingParams:
    stop = body.stop
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    top_k = body.top_k if body.top_k is not None else 0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=0 if top_k == -1 else top_k,
        n=body.n, stop=stops, seed=body.seed, logprobs=logprobs, top_logprobs=top_logprobs,
    )


def _settle(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


class StreamBridge:
    """Hands the engine thread's callbacks of one streaming request to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
        self.started: asyncio.Future[int | None] = loop.create_future()

    def on_start(self, version: int) -> None:
        self.loop.call_soon_threadsafe(_settle, self.started, version)

    def on_token(self, event: TokenEvent) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def on_done(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)
        self.loop.call_soon_threadsafe(_settle, self.started, None)


class CompletionWaiter:
    """The one hand-off a non-streaming request needs: the engine thread says "done" once.

    No per-token callbacks: each would wake the event loop (a pipe write, a loop iteration)
    for a token nobody reads before the end; that about doubled the loop's CPU per request."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.done: asyncio.Future[None] = loop.create_future()
        self.loop = loop

    def on_done(self) -> None:
        self.loop.call_soon_threadsafe(_settle, self.done, None)


def start_stream(engine: ServedEngine, prompt_ids: list[int],
                 params: SamplingParams) -> tuple[GenerationRequest, StreamBridge]:
    """Submit a streaming request (raises ``EngineError`` at once for a bad one)."""
    bridge = StreamBridge(asyncio.get_running_loop())
    job = engine.submit(prompt_ids, params, on_token=bridge.on_token, on_start=bridge.on_start,
                        on_done=bridge.on_done, text_deltas=True)
    call_spans.track_job(job)
    return job, bridge


def start_completion(engine: ServedEngine, prompt_ids: list[int],
                     params: SamplingParams) -> tuple[GenerationRequest, CompletionWaiter]:
    """Submit a request whose result is read once it is done."""
    waiter = CompletionWaiter(asyncio.get_running_loop())
    job = engine.submit(prompt_ids, params, on_done=waiter.on_done, text_deltas=False)
    call_spans.track_job(job)
    return job, waiter


async def wait_result(job: GenerationRequest, waiter: CompletionWaiter) -> GenerationResult:
    try:
        await waiter.done
    except asyncio.CancelledError:  # the client went away: stop generating for it
        job.cancel()
        raise
    if job.error is not None:
        raise job.error
    assert job.result is not None
    return job.result


async def stream_version(engine: ServedEngine, job: GenerationRequest, bridge: StreamBridge) -> int:
    """The version serving a streamed request, once its batch starts (so the header is known);
    raises the request's error if it failed before starting."""
    try:
        version = await bridge.started
    except asyncio.CancelledError:  # the client went away before the batch started
        job.cancel()
        raise
    if version is None:
        if job.error is not None:
            raise job.error
        version = engine.version
    return version


async def token_events(bridge: StreamBridge) -> AsyncIterator[TokenEvent]:
    """A streamed request's tokens as they are sampled, until it is done."""
    while True:
        event = await bridge.queue.get()
        if event is None:
            return
        yield event


def cancel_unfinished(job: GenerationRequest) -> None:
    """Stop generating for a streamed request whose client went away."""
    if not job.done.is_set():
        job.cancel()


def sse(body: ResponseModel) -> str:
    return f"data: {body.to_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def event_stream_response(events: AsyncIterator[str], version: int) -> StreamingResponse:
    headers = {**version_headers(version), "cache-control": "no-cache"}
    return StreamingResponse(call_spans.watch_stream(events), media_type="text/event-stream", headers=headers)


__all__ = ["CompletionWaiter", "IgnoredFieldLog", "SSE_DONE", "ServedEngine", "ServerState", "StreamBridge",
           "cancel_unfinished", "check_model", "event_stream_response", "json_response", "read_body",
           "sampling_params", "sse", "start_completion", "start_stream", "stream_version", "token_events",
           "version_headers", "wait_result"]
