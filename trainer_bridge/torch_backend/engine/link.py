"""The link between a ``PolicyEngine`` and the HTTP front end when that runs in another process.

Why another process: the HTTP work of a request (parsing, validation, tokenizing, JSON) costs
about as much CPU as the request's share of a batched decode, and in the engine's process the
event loop and the engine thread take turns on one GIL at every torch operation. So
``spanrl serve`` runs the HTTP app in a child process (``api_process.py``), as vLLM runs its
API server apart from its engine core. This module holds the two ends of the link; what
crosses it (length-prefixed pickle frames over an anonymous Unix socketpair, one small frozen
dataclass per kind of message) is defined in ``wire.py``.

- ``EngineHost`` (in the engine's process): sends ``Hello``, reads ``Submit`` / ``Cancel`` /
  ``Call`` / ``Ready``, submits to the engine, and answers with ``Started`` / ``Token`` /
  ``Done`` / ``Reply`` sent from the engine's callbacks; ``VersionPush`` when new weights are
  swapped in.
- ``RemoteEngine`` (in the API process, no torch): what ``server/app.create_app`` uses of an
  engine (``submit`` with the same callbacks, the tokenizer, limits, version, ``describe``,
  ``load_weights_from_dir``), over the socket; it drives its ``RemoteRequest``s through the
  public lifecycle of ``GenerationRequest``.

Either side seeing the socket close fails or cancels what it has in flight: a dead engine
process answers every waiting request with 503, a dead front end cancels its requests.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

from spanrl.trainer_bridge.torch_backend.engine.requests import (
    EngineError,
    EngineLimits,
    EngineStoppedError,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    check_request,
    safe_call,
)
from spanrl.trainer_bridge.torch_backend.engine.wire import (
    Call,
    Cancel,
    Done,
    ErrorInfo,
    FrameChannel,
    Hello,
    Ready,
    Reply,
    Started,
    Submit,
    Token,
    VersionPush,
)
from spanrl.trainer_bridge.torch_backend.server.chat_format import encode_chat, encode_text

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- engine side


class EngineHost:
    """Serves one front end's requests from ``engine`` (in the engine's process)."""

    CALLS = ("describe", "load_weights_from_dir")

    def __init__(self, engine: Any, channel: FrameChannel):
        self.engine = engine
        self.channel = channel
        self.ready = threading.Event()  # the front end said it is listening
        self.closed = threading.Event()  # the front end is gone
        self._jobs: dict[int, GenerationRequest] = {}  # by the front end's request id
        self._thread = threading.Thread(target=self._serve, name="spanrl-engine-host", daemon=True)
        self._handlers: dict[type, Callable[[Any], None]] = {
            Submit: self._submit, Cancel: self._cancel, Call: self._start_call, Ready: self._ready}

    def hello(self) -> Hello:
        engine = self.engine
        return Hello(engine.model_name, engine.version, engine.limits, engine.tokenizer, dict(engine.adapters))

    def start(self) -> EngineHost:
        self.channel.send(self.hello())
        self.engine.add_version_listener(lambda version: self.channel.send(VersionPush(version)))
        self._thread.start()
        return self

    def _serve(self) -> None:
        try:
            for message in self.channel.frames():
                handler = self._handlers.get(type(message))
                if handler is None:
                    raise TypeError(f"unexpected message from the API process: {message!r}")
                handler(message)
        except Exception:  # a broken frame: nothing sane can follow it on this stream
            logger.exception("the link to the API process failed")
        finally:
            self.closed.set()
            for job in list(self._jobs.values()):
                job.cancel()  # nobody is left to read their tokens

    def _ready(self, _message: Ready) -> None:
        self.ready.set()

    def _cancel(self, message: Cancel) -> None:
        job = self._jobs.get(message.request_id)
        if job is not None:
            job.cancel()

    def _submit(self, message: Submit) -> None:
        send, request_id = self.channel.send, message.request_id

        def on_done() -> None:
            job = self._jobs.pop(request_id, None)
            if job is not None:
                send(Done(request_id, job.result, ErrorInfo.of(job.error)))

        try:
            job = self.engine.new_request(
                message.prompt_ids, message.params, text_deltas=message.text_deltas, on_done=on_done,
                on_start=(lambda version: send(Started(request_id, version))) if message.wants_start else None,
                on_token=(lambda event: send(Token(request_id, event))) if message.wants_tokens else None)
            self._jobs[request_id] = job  # filed before it is queued: on_done finds it
            self.engine.enqueue(job)
        except Exception as exc:
            self._jobs.pop(request_id, None)
            if not isinstance(exc, EngineError):
                logger.error("the engine refused a request", exc_info=exc)
            send(Done(request_id, None, ErrorInfo.of(exc)))

    def _start_call(self, message: Call) -> None:
        threading.Thread(target=self._call, args=(message,), daemon=True).start()

    def _call(self, message: Call) -> None:
        if message.name not in self.CALLS:
            self.channel.send(Reply(message.call_id, None, ErrorInfo.of(EngineError(f"unknown call {message.name!r}"))))
            return
        try:
            value = getattr(self.engine, message.name)(*message.args)
        except Exception as exc:
            if not isinstance(exc, EngineError):  # a failure of ours: its text stays in this log
                logger.error("the engine's %s failed", message.name, exc_info=exc)
            self.channel.send(Reply(message.call_id, None, ErrorInfo.of(exc)))
        else:
            self.channel.send(Reply(message.call_id, value, None))


# ----------------------------------------------------------------------------- front-end side


class RemoteRequest(GenerationRequest):
    """A request in flight in the engine's process, as the HTTP app sees one; ``cancel``
    reaches the engine over the link."""

    def __init__(self, link: RemoteEngine, request_id: int, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._link = link
        self.request_id = request_id

    def cancel(self) -> None:
        super().cancel()
        if not self.done.is_set():
            self._link.channel.send(Cancel(self.request_id))


class RemoteEngine:
    """The engine of another process, as the HTTP app sees an engine. Reads the host's hello
    (blocking) on construction; callbacks run on this object's reader thread, as a local
    engine runs them on its engine thread."""

    def __init__(self, channel: FrameChannel, on_lost: Callable[[], None] | None = None):
        self.channel = channel
        self.on_lost = on_lost  # called once when the engine's process is gone
        self._frames = channel.frames()
        hello = next(self._frames, None)
        if not isinstance(hello, Hello):
            raise EngineStoppedError("the engine process sent no hello")
        self.model_name: str = hello.model_name
        self.version: int = hello.version
        self.limits: EngineLimits = hello.limits
        self.tokenizer = hello.tokenizer
        self.adapters: dict[str, tuple[str, ...]] = dict(hello.adapters)  # adapter -> its agents
        self.context_length = self.limits.context_length
        self._ids = itertools.count()
        self._requests: dict[int, RemoteRequest] = {}
        self._calls: dict[int, tuple[threading.Event, list]] = {}
        self._lock = threading.Lock()
        self.lost = False
        self._handlers: dict[type, Callable[[Any], None]] = {
            Token: self._on_token, Started: self._on_started, Done: self._on_done,
            VersionPush: self._on_version, Reply: self._on_reply}
        self._thread = threading.Thread(target=self._read, name="spanrl-engine-link", daemon=True)
        self._thread.start()

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def encode_text(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

    def announce_ready(self) -> None:
        """Tell the engine's side that the HTTP server is about to listen."""
        self.channel.send(Ready())

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_token: Callable[[TokenEvent], None] | None = None,
               on_start: Callable[[int], None] | None = None,
               on_done: Callable[[], None] | None = None,
               text_deltas: bool = True) -> RemoteRequest:
        """Like ``PolicyEngine.submit``: checked here (so bad requests fail at once), run there."""
        max_new_tokens = check_request(prompt_ids, params, self.limits)
        request = RemoteRequest(self, next(self._ids), list(prompt_ids), params, max_new_tokens, on_token, on_start,
                                on_done, text_deltas)
        with self._lock:
            if self.lost:
                raise EngineStoppedError("the policy engine's process is gone")
            self._requests[request.request_id] = request
        if not self.channel.send(Submit(request.request_id, request.prompt_ids, params, on_token is not None,
                                        on_start is not None, text_deltas)):
            self._fail_all()
        return request

    def describe(self) -> dict:
        described = self._call("describe")
        self.version = described["version"]
        return described

    def load_weights_from_dir(self, model_dir: str, version: int) -> None:
        self._call("load_weights_from_dir", str(model_dir), version)

    def _call(self, name: str, *args: Any) -> Any:
        """A blocking call of an engine method in the engine's process (from a worker thread)."""
        call_id, done = next(self._ids), threading.Event()
        outcome: list[Any] = []  # [value, error] once answered
        with self._lock:
            if self.lost:
                raise EngineStoppedError("the policy engine's process is gone")
            self._calls[call_id] = (done, outcome)
        self.channel.send(Call(call_id, name, args))
        done.wait()
        value, error = outcome
        if error is not None:
            raise error
        return value

    def _read(self) -> None:
        try:
            for message in self._frames:
                self._handlers[type(message)](message)
        except Exception:
            logger.exception("the link to the engine process failed")
        finally:
            self._fail_all()

    def _on_token(self, message: Token) -> None:
        request = self._requests.get(message.request_id)
        if request is not None:
            request.emit_token(message.event)

    def _on_started(self, message: Started) -> None:
        request = self._requests.get(message.request_id)
        if request is not None:
            request.begin(message.version)

    def _on_done(self, message: Done) -> None:
        with self._lock:
            request = self._requests.pop(message.request_id, None)
        if request is None:
            return
        if message.result is not None and message.error is None:
            request.finish(message.result)
        else:
            error = message.error or ErrorInfo("RuntimeError", "the engine finished a request with no result")
            request.fail(error.to_exception())

    def _on_version(self, message: VersionPush) -> None:
        self.version = message.version

    def _on_reply(self, message: Reply) -> None:
        with self._lock:
            done, outcome = self._calls.pop(message.call_id)
        outcome.extend([message.value, None if message.error is None else message.error.to_exception()])
        done.set()

    def _fail_all(self) -> None:
        with self._lock:
            if self.lost:
                return
            self.lost = True
            requests, self._requests = list(self._requests.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        gone = EngineStoppedError("the policy engine's process is gone")
        for request in requests:
            request.fail(gone)
        for done, outcome in calls:
            outcome.extend([None, gone])
            done.set()
        if self.on_lost is not None:
            safe_call(self.on_lost)


__all__ = ["FrameChannel", "EngineHost", "RemoteEngine", "RemoteRequest"]
