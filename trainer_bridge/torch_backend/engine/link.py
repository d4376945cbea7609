"""The link between a ``PolicyEngine`` and the HTTP front end when that runs in another process.

Why another process: the HTTP work of a request (parsing, validation, tokenizing, JSON) costs
about as much CPU as the request's share of a batched decode, and in the engine's process the
event loop and the engine thread take turns on one GIL at every torch operation. So
``spanrl serve`` runs the HTTP app in a child process (``api_process.py``), as vLLM runs its
API server apart from its engine core. This module is the wire between the two:
length-prefixed pickle frames over an anonymous Unix socketpair (both ends are our own
processes; nothing else can reach the socket, so unpickling is safe).

- ``EngineHost`` (in the engine's process): reads ``submit`` / ``cancel`` / ``call`` frames,
  submits to the engine, and answers with ``start`` / ``token`` / ``done`` / ``reply`` frames
  sent from the engine's callbacks; ``version`` frames when new weights are swapped in.
- ``RemoteEngine`` (in the API process, no torch): what ``policy_server.create_app`` uses of
  an engine (``submit`` with the same callbacks, the tokenizer, limits, version,
  ``describe``, ``load_weights_from_dir``), over the socket.

Either side seeing the socket close fails or cancels what it has in flight: a dead engine
process answers every waiting request with 503, a dead front end cancels its requests.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

from spanrl.trainer_bridge.torch_backend.engine.requests import (
    EngineError,
    EngineLimits,
    EngineStoppedError,
    GenerationRequest,
    PromptTooLongError,
    SamplingParams,
    TokenEvent,
    check_request,
    safe_call,
)
from spanrl.trainer_bridge.torch_backend.server.chat_format import encode_chat, encode_text

logger = logging.getLogger(__name__)

_HEADER_BYTES = 4
_ERRORS = {cls.__name__: cls for cls in (EngineError, PromptTooLongError, EngineStoppedError)}


class FrameChannel:
    """Pickled messages over a stream socket, each prefixed with its length; ``send`` may be
    called from any thread, ``frames`` is read by one thread."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: Any) -> bool:
        """Send one message; False (and nothing raised) when the other side is gone."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._send_lock:
                self.sock.sendall(len(data).to_bytes(_HEADER_BYTES, "big") + data)
            return True
        except OSError:
            return False

    def frames(self) -> Iterator[Any]:
        """Messages as they arrive, until the socket closes."""
        buffer = bytearray()
        while True:
            try:
                chunk = self.sock.recv(1 << 16)
            except OSError:
                return
            if not chunk:
                return
            buffer += chunk
            start = 0
            while len(buffer) - start >= _HEADER_BYTES:
                size = int.from_bytes(buffer[start:start + _HEADER_BYTES], "big")
                end = start + _HEADER_BYTES + size
                if len(buffer) < end:
                    break
                yield pickle.loads(memoryview(buffer)[start + _HEADER_BYTES:end])
                start = end
            del buffer[:start]

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
        except OSError:
            pass
        self.sock.close()


def _error_info(error: BaseException | None) -> tuple[str, str, str | None] | None:
    if error is None:
        return None
    return type(error).__name__, getattr(error, "message", None) or str(error), getattr(error, "param", None)


def _error_from(info: tuple[str, str, str | None]) -> BaseException:
    name, message, param = info
    cls = _ERRORS.get(name)
    if cls is not None:
        return cls(message, param)
    error = EngineError(f"internal error: {message}", param)  # any other failure of the engine: a 500
    error.status, error.error_type = 500, "server_error"
    return error


# ----------------------------------------------------------------------------- engine side


class EngineHost:
    """Serves one front end's requests from ``engine`` (in the engine's process)."""

    CALLS = ("describe", "load_weights_from_dir")

    def __init__(self, engine, channel: FrameChannel):
        self.engine = engine
        self.channel = channel
        self.ready = threading.Event()  # the front end said it is listening
        self.closed = threading.Event()  # the front end is gone
        self._jobs: dict[int, GenerationRequest] = {}  # by the front end's request id
        self._thread = threading.Thread(target=self._serve, name="spanrl-engine-host", daemon=True)

    def hello(self) -> dict:
        engine = self.engine
        return {"model_name": engine.model_name, "version": engine.version, "limits": engine.limits,
                "tokenizer": engine.tokenizer}

    def start(self) -> EngineHost:
        self.channel.send(("hello", self.hello()))
        self.engine.add_version_listener(lambda version: self.channel.send(("version", version)))
        self._thread.start()
        return self

    def _serve(self) -> None:
        try:
            for message in self.channel.frames():
                kind = message[0]
                if kind == "submit":
                    self._submit(*message[1:])
                elif kind == "cancel":
                    job = self._jobs.get(message[1])
                    if job is not None:
                        job.cancel()
                elif kind == "call":
                    threading.Thread(target=self._call, args=message[1:], daemon=True).start()
                elif kind == "ready":
                    self.ready.set()
        except Exception:  # a broken frame: nothing sane can follow it on this stream
            logger.exception("the link to the API process failed")
        finally:
            self.closed.set()
            for job in list(self._jobs.values()):
                job.cancel()  # nobody is left to read their tokens

    def _submit(self, request_id: int, prompt_ids: list[int], params: SamplingParams, wants_tokens: bool,
                wants_start: bool, text_deltas: bool) -> None:
        """Submit one request; only the messages the front end asked for cross back (a
        non-streaming request gets just its ``done``)."""
        send = self.channel.send

        def on_done() -> None:
            job = self._jobs.pop(request_id, None)
            if job is not None:
                send(("done", request_id, job.result, _error_info(job.error)))

        try:
            job = self.engine.new_request(
                prompt_ids, params, text_deltas=text_deltas, on_done=on_done,
                on_start=(lambda version: send(("start", request_id, version))) if wants_start else None,
                on_token=(lambda event: send(("token", request_id, event))) if wants_tokens else None)
            self._jobs[request_id] = job  # filed before it is queued: on_done finds it
            self.engine.enqueue(job)
        except Exception as exc:
            self._jobs.pop(request_id, None)
            send(("done", request_id, None, _error_info(exc)))

    def _call(self, call_id: int, name: str, args: tuple) -> None:
        if name not in self.CALLS:
            self.channel.send(("reply", call_id, None, _error_info(EngineError(f"unknown call {name!r}"))))
            return
        try:
            value = getattr(self.engine, name)(*args)
        except Exception as exc:
            self.channel.send(("reply", call_id, None, _error_info(exc)))
        else:
            self.channel.send(("reply", call_id, value, None))


# ----------------------------------------------------------------------------- front-end side


class RemoteRequest(GenerationRequest):
    """A request in flight in the engine's process, as the HTTP app sees one; ``cancel``
    reaches the engine over the link."""

    def __init__(self, link: RemoteEngine, request_id: int, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._link = link
        self.request_id = request_id

    def cancel(self) -> None:
        super().cancel()
        if not self.done.is_set():
            self._link.channel.send(("cancel", self.request_id))


class RemoteEngine:
    """The engine of another process, as the HTTP app sees an engine. Reads the host's hello
    (blocking) on construction; callbacks run on this object's reader thread, as a local
    engine runs them on its engine thread."""

    def __init__(self, channel: FrameChannel, on_lost: Callable[[], None] | None = None):
        self.channel = channel
        self.on_lost = on_lost  # called once when the engine's process is gone
        self._frames = channel.frames()
        first = next(self._frames, None)
        if not (isinstance(first, tuple) and first[0] == "hello"):
            raise EngineStoppedError("the engine process sent no hello")
        hello = first[1]
        self.model_name: str = hello["model_name"]
        self.version: int = hello["version"]
        self.limits: EngineLimits = hello["limits"]
        self.tokenizer = hello["tokenizer"]
        self.context_length = self.limits.context_length
        self._ids = itertools.count()
        self._requests: dict[int, RemoteRequest] = {}
        self._calls: dict[int, tuple[threading.Event, list]] = {}
        self._lock = threading.Lock()
        self.lost = False
        self._thread = threading.Thread(target=self._read, name="spanrl-engine-link", daemon=True)
        self._thread.start()

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def encode_text(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

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
        if not self.channel.send(("submit", request.request_id, request.prompt_ids, params,
                                  on_token is not None, on_start is not None, text_deltas)):
            self._fail_all()
        return request

    def describe(self) -> dict:
        described = self._call("describe")
        self.version = described["version"]
        return described

    def load_weights_from_dir(self, model_dir: str, version: int) -> None:
        self._call("load_weights_from_dir", str(model_dir), version)

    def _call(self, name: str, *args) -> Any:
        """A blocking call of an engine method in the engine's process (from a worker thread)."""
        call_id, done, outcome = next(self._ids), threading.Event(), []
        with self._lock:
            if self.lost:
                raise EngineStoppedError("the policy engine's process is gone")
            self._calls[call_id] = (done, outcome)
        self.channel.send(("call", call_id, name, args))
        done.wait()
        value, error = outcome
        if error is not None:
            raise error
        return value

    def _read(self) -> None:
        try:
            for message in self._frames:
                self._dispatch(message)
        except Exception:
            logger.exception("the link to the engine process failed")
        finally:
            self._fail_all()

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "token":
            request = self._requests.get(message[1])
            if request is not None and request.on_token is not None:
                safe_call(request.on_token, message[2])
        elif kind == "start":
            request = self._requests.get(message[1])
            if request is not None:
                request.policy_version = message[2]
                if request.on_start is not None:
                    safe_call(request.on_start, message[2])
        elif kind == "done":
            _, request_id, result, error = message
            with self._lock:
                request = self._requests.pop(request_id, None)
            if request is not None:
                request.result = result
                request._complete(None if error is None else _error_from(error))
        elif kind == "version":
            self.version = message[1]
        elif kind == "reply":
            _, call_id, value, error = message
            with self._lock:
                done, outcome = self._calls.pop(call_id)
            outcome.extend([value, None if error is None else _error_from(error)])
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
            request._complete(gone)
        for done, outcome in calls:
            outcome.extend([None, gone])
            done.set()
        if self.on_lost is not None:
            safe_call(self.on_lost)


__all__ = ["FrameChannel", "EngineHost", "RemoteEngine", "RemoteRequest"]
