"""The embedded OpenAI-compatible policy server (FastAPI + uvicorn) over a ``PolicyEngine``.

Called by ``spanrl serve`` (``serve_cli.py``) and, inside the trainer's process, through
``serve_in_thread(engine, host, port)``. Routes: ``/v1/chat/completions``,
``/v1/completions``, ``/v1/models`` (OpenAI shapes, vLLM's extras ``return_token_ids``,
``prompt_token_ids``, ``token_ids``, ``top_k``), ``/spanrl/v1/policy`` and
``/spanrl/v1/weights``, ``/health``. Every response carries the serving policy version in
the body (``policy_version``) and the ``x-spanrl-policy-version`` header; errors are
OpenAI-style ``{"error": {...}}`` bodies, mapped in one place (``_error_response``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from spanrl.trainer_bridge.torch_backend.engine.requests import (
    EngineError,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)

if TYPE_CHECKING:  # this module runs in the torch-free API process too (api_process.py)
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine

logger = logging.getLogger(__name__)

VERSION_HEADER = "x-spanrl-policy-version"


# ----------------------------------------------------------------------------- request bodies


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields (user, tools...) are ignored


class ContentPart(_Lenient):
    type: str = "text"
    text: str = ""


class ChatMessage(_Lenient):
    role: str
    content: str | list[ContentPart] | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class _SamplingFields(_Lenient):
    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False


class ChatCompletionBody(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionBody(_SamplingFields):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool = False


class WeightsBody(_Lenient):
    path: str
    version: int


# ----------------------------------------------------------------------------- errors


class HTTPError(Exception):
    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.param, self.code = status, message, error_type, param, code


def _error_response(exc: Exception) -> JSONResponse:
    """The one place that turns an exception into an OpenAI-style error response."""
    if isinstance(exc, HTTPError):
        status, message, kind, param, code = exc.status, exc.message, exc.error_type, exc.param, exc.code
    elif isinstance(exc, EngineError):
        status, message, kind, param, code = exc.status, exc.message, exc.error_type, exc.param, None
    elif isinstance(exc, ValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:5]
        )
        first = exc.errors()[0]["loc"] if exc.errors() else ()
        status, message, kind, param, code = 422, f"invalid request: {problems}", "invalid_request_error", \
            ".".join(str(p) for p in first) or None, None
    else:
        logger.exception("unexpected server error")
        status, message, kind, param, code = 500, f"internal error: {exc}", "server_error", None, None
    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": kind, "param": param, "code": code}})


# ----------------------------------------------------------------------------- helpers


def _params_from(body: _SamplingFields, max_tokens: int | None, logprobs: bool, top_logprobs: int) -> SamplingParams:
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


def _message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


class _Stream:
    """Bridges the engine thread's callbacks into an asyncio queue for one streaming request."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.started: asyncio.Future = loop.create_future()

    def on_start(self, version: int) -> None:
        self.loop.call_soon_threadsafe(_settle, self.started, version)

    def on_token(self, event: TokenEvent) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def on_done(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)
        self.loop.call_soon_threadsafe(_settle, self.started, None)


class _Completion:
    """The one hand-off a non-streaming request needs: the engine thread says "done" once.

    No per-token callbacks: each would wake the event loop (a pipe write, a loop iteration)
    for a token nobody reads before the end; that about doubled the loop's CPU per request."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.done: asyncio.Future = loop.create_future()

    def on_done(self) -> None:
        self.loop.call_soon_threadsafe(_settle, self.done, None)


def _settle(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


# ----------------------------------------------------------------------------- the app


def create_app(engine: PolicyEngine, api_token: str | None = None) -> FastAPI:
    """A FastAPI app serving ``engine``; requires ``Authorization: Bearer <api_token>`` if set."""
    async def check_token(request: Request) -> None:
        if request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given, f"Bearer {api_token}"):
                raise HTTPError(401, "missing or wrong bearer token", "authentication_error",
                                code="invalid_api_key")

    # a dependency rather than an HTTP middleware: Starlette's BaseHTTPMiddleware costs every
    # request an extra task and stream, which shows at small models' request rates; and only
    # when a token is set, since solving a dependency costs each request too
    app = FastAPI(title="spanrl policy server", docs_url=None, redoc_url=None,
                  dependencies=[Depends(check_token)] if api_token else [])
    app.state.engine = engine

    @app.exception_handler(Exception)
    async def _any_error(_request, exc):  # never a crash: every failure becomes an error body
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(_request, exc):  # unknown route, wrong method
        return _error_response(HTTPError(exc.status_code, str(exc.detail)))

    @app.exception_handler(HTTPError)
    async def _http_error(_request, exc):
        return _error_response(exc)

    @app.exception_handler(EngineError)
    async def _engine_error(_request, exc):
        return _error_response(exc)

    @app.exception_handler(ValidationError)
    async def _validation_error(_request, exc):
        return _error_response(exc)

    async def read_json(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HTTPError(400, f"the request body is not valid JSON: {exc}") from exc

    def check_model(name: str) -> None:
        if name != engine.model_name:
            raise HTTPError(404, f"the model {name!r} does not exist; this server serves "
                                 f"{engine.model_name!r}", param="model", code="model_not_found")

    def version_headers(version: int) -> dict[str, str]:
        return {VERSION_HEADER: str(version)}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return JSONResponse(
            {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                         "owned_by": "spanrl", "max_model_len": engine.context_length}]},
            headers=version_headers(engine.version))

    @app.get("/spanrl/v1/policy")
    async def policy():
        described = await run_in_threadpool(engine.describe)  # a round trip to another process, maybe
        return JSONResponse(described, headers=version_headers(described["version"]))

    @app.post("/spanrl/v1/weights")
    async def weights(request: Request):
        body = WeightsBody.model_validate(await read_json(request))
        await run_in_threadpool(engine.load_weights_from_dir, body.path, body.version)
        return JSONResponse({"version": engine.version, "model": engine.model_name},
                            headers=version_headers(engine.version))

    async def run_generation(prompt_ids: list[int], params: SamplingParams,
                             streaming: bool) -> tuple[GenerationRequest, _Stream | _Completion]:
        loop = asyncio.get_running_loop()
        if streaming:
            stream = _Stream(loop)
            job = engine.submit(prompt_ids, params, on_token=stream.on_token, on_start=stream.on_start,
                                on_done=stream.on_done, text_deltas=True)
            return job, stream
        waiter = _Completion(loop)
        return engine.submit(prompt_ids, params, on_done=waiter.on_done, text_deltas=False), waiter

    async def wait_result(job: GenerationRequest, waiter: _Completion):
        try:
            await waiter.done
        except asyncio.CancelledError:  # the client went away: stop generating for it
            job.cancel()
            raise
        if job.error is not None:
            raise job.error
        return job.result

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = ChatCompletionBody.model_validate(await read_json(request))
        check_model(body.model)
        messages = [{"role": m.role, "content": _message_text(m)} for m in body.messages]
        try:
            prompt_ids = engine.encode_chat(messages)
        except Exception as exc:
            raise HTTPError(400, f"the messages cannot be rendered with the chat template: {exc}",
                            param="messages") from exc
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top_logprobs = body.top_logprobs or 0
        params = _params_from(body, max_tokens, body.logprobs or top_logprobs > 0, top_logprobs)
        job, stream = await run_generation(prompt_ids, params, body.stream)
        created, rid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return await _stream_response(engine, body, job, stream, rid, created, chat=True)
        result = await wait_result(job, stream)
        choices = []
        for choice in result.choices:
            item: dict[str, Any] = {
                "index": choice.index,
                "message": {"role": "assistant", "content": choice.text},
                "logprobs": None,
                "finish_reason": choice.finish_reason,
            }
            if params.logprobs:
                item["logprobs"] = {"content": [
                    _chat_logprob(engine, token, lp, choice.top_logprobs[j] if choice.top_logprobs else None)
                    for j, (token, lp) in enumerate(zip(choice.token_ids, choice.logprobs or []))]}
            if body.return_token_ids:
                item["token_ids"] = choice.token_ids
            choices.append(item)
        completion_tokens = sum(len(c.token_ids) for c in result.choices)
        payload: dict[str, Any] = {
            "id": rid, "object": "chat.completion", "created": created, "model": engine.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt_ids) + completion_tokens},
            "policy_version": result.policy_version,
        }
        if body.return_token_ids:
            payload["prompt_token_ids"] = prompt_ids
        return JSONResponse(payload, headers=version_headers(result.policy_version))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = CompletionBody.model_validate(await read_json(request))
        check_model(body.model)
        if body.echo:
            raise HTTPError(400, "echo is not supported by this server", param="echo")
        prompt_ids = engine.encode_text(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        top = body.logprobs or 0
        params = _params_from(body, body.max_tokens if body.max_tokens is not None else 16,
                              body.logprobs is not None, top)
        try:
            job, stream = await run_generation(prompt_ids, params, body.stream)
        except EngineError as exc:
            if exc.param == "messages":
                exc.param = "prompt"  # the engine speaks of chats; this endpoint takes a prompt
            raise
        created, rid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return await _stream_response(engine, body, job, stream, rid, created, chat=False)
        result = await wait_result(job, stream)
        choices = []
        for choice in result.choices:
            item: dict[str, Any] = {"index": choice.index, "text": choice.text, "logprobs": None,
                                    "finish_reason": choice.finish_reason}
            if params.logprobs:
                item["logprobs"] = _completion_logprobs(engine, choice.token_ids, choice.logprobs or [],
                                                        choice.top_logprobs)
            if body.return_token_ids:
                item["prompt_token_ids"] = prompt_ids
                item["token_ids"] = choice.token_ids
            choices.append(item)
        completion_tokens = sum(len(c.token_ids) for c in result.choices)
        payload = {
            "id": rid, "object": "text_completion", "created": created, "model": engine.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt_ids) + completion_tokens},
            "policy_version": result.policy_version,
        }
        return JSONResponse(payload, headers=version_headers(result.policy_version))

    return app


def _token_text(engine: PolicyEngine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id])


def _chat_logprob(engine: PolicyEngine, token_id: int, logprob: float, top) -> dict:
    text = _token_text(engine, token_id)
    entry = {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")), "top_logprobs": []}
    if top:
        entry["top_logprobs"] = [
            {"token": (t := _token_text(engine, tid)), "logprob": lp, "bytes": list(t.encode("utf-8"))}
            for tid, lp in top]
    return entry


def _completion_logprobs(engine: PolicyEngine, token_ids, logprobs, top) -> dict:
    tokens = [_token_text(engine, t) for t in token_ids]
    offsets, position = [], 0
    for text in tokens:
        offsets.append(position)
        position += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": [{_token_text(engine, tid): lp for tid, lp in row} for row in top] if top else None,
        "text_offset": offsets,
    }


async def _stream_response(engine: PolicyEngine, body, job: GenerationRequest, stream: _Stream,
                           rid: str, created: int, chat: bool) -> StreamingResponse:
    """SSE: waits for the batch to start (so the version header is known), then streams deltas."""
    version = await stream.started
    if version is None:  # failed before its batch started
        if job.error is not None:
            raise job.error
        version = engine.version
    prompt_ids = job.prompt_ids
    kind = "chat.completion.chunk" if chat else "text_completion"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    want_logprobs = job.params.logprobs

    def chunk(choices: list[dict]) -> dict:
        return {"id": rid, "object": kind, "created": created, "model": engine.model_name,
                "choices": choices, "policy_version": version}

    async def events():
        completion_tokens = 0
        try:
            first = chunk([])
            if chat:
                first["choices"] = [{"index": i, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}
                                    for i in range(job.params.n)]
                if body.return_token_ids:
                    first["prompt_token_ids"] = prompt_ids
                    for item in first["choices"]:
                        item["token_ids"] = []
                yield _sse(first)
            first_token = {i: True for i in range(job.params.n)}
            while True:
                event = await stream.queue.get()
                if event is None:
                    break
                completion_tokens += 1
                if chat:
                    item: dict[str, Any] = {"index": event.choice, "delta": {"content": event.text},
                                            "logprobs": None, "finish_reason": event.finish_reason}
                    if want_logprobs:
                        item["logprobs"] = {"content": [_chat_logprob(engine, event.token_id, event.logprob,
                                                                      event.top_logprobs)]}
                else:
                    item = {"index": event.choice, "text": event.text, "logprobs": None,
                            "finish_reason": event.finish_reason}
                    if want_logprobs:
                        item["logprobs"] = _completion_logprobs(
                            engine, [event.token_id], [event.logprob],
                            [event.top_logprobs] if event.top_logprobs else None)
                if body.return_token_ids:
                    item["token_ids"] = [event.token_id]
                    if not chat and first_token[event.choice]:
                        item["prompt_token_ids"] = prompt_ids
                first_token[event.choice] = False
                yield _sse(chunk([item]))
            if job.error is not None:
                yield _sse({"error": {"message": str(job.error), "type": "server_error",
                                      "param": None, "code": None}})
            if include_usage:
                usage = chunk([])
                usage["usage"] = {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                                  "total_tokens": len(prompt_ids) + completion_tokens}
                yield _sse(usage)
            yield "data: [DONE]\n\n"
        finally:
            if not job.done.is_set():
                job.cancel()  # the client went away

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={VERSION_HEADER: str(version), "cache-control": "no-cache"})


# ----------------------------------------------------------------------------- running it


@dataclass
class ServerHandle:
    """A server running in a background thread: ``url`` (``http://host:port``), ``stop()``."""

    url: str
    host: str
    port: int
    server: Any
    thread: threading.Thread
    engine: PolicyEngine
    owns_engine: bool

    @property
    def base_url(self) -> str:
        """The OpenAI client's ``base_url`` (``.../v1``)."""
        return f"{self.url}/v1"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.owns_engine:
            self.engine.stop()


def serve_in_thread(engine: PolicyEngine, host: str = "127.0.0.1", port: int = 0,
                    api_token: str | None = None, log_level: str = "warning",
                    startup_timeout: float = 30.0) -> ServerHandle:
    """Run the server for ``engine`` in a daemon thread of this process; ``port=0`` picks a free one.

    Starts the engine if it is not running (and then stops it in ``handle.stop()``).
    """
    import uvicorn

    owns_engine = engine._thread is None
    engine.start()
    config = uvicorn.Config(create_app(engine, api_token), host=host, port=port, log_level=log_level,
                            access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="spanrl-policy-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            if owns_engine:
                engine.stop()
            raise RuntimeError(f"the policy server did not start on {host}:{port}")
        time.sleep(0.02)
    bound_port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://{host}:{bound_port}"
    logger.info("policy server listening on %s (model %s, version %d)", url, engine.model_name, engine.version)
    return ServerHandle(url, host, bound_port, server, thread, engine, owns_engine)


__all__ = ["create_app", "serve_in_thread", "ServerHandle", "VERSION_HEADER"]
